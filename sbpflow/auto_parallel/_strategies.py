"""Candidate strategies of each captured op: its inputs' and outputs' layouts. Pure.

A rule gives the op's options on one placement axis, ``(input sbps, output sbps)``; the
N-D strategies are every combination over the axes whose split dims divide evenly.
An op with no rule gets one strategy, everything broadcast: always correct, priced as
computing the whole op on every rank (the plan lists such ops).

# NOTE [backward layouts]
# The gradient of an input arrives, per axis, in the layout the op's backward computes
# locally from the output gradient:
#
#   input   outputs        gradient of the input
#   S(d)    any            S(d)
#   P       any            B     (the op is linear in a partial input; the gradient is whole)
#   B       all B          B
#   B       some S or P    P     (each rank holds part of the work: its gradients are partial)
#
# and an output of layout S(d) / B / P needs its gradient as S(d) / B / B. A partial
# gradient reaching a broadcast producer is the all_reduce of data parallelism (the
# parameters') and of Megatron's column-parallel input.
#
# Every backward is linear in the output's gradient, so an op whose inputs and outputs are
# all B on an axis may also take a partial gradient there and hand partial gradients to its
# inputs (the "partial gradient" variant of its all-B option): the all_reduce then happens
# once, where it is cheapest (Megatron's: at the block's input, after q, k and v's sum).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..sbp import Broadcast, NdSbp, Partial, SbpParallel, Split, broadcast, partial_sum, split
from ._capture import SDPA, Node, Ref

__all__ = ["Strategy", "grad_target", "is_view", "op_flops", "strategies"]

B = broadcast
P = partial_sum
AxisOption = tuple[tuple[SbpParallel, ...], tuple[SbpParallel, ...]]


@dataclass(frozen=True)
class Strategy:
    inputs: tuple[NdSbp, ...]
    outputs: tuple[NdSbp, ...]
    grads: tuple[NdSbp, ...]  # layout each input's gradient arrives in (NOTE [backward layouts])
    fraction: float  # the share of the op's work one rank does
    out_grads: tuple[NdSbp, ...] = ()  # layout each output's gradient is needed in

    def __post_init__(self) -> None:
        if not self.out_grads:
            object.__setattr__(self, "out_grads", tuple(grad_target(o) for o in self.outputs))


def grad_target(layout: NdSbp) -> NdSbp:
    """The layout an output of ``layout`` needs its gradient in."""
    return tuple(B if isinstance(s, Partial) else s for s in layout)


# -- rules ------------------------------------------------------------------------------

Rule = Callable[[Node], list[AxisOption]]
_RULES: dict[str, Rule] = {}


def _rule(*names: str) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        for name in names:
            _RULES[name] = fn
        return fn

    return register


def _arg(node: Node, position: int, name: str, default: object = None) -> object:
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)


def _all_b(node: Node) -> AxisOption:
    return ((B,) * len(node.in_shapes), (B,) * len(node.out_shapes))


def _pointwise(node: Node) -> list[AxisOption]:
    out = node.out_shapes[0]
    rank = len(out)
    options = []
    for d in range(rank):
        if out[d] <= 1:
            continue
        ins = []
        for shape in node.in_shapes:
            di = d - (rank - len(shape))
            ins.append(split(di) if di >= 0 and shape[di] == out[d] else B)
        options.append((tuple(ins), (split(d),) * len(node.out_shapes)))
    return options


# Pointwise ops linear in some inputs: which inputs may be partial together (the rest B).
_LINEAR = {
    "add": ("all",),
    "sub": ("all",),
    "neg": ("all",),
    "mul": ("first", "second"),
    "div": ("first",),
    "_to_copy": ("all",),
    "clone": ("all",),
    "alias": ("all",),
    "detach": ("all",),
    "expand": ("first",),
}


def _partial_options(node: Node, base: str) -> list[AxisOption]:
    n_in, n_out = len(node.in_shapes), len(node.out_shapes)
    options = []
    for which in _LINEAR.get(base, ()):
        if which == "all":
            ins = (P,) * n_in
        elif which == "first":
            ins = (P,) + (B,) * (n_in - 1)
        elif n_in == 2:
            ins = (B, P)
        else:
            continue
        if base in ("add", "sub") and not (
            len(node.args) >= 2 and isinstance(node.args[0], Ref) and isinstance(node.args[1], Ref)
        ):
            continue  # x + 1 is not linear in x
        if n_in:
            options.append((ins, (P,) * n_out))
    return options


def _view_groups(src: Sequence[int], dst: Sequence[int]) -> dict[int, int]:
    """Source dim -> destination dim where splitting one is splitting the other (a view)."""
    mapping: dict[int, int] = {}
    if math.prod(src) != math.prod(dst) or math.prod(src) == 0:
        return mapping
    i = j = 0
    while i < len(src) and j < len(dst):
        group_src, group_dst = [i], [j]
        size_src, size_dst = src[i], dst[j]
        while size_src != size_dst:
            if size_src < size_dst:
                i += 1
                group_src.append(i)
                size_src *= src[i]
            else:
                j += 1
                group_dst.append(j)
                size_dst *= dst[j]
        a = next((d for d in group_src if src[d] != 1), None)
        b = next((d for d in group_dst if dst[d] != 1), None)
        if a is not None and b is not None:
            mapping[a] = b
        i += 1
        j += 1
    return mapping


def _mapped(node: Node, mapping: dict[int, int]) -> list[AxisOption]:
    n_out = len(node.out_shapes)
    others = (B,) * (len(node.in_shapes) - 1)
    return [((split(a), *others), (split(b),) * n_out) for a, b in sorted(mapping.items())]


@_rule("view", "_unsafe_view", "reshape", "_reshape_alias", "squeeze", "unsqueeze")
def _view(node: Node) -> list[AxisOption]:
    return _mapped(node, _view_groups(node.in_shapes[0], node.out_shapes[0]))


@_rule("permute")
def _permute(node: Node) -> list[AxisOption]:
    dims = [int(d) % len(node.in_shapes[0]) for d in _arg(node, 1, "dims")]  # type: ignore[union-attr]
    return _mapped(node, {src: dst for dst, src in enumerate(dims)})


@_rule("transpose", "t")
def _transpose(node: Node) -> list[AxisOption]:
    rank = len(node.in_shapes[0])
    if rank < 2:
        return _mapped(node, {d: d for d in range(rank)})
    d0 = int(_arg(node, 1, "dim0", 0)) % rank  # type: ignore[arg-type]
    d1 = int(_arg(node, 2, "dim1", 1)) % rank  # type: ignore[arg-type]
    mapping = {d: d for d in range(rank)}
    mapping[d0], mapping[d1] = d1, d0
    return _mapped(node, mapping)


def _dim_arg(node: Node, position: int, name: str, default: int = 0) -> int:
    return int(_arg(node, position, name, default)) % max(1, len(node.in_shapes[0]))  # type: ignore[arg-type]


@_rule("slice", "split", "split_with_sizes", "narrow")
def _slice(node: Node) -> list[AxisOption]:
    dim = _dim_arg(node, 1, "dim")
    return _mapped(node, {d: d for d in range(len(node.in_shapes[0])) if d != dim})


@_rule("select", "unbind")
def _select(node: Node) -> list[AxisOption]:
    dim = _dim_arg(node, 1, "dim")
    rank = len(node.in_shapes[0])
    return _mapped(node, {d: d - (d > dim) for d in range(rank) if d != dim})


@_rule("cat")
def _cat(node: Node) -> list[AxisOption]:
    rank = len(node.out_shapes[0])
    dim = int(_arg(node, 1, "dim", 0)) % rank  # type: ignore[arg-type]
    # empty pieces (a fresh key/value cache) are skipped by cat: they may stay broadcast
    full = [math.prod(s) > 0 for s in node.in_shapes]
    if any(len(s) != rank for s, f in zip(node.in_shapes, full, strict=True) if f):
        return []
    options = [
        (tuple(split(d) if f else B for f in full), (split(d),)) for d in range(rank) if d != dim
    ]
    return [*options, (tuple(P if f else B for f in full), (P,))]


@_rule("mm")
def _mm(node: Node) -> list[AxisOption]:
    return [
        ((split(0), B), (split(0),)),
        ((B, split(1)), (split(1),)),
        ((split(1), split(0)), (P,)),
        ((P, B), (P,)),
        ((B, P), (P,)),
    ]


@_rule("addmm")
def _addmm(node: Node) -> list[AxisOption]:
    bias = node.in_shapes[0]
    rows = split(0) if len(bias) == 2 and bias[0] == node.out_shapes[0][0] else B
    cols = split(len(bias) - 1) if bias and bias[-1] == node.out_shapes[0][1] else B
    return [
        ((rows, split(0), B), (split(0),)),
        ((cols, B, split(1)), (split(1),)),
        ((P, split(1), split(0)), (P,)),
        ((P, P, B), (P,)),
        ((P, B, P), (P,)),
    ]


@_rule("bmm")
def _bmm(node: Node) -> list[AxisOption]:
    return [
        ((split(0), split(0)), (split(0),)),
        ((split(1), B), (split(1),)),
        ((B, split(2)), (split(2),)),
        ((split(2), split(1)), (P,)),
        ((P, B), (P,)),
        ((B, P), (P,)),
    ]


def _reduced_dims(node: Node) -> tuple[list[int], bool]:
    rank = len(node.in_shapes[0])
    dims = _arg(node, 1, "dim", None)
    if node.target.endswith(".default") or dims is None or dims == []:
        return list(range(rank)), False
    if isinstance(dims, int):
        dims = [dims]
    keepdim = bool(_arg(node, 2, "keepdim", False))
    return sorted({int(d) % rank for d in dims}), keepdim  # type: ignore[union-attr]


def _reduction(node: Node, partial: bool) -> list[AxisOption]:
    reduced, keepdim = _reduced_dims(node)
    n_out = len(node.out_shapes)
    options = []
    for d in range(len(node.in_shapes[0])):
        if d in reduced:
            if partial:
                options.append(((split(d),), (P,) * n_out))
        else:
            out = d if keepdim else d - sum(1 for r in reduced if r < d)
            options.append(((split(d),), (split(out),) * n_out))
    if partial:
        options.append(((P,), (P,) * n_out))
    return options


@_rule("sum", "mean")
def _sum(node: Node) -> list[AxisOption]:
    return _reduction(node, partial=len(node.in_shapes) == 1)


@_rule("amax", "amin", "max", "min", "argmax", "argmin")
def _max(node: Node) -> list[AxisOption]:
    if len(node.in_shapes) != 1:  # max.other: elementwise
        return _pointwise(node)
    if node.target.endswith(".default"):
        return []
    return _reduction(node, partial=False)


@_rule("_softmax", "_log_softmax", "_safe_softmax")
def _softmax(node: Node) -> list[AxisOption]:
    dim = _dim_arg(node, 1, "dim")
    return _mapped(node, {d: d for d in range(len(node.in_shapes[0])) if d != dim})


@_rule("native_layer_norm", "_fused_rms_norm")
def _norm(node: Node) -> list[AxisOption]:
    rank = len(node.in_shapes[0])
    normalized = len(_arg(node, 1, "normalized_shape"))  # type: ignore[arg-type]
    others = (B,) * (len(node.in_shapes) - 1)
    n_out = len(node.out_shapes)
    return [((split(d), *others), (split(d),) * n_out) for d in range(rank - normalized)]


@_rule("embedding")
def _embedding(node: Node) -> list[AxisOption]:
    out_rank = len(node.out_shapes[0])
    options = [((B, split(d)), (split(d),)) for d in range(len(node.in_shapes[1]))]
    return [*options, ((split(1), B), (split(out_rank - 1),)), ((split(0), B), (P,))]


@_rule("nll_loss_forward")
def _nll(node: Node) -> list[AxisOption]:
    reduction = int(_arg(node, 3, "reduction", 1))  # type: ignore[arg-type]
    if len(node.in_shapes[0]) != 2:
        return []
    extra = (B,) * (len(node.in_shapes) - 2)
    out = (split(0), P) if reduction == 0 else (P, P)
    return [((split(0), split(0), *extra), out)]


@_rule(SDPA)
def _sdpa(node: Node) -> list[AxisOption]:
    q = node.in_shapes[0]
    if len(q) != 4:
        return []
    options = []
    for d in (0, 1):
        ins = [split(d), split(d), split(d)]
        for shape in node.in_shapes[3:]:  # the attention mask, broadcast over b and h
            aligned = d - (4 - len(shape))
            ins.append(split(aligned) if aligned >= 0 and shape[aligned] == q[d] else B)
        options.append((tuple(ins), (split(d),) * len(node.out_shapes)))
    return options


# -- N-D strategies ------------------------------------------------------------------


def _base(target: str) -> str:
    name = target.split(".")[1] if target.startswith("aten.") else target
    return name[:-1] if name.endswith("_") and not name.startswith("_") else name


def _is_pointwise(target: str) -> bool:
    if not target.startswith("aten."):
        return False
    _, name, overload = target.split(".")
    packet = getattr(torch.ops.aten, name, None)
    op = getattr(packet, overload, None) if packet is not None else None
    return op is not None and torch.Tag.pointwise in op.tags


_VIEWS = {
    "view",
    "_unsafe_view",
    "reshape",
    "_reshape_alias",
    "squeeze",
    "unsqueeze",
    "permute",
    "transpose",
    "t",
    "expand",
    "slice",
    "select",
    "split",
    "split_with_sizes",
    "narrow",
    "unbind",
    "alias",
    "detach",
}


def is_view(node: Node) -> bool:
    return node.kind == "op" and _base(node.target) in _VIEWS


def has_rule(node: Node) -> bool:
    base = _base(node.target)
    return (
        base in _RULES
        or _is_pointwise(node.target)
        or base in _LINEAR
        or base.endswith("_like")
        or not node.in_shapes
    )


def axis_options(node: Node) -> list[AxisOption]:
    """The op's options on one placement axis, all-broadcast first."""
    options = [_all_b(node)]
    if node.kind in ("param", "input"):
        shape = node.out_shapes[0]
        return options + [((), (split(d),)) for d in range(len(shape)) if shape[d] > 1]
    if node.kind != "op" or not node.depends_on_data:
        return options
    base = _base(node.target)
    if base in _RULES:
        options += _RULES[base](node)
    elif _is_pointwise(node.target) or base in _LINEAR or base.endswith("_like"):
        options += _pointwise(node)
    if base in _LINEAR:
        options += _partial_options(node, base)
    return options


def _divides(shape: Sequence[int], layout: NdSbp, mesh: Sequence[int]) -> bool:
    factors = [1] * len(shape)
    for s, size in zip(layout, mesh, strict=True):
        if isinstance(s, Split):
            if s.dim >= len(shape):
                return False
            factors[s.dim] *= size
    return all(n % f == 0 and n >= f for n, f in zip(shape, factors, strict=True) if f > 1)


def _local_fraction(layout: NdSbp, mesh: Sequence[int]) -> float:
    return 1.0 / math.prod(
        size for s, size in zip(layout, mesh, strict=True) if isinstance(s, Split)
    )


def _grad(inp: SbpParallel, outs: Sequence[SbpParallel]) -> SbpParallel:
    if isinstance(inp, Split):
        return inp
    if isinstance(inp, Partial):
        return B
    return B if all(isinstance(o, Broadcast) for o in outs) else P


_PARTIAL_GRAD = "partial gradient"


def strategies(node: Node, mesh: Sequence[int]) -> list[Strategy]:
    """Every N-D strategy of ``node`` on a mesh of shape ``mesh``, in a fixed order."""
    options: list[object] = list(dict.fromkeys(axis_options(node)))
    if node.kind == "op" and node.requires_grad:
        options.append(_PARTIAL_GRAD)
    all_b = options[0]
    found: list[Strategy] = []
    seen = set()
    for marked in itertools.product(options, repeat=len(mesh)):
        combo = [all_b if opt == _PARTIAL_GRAD else opt for opt in marked]
        partial = [opt == _PARTIAL_GRAD for opt in marked]
        inputs = tuple(tuple(opt[0][i] for opt in combo) for i in range(len(node.in_shapes)))
        outputs = tuple(tuple(opt[1][j] for opt in combo) for j in range(len(node.out_shapes)))
        if (inputs, outputs, tuple(partial)) in seen:
            continue
        tensors = list(zip(node.in_shapes, inputs, strict=True)) + list(
            zip(node.out_shapes, outputs, strict=True)
        )
        if not all(_divides(shape, layout, mesh) for shape, layout in tensors):
            continue
        seen.add((inputs, outputs, tuple(partial)))
        grads = tuple(
            tuple(
                P if pg else _grad(opt[0][i], opt[1])
                for opt, pg in zip(combo, partial, strict=True)
            )
            for i in range(len(node.in_shapes))
        )
        out_grads = tuple(
            tuple(
                P if pg else grad_target((opt[1][j],))[0]
                for opt, pg in zip(combo, partial, strict=True)
            )
            for j in range(len(node.out_shapes))
        )
        fraction = min(_local_fraction(layout, mesh) for _, layout in tensors)
        found.append(Strategy(inputs, outputs, grads, fraction, out_grads))
    return found


def op_flops(node: Node) -> tuple[float, float]:
    """(floating-point operations, bytes read and written) of the whole (logical) op."""
    if node.kind != "op" or is_view(node):
        return 0.0, 0.0
    itemsize = node.out_dtypes[0].itemsize
    num_bytes = (
        float(
            sum(math.prod(s) for s in node.in_shapes) + sum(math.prod(s) for s in node.out_shapes)
        )
        * itemsize
    )
    base = _base(node.target)
    out = node.out_shapes[0]
    if base in ("mm", "addmm"):
        k = node.in_shapes[-2][1]
        return 2.0 * math.prod(out) * k + (math.prod(out) if base == "addmm" else 0), num_bytes
    if base == "bmm":
        return 2.0 * math.prod(out) * node.in_shapes[0][2], num_bytes
    if base == SDPA:
        q, k = node.in_shapes[0], node.in_shapes[1]
        return 4.0 * math.prod(q) * k[-2], num_bytes
    return float(sum(math.prod(s) for s in node.out_shapes)), num_bytes


def unsupported(node: Node) -> bool:
    """The op runs all-broadcast because it has no rule (listed by the plan)."""
    return node.kind == "op" and node.depends_on_data and not has_rule(node)


def ref_positions(node: Node) -> list[int]:
    return [a.index for a in node.args if isinstance(a, Ref)]
