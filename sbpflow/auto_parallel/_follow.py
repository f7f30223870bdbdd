"""Running a plan: each op takes its planned strategy, and module boundaries box to the
planned layouts.

# NOTE [following the plan]
# ``Plan.apply`` sets the parameters' layouts; between them, sbpflow's own propagation lays
# out each op from the layouts it is given (NOTE [choosing a strategy] in
# sbpflow/_propagation.py), and may box elsewhere than the plan (an all_reduce where the
# plan reduce-scatters and all-gathers later). So ``apply`` also pins the layouts at module
# boundaries, as DTensor's ``parallelize_module`` input/output layouts do: a forward
# pre-hook and a forward hook per module box each tensor the module is given or returns to
# the layout the plan reads it in (``Boundary.sbp``), through ``_Follow``, an autograd
# Function whose backward boxes the gradient to the layout the plan hands back there
# (``Boundary.grad_sbp``), from whatever layout it arrives in. Being a Function, its output
# gets no gradient hook of the propagation's own (NOTE [gradient plan]): the plan decides.
# Inside a module, ops still propagate; from planned inputs and parameters they mostly
# take the planned strategy, and the boundaries bring any drift back. Boxing never changes
# a value, so a boundary can only move collectives, never numerics.
#
# A boundary applies when the module's call has as many tensor leaves as when the step was
# captured and the tensor has the captured shape; otherwise the tensor is left as it is.
#
# Hooks cost eager work on every call (flattening the arguments, a Function per tensor), so
# the first training step also notes which boundaries acted: boxed a tensor forward, or a
# gradient backward. When the model is next called after a backward has run through the
# boundaries, the hooks of every module none of whose boundaries acted are removed: there
# propagation already lays out the step as planned, and it makes the same decisions from
# the same layouts on every later step. Modules that did act keep their hooks.
#
# Inside a module, each op takes the strategy the plan gives it (NOTE [planned strategies]
# in sbpflow/_propagation.py): while the model's forward runs, a ``_Cursor`` over the plan's
# ops (``_Ops``) is the plan being followed (``FOLLOWING`` in sbpflow/_decisions.py), and
# the dispatcher asks it, for each call on global tensors, which planned op the call is.
# The forward runs its ops in the order the step was captured in, so the cursor walks the
# captured ops: a call is the next captured op of the same name whose tensor arguments have
# the same shapes, looked for among the next ``_LOOKAHEAD`` ones (the capture also holds ops
# on plain tensors, which never reach the dispatcher). A call found nowhere there (another batch
# shape, another branch of the model's control flow, an op sbpflow decomposes) is not the
# plan's: it propagates as without a plan, and the cursor stays. Propagation takes a
# planned strategy only where the op's rule offers it, so a call matched to the wrong op
# still computes the right value; only its boxing may differ from the plan.
# The backward is not matched op by op: it follows from the forward's layouts (an input a
# planned op boxed gets its gradient boxed back, NOTE [gradient plan]). Autograd saves an
# op's inputs as they were passed, before dispatch boxes them, so an op whose backward reads
# an input the plan boxed boxes it again there, which the plan does not price. In the
# forward too, each planned op boxes its own inputs: a tensor several ops of one module read
# in the same boxed layout is boxed once per reader, where the plan counts it once (NOTE
# [shared outputs] in _solve.py; readers in separate modules share their parent's boundary
# instead). A call of the model from inside its own forward on the same thread is not
# followed op by op. Captured ``sdpa`` (one fused call, several ATen ops at run time) and
# ops with no rule are left to propagation, and so are the ops between a fully sharded
# parameter and its readers (NOTE [fully sharded modules of a plan] in _api.py: they get
# the gathered parameter, not the split one the plan laid them out for), though the
# cursor still walks past them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

from .._decisions import FOLLOWING
from .._global import GlobalTensor, as_global_grad
from .._layout import Layout
from .._propagation import Planned
from ..boxing._redistribute import Redistribute, box_below_autograd
from ..placement import Placement
from ._capture import SDPA

if TYPE_CHECKING:  # _plan imports this module when a plan is applied
    from ._plan import Boundary, OpChoice

__all__ = ["follow", "followed_modules", "unfollow"]

_HANDLES = "_sbpflow_plan_hooks"


class _Follow(torch.autograd.Function):
    """Forward: box to the planned layout. Backward: box the gradient to the planned one."""

    @staticmethod
    def forward(
        ctx: Any, x: GlobalTensor, dst: Layout, grad: Layout, seen: Any = None
    ) -> GlobalTensor:
        ctx.grad = grad
        ctx.seen = seen
        # a new tensor even when nothing moves: an input returned as is would be a view of
        # it, and the propagation's gradient hooks would go on its base (NOTE [gradient plan])
        if x._layout.normalized() == dst:
            return GlobalTensor(x._local, x._layout, x.shape)
        return box_below_autograd(x, dst)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        grad = as_global_grad(grad, "a module boundary of an auto_parallel plan")
        moved = grad._layout.normalized() != ctx.grad
        if moved:
            grad = Redistribute.apply(grad, ctx.grad)
        if ctx.seen is not None:
            ctx.seen(moved)
        return grad, None, None, None


class _Boundaries:
    """The boundaries of one model, by module, with their layouts made once."""

    def __init__(self, placement: Placement, boundaries: Sequence[Boundary]) -> None:
        self.placement = placement
        self.tables: dict[tuple[str, str], dict[int, tuple[Boundary, Layout, Layout | None]]]
        self.tables = {}
        for b in boundaries:
            dst = Layout(placement, b.sbp).normalized()
            grad = None if b.grad_sbp is None else Layout(placement, b.grad_sbp).normalized()
            self.tables.setdefault((b.module, b.where), {})[b.position] = (b, dst, grad)
        # tensors a boundary made, with its layouts: the next boundary with the same ones
        # (a module's output handed to the next module) adds nothing
        self.made: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # the first step's record: modules whose boundaries boxed something, and whether a
        # backward ran through any boundary (None once the idle hooks are removed)
        self.acted: set[str] | None = set()
        self.backward_seen = False

    def _seen(self, module: str) -> Any:
        def seen(moved: bool) -> None:
            self.backward_seen = True
            if moved and self.acted is not None:
                self.acted.add(module)

        return seen

    def box(self, value: Any, key: tuple[str, str]) -> Any:
        table = self.tables[key]
        leaves, spec = pytree.tree_flatten(value)
        if len(leaves) != next(iter(table.values()))[0].num_leaves:
            return value
        for position, (boundary, dst, grad) in table.items():
            x = leaves[position]
            if (
                not isinstance(x, GlobalTensor)
                or x.placement != self.placement
                or tuple(x.shape) != boundary.shape
                or self.made.get(x) == (dst, grad)
            ):
                continue
            moved = x._layout.normalized() != dst
            if moved and self.acted is not None:
                self.acted.add(key[0])
            if x.requires_grad and torch.is_grad_enabled() and grad is not None:
                seen = None if self.acted is None else self._seen(key[0])
                x = _Follow.apply(x, dst, grad, seen)
            elif moved:
                x = x.to_global(sbp=dst.sbp)
            self.made[x] = (dst, grad)
            leaves[position] = x
        return pytree.tree_unflatten(leaves, spec)


# How many captured ops past the cursor a call may be found at (NOTE [following the plan])
_LOOKAHEAD = 32


class _Ops:
    """The plan's ops in the order the forward runs them; each forward walks them with a
    ``_Cursor`` of its own."""

    def __init__(
        self, placement: Placement, ops: Sequence[OpChoice], free: Collection[int] = ()
    ) -> None:
        interned: dict[tuple[Any, ...], Planned] = {}
        self.entries: list[tuple[str, tuple[tuple[int, ...], ...], Planned | None]] = []
        for op in ops:
            if op.fallback or op.op == SDPA or len(op.in_shapes) != len(op.inputs):
                continue  # left to propagation
            if op.index in free:  # matched, so that the cursor moves past it, then propagated
                self.entries.append((op.op, op.in_shapes, None))
                continue
            key = (op.inputs, op.outputs)
            if key not in interned:
                interned[key] = Planned(
                    tuple(Layout(placement, sbp).normalized() for sbp in op.inputs),
                    tuple(Layout(placement, sbp).normalized() for sbp in op.outputs),
                )
            self.entries.append((op.op, op.in_shapes, interned[key]))
        self.names: dict[Any, str] = {}
        self.calls = threading.local()  # per thread: the token of the forward running

    def start(self) -> None:
        """A forward of the model starts: follow the plan from its first op, with a cursor of
        its own (two threads running the model each have theirs)."""
        # a forward that never stopped (interrupted: module hooks catch Exception only)
        stale = self._take_token()
        if stale is not None:
            with contextlib.suppress(ValueError):  # set in another context: nothing to undo
                FOLLOWING.reset(stale)
        self.calls.token = FOLLOWING.set(_Cursor(self).match)

    def stop(self) -> None:
        token = self._take_token()
        if token is not None:
            FOLLOWING.reset(token)

    def _take_token(self) -> Any:
        token, self.calls.token = getattr(self.calls, "token", None), None
        return token


class _Cursor:
    """How far one forward got through the plan's ops."""

    def __init__(self, ops: _Ops) -> None:
        self.ops = ops
        self.next = 0

    def match(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Planned | None:
        """The planned layouts of this call, if it is the next op of the plan."""
        names = self.ops.names
        name = names.get(func)
        if name is None:
            name = names[func] = str(func)
        entries, shapes = self.ops.entries, None
        for j in range(self.next, min(self.next + _LOOKAHEAD, len(entries))):
            entry = entries[j]
            if entry[0] != name:
                continue
            if shapes is None:
                shapes = _shapes(args, kwargs.values())
            if entry[1] == shapes:
                self.next = j + 1
                return entry[2]
        return None


def _shapes(*groups: Any) -> tuple[Any, ...]:
    """The shapes of the tensor arguments of a call (its args, its kwargs' values), as
    ``tree_flatten`` orders them (an ATen call nests tensors in lists one level deep)."""
    found = []
    for group in groups:
        for a in group:
            if isinstance(a, torch.Tensor):
                found.append(a.shape)
            elif type(a) is list or type(a) is tuple:
                found += [t.shape for t in a if isinstance(t, torch.Tensor)]
    return tuple(found)


def follow(
    model: torch.nn.Module,
    placement: Placement,
    boundaries: Sequence[Boundary],
    ops: Sequence[OpChoice] = (),
    free: Collection[int] = (),
) -> None:
    """Install the hooks that follow the plan on ``model`` (replacing earlier ones): each op
    takes its planned strategy (but those of ``free``, by index: propagated), each module
    boundary boxes to its planned layouts."""
    unfollow(model)
    state = _Boundaries(placement, boundaries)
    by_module: dict[str, list[Any]] = {}
    for name, module in model.named_modules():
        if (name, "input") in state.tables:

            def pre(_m: Any, args: Any, kwargs: Any = None, key: tuple = (name, "input")) -> Any:
                if kwargs is None:  # removed by ``prune`` while the root's call was starting
                    return None
                return state.box((args, kwargs), key)

            by_module.setdefault(name, []).append(
                module.register_forward_pre_hook(pre, with_kwargs=True)
            )
        if (name, "output") in state.tables:

            def post(_m: Any, _a: Any, out: Any, key: tuple = (name, "output")) -> Any:
                return state.box(out, key)

            by_module.setdefault(name, []).append(module.register_forward_hook(post))

    def prune(_m: Any, _args: Any) -> None:
        if state.acted is None or not state.backward_seen:
            return  # the first step has not finished its backward yet
        for name in [n for n in by_module if n not in state.acted]:
            for handle in by_module.pop(name):
                handle.remove()
        state.acted = None
        pruner.remove()

    # runs before the boundary hooks of the root (registered after them, but prepended)
    pruner = model.register_forward_pre_hook(prune, prepend=True)
    following = _Ops(placement, ops, free)

    def start(_m: Any, _args: Any) -> None:
        if not torch.compiler.is_compiling():
            following.start()

    def stop(_m: Any, _args: Any, _out: Any) -> None:
        if not torch.compiler.is_compiling():
            following.stop()

    ops_hooks = (
        model.register_forward_pre_hook(start, prepend=True),
        model.register_forward_hook(stop, always_call=True),
    )
    model.__dict__[_HANDLES] = (by_module, pruner, ops_hooks)


def unfollow(model: torch.nn.Module) -> None:
    """Remove the hooks ``Plan.apply`` installed on ``model`` (no-op if none)."""
    installed = model.__dict__.pop(_HANDLES, None)
    if installed is None:
        return
    by_module, pruner, ops_hooks = installed
    for handles in (*by_module.values(), ops_hooks):
        for handle in handles:
            handle.remove()
    pruner.remove()


def followed_modules(model: torch.nn.Module) -> list[str]:
    """Names of the modules whose boundaries ``model`` still follows (hooks installed)."""
    installed = model.__dict__.get(_HANDLES)
    return [] if installed is None else sorted(installed[0])
