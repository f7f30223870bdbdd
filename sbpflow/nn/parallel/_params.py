"""The kinds of parameter whose gradients ``GradientSync`` reduces: one small type each.

- ``GlobalParam``: a global tensor broadcast (B) on its data axes. Its gradient is a global
  tensor that arrives partial (P) there; it is reduced over the data axes only, and keeps
  its layout on every other axis (a tensor-parallel split stays split).
- ``LocalParam``: a plain tensor of a ``DistributedDataParallel`` model, read as broadcast
  over the placement. Its gradient is this replica's; the reduction averages the replicas'.

Each kind owns its piece of a bucket's flat buffer (``view``) and knows how its gradient
goes in (``fill_on_arrival``, ``piece_for_launch``), how a gradient that AccumulateGrad adds
in place is prepared (``before_accumulate``) and what ``.grad`` becomes once the bucket is
reduced (``reduced_grad``). The bucket and its states are ``GradientSync``'s
(``_reducer``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..._global import GlobalTensor, Meta, _post_hooks, _pre_hooks, meta_of, wrap
from ..._layout import Layout
from ...comm._world import get_rank
from ...placement import Placement
from ...sbp import Broadcast, Partial

__all__ = ["NO_SYNC", "GlobalParam", "LocalParam", "NoSyncBlocks", "ReducedParam", "data_axes"]

_SUM = Partial("sum")


class NoSyncBlocks:
    """The parameters that running ``no_sync()`` blocks hold, and how many blocks hold each.

    Keyed by ``id``: a block holds its parameters until it ends, so an id here names one
    live parameter (``torch.utils.swap_tensors`` keeps the Python object, and so the id).
    """

    def __init__(self) -> None:
        self._depth: dict[int, int] = {}

    def holds(self, param: torch.Tensor) -> bool:
        return id(param) in self._depth

    def any_held(self) -> bool:
        """Whether some block is running (if not, ``holds`` is False for every parameter)."""
        return bool(self._depth)

    @contextlib.contextmanager
    def block(self, params: Sequence[torch.Tensor]) -> Iterator[None]:
        """Hold ``params`` while the block runs."""
        depth = self._depth
        for p in params:
            depth[id(p)] = depth.get(id(p), 0) + 1
        try:
            yield
        finally:
            for p in params:
                left = depth.get(id(p), 1) - 1
                if left:
                    depth[id(p)] = left
                else:
                    depth.pop(id(p), None)


NO_SYNC = NoSyncBlocks()


def data_axes(layout: Layout) -> tuple[int, ...]:
    """The axes a parameter may be reduced over: broadcast, with more than one rank."""
    shape = layout.placement.shape
    return tuple(a for a, s in enumerate(layout.sbp) if isinstance(s, Broadcast) and shape[a] > 1)


class ReducedParam:
    """One parameter of a ``GradientSync``: its layout and its piece of a bucket.

    The base holds what every kind shares; ``GlobalParam`` and ``LocalParam`` say how
    their gradients go in and out of the bucket.
    """

    name: str  # its name in the module, or a description of it
    label: str  # how error messages name it
    param: torch.Tensor
    layout: Layout
    bucket: Any  # the ``_Bucket`` holding it (set by GradientSync)
    view: torch.Tensor | None  # its piece of the bucket's flat buffer (None off the placement)
    divisor: int  # what its gradient is divided by as it goes in (DDP's average)
    # -- this round (one backward pass, NOTE [bucket states] in _reducer) -------------------
    ready: bool  # its gradient has arrived
    filled: bool  # this round's piece is in ``view``
    has_grad: bool  # ... and it came from a gradient (not zeros)
    divide_at_launch: bool  # it was accumulated in ``view`` itself: divide it there
    piece_handed: bool  # AccumulateGrad was handed the gradient's plain piece (``hand_piece``)

    def __init__(self, name: str, param: torch.Tensor, layout: Layout, label: str | None) -> None:
        self.name, self.param, self.layout = name, param, layout
        self.label = repr(name) if label is None else label
        self.bucket = None
        self.view = None
        self.divisor = 1
        self.reset()

    def reset(self) -> None:
        self.ready = self.filled = self.has_grad = self.divide_at_launch = False
        self.piece_handed = False

    @property
    def local(self) -> torch.Tensor:
        """This rank's piece of the parameter."""
        raise NotImplementedError

    @property
    def data_axes(self) -> tuple[int, ...]:
        return data_axes(self.layout)

    @property
    def paused(self) -> bool:
        """Inside a ``no_sync()`` block that holds this parameter."""
        return NO_SYNC.holds(self.param)

    def bucket_key(self) -> Any:
        """Parameters of one key can share a flat buffer (NOTE [bucket order])."""
        local = self.local
        return (self.layout.placement, self.data_axes, local.dtype, local.device)

    def changed(self) -> bool:
        """Whether the parameter is no longer what its bucket was made for (``p.data = ...``);
        it then takes the parameter's new metadata."""
        raise NotImplementedError

    def attach(self, view: torch.Tensor, bucket_axes: tuple[int, ...]) -> None:
        """Take ``view`` (a piece of the bucket's buffer, shaped as the local piece)."""
        self.view = view

    def grad_local(self) -> torch.Tensor | None:
        """This rank's piece of ``.grad`` (None without one)."""
        raise NotImplementedError

    def own_layout_grad(self, grad: torch.Tensor) -> torch.Tensor | None:
        """``grad`` for ``torch.autograd.grad`` (not accumulated, nothing bucketed): in the
        parameter's own layout, as the per-parameter path gives it; None: unchanged."""
        raise NotImplementedError

    def before_accumulate(self, grad: torch.Tensor) -> torch.Tensor | None:
        """Before AccumulateGrad: prepare an in-place add into the bucket (a pre-hook's result)."""
        raise NotImplementedError

    def hand_piece(self, grad: torch.Tensor) -> torch.Tensor | None:
        """Before AccumulateGrad, in a filling bucket: the plain piece of ``grad`` to accumulate
        instead, where ``fill_on_arrival`` takes it (NOTE [gradients handed over as pieces] in
        _reducer); None: ``grad`` goes its usual way."""
        return None

    def fill_on_arrival(self) -> None:
        """After AccumulateGrad: copy ``.grad`` into ``view`` if its layout is the bucket's."""
        raise NotImplementedError

    def piece_for_launch(self, axes: tuple[int, ...]) -> torch.Tensor | None:
        """This rank's piece of ``.grad`` laid out partial-sum on ``axes`` (None: no grad)."""
        raise NotImplementedError

    def reduced_grad(self, local: torch.Tensor) -> torch.Tensor:
        """``.grad`` once the bucket is reduced: ``local``, this parameter's piece of the
        reduced buffer as the bucket hands it out (NOTE [who else holds a gradient] in
        _reducer), laid out as the parameter."""
        raise NotImplementedError

    def regrad(self, local: torch.Tensor) -> torch.Tensor:
        """The current ``.grad`` (held in the bucket) moved onto ``local``, its layout kept."""
        raise NotImplementedError

    def fill(self, piece: torch.Tensor) -> None:
        """Put this rank's partial gradient ``piece`` in its place in the bucket."""
        view = self.view
        assert view is not None
        if piece.numel() != view.numel():
            raise RuntimeError(
                f"sbpflow: the gradient of {self.label} has {piece.numel()} local elements, "
                f"its parameter {view.numel()}; was the parameter replaced or resized after "
                "its gradients were set up to be synced? Set them up again afterwards."
            )
        if piece.shape != view.shape:
            piece = piece.reshape(view.shape)
        if piece.data_ptr() == view.data_ptr() and piece.stride() == view.stride():
            # accumulated in place (zero_grad(set_to_none=False)); divided once, at the launch.
            # Already filled: a second AccumulateGrad added to it, divided as needed (pre-hook).
            if not self.filled:
                self.divide_at_launch = self.divisor != 1
        elif self.divisor != 1:
            # times the reciprocal, as torch DDP averages (a multiply is cheaper than a divide)
            torch.mul(piece, 1.0 / self.divisor, out=view)
        else:
            view.copy_(piece)
        self.filled = self.has_grad = True


class GlobalParam(ReducedParam):
    """A global parameter, broadcast on its data axes, whose gradient arrives partial there."""

    param: GlobalTensor
    rank: int
    meta: Meta  # the parameter's metadata when it joined (``changed`` compares)
    partial_meta: Meta | None  # P on the bucket's axes: the layout a gradient is bucketed in
    partial_grad: GlobalTensor | None  # ``.grad`` once copied in: ``view`` laid out P
    receipt: Any  # the gradient pre-hook its sync runs for it (set by GradientSync)
    post_receipt: Any  # and the post-accumulate-grad hook

    def __init__(self, name: str, param: GlobalTensor, label: str | None = None) -> None:
        super().__init__(name, param, param._layout, label)
        self.rank = get_rank()
        self.meta = param._meta
        self.partial_meta = self.partial_grad = None
        self.receipt = self.post_receipt = None

    @property
    def local(self) -> torch.Tensor:
        return self.param._local

    def changed(self) -> bool:
        meta, mine = self.param._meta, self.meta
        if meta is mine:
            return False
        self.meta, self.layout = meta, meta.layout
        return (meta.layout, meta.shape, meta.dtype) != (mine.layout, mine.shape, mine.dtype)

    def attach(self, view: torch.Tensor, bucket_axes: tuple[int, ...]) -> None:
        super().attach(view, bucket_axes)
        meta = self.meta
        partial = tuple(_SUM if a in bucket_axes else s for a, s in enumerate(meta.layout.sbp))
        self.partial_meta = meta_of(Layout(meta.layout.placement, partial), meta.shape, meta.dtype)
        self.partial_grad = wrap(view, self.partial_meta)

    def grad_local(self) -> torch.Tensor | None:
        grad = self.param.grad
        return grad._local if isinstance(grad, GlobalTensor) else grad

    def own_layout_grad(self, grad: torch.Tensor) -> torch.Tensor | None:
        own = self.param._layout
        if not isinstance(grad, GlobalTensor) or grad._layout == own:
            return None
        return grad.to_global(own.placement, own.sbp, check_meta=False)

    def before_accumulate(self, grad: torch.Tensor) -> torch.Tensor | None:
        """Make the add into a B ``.grad`` local: relabel it P in place in the bucket (NOTE
        [gradients are bucket views]; a ``.grad`` from elsewhere, e.g. the per-parameter first
        backward, is copied in relabelled), and hand over ``grad`` contiguous (a weight's
        gradient often arrives transposed in memory, and an add reading it strided is far
        slower than one blocked copy first)."""
        current, view = self.param.grad, self.view
        if (
            isinstance(current, GlobalTensor)
            and isinstance(grad, GlobalTensor)
            and view is not None
            and current._layout != grad._layout
            and current.placement == grad.placement
        ):
            self._relabel_partial(current, grad, view)
        if not isinstance(grad, GlobalTensor) or grad._local.is_contiguous():
            return None
        return wrap(grad._local.contiguous(), meta_of(grad._layout, tuple(grad.shape), grad.dtype))

    def hand_piece(self, grad: torch.Tensor) -> torch.Tensor | None:
        meta, param = self.partial_meta, self.param
        if (
            param.grad is not None
            or not isinstance(grad, GlobalTensor)
            or meta is None
            or not (grad._meta is meta or grad._layout == meta.layout)
            or grad._local.shape != param.shape  # autograd checks the size a hook returns
            or grad.dtype != param.dtype
            or not self._hooks_end_with_the_sync()
        ):
            return None
        self.piece_handed = True
        local = grad._local
        return local if local.is_contiguous() else local.contiguous()

    def _hooks_end_with_the_sync(self) -> bool:
        """Whether the sync's gradient pre-hook is the last one the parameter runs and its
        post-accumulate-grad hook the only one: no other hook sees a piece handed over."""
        hooks = _pre_hooks(self.param)
        post = _post_hooks(self.param)
        return (
            len(post) == 1
            and next(iter(post.values())) is self.post_receipt
            and len(hooks) > 0
            and next(reversed(hooks.values())) is self.receipt
        )

    def _relabel_partial(
        self, current: GlobalTensor, grad: GlobalTensor, view: torch.Tensor
    ) -> None:
        """``.grad`` := ``current`` laid out as ``grad`` (B -> P on the axes where they differ:
        the value kept on the first rank of those axes, zeros elsewhere), in the bucket."""
        changed = []
        for axis, (now, new) in enumerate(zip(current.sbp, grad.sbp, strict=True)):
            if now == new:
                continue
            if not (isinstance(now, Broadcast) and new == _SUM):
                return  # not B -> P: the add boxes it (correct, not in place)
            changed.append(axis)
        coords = current.placement.coords_of(self.rank)
        keeps = all(coords[axis] == 0 for axis in changed)
        local = current._local
        if local.data_ptr() == view.data_ptr():
            if not keeps:
                local.zero_()
        elif local.shape == view.shape:
            if keeps:
                view.copy_(local)
            else:
                view.zero_()
            local = view
        else:
            return
        self.param.grad = wrap(local, meta_of(grad._layout, tuple(grad.shape), grad.dtype))

    def fill_on_arrival(self) -> None:
        grad = self.param.grad
        if self.piece_handed:  # NOTE [gradients handed over as pieces] in _reducer
            self.piece_handed = False
            if isinstance(grad, torch.Tensor) and not isinstance(grad, GlobalTensor):
                self.fill(grad)
                self.param.grad = self.partial_grad
                return
        if not isinstance(grad, GlobalTensor):
            return  # none, or a plain tensor set by hand: piece_for_launch says what is wrong
        meta = self.partial_meta
        assert meta is not None
        if grad._meta is meta or (grad._layout == meta.layout and grad.shape == self.param.shape):
            self.fill(grad._local)
            self.param.grad = self.partial_grad  # the gradient is freed now; nothing is divided
        # any other layout waits for the launch, which decides the axes to reduce

    def piece_for_launch(self, axes: tuple[int, ...]) -> torch.Tensor | None:
        grad = self.param.grad
        if grad is None:
            return None
        if not isinstance(grad, GlobalTensor):
            raise TypeError(
                f"the gradient of {self.label} is a plain {type(grad).__name__}; expected a "
                "global tensor. Was .grad set by hand?"
            )
        sbp = tuple(_SUM if a in axes else s for a, s in enumerate(self.layout.sbp))
        return grad.to_global(self.layout.placement, sbp, check_meta=False)._local

    def reduced_grad(self, local: torch.Tensor) -> torch.Tensor:
        return wrap(local, self.meta)

    def regrad(self, local: torch.Tensor) -> torch.Tensor:
        grad = self.param.grad
        assert isinstance(grad, GlobalTensor)
        return wrap(local, grad._meta)


class LocalParam(ReducedParam):
    """A plain parameter of a ``DistributedDataParallel`` model: broadcast on every axis of
    the placement, its local gradient this replica's partial sum, averaged on the way in."""

    def __init__(self, name: str, param: torch.Tensor, placement: Placement) -> None:
        super().__init__(name, param, Layout(placement, (Broadcast(),) * placement.ndim), None)
        self.shape, self.dtype = tuple(param.shape), param.dtype

    @property
    def local(self) -> torch.Tensor:
        return self.param

    def changed(self) -> bool:
        p = self.param
        if tuple(p.shape) == self.shape and p.dtype == self.dtype:
            return False
        self.shape, self.dtype = tuple(p.shape), p.dtype
        return True

    def grad_local(self) -> torch.Tensor | None:
        return self.param.grad

    def own_layout_grad(self, grad: torch.Tensor) -> torch.Tensor | None:
        return None  # a local gradient has no layout to keep

    def before_accumulate(self, grad: torch.Tensor) -> torch.Tensor | None:
        """AccumulateGrad runs twice before the launch: the first gradient is in the view
        divided already, so the second must be too (its add is into the view)."""
        if self.filled and not self.divide_at_launch and self.divisor != 1:
            return grad * (1.0 / self.divisor)
        return None

    def fill_on_arrival(self) -> None:
        grad = self.param.grad
        if grad is None:
            return
        self.fill(grad)
        # The fresh gradient is freed now, so backward's next allocation reuses its memory
        # (freed only at the end of backward, it came back as fresh pages every step).
        assert self.view is not None
        self.param.grad = self.view.detach()  # until the bucket hands out the reduced one

    def piece_for_launch(self, axes: tuple[int, ...]) -> torch.Tensor | None:
        return self.param.grad

    def reduced_grad(self, local: torch.Tensor) -> torch.Tensor:
        return local

    def regrad(self, local: torch.Tensor) -> torch.Tensor:
        return local
