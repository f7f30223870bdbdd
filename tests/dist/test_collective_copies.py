"""Boxing that is one collective copies only what the layout needs (NOTE [one copy at most]).

Every aten op that copies data on the calling rank (``copy_``, ``cat``, ``clone``, ...)
is counted with a ``TorchDispatchMode`` while a collective or a ``to_global`` runs; what
runs inside the process-group calls (gloo's own buffers) is the collective, as it is for
raw ``torch.distributed``, and is not counted. The
bytes each case may copy are worked out here from the layouts alone: nothing for an
even split along dim 0, one copy of the result (or of the source) where the layout
needs an interleave, a transpose or padding. Each result is also compared with the
piece plain single-process PyTorch computes, and written in place afterwards to show
that it shares no memory with the source.

The same mode sees the process-group ops (``c10d.*``) and adds up the bytes each puts on
the wire from this rank, which a one-collective layout change must keep to what the
layout needs (NOTE [gloo gathers and reductions]).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import sbpflow
from sbpflow.comm import _groups, collectives
from sbpflow.sbp import broadcast, partial_sum, split
from sbpflow.testing import DistributedPool

_COPIES = {"copy_", "cat", "clone", "_to_copy", "stack", "index_put_", "slice_scatter"}
# The process-group calls: what runs inside them (gloo's reduce_scatter copies its chunk
# out of a reduced buffer on this thread, in ``wait()``) is the collective, as for raw torch.
_WIRE = ("_all_gather_into", "_reduce_scatter_into", "_all_reduce_in_place", "_all_to_all_into")


class _CopiedBytes(TorchDispatchMode):
    """Bytes written by the copying aten ops run on this thread while active, outside
    the process-group calls."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.on_the_wire = 0
        self.sent = 0  # bytes the process-group ops sent from this rank (_sent_bytes)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in _COPIES and not self.on_the_wire:
            written = args[1] if func.overloadpacket.__name__ == "copy_" else out
            self.bytes += written.numel() * written.element_size()
        if func.namespace == "c10d":
            self.sent += _sent_bytes(func.overloadpacket.__name__, args)
        return out


def _sent_bytes(op: str, args: Any) -> int:
    """The bytes a gloo process-group op sends from this rank, a member of the whole world
    in rank order. An all_reduce of ``n`` bytes sends at least ``2 (p - 1) / p * n`` (the
    bound every all_reduce algorithm meets); gloo runs a reduce_scatter as an all_reduce of
    its whole input (``reduce_scatter_tensor_coalesced`` in torch's ProcessGroupGloo.cpp);
    an all_gather sends its piece to each other member; an all_to_all sends its input but
    the slice for this rank."""
    world, rank = sbpflow.env.get_world_size(), sbpflow.env.get_rank()
    if op == "allreduce_":
        return sum(2 * (world - 1) * _nbytes(t) // world for t in args[0])
    if op in ("_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"):
        inputs = args[1] if isinstance(args[1], list) else [args[1]]
        return sum(2 * (world - 1) * _nbytes(t) // world for t in inputs)
    if op in ("_allgather_base_", "allgather_into_tensor_coalesced_"):
        inputs = args[1] if isinstance(args[1], list) else [args[1]]
        return sum((world - 1) * _nbytes(t) for t in inputs)
    if op == "alltoall_base_":
        send, splits = args[1], args[4]
        row = _nbytes(send) // max(send.shape[0], 1)
        mine = splits[rank] * row if splits else _nbytes(send) // world
        return _nbytes(send) - mine
    raise AssertionError(f"no count of the bytes c10d.{op} sends: add one")


@contextlib.contextmanager
def _counting_copies() -> Iterator[_CopiedBytes]:
    counter = _CopiedBytes()
    originals = {name: getattr(collectives, name) for name in _WIRE}

    def uncounted(call: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            counter.on_the_wire += 1
            try:
                return call(*args, **kwargs)
            finally:
                counter.on_the_wire -= 1

        return run

    for name, call in originals.items():
        setattr(collectives, name, uncounted(call))
    try:
        with counter:
            yield counter
    finally:
        for name, call in originals.items():
            setattr(collectives, name, call)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _sizes(length: int, num: int) -> list[int]:
    return [t.shape[0] for t in torch.tensor_split(torch.empty(length), num)]


def _read(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if sbpflow.is_global(t) else t


def _measure(
    where: str, run: Any, reference: torch.Tensor, allowed: int, source: torch.Tensor
) -> list[str]:
    """Run ``run()`` counting copies; compare with ``reference``; then write the result in
    place and check that ``source`` (a local tensor or a global one's piece) did not change."""
    before = _read(source).clone()
    with _counting_copies() as counter:
        got = run()
    if got.shape != reference.shape or not torch.equal(got, reference):
        return [f"{where}: wrong result"]
    problems = []
    if counter.bytes > allowed:
        problems.append(f"{where}: copied {counter.bytes} bytes, needs {allowed}")
    got.add_(1000)
    if not torch.equal(_read(source), before):
        problems.append(f"{where}: writing the result changed the source")
    return problems


def _collective_copies() -> list[str]:
    """Each collective of ``collectives`` on the world in rank order: bytes copied vs needed."""
    rank, world = sbpflow.env.get_rank(), sbpflow.env.get_world_size()
    group = _groups.group_of("cpu", [tuple(range(world))], rank)
    assert group is not None
    problems: list[str] = []
    gen = torch.Generator().manual_seed(5)
    for shape in [(8, 6), (7, 5)]:  # even, and uneven along both dims (2 ranks: 4 + 3, 3 + 2)
        parts = [torch.randint(-8, 9, shape, generator=gen).float() for _ in range(world)]
        whole, total = parts[0], sum(parts)
        for dim in (0, 1):
            sizes = _sizes(shape[dim], world)
            even = len(set(sizes)) == 1
            at = f"shape {shape}, dim {dim}, rank {rank}"
            # all_gather: an even dim-0 split copies nothing (the gathered buffer is the
            # result); an even inner dim interleaves the gathered pieces once; an uneven
            # split copies the piece once into its padded send buffer and once out of it
            local = torch.tensor_split(whole, world, dim=dim)[rank].clone()
            needed = (0 if even else _nbytes(local)) + (0 if dim == 0 and even else _nbytes(whole))
            problems += _measure(
                f"all_gather, {at}",
                partial(collectives.all_gather, local, dim, group, sizes),
                whole, needed, local,
            )  # fmt: skip
            # reduce_scatter: an even dim-0 split copies nothing; otherwise the block is
            # packed once for the wire, and an uneven inner dim's result is put back once
            block = parts[rank].clone()
            expected = torch.tensor_split(total, world, dim=dim)[rank]
            needed = 0 if dim == 0 and even else _nbytes(block)
            needed += _nbytes(expected) if dim != 0 and not even else 0
            problems += _measure(
                f"reduce_scatter, {at}",
                partial(collectives.reduce_scatter, block, dim, group, sizes, "sum"),
                expected, needed, block,
            )  # fmt: skip
            # all_to_all from the other dim: to dim 0 the source is the send buffer and the
            # pieces received are interleaved along dim 1 once; to dim 1 the source's chunks
            # are packed once and the pieces received lie one after another already
            other = 1 - dim
            source = torch.tensor_split(whole, world, dim=other)[rank].clone()
            expected = torch.tensor_split(whole, world, dim=dim)[rank]
            problems += _measure(
                f"all_to_all, {at}",
                partial(
                    collectives.all_to_all,
                    source, other, dim, group, _sizes(shape[other], world), sizes,
                ),
                expected, _nbytes(expected) if dim == 0 else _nbytes(source), source,
            )  # fmt: skip
    return problems


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_collectives_copy_only_what_the_layout_needs(dist_pool: DistributedPool) -> None:
    problems = [p for ranks in dist_pool.run(_collective_copies) for p in ranks]
    assert not problems, "\n".join(problems)


def _box(x: torch.Tensor, dst: Any) -> torch.Tensor:
    return x.to_global(sbp=dst, check_meta=False).to_local()


def _one_collective_cases(whole: int, piece: int) -> list[tuple[Any, Any, int]]:
    """(src, dst, bytes the layout change must copy) on two ranks, ``whole`` bytes logical."""
    return [
        (split(0), broadcast, 0),  # all_gather into the result
        (partial_sum, split(0), 0),  # reduce_scatter from the source, into the result
        (partial_sum, broadcast, whole),  # small: gloo's in-place all_reduce of one clone
        (split(1), split(0), piece),  # all_to_all, interleaved along dim 1 once
        (split(1), broadcast, whole),  # all_gather, interleaved once
        (partial_sum, split(1), whole),  # the chunks packed once for the wire
    ]


def _to_global_copies() -> list[str]:
    """``to_global`` for each one-collective case on the whole world (2 ranks, even)."""
    rank, world = sbpflow.env.get_rank(), sbpflow.env.get_world_size()
    placement = sbpflow.placement("cpu", list(range(world)))
    gen = torch.Generator().manual_seed(9)
    shape = (8, 6)
    parts = [torch.randint(-8, 9, shape, generator=gen).float() for _ in range(world)]
    whole, total = parts[0], sum(parts)
    problems: list[str] = []
    piece_bytes = _nbytes(whole) // world
    for src, dst, needed in _one_collective_cases(_nbytes(whole), piece_bytes):
        if src == partial_sum:
            value, local = total, parts[rank].clone()
        else:
            value, local = whole, torch.tensor_split(whole, world, dim=src.dim)[rank].clone()
        x = sbpflow.to_global(local, placement, src, check_meta=False, shape=shape)
        expected = (
            value if dst == broadcast else torch.tensor_split(value, world, dim=dst.dim)[rank]
        )
        problems += _measure(
            f"{src} -> {dst} on rank {rank}",
            partial(_box, x, dst),
            expected, needed, x,
        )  # fmt: skip
    # P -> B of two members, 8 MiB (from collectives.EXCHANGED_ALL_REDUCE_BYTES up): a
    # reduce_scatter and an all_gather inside the result (NOTE [gloo gathers and
    # reductions]), no clone
    rows = 8 * 2**20 // 4 // 64
    big = [torch.randint(-8, 9, (rows, 64), generator=gen).float() for _ in range(world)]
    x = sbpflow.to_global(big[rank].clone(), placement, partial_sum, check_meta=False)
    problems += _measure(
        f"large P -> B on rank {rank}", partial(_box, x, broadcast), sum(big), 0, x
    )
    return problems


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_one_collective_boxing_copies_only_what_the_layout_needs(
    dist_pool: DistributedPool,
) -> None:
    problems = [p for ranks in dist_pool.run(_to_global_copies) for p in ranks]
    assert not problems, "\n".join(problems)


def _to_global_wire_bytes() -> list[str]:
    """Bytes each one-collective ``to_global`` sends from this rank (the whole world, even
    pieces) against what its layout change needs: a gather sends the piece to each other
    member, a reduce_scatter each other member's chunk once, an all_reduce the bound above,
    an all_to_all the piece but this rank's chunk of it."""
    rank, world = sbpflow.env.get_rank(), sbpflow.env.get_world_size()
    placement = sbpflow.placement("cpu", list(range(world)))
    shape = (8 * world, 6 * world)
    whole = torch.arange(shape[0] * shape[1], dtype=torch.float32).view(shape)
    piece, other = _nbytes(whole) // world, world - 1
    problems: list[str] = []
    for src, dst, needed in [
        (split(0), broadcast, other * piece),
        (split(1), broadcast, other * piece),
        (partial_sum, broadcast, 2 * other * piece),
        (partial_sum, split(0), other * piece),
        (partial_sum, split(1), other * piece),
        (split(1), split(0), other * piece // world),
    ]:
        local = whole.clone() if src == partial_sum else whole.tensor_split(world, src.dim)[rank]
        x = sbpflow.to_global(local.clone(), placement, src, check_meta=False, shape=shape)
        value = whole * world if src == partial_sum else whole
        expected = value if dst == broadcast else value.tensor_split(world, dst.dim)[rank]
        with _counting_copies() as counter:
            got = _box(x, dst)
        if not torch.equal(got, expected):
            problems.append(f"{src} -> {dst} on rank {rank}: wrong result")
        if counter.sent > needed:
            problems.append(
                f"{src} -> {dst} on rank {rank}: sent {counter.sent} bytes, needs {needed}"
            )
    return problems


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_one_collective_boxing_sends_only_what_the_layout_needs(
    dist_pool: DistributedPool,
) -> None:
    problems = [p for ranks in dist_pool.run(_to_global_wire_bytes) for p in ranks]
    assert not problems, "\n".join(problems)
