"""Single-process references for boxing tests: the ranks' pieces of a logical tensor,
the logical tensor they form, and a simulator that runs a plan on all ranks at once.

The simulator applies each step mechanically, as the collective would: an
all_gather concatenates the members' tensors in member order, an all_to_all
hands member ``k`` chunk ``k`` of everyone, and so on. It never looks at the
logical tensor, so a plan whose step is not a real group collective (a group
holding interleaved pieces) ends with the wrong values.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sbpflow._layout import Layout, box_shape, relative
from sbpflow.boxing._transfer import transfer_pieces
from sbpflow.boxing.plan import BoxingPlan, BoxingStep
from sbpflow.sbp import Partial, Split

Locals = dict[int, torch.Tensor]


def reference(shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A logical tensor with distinct small integer values (exact in float32)."""
    numel = 1
    for n in shape:
        numel *= n
    return (torch.arange(numel) % 251 - 100).to(dtype).reshape(tuple(shape))


def _term_index(layout: Layout, rank: int) -> int:
    """Which partial term ``rank`` holds: its coordinates on the partial axes, flattened."""
    pl = layout.placement
    index = 0
    for c, n, s in zip(pl.coords_of(rank), pl.shape, layout.sbp, strict=True):
        if isinstance(s, Partial):
            index = index * n + c
    return index


def _num_terms(layout: Layout) -> int:
    count = 1
    for n, s in zip(layout.placement.shape, layout.sbp, strict=True):
        if isinstance(s, Partial):
            count *= n
    return count


def _term(box_values: torch.Tensor, term: int) -> torch.Tensor:
    """Partial term ``term`` (> 0) of a box: an integer pattern, so sums stay exact."""
    flat = torch.arange(box_values.numel()).reshape(box_values.shape)
    return ((flat * (term + 3) + term) % 9 - 4).to(box_values.dtype)


def make_locals(ref: torch.Tensor, layout: Layout) -> Locals:
    """Every rank's local tensor of ``ref`` laid out as ``layout`` (partial sum terms add up to it)."""
    out: Locals = {}
    terms = _num_terms(layout)
    for rank in layout.placement.flat_ranks:
        values = ref[
            relative(layout.box(ref.shape, rank), tuple((0, n) for n in ref.shape))
        ].clone()
        term = _term_index(layout, rank)
        if term > 0:
            values = _term(values, term)
        elif terms > 1:
            values = values - sum(_term(values, t) for t in range(1, terms))
        out[rank] = values
    return out


def assemble(shape: Sequence[int], layout: Layout, pieces: Locals) -> torch.Tensor:
    """The logical tensor the ranks' ``pieces`` form; asserts shapes and replicas agree."""
    shape = tuple(shape)
    pl = layout.placement
    reduce_op = next((s.reduce_op for s in layout.sbp if isinstance(s, Partial)), "sum")
    terms: dict[int, torch.Tensor] = {}
    seen: dict[tuple[int, tuple[tuple[int, int], ...]], torch.Tensor] = {}
    for rank in pl.flat_ranks:
        box = layout.box(shape, rank)
        piece = pieces[rank]
        assert tuple(piece.shape) == box_shape(box), (rank, tuple(piece.shape), box)
        term = _term_index(layout, rank)
        key = (term, box)
        if key in seen:  # a replica along a broadcast axis (or an empty box)
            assert torch.equal(seen[key], piece), f"rank {rank} disagrees with its replica"
            continue
        seen[key] = piece
        whole = terms.setdefault(term, torch.zeros(shape, dtype=piece.dtype))
        whole[relative(box, tuple((0, n) for n in shape))] = piece
    values = list(terms.values())
    if reduce_op == "max":
        return torch.stack(values).amax(0)
    return torch.stack(values).sum(0)


# -- the simulator ------------------------------------------------------------------


def simulate(plan: BoxingPlan, pieces: Locals) -> Locals:
    """Run ``plan`` on every rank's piece at once; the ranks of the destination's pieces."""
    for step in plan.steps:
        pieces = _simulate_step(step, plan.shape, pieces)
    return {r: pieces[r] for r in plan.dst.placement.flat_ranks}


def _simulate_step(step: BoxingStep, shape: tuple[int, ...], pieces: Locals) -> Locals:
    if not step.axes:
        return _simulate_transfer(step, shape, pieces)
    src, dst = step.src, step.dst
    before, after = src.sbp[step.axes[0]], dst.sbp[step.axes[0]]
    out = dict(pieces)
    for members in src.placement.groups_along(step.axes):
        mine = [pieces[m] for m in members]
        if step.op == "all_gather":
            assert isinstance(before, Split)
            whole = torch.cat(mine, dim=before.dim)
            results = [whole] * len(members)
        elif step.op == "all_reduce":
            results = [_reduce(mine, before)] * len(members)
        elif step.op == "reduce_scatter":
            assert isinstance(after, Split)
            sizes = [box_shape(dst.box(shape, m))[after.dim] for m in members]
            results = list(torch.split(_reduce(mine, before), sizes, dim=after.dim))
        elif step.op == "all_to_all":
            assert isinstance(before, Split) and isinstance(after, Split)
            sizes = [box_shape(dst.box(shape, m))[after.dim] for m in members]
            chunks = [torch.split(t, sizes, dim=after.dim) for t in mine]
            results = [
                torch.cat([c[k] for c in chunks], dim=before.dim) for k in range(len(members))
            ]
        elif step.op == "slice":
            results = [
                t[relative(dst.box(shape, m), src.box(shape, m))]
                for m, t in zip(members, mine, strict=True)
            ]
        elif step.op == "zero":
            results = [_zero(shape, step, m, t) for m, t in zip(members, mine, strict=True)]
        else:
            raise AssertionError(f"unknown op {step.op}")
        for m, t in zip(members, results, strict=True):
            out[m] = t.clone()
    return out


def _reduce(tensors: list[torch.Tensor], value: object) -> torch.Tensor:
    assert isinstance(value, Partial)
    stacked = torch.stack(tensors)
    return stacked.amax(0) if value.reduce_op == "max" else stacked.sum(0)


def _zero(shape: tuple[int, ...], step: BoxingStep, rank: int, local: torch.Tensor) -> torch.Tensor:
    src, dst = step.src, step.dst
    after = dst.sbp[step.axes[0]]
    assert isinstance(after, Partial)
    fill = 0.0 if after.reduce_op == "sum" else float("-inf")
    if isinstance(src.sbp[step.axes[0]], Split):
        out = torch.full(box_shape(dst.box(shape, rank)), fill, dtype=local.dtype)
        out[relative(src.box(shape, rank), dst.box(shape, rank))] = local
        return out
    coords = src.placement.coords_of(rank)
    if after.reduce_op == "max" or all(coords[a] == 0 for a in step.axes):
        return local
    return torch.zeros_like(local)


def _simulate_transfer(step: BoxingStep, shape: tuple[int, ...], pieces: Locals) -> Locals:
    src, dst = step.src, step.dst
    dtype = next(iter(pieces.values())).dtype
    out = {
        r: torch.zeros(box_shape(dst.box(shape, r)), dtype=dtype) for r in dst.placement.flat_ranks
    }
    for piece in transfer_pieces(shape, src, dst):
        data = pieces[piece.src_rank][relative(piece.box, src.box(shape, piece.src_rank))]
        out[piece.dst_rank][relative(piece.box, dst.box(shape, piece.dst_rank))] = data
    return out
