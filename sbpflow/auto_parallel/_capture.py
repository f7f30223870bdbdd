"""Capture the forward of a training step on meta tensors: a list of ATen ops and their tensors.

No data and no process group: the parameters, buffers and inputs are replaced by meta tensors
of the same shape and dtype (``torch.func.functional_call``), and a ``TorchDispatchMode``
records every ATen op the forward runs. ``scaled_dot_product_attention`` is recorded as one
op (a ``TorchFunctionMode`` sees it before it decomposes), so attention can be split by heads.

# NOTE [forward graph, derived backward]
# Only the forward is captured. The backward of each op is priced from its forward strategy
# (NOTE [backward layouts] in _strategies.py): twice the forward compute, and the boxing of
# each gradient from the layout the consumer's backward produces to the layout its producer
# needs. Repeated blocks (a ``ModuleList``'s entries with the same ops on the same shapes)
# are found here and share one set of decisions in the solver.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Graph", "Node", "Ref", "capture"]

SDPA = "sdpa"  # the target of a recorded F.scaled_dot_product_attention


@dataclass(frozen=True)
class Ref:
    """A tensor argument of an op: the ``index``-th tensor input of its node."""

    index: int


@dataclass
class Node:
    """One tensor producer: a parameter, buffer, input, constant or op."""

    index: int
    kind: str  # "param", "buffer", "input", "constant", "op"
    target: str  # the op's name ("aten.mm.default", "sdpa") or the tensor's name
    inputs: tuple[tuple[int, int], ...]  # (producer node, its output index) per tensor input
    in_shapes: tuple[tuple[int, ...], ...]
    out_shapes: tuple[tuple[int, ...], ...]
    out_dtypes: tuple[torch.dtype, ...]
    args: tuple[Any, ...] = ()  # tensors replaced by Ref
    kwargs: dict[str, Any] = field(default_factory=dict)
    module: str = ""  # innermost module path the op ran in
    block: tuple[str, int] | None = None  # (repeated block path, its call number)
    depends_on_data: bool = False  # reached from a parameter or an input
    requires_grad: bool = False  # reached from a parameter
    tie: int = -1  # the node whose decision this one shares (itself when -1)


Refs = tuple[tuple[int, int] | None, ...]  # per leaf of a module's arguments / output


@dataclass
class Graph:
    nodes: list[Node]
    outputs: tuple[tuple[int, int], ...]  # the step's output tensors (node, output index)
    param_nodes: dict[str, int]  # parameter name -> node
    input_nodes: tuple[int, ...]
    # module path -> per call, the tensors it was given and returned (NOTE [module boundaries])
    module_io: dict[str, list[tuple[Refs, Refs]]] = field(default_factory=dict)


# -- recording ------------------------------------------------------------------------


class _Recorder:
    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.produced: dict[int, tuple[int, int]] = {}
        self.alive: list[torch.Tensor] = []  # keeps ids unique while capturing
        self.module_stack: list[str] = [""]
        self.block_calls: dict[str, int] = {}
        self.block_stack: list[tuple[str, int] | None] = [None]
        self.module_io: dict[str, list[tuple[Refs, Refs]]] = {}
        self.paused = 0

    def refs(self, value: Any) -> Refs:
        """The node output each tensor leaf of ``value`` is (None: not a tensor, or unseen)."""
        return tuple(
            self.produced.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None
            for leaf in pytree.tree_leaves(value)
        )

    def leaf(self, kind: str, name: str, tensor: torch.Tensor) -> int:
        node = Node(
            index=len(self.nodes),
            kind=kind,
            target=name,
            inputs=(),
            in_shapes=(),
            out_shapes=(tuple(tensor.shape),),
            out_dtypes=(tensor.dtype,),
            depends_on_data=kind in ("param", "input"),
            requires_grad=kind == "param",
        )
        self.nodes.append(node)
        self.produced[id(tensor)] = (node.index, 0)
        self.alive.append(tensor)
        return node.index

    def source(self, tensor: torch.Tensor) -> tuple[int, int]:
        found = self.produced.get(id(tensor))
        if found is None:  # a tensor made outside the step's ops (a module attribute)
            self.leaf("constant", "constant", tensor)
            found = self.produced[id(tensor)]
        return found

    def record(self, target: str, args: Any, kwargs: Any, out: Any) -> None:
        inputs: list[tuple[int, int]] = []
        in_shapes: list[tuple[int, ...]] = []

        def to_ref(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                inputs.append(self.source(value))
                in_shapes.append(tuple(value.shape))
                return Ref(len(inputs) - 1)
            return value

        args = pytree.tree_map(to_ref, tuple(args))
        kwargs = pytree.tree_map(to_ref, dict(kwargs or {}))
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outs:
            return
        producers = [self.nodes[i] for i, _ in inputs]
        node = Node(
            index=len(self.nodes),
            kind="op",
            target=target,
            inputs=tuple(inputs),
            in_shapes=tuple(in_shapes),
            out_shapes=tuple(tuple(t.shape) for t in outs),
            out_dtypes=tuple(t.dtype for t in outs),
            args=args,
            kwargs=kwargs,
            module=self.module_stack[-1],
            block=self.block_stack[-1],
            depends_on_data=any(p.depends_on_data for p in producers),
            requires_grad=any(p.requires_grad for p in producers)
            and any(t.dtype.is_floating_point for t in outs),
        )
        self.nodes.append(node)
        for j, t in enumerate(outs):
            self.produced[id(t)] = (node.index, j)
            self.alive.append(t)

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


class _DispatchRecorder(TorchDispatchMode):
    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not self.recorder.paused:
            self.recorder.record(str(func), args, kwargs, out)
        return out


class _FusedRecorder(TorchFunctionMode):
    """Records ``F.scaled_dot_product_attention`` as one op instead of its decomposition."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or self.recorder.paused:
            return func(*args, **kwargs)
        with self.recorder.pause():
            out = func(*args, **kwargs)
        self.recorder.record(SDPA, args, kwargs, out)
        return out


# A path component that is an index into a ModuleList / Sequential: "layers.3" -> "layers.*".
_INDEX = re.compile(r"(^|\.)(\d+)(?=\.|$)")


def canonical(path: str) -> str:
    return _INDEX.sub(r"\1*", path)


@contextlib.contextmanager
def _module_hooks(model: torch.nn.Module, recorder: _Recorder) -> Iterator[None]:
    handles = []
    for name, module in model.named_modules():

        def pre(_m: Any, args: Any, kwargs: Any, name: str = name) -> None:
            recorder.module_io.setdefault(name, []).append((recorder.refs((args, kwargs)), ()))
            recorder.module_stack.append(name)
            block = recorder.block_stack[-1]
            if block is None and _INDEX.search(name):
                calls = recorder.block_calls.get(name, 0)
                recorder.block_calls[name] = calls + 1
                block = (name, calls)
            recorder.block_stack.append(block)

        def post(_m: Any, _a: Any, out: Any, name: str = name) -> None:
            recorder.module_stack.pop()
            recorder.block_stack.pop()
            given, _ = recorder.module_io[name][-1]
            recorder.module_io[name][-1] = (given, recorder.refs(out))

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, always_call=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def capture(model: torch.nn.Module, example_inputs: Sequence[torch.Tensor]) -> Graph:
    """Run ``model(*example_inputs)`` on meta tensors and record its ops."""
    recorder = _Recorder()
    state: dict[str, torch.Tensor] = {}
    param_nodes: dict[str, int] = {}
    seen: dict[int, tuple[torch.Tensor, int]] = {}  # tied parameters: one node for every name
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            meta = _meta(p).requires_grad_(p.requires_grad)
            seen[id(p)] = (meta, recorder.leaf("param", name, meta))
        state[name], param_nodes[name] = seen[id(p)]
    for name, b in model.named_buffers(remove_duplicate=False):
        if id(b) not in seen:
            meta = _meta(b)
            seen[id(b)] = (meta, recorder.leaf("buffer", name, meta))
        state[name] = seen[id(b)][0]
    inputs = []
    input_nodes = []
    for i, x in enumerate(example_inputs):
        meta = _meta(x)
        inputs.append(meta)
        input_nodes.append(recorder.leaf("input", f"input{i}", meta))
    try:
        with _module_hooks(model, recorder), _FusedRecorder(recorder), _DispatchRecorder(recorder):
            out = torch.func.functional_call(model, state, tuple(inputs), tie_weights=False)
    except RuntimeError as error:
        if "meta tensors" not in str(error):
            raise
        raise ValueError(
            "the model's forward reads a tensor's value (.item(), bool(), a data-dependent "
            "branch), but auto_parallel runs it on meta tensors, with shapes and no data. Make "
            "the forward's control flow independent of values (Hugging Face models: keep the "
            f"default use_cache, or pass an attention mask). The error was: {error}"
        ) from error
    outputs = tuple(
        recorder.produced[id(t)]
        for t in _output_tensors(out)
        if id(t) in recorder.produced and t.dtype.is_floating_point
    )
    if not outputs:
        raise ValueError(
            f"the model's output holds no floating-point tensor computed from its parameters "
            f"(got {type(out).__name__}); auto_parallel needs a forward whose output a loss "
            "is computed from."
        )
    nodes = recorder.nodes
    _tie_blocks(nodes)
    return Graph(nodes, outputs, param_nodes, tuple(input_nodes), recorder.module_io)


def _output_tensors(out: Any) -> list[torch.Tensor]:
    if hasattr(out, "to_tuple"):  # transformers' ModelOutput
        out = out.to_tuple()
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


# -- repeated blocks ------------------------------------------------------------------


def _tie_blocks(nodes: list[Node]) -> None:
    """Nodes of repeated block calls with identical ops and shapes share decisions.

    Two calls of blocks with the same canonical path ("layers.*") tie when their op
    sequences match one for one: same op, shapes and non-tensor arguments, and every
    tensor input either inside the call at the same position, or outside it from a
    parameter of the same canonical name, or from the same-position node of the previous
    call's output edge (the residual stream). Parameters tie when all their uses are tied.
    """
    calls: dict[tuple[str, int], list[int]] = {}
    for node in nodes:
        if node.block is not None:
            calls.setdefault(node.block, []).append(node.index)
    by_path: dict[str, list[list[int]]] = {}
    for (path, _), members in sorted(calls.items(), key=lambda kv: kv[1][0]):
        by_path.setdefault(canonical(path), []).append(members)

    def signature(members: list[int]) -> tuple[Any, ...]:
        position = {n: i for i, n in enumerate(members)}
        sig = []
        for n in members:
            node = nodes[n]
            ins = []
            for src, out in node.inputs:
                if src in position:
                    ins.append(("in", position[src], out))
                elif nodes[src].kind == "param":
                    ins.append(("param", canonical(nodes[src].target), out))
                else:
                    ins.append(("out", nodes[src].out_shapes[out]))
            sig.append(
                (
                    node.target,
                    node.in_shapes,
                    node.out_shapes,
                    repr((node.args, node.kwargs)),
                    tuple(ins),
                    node.requires_grad,
                    node.depends_on_data,
                )
            )
        return tuple(sig)

    param_ties: dict[int, set[int]] = {}
    for groups in by_path.values():
        first = groups[0]
        first_sig = signature(first)
        for members in groups[1:]:
            if len(members) != len(first) or signature(members) != first_sig:
                continue
            for a, b in zip(first, members, strict=True):
                nodes[b].tie = a
                for (src_a, _), (src_b, _) in zip(nodes[a].inputs, nodes[b].inputs, strict=True):
                    if nodes[src_b].kind == "param" and src_a != src_b:
                        param_ties.setdefault(src_b, set()).add(src_a)
    for param, reps in param_ties.items():
        if len(reps) == 1 and nodes[param].out_shapes == nodes[min(reps)].out_shapes:
            nodes[param].tie = min(reps)
