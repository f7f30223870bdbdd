"""The global tensor type: a wrapper subclass around this rank's local tensor, and its metadata.

# NOTE [tensor layers]
# ``GlobalTensor`` is one class, defined here with all its methods, its
# dispatcher a class attribute (``_op_dispatcher``), as DTensor's ``_api.py``
# holds its ``OpDispatcher``. Its methods run the layers below it in data flow:
# the dispatcher and its rules, boxing, printing, device moves, pickling. Those
# layers make and recognise global tensors too, so they import this module
# back, as a module object (``from . import _global``), and read
# ``_global.GlobalTensor`` when they run, never while they are imported. That
# is the one cycle of the import graph, and it holds only because this module
# is imported first: ``sbpflow/__init__.py`` imports it before anything else,
# and its own imports of those layers finish before its class statement runs
# (tests/unit/test_import_graph.py checks both). Nothing else sets anything on
# the class; what torch's own classes get (``Tensor.to_global``,
# ``Module.to_global``) is added in one place, sbpflow/_install.py.

# NOTE [interned metadata]
# A global tensor's (layout, logical shape, dtype) is one ``Meta`` object per
# value while that value is in ``_metas``, so the dispatch fast path hashes and
# compares metadata by identity (NOTE [fast path] in ``_dispatch``). ``_metas``
# is bounded (NOTE [bounded caches]): once it has dropped a value, the next
# tensor of that value gets a new object. Two objects of one value then
# compare unequal, which costs a fast-path miss and nothing else. A wrong hit
# cannot happen: a ``Meta`` never changes value, and a cache key holding one
# keeps it alive, so its identity is never reused for another value.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from . import _compiled_outputs, _devices, _dispatch, _printing, _saving, _step_context
from ._bounded import BoundedDict
from ._compiling import never_a_compiled_frame, traced
from ._layout import Layout, dual_sbp, empty_local_shape
from ._view_writes import holds_copy, note_alias, note_copy
from .boxing import _redistribute
from .comm._world import device_for, get_rank
from .placement import Placement
from .sbp import Broadcast, NdSbp, SbpParallel

__all__ = [
    "GlobalTensor",
    "Meta",
    "PartialGradients",
    "as_global_grad",
    "bind_partial_gradients",
    "gradient_owner",
    "hand_over_gradients",
    "has_only_layout_hooks",
    "is_global",
    "is_layout_hook",
    "keep_grad_layout",
    "keep_hook_dicts",
    "meta_of",
    "register_accumulated_grad_hook",
    "register_grad_hook",
    "take_back_gradients",
    "wrap",
]


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


# NOTE [logical strides]
# A global tensor's strides are those of its logical tensor: the strides the op's
# meta kernel gives its output from the inputs' logical strides (``W.t()`` is
# transposed, ``x.expand(...)`` has zero strides, ``mm`` is contiguous), as DTensor's
# are. They are the same on every rank whatever each rank's piece looks like (a
# piece of one row is contiguous either way), so torch code that branches on
# strides takes the same branch everywhere and the ranks run the same ops. Nothing
# reads memory through them (every op runs on the pieces). Autograd reads them to
# pick a gradient's layout: ``mm``'s backward gives the weight of ``x @ W.t()`` a
# gradient laid out like ``W`` only when ``W.t()`` says it is transposed, and a
# gradient laid out unlike its parameter costs a transposing copy into every bucket.
class Meta:
    """A global tensor's (layout, logical shape, dtype, logical strides), interned: one
    object per value.

    Compared and hashed by identity, so the dispatch fast path builds and looks
    up its cache key without hashing layouts.
    """

    __slots__ = ("dtype", "layout", "shape", "strides")

    def __init__(
        self,
        layout: Layout,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        strides: tuple[int, ...] | None = None,
    ) -> None:
        self.layout, self.shape, self.dtype = layout, shape, dtype
        self.strides = _contiguous_strides(shape) if strides is None else strides

    def __reduce__(self) -> Any:  # pickling and deepcopy re-intern
        return (meta_of, (self.layout, self.shape, self.dtype, self.strides))


# Distinct (layout, shape, dtype, strides) values kept interned; a model with fixed shapes
# uses hundreds.
METAS_BOUND = 4096
_metas: BoundedDict[tuple[Any, ...], Meta] = BoundedDict("interned metas", METAS_BOUND)


def meta_of(
    layout: Layout,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    strides: tuple[int, ...] | None = None,
) -> Meta:
    """The interned metadata; ``strides`` default to contiguous (NOTE [logical strides])."""
    if strides is None:
        key: tuple[Any, ...] = (layout, shape, dtype)
        meta = _metas.get(key)
        if meta is None:
            meta = _metas[key] = Meta(layout, shape, dtype)
        return meta
    key = (layout, shape, dtype, strides)
    try:
        meta = _metas.get(key)
    except TypeError:  # symbolic strides (dynamic shapes) are unhashable: not interned
        return _strided_meta(layout, shape, dtype, strides)
    if meta is None:
        meta = _metas[key] = _strided_meta(layout, shape, dtype, strides)
    return meta


def _strided_meta(
    layout: Layout, shape: tuple[int, ...], dtype: torch.dtype, strides: tuple[int, ...]
) -> Meta:
    """Contiguous strides given explicitly are the value ``None`` stands for: one object."""
    if strides == _contiguous_strides(shape):
        return meta_of(layout, shape, dtype)
    return Meta(layout, shape, dtype, strides)


_make_wrapper_subclass = torch.Tensor._make_wrapper_subclass


def wrap(
    local: torch.Tensor, meta: Meta, requires_grad: bool = False, cls: type | None = None
) -> GlobalTensor:
    """``GlobalTensor(local, meta.layout, meta.shape)`` from interned metadata (the fast path)."""
    self: GlobalTensor = _make_wrapper_subclass(
        cls or GlobalTensor,
        meta.shape,
        strides=meta.strides,
        dtype=local.dtype,
        device=local.device,
        layout=local.layout,
        requires_grad=requires_grad,
    )
    self._local = local
    self._meta = meta
    return self


def empty_piece(meta: Meta) -> GlobalTensor:
    """A global tensor with ``meta`` and an empty piece: what a rank outside its placement holds."""
    device = device_for(meta.layout.placement.type)
    local = torch.empty(empty_local_shape(len(meta.shape)), dtype=meta.dtype, device=device)
    return wrap(local, meta)


class GlobalTensor(torch.Tensor):
    """A logical tensor spread over a placement. ``.shape``/``.dtype`` are logical.

    Every ATen op on it goes to the class's dispatcher (NOTE [tensor layers]).
    """

    _local: torch.Tensor
    _meta: Meta  # (layout, shape, dtype) interned, for the dispatch fast path
    _traced_input: bool = False  # NOTE [inputs of a traced function]
    _op_dispatcher: ClassVar[_dispatch.OpDispatcher] = _dispatch.OpDispatcher()
    # NOTE [outputs the backward does not reach] in sbpflow/_compiled_outputs.py
    _compiled_runs: ClassVar[_compiled_outputs.CompiledRuns] = _compiled_outputs.CompiledRuns()

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(
        cls, local: torch.Tensor, layout: Layout, shape: Sequence[int], requires_grad: bool = False
    ) -> GlobalTensor:
        # NOTE [device moves] in _devices: never a cpu placement holding cuda locals.
        assert local.device.type == layout.placement.type, (
            f"a {local.device} local tensor on {layout.placement}"
        )
        self = wrap(local, meta_of(layout, tuple(shape), local.dtype), requires_grad, cls)
        if requires_grad:
            keep_grad_layout(self)
        return self

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        return cls._op_dispatcher.dispatch(func, args, kwargs or {})

    # -- layout changes -----------------------------------------------------------------
    def to_global(
        self,
        placement: Placement | None = None,
        sbp: SbpParallel | Sequence[SbpParallel] | None = None,
        *,
        check_meta: bool = True,
    ) -> GlobalTensor:
        """Change the layout (boxing); the logical value stays the same. Differentiable.

        ``placement`` or ``sbp`` left out keeps this tensor's; ``check_meta`` first makes
        the ranks agree on what they box (NOTE [two ways to box] in boxing/_redistribute).
        """
        return _redistribute.to_global(self, placement, sbp, check_meta=check_meta)

    def to_local(self) -> torch.Tensor:
        """This rank's piece (empty on a rank outside the placement). Differentiable."""
        return _ToLocal.apply(self)

    def to(self, *args: Any, **kwargs: Any) -> Any:
        """As ``torch.Tensor.to``; a device move keeps the ranks and SBP (NOTE [device moves]
        in _devices)."""
        return _devices.to_method(self, *args, **kwargs)

    def cuda(
        self,
        device: Any = None,
        non_blocking: bool = False,
        memory_format: torch.memory_format = torch.preserve_format,
    ) -> GlobalTensor:
        """As ``torch.Tensor.cuda``; the locals go to this rank's own cuda device."""
        return _devices.cuda_method(self, device, non_blocking, memory_format)

    # -- reading the logical value (collectives) ----------------------------------------
    def tolist(self) -> Any:
        """The logical value as nested lists, on every rank (a collective)."""
        return _printing.logical_value(self, "tolist()").tolist()

    def numpy(self, *, force: bool = False) -> Any:
        """The logical value as a numpy array, on every rank (a collective)."""
        if self.requires_grad and not force:
            raise RuntimeError(
                "Can't call numpy() on a global tensor that requires grad; "
                "use t.detach().numpy() instead."
            )
        return _printing.logical_value(self, "numpy()").numpy(force=force)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return _printing.global_repr(self)

    def __format__(self, spec: str) -> Any:
        return _printing.global_format(self, spec)

    # -- copying and pickling (NOTE [torch.save of global tensors] in _saving) -------------
    def __reduce_ex__(self, protocol: Any) -> Any:
        return _saving.reduce_global(self, protocol)

    def __copy__(self) -> GlobalTensor:
        return _saving.copy_global(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> GlobalTensor:
        return _saving.deepcopy_global(self, memo)

    # -- tracing (NOTE [compiled global tensors] in sbpflow/_compiling.py) -------------
    # What __tensor_flatten__'s context holds; in the cache key, so a graph cached on disk
    # by an older release (another context) is compiled again rather than loaded.
    FLATTEN_FORMAT: ClassVar[str] = "layout, shape, dtype, holds_copy"

    def __tensor_flatten__(
        self,
    ) -> tuple[list[str], tuple[Layout, tuple[int, ...], torch.dtype, bool]]:
        meta = self._meta  # NOTE [view writes]: a piece holding a copy stays one in a trace
        return ["_local"], (meta.layout, meta.shape, meta.dtype, holds_copy(self))

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], ctx: Any, outer_size: Any, outer_stride: Any
    ) -> GlobalTensor:
        layout, shape, dtype = ctx[:3]
        local = inner["_local"]
        if ctx[3:] == (True,):
            note_copy(local)
        # The strides the trace gave this tensor (NOTE [logical strides]); symbolic ones
        # (dynamic shapes) fall back to contiguous.
        strides = tuple(outer_stride) if outer_stride is not None else None
        if strides is not None and not all(type(s) is int for s in strides):
            strides = None
        self = wrap(local, meta_of(layout, shape, dtype, strides), local.requires_grad)
        if not traced(local):  # made by a compiled region at run time
            GlobalTensor._compiled_runs.record(self)
        else:
            self._traced_input = True
        return self

    # NOTE [inputs of a traced function]
    # While torch.compile traces a function, the global tensors it is given (parameters
    # among them) reach it rebuilt from their pieces by ``__tensor_unflatten__``, as fresh
    # tensors that are not leaves; they are marked ``_traced_input``. The gradient plan
    # (``_gradient_hooks``) takes them for the parameters they stand in for, as eager code
    # takes leaves: the traced backward then returns gradients in the layouts eager does.

    def _stable_hash_for_caching(self) -> str:
        """The key of this input in torch.compile's on-disk caches: metadata and this rank.

        A compiled graph holds this rank's piece of every step (uneven shards,
        which rank keeps a partial value), so ranks must never share one.
        """
        local = self._local
        meta, rank = self._meta, get_rank()
        data = (self.FLATTEN_FORMAT, meta.layout, meta.shape, self.dtype, self.requires_grad, rank)
        data_local = (tuple(local.shape), local.stride(), local.dtype, local.device)
        return hashlib.blake2b(repr((data, data_local)).encode(), digest_size=16).hexdigest()

    def __coerce_tangent_metadata__(self) -> GlobalTensor:
        """The layout a compiled backward expects this output's gradient in: partial axes
        broadcast, as a loss's gradient (``ones_like``) arrives."""
        layout = self._layout
        if not layout.has_partial:
            return self
        return _redistribute.box_below_autograd(self, layout.without_partial())

    def __coerce_same_metadata_as_tangent__(
        self, expected: Any, expected_type: type | None = None
    ) -> GlobalTensor | None:
        """The incoming gradient boxed to the layout the compiled backward was traced with."""
        if expected_type is not None and expected_type is not type(self):
            return None
        layout, shape, dtype = expected[:3]  # __tensor_flatten__'s context
        if tuple(self.shape) != shape or self.dtype != dtype:
            return None
        return self if self._layout == layout else _redistribute.box_below_autograd(self, layout)

    # -- metadata ---------------------------------------------------------------------
    @property
    def _layout(self) -> Layout:
        return self._meta.layout

    @property
    def placement(self) -> Placement:
        return self._layout.placement

    @property
    def sbp(self) -> NdSbp:
        """One SBP per placement axis, as a tuple."""
        return self._layout.sbp

    @property
    def is_global(self) -> bool:
        return True

    @property
    def is_local(self) -> bool:
        return False

    @property
    def data(self) -> torch.Tensor:
        """As ``torch.Tensor.data``: a detached global tensor sharing the locals."""
        return _TENSOR_DATA.__get__(self)  # type: ignore[attr-defined]

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        """``p.data = g`` (what ``module.to(...)``/``.cuda()``/``.double()`` do): ``p`` takes
        ``g``'s local tensor, layout, shape, dtype and device; ``p`` stays the same object
        (tied parameters stay tied, optimizers and gradient hooks keep it)."""
        if not isinstance(new, GlobalTensor):
            raise TypeError(
                f"a global tensor's .data can only be set to a global tensor, got a plain "
                f"{type(new).__name__}; convert it first (x.to_global(placement, sbp)) or work "
                "on this rank's piece with g.to_local()."
            )
        _TENSOR_DATA.__set__(self, new)  # type: ignore[attr-defined]
        note_alias(new, new._local)  # NOTE [view writes]: p.data = x[:, 1] holds its copy
        self._local = new._local
        self._meta = new._meta

    # -- autograd -------------------------------------------------------------------
    def register_hook(self, hook: Callable[[torch.Tensor], Any]) -> Any:  # type: ignore[override]
        """As ``torch.Tensor.register_hook``; on a parameter, also after ``module.to(...)``
        swapped its contents (NOTE [hook dicts after a swap])."""
        return register_grad_hook(self, hook)

    def register_post_accumulate_grad_hook(  # type: ignore[override]
        self, hook: Callable[[torch.Tensor], Any]
    ) -> Any:
        """As ``torch.Tensor.register_post_accumulate_grad_hook``, also after a swap."""
        return register_accumulated_grad_hook(self, hook)

    def backward(
        self,
        gradient: torch.Tensor | None = None,
        retain_graph: bool | None = None,
        create_graph: bool = False,
        inputs: Any = None,
    ) -> None:
        """As ``torch.Tensor.backward``; the step hooks may take it to run later.

        A caller running a program's work out of order installs hooks that can
        keep this call and run it when it chooses (NOTE [step hooks] in
        sbpflow/_step_context.py). The outputs of compiled regions
        that this backward runs but does not reach (a model's logits and cache
        next to its loss) get zero gradients of the layout their compiled
        backward expects (NOTE [outputs the backward does not reach] in
        sbpflow/_compiled_outputs.py).
        """
        hooks = _step_context.current.get()
        if hooks is not None and hooks.take_backward(
            self, gradient, retain_graph, create_graph, inputs
        ):
            return
        if GlobalTensor._compiled_runs:  # NOTE [outputs the backward does not reach]
            edges, zeros = _compiled_outputs.unreached_outputs(self)
            if edges:
                torch.autograd.backward(
                    [self, *edges],  # type: ignore[list-item]
                    [gradient, *zeros],
                    retain_graph,
                    create_graph,
                    inputs=inputs,
                )
                return
        super().backward(gradient, retain_graph, create_graph, inputs)

    def requires_grad_(self, requires_grad: bool = True) -> GlobalTensor:
        """As ``torch.Tensor.requires_grad_``; a leaf's gradient then keeps its layout."""
        super().requires_grad_(requires_grad)
        if requires_grad and self.is_leaf:
            keep_grad_layout(self)
        return self

    @property
    def requires_grad(self) -> bool:
        return _TENSOR_REQUIRES_GRAD.__get__(self)  # type: ignore[attr-defined]

    @requires_grad.setter
    def requires_grad(self, requires_grad: bool) -> None:
        """``t.requires_grad = True`` does what ``t.requires_grad_()`` does."""
        self.requires_grad_(requires_grad)


class _ToLocal(torch.autograd.Function):
    """Forward: this rank's piece. Backward: local gradients read with the dual layout
    (NOTE [gradient duals] in sbpflow/tensor.py)."""

    @staticmethod
    def forward(ctx: Any, g: GlobalTensor) -> torch.Tensor:
        ctx.layout = g._layout
        ctx.shape = tuple(g.shape)
        return g._local.view_as(g._local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> GlobalTensor:
        layout: Layout = ctx.layout
        return GlobalTensor(
            grad.contiguous(), Layout(layout.placement, dual_sbp(layout.sbp)), ctx.shape
        )


_TENSOR_REQUIRES_GRAD = torch._C.TensorBase.requires_grad
_TENSOR_DATA = torch._C.TensorBase.data


# Inside a compiled function, an op Dynamo leaves out of its graph runs eagerly, and its
# __torch_dispatch__ would be a new frame for Dynamo to compile: the whole dispatcher.
never_a_compiled_frame(vars(GlobalTensor)["__torch_dispatch__"].__func__.__code__)


def is_global(x: object) -> bool:
    return isinstance(x, GlobalTensor)


def keep_grad_layout(leaf: torch.Tensor) -> None:
    """Make ``leaf``'s incoming gradient arrive in ``leaf``'s own layout (idempotent).

    A parameter's gradient can come out of the backward pass partial or split
    (a broadcast weight times a split batch gives a partial-sum gradient). A
    hook boxes it to the parameter's layout before it is accumulated into
    ``.grad`` (for a broadcast parameter: the all_reduce of data parallelism),
    so ``optimizer.step()`` is purely local.

    An object may take the leaf's gradients over (``hand_over_gradients``: a
    ``GradientSync`` reducing them in buckets); the layout hooks are then removed
    until it gives them back. A gradient that arrives partial on an axis where
    the leaf is broadcast is shown to the handler of partial gradients, if one
    is bound (NOTE [partial gradients of leaves]).
    """
    if (
        not isinstance(leaf, GlobalTensor)
        or _has_layout_hooks(leaf)
        or gradient_owner(leaf) is not None
    ):
        return
    register_grad_hook(leaf, _to_own_layout)
    register_accumulated_grad_hook(leaf, _after_accumulate)


# A tensor's hook dict -> the ``__dict__`` key of its record (NOTE [hook dicts after a swap]).
_PRE, _POST = "_backward_hooks", "_post_accumulate_grad_hooks"
_RECORDS = {_PRE: "_grad_hooks_dict", _POST: "_post_hooks_dict"}


def _recorded(leaf: GlobalTensor, field: str) -> dict[Any, Any]:
    mine = leaf.__dict__.get(_RECORDS[field])
    return {} if mine is None or mine.value is None else mine.value


def _record(leaf: GlobalTensor, field: str, hooks: Any) -> None:
    attrs = leaf.__dict__  # autograd plumbing, dropped by copies (``_NotCopied``)
    attrs[_RECORDS[field]] = _NotCopied(hooks)


def _pre_hooks(leaf: GlobalTensor) -> dict[Any, Any]:
    """The gradient pre-hooks ``leaf`` runs (NOTE [hook dicts after a swap])."""
    return _recorded(leaf, _PRE)


def _post_hooks(leaf: GlobalTensor) -> dict[Any, Any]:
    """The post-accumulate-grad hooks ``leaf`` runs (NOTE [hook dicts after a swap])."""
    return _recorded(leaf, _POST)


def _has_layout_hooks(leaf: GlobalTensor) -> bool:
    return any(hook is _to_own_layout for hook in _pre_hooks(leaf).values())


def _remove_layout_hooks(leaf: GlobalTensor) -> None:
    """What removing the handles of ``keep_grad_layout``'s hooks does, found by the hooks."""
    for hooks in (_pre_hooks(leaf), _post_hooks(leaf)):
        for key in [k for k, hook in hooks.items() if is_layout_hook(hook)]:
            del hooks[key]


# NOTE [hooks that find their leaf]
# The hooks of ``keep_grad_layout`` are module-level functions holding nothing:
# the pre-hook finds its leaf as the AccumulateGrad node running it
# (``_current_autograd_node().variable``), the post-hook is given it. So no
# reference cycle runs through the C++ hook list (which the garbage collector
# cannot see), no weakref is taken (``torch.utils.swap_tensors``, which
# ``module.to(...)`` uses on global parameters, refuses tensors with weakrefs),
# and the leaf's ``__dict__`` is always the leaf's own: a swap moves it with the
# tensor, and ``copy.copy``/``copy.deepcopy`` give the copy a new one. The hooks
# keep no record of their own on the tensor: whether a leaf has them is read off
# its hook dicts (the dict tied to it is kept in ``__dict__`` as ``_NotCopied``
# autograd plumbing, ``register_grad_hook``), a gradient that arrived partial is
# noted for the post-hook on the running thread (``_ARRIVED``), and the object
# its gradients were handed over to is in ``GRADIENT_OWNERS`` (NOTE [gradient
# owners]). A copy has hooks of its own, not these, and no owner (NOTE [copies
# of global tensors] in _saving).
class _NotCopied:
    """A value in a tensor's ``__dict__`` that ``copy.deepcopy`` and pickling drop (to None)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __deepcopy__(self, memo: Any) -> None:
        return None

    def __reduce__(self) -> Any:
        return (_dropped, ())


def _dropped() -> None:
    return None


def _to_own_layout(grad: torch.Tensor) -> torch.Tensor | None:
    """Pre-hook of ``keep_grad_layout`` (NOTE [hooks that find their leaf])."""
    leaf = getattr(torch._C._current_autograd_node(), "variable", None)
    if leaf is None:
        return None
    own: Layout = leaf._meta.layout
    if not isinstance(grad, GlobalTensor) or grad._layout == own:
        return None
    arrived_partial = _partial_on_a_data_axis(grad._layout, own)
    if arrived_partial:
        handler = _partial_gradients
        if handler is not None and handler.holds(leaf):
            _ARRIVED.leaf = leaf  # for ``_after_accumulate``, next on this thread
            return None  # accumulated as it is, reduced later (NOTE [partial gradients of leaves])
    # The ranks agree by construction (the same backward on every rank): no meta check.
    boxed = grad.to_global(own.placement, own.sbp, check_meta=False)
    if arrived_partial:  # noted only once boxed: a failed boxing leaves nothing behind
        _ARRIVED.leaf = leaf
    return boxed


def register_grad_hook(leaf: torch.Tensor, hook: Callable[[torch.Tensor], Any]) -> Any:
    """``leaf.register_hook(hook)``, also after ``torch.utils.swap_tensors``.

    ``module.to(...)``/``.double()`` swap a global parameter's contents with a new tensor's
    (``Module._apply`` swaps wrapper subclasses). The swap moves the tensor and its
    ``__dict__`` but leaves behind the Python dicts of its gradient hooks, which stay tied to
    the old tensor: a hook added to them afterwards would never run. The dict tied to this
    tensor is kept in its ``__dict__`` (which moves with it) and put back first; a leaf with
    none kept there gets a new one (NOTE [hook dicts after a swap]).
    """
    return _register(leaf, hook, _PRE, torch.Tensor.register_hook)


def register_accumulated_grad_hook(leaf: torch.Tensor, hook: Callable[[torch.Tensor], Any]) -> Any:
    """``leaf.register_post_accumulate_grad_hook(hook)``, also after a swap (as
    ``register_grad_hook``)."""
    return _register(leaf, hook, _POST, torch.Tensor.register_post_accumulate_grad_hook)


def keep_hook_dicts(leaf: torch.Tensor, pre: Any, post: Any) -> None:
    """Make ``pre`` and ``post`` (the hook dicts a tensor had before ``swap_tensors`` gave
    ``leaf`` its contents) the ones ``leaf`` runs, and record them (NOTE [hook dicts after a
    swap])."""
    for field, hooks in ((_PRE, pre), (_POST, post)):
        if hooks is not None:
            setattr(leaf, field, hooks)
            if isinstance(leaf, GlobalTensor):
                _record(leaf, field, hooks)


# NOTE [hook dicts after a swap]
# torch keeps a tensor's hook dicts on its Python object and ties each to the
# C++ tensor when first set. ``torch.utils.swap_tensors`` exchanges the C++
# tensors and the ``__dict__``s of two objects but not those dicts, so after
# ``model.to(...)`` a global parameter's ``_backward_hooks`` and
# ``_post_accumulate_grad_hooks`` belong to the tensor it was swapped with, and
# hooks added to them never run (plain torch loses them the same way). Every
# hook put on a global tensor (``register_hook``, ``register_post_accumulate_grad_hook``,
# sbpflow's own) goes through ``_register``, which records the dict it used in the
# tensor's ``__dict__`` (it moves with the C++ tensor) and, before adding, makes
# that recorded dict the one tied to the tensor; a leaf with no record but a dict
# left by a swap gets a new one. Readers of a leaf's hooks read the records
# (``_pre_hooks``, ``_post_hooks``). Hooks added before a swap stay with the
# tensor swapped out, as in plain torch.
def _register(
    leaf: torch.Tensor,
    hook: Callable[[torch.Tensor], Any],
    field: str,
    register: Callable[[torch.Tensor, Any], Any],
) -> Any:
    if not isinstance(leaf, GlobalTensor):
        return register(leaf, hook)
    mine = leaf.__dict__.get(_RECORDS[field])
    current = getattr(leaf, field)
    if mine is not None and current is not mine.value:
        setattr(leaf, field, mine.value)  # re-attaches it to this tensor (it has no others)
    elif mine is None and current is not None and leaf.grad_fn is None:
        setattr(leaf, field, None)  # left by a swap: torch ties a new dict to this tensor
    handle = register(leaf, hook)
    _record(leaf, field, getattr(leaf, field))
    return handle


def _partial_on_a_data_axis(grad: Layout, own: Layout) -> bool:
    """Whether ``grad`` is not broadcast on an axis where ``own`` is, over more than one rank."""
    if grad.placement != own.placement:
        return False
    shape = own.placement.shape
    return any(
        type(mine) is Broadcast and type(theirs) is not Broadcast and shape[axis] > 1
        for axis, (mine, theirs) in enumerate(zip(own.sbp, grad.sbp, strict=True))
    )


# NOTE [partial gradients of leaves]
# A leaf's gradient that arrives partial on an axis where the leaf is broadcast
# is the gradient of data parallelism. The layout hooks box it (one all_reduce
# per leaf) unless the bound handler ``holds`` the leaf (a ``no_sync()`` block
# of ``sbpflow.nn.parallel``): then it is accumulated partial, and the first
# backward after the block boxes the sum. After AccumulateGrad the handler
# ``sees`` the leaf (its gradient discovery, NOTE [data parallel by default]),
# which may hand the leaf's gradients over to buckets of its own
# (``hand_over_gradients``). The handler keeps its state on its own objects;
# nothing of it is kept on the tensor.
class PartialGradients:
    """What the layout hooks ask about a leaf whose gradient arrived partial on a data axis."""

    def holds(self, leaf: GlobalTensor) -> bool:
        """Whether to leave its gradient partial in this backward pass."""
        return False

    def sees(self, leaf: GlobalTensor) -> None:
        """After AccumulateGrad."""


_partial_gradients: PartialGradients | None = None


def bind_partial_gradients(handler: PartialGradients) -> None:
    """Show ``handler`` every leaf whose gradient arrives partial where it is broadcast."""
    global _partial_gradients
    _partial_gradients = handler


def _after_accumulate(leaf: torch.Tensor) -> None:
    """Post-accumulate-grad hook of ``keep_grad_layout``: a gradient that arrived partial."""
    if getattr(_ARRIVED, "leaf", None) is not leaf:
        return
    _ARRIVED.leaf = None
    handler = _partial_gradients
    if handler is None or not handler.holds(leaf):  # type: ignore[arg-type]
        # A gradient accumulated partial inside no_sync() is still partial: box the sum.
        grad, own = leaf.grad, leaf._meta.layout  # type: ignore[attr-defined]
        if isinstance(grad, GlobalTensor) and grad._layout != own:
            leaf.grad = grad.to_global(own.placement, own.sbp, check_meta=False)
    if handler is not None:
        handler.sees(leaf)  # type: ignore[arg-type]


# NOTE [gradient owners]
# An object may take a leaf's gradients over (``hand_over_gradients``: the
# data-parallel ``GradientSync`` that reduces them in buckets) with a gradient
# pre-hook of its own, its receipt. The record is kept here, not on the tensor:
# ``GRADIENT_OWNERS`` maps the leaf's ``id`` to weak references to the owner and
# the receipt, and holds while the receipt is among the hooks the leaf runs
# (the dict ``register_grad_hook`` keeps in its ``__dict__``). The leaf itself
# is not referenced (weakly: ``torch.utils.swap_tensors``, which
# ``module.to(...)`` uses, refuses a tensor with weakrefs; strongly: the table
# would keep every leaf alive). So the record goes with what it describes:
# - the owner collected: the entry is dropped (before the leaf is freed, as the
#   owner holds the leaves whose gradients it takes);
# - its hook removed (the owner stopping): no owner, until it takes the
#   gradients back (``take_back_gradients``, which reads the record itself);
# - a swap (``module.float()``) gives the leaf another tensor's hooks, without
#   the receipt: no owner, as a new leaf (the buckets find it again);
# - ``p.data = ...`` keeps the hooks: the same owner;
# - a copy is another object: no owner.
# What keeps the owner alive is the owner's affair (a ``GradientSync`` is held
# by its parameters' gradient pre-hooks, NOTE [who owns a sync] in _reducer).
class GradientOwners:
    """The objects leaves' gradients were handed over to, by leaf (NOTE [gradient owners])."""

    def __init__(self) -> None:
        self._by_leaf: dict[int, tuple[weakref.ref[Any], weakref.ref[Any]]] = {}

    def of(self, leaf: GlobalTensor) -> object | None:
        """The owner, while its receipt is among the hooks ``leaf`` runs."""
        found = self._by_leaf.get(id(leaf))
        if found is None:
            return None
        owner, receipt = found[0](), found[1]()
        if owner is None or receipt is None:
            return None
        held = any(hook is receipt for hook in _pre_hooks(leaf).values())
        return owner if held else None

    def recorded(self, leaf: GlobalTensor) -> object | None:
        """The owner recorded for ``leaf``, whether or not its receipt is still there."""
        found = self._by_leaf.get(id(leaf))
        return None if found is None else found[0]()

    def hand_over(self, leaf: GlobalTensor, owner: object, receipt: Callable[..., Any]) -> None:
        key, table = id(leaf), self._by_leaf

        def gone(_: weakref.ref[Any]) -> None:
            if table.get(key) is entry:
                del table[key]

        entry = (weakref.ref(owner, gone), weakref.ref(receipt))
        table[key] = entry

    def take_back(self, leaf: GlobalTensor) -> None:
        self._by_leaf.pop(id(leaf), None)


GRADIENT_OWNERS = GradientOwners()

# The leaf whose gradient the pre-hook found partial on a data axis, for the post-hook that
# runs next on the same thread (AccumulateGrad runs both, NOTE [hooks that find their leaf]).
_ARRIVED = threading.local()


def hand_over_gradients(leaf: torch.Tensor, owner: object, receipt: Callable[..., Any]) -> None:
    """From now on ``owner`` puts ``leaf``'s gradients in place, with ``receipt``, a gradient
    pre-hook it registered on ``leaf`` (``register_grad_hook``): the layout hooks are removed
    (backward makes fewer Python calls per parameter) until ``take_back_gradients``. A copy of
    the leaf has hooks of its own and no owner. ``owner`` must hold ``leaf`` while it owns its
    gradients (NOTE [gradient owners])."""
    if not isinstance(leaf, GlobalTensor):
        return
    _remove_layout_hooks(leaf)
    GRADIENT_OWNERS.hand_over(leaf, owner, receipt)


def take_back_gradients(leaf: torch.Tensor, owner: object) -> None:
    """``owner`` stops putting ``leaf``'s gradients in place: its layout hooks come back."""
    # Asked of the record, not of ``of``: the owner may have removed its hooks first.
    if not isinstance(leaf, GlobalTensor) or GRADIENT_OWNERS.recorded(leaf) is not owner:
        return
    GRADIENT_OWNERS.take_back(leaf)
    keep_grad_layout(leaf)


def gradient_owner(leaf: torch.Tensor) -> object | None:
    """The object ``leaf``'s gradients were handed over to (``hand_over_gradients``), or None."""
    return GRADIENT_OWNERS.of(leaf) if isinstance(leaf, GlobalTensor) else None


def has_only_layout_hooks(leaf: GlobalTensor) -> bool:
    """Whether ``leaf``'s gradient hooks are at most ``keep_grad_layout``'s and nothing took its
    gradients over: a gradient arriving in its own layout then only accumulates."""
    pre, post = _pre_hooks(leaf), _post_hooks(leaf)
    return (
        gradient_owner(leaf) is None
        and all(hook is _to_own_layout for hook in pre.values())
        and all(hook is _after_accumulate for hook in post.values())
    )


def is_layout_hook(hook: object) -> bool:
    """Whether ``hook`` is one of ``keep_grad_layout``'s (not a user's)."""
    return hook is _to_own_layout or hook is _after_accumulate


def as_global_grad(grad: Any, where: str) -> GlobalTensor:
    """``grad``, checked to be global (a global tensor's gradient must be)."""
    if not isinstance(grad, GlobalTensor):
        raise TypeError(
            f"the gradient reaching {where} is a plain {type(grad).__name__}, expected a global "
            "tensor; a global tensor's gradient must itself be global."
        )
    return grad
