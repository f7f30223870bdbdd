"""Reducing partial-sum gradients in buckets while backward runs: the engine of data parallelism.

# NOTE [bucketed gradient sync]
# A data-parallel parameter is broadcast (B) on its data axes and its gradient
# arrives there as a partial sum (P): each rank holds the gradient of its own
# slice of the batch. Instead of one synchronous all_reduce per parameter
# (``keep_grad_layout``'s hook in ``_global``), ``GradientSync``:
#   1. fixes buckets before the first backward (NOTE [bucket order] in ``_buckets``)
#      and gives each one flat buffer for good (NOTE [gradients are bucket views]);
#   2. leaves each gradient as it arrives (it removes ``keep_grad_layout``'s hook
#      and marks the parameter ``_grad_sync``) and, once AccumulateGrad has written it
#      to ``.grad``, marks it ready and puts it in its place in the flat buffer
#      (a post-accumulate-grad hook);
#   3. as soon as a bucket's gradients are all ready, and every bucket before it
#      has been launched, starts an ``all_reduce(async_op=True)`` of its flat
#      buffer over the group along the bucket's data axes, while backward goes
#      on computing earlier layers' gradients;
#   4. at the end of backward (torch's ``queue_callback``, as torch DDP does)
#      launches the buckets still open, with zeros for gradients that never
#      came, waits for all of them and sets each ``.grad`` to its reduced piece
#      of the flat buffer, laid out as the parameter.
# Only the axes where the parameter is B and some gradient of the bucket is not
# (P, or S which becomes P locally) are reduced; a gradient that is B on such
# an axis is boxed B -> P (zeros off the axis' first rank) so the sum is right.
# Averaging (DistributedDataParallel) divides each gradient by the number of
# replicas as it is copied in (times the reciprocal, as torch DDP does, so the values
# are torch DDP's), so no pass over the buffer is added.
#
# Unused parameters: a gradient that is None on every rank of the group stays
# None (the optimizer skips it, as with torch DDP's find_unused_parameters).
# Each bucket carries one flag per parameter after the gradients, 1 where this
# rank had a gradient, so this is known after the same all_reduce. A local
# (DDP) parameter unused on some ranks only gets the mean of the others' and
# zeros.
#
# Gradient accumulation: inside ``no_sync()`` the hooks do nothing, so ``.grad``
# keeps accumulating the partial sums; the first backward outside it reduces
# the accumulated sum, including gradients that were computed only in earlier
# micro-batches (they are read from ``.grad`` at the end of backward).

# NOTE [gradients are bucket views]
# As torch DDP's ``gradient_as_bucket_view``: after a synced backward each
# ``.grad`` is a view into its bucket's flat buffer (for a global parameter, a
# global tensor wrapping that view), and the buffers live as long as the sync.
#   - ``zero_grad(set_to_none=True)`` (the default): the next backward's
#     AccumulateGrad hands over a fresh gradient; the hook copies it into the
#     view (dividing, for DDP), ``.grad`` becomes the view and the fresh one is
#     freed at once, so backward's next allocation reuses its memory: one copy
#     per step, no buffer allocated, no fresh pages faulted in. (Should
#     AccumulateGrad run again before the launch, a pre-hook divides the second
#     gradient too before it is added into the view.)
#   - ``zero_grad(set_to_none=False)``: AccumulateGrad adds in place into the
#     view, so the gradient is already in the buffer: no copy at all. For a
#     global parameter the view holds B and the new gradient P; a pre-hook
#     first relabels the view P, keeping its values on the first rank of the
#     axes that change and zeroing it elsewhere (B -> P, in place), so the
#     in-place add stays local and the sum is unchanged.
# A ``.grad`` kept across steps therefore changes with the next backward, as
# with torch DDP's bucket views; ``.grad.clone()`` to keep a copy.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..._global import GlobalTensor, Meta, drop_grad_layout_hook, keep_grad_layout, meta_of, wrap
from ..._layout import Layout
from ...boxing import tracing as _trace
from ...comm import _groups, collectives
from ...comm._world import get_rank
from ...placement import Placement
from ...sbp import Broadcast, Partial
from ._buckets import assign_buckets

__all__ = ["GradientSync", "Member"]

# With ``bucket_cap_mb`` left at its default, buckets hold 25 MB and the first bucket of
# each kind 1 MiB, so reduction starts early in backward; a cap given explicitly applies to
# every bucket. Both as torch DDP (its ``_DEFAULT_FIRST_BUCKET_BYTES`` is used only when
# ``bucket_cap_mb`` is None).
DEFAULT_BUCKET_CAP_MB = 25.0
FIRST_BUCKET_BYTES = 1024 * 1024
_SUM = Partial("sum")


@dataclass(eq=False)
class Member:
    """One parameter whose gradient is reduced: its layout and whether it is a global tensor.

    A local parameter (DistributedDataParallel) is read as broadcast on every axis of
    ``layout.placement``, and its local gradient as this replica's partial sum. The
    other fields are ``GradientSync``'s bookkeeping.
    """

    name: str
    param: torch.nn.Parameter
    layout: Layout
    is_global: bool
    ready: bool = False
    # -- set by GradientSync on the ranks of the placement ------------------------------
    view: torch.Tensor | None = field(default=None, repr=False)  # its piece of the bucket
    reduced_grad: torch.Tensor | None = field(default=None, repr=False)  # .grad once reduced
    partial_meta: Meta | None = field(default=None, repr=False)  # P on the bucket's axes
    partial_grad: torch.Tensor | None = field(default=None, repr=False)  # .grad once filled
    filled: bool = False  # this backward's piece is in ``view``
    has_grad: bool = False  # ... and it came from a gradient (not zeros)
    divide_at_launch: bool = False  # it was accumulated in ``view`` itself: divide it there

    @property
    def local(self) -> torch.Tensor:
        return self.param._local if self.is_global else self.param  # type: ignore[attr-defined]

    @property
    def data_axes(self) -> tuple[int, ...]:
        """The axes this parameter may be reduced over: broadcast, with more than one rank."""
        placement = self.layout.placement
        return tuple(
            a
            for a, s in enumerate(self.layout.sbp)
            if isinstance(s, Broadcast) and placement.shape[a] > 1
        )


@dataclass(eq=False)
class _Bucket:
    members: list[Member]
    placement: Placement
    axes: tuple[int, ...]  # where its parameters are broadcast: the axes it may reduce over
    numel: int
    dtype: torch.dtype
    device: torch.device
    flat: torch.Tensor | None = None  # the gradients, then one flag per member
    divisor: int = 1  # what each gradient is divided by as it is copied in
    num_ready: int = 0
    launched: bool = False
    pending: collectives.PendingCollective | None = None


class GradientSync:
    """Reduces the gradients of ``members`` in buckets that overlap backward.

    Made by ``sync_gradients`` (global models) and ``DistributedDataParallel`` (local
    ones). ``average=True`` divides each sum by the number of ranks it ran over.
    """

    def __init__(
        self, members: Sequence[Member], bucket_cap_mb: float | None, average: bool
    ) -> None:
        if bucket_cap_mb is not None:
            if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)):
                raise TypeError(
                    f"bucket_cap_mb must be a number of megabytes or None (the default, 25), "
                    f"got {type(bucket_cap_mb).__name__}: {bucket_cap_mb!r}; e.g. "
                    "bucket_cap_mb=25."
                )
            if not bucket_cap_mb > 0:
                raise ValueError(
                    f"bucket_cap_mb must be positive, got {bucket_cap_mb!r}; e.g. bucket_cap_mb=25."
                )
        self.bucket_cap_mb = (
            DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else float(bucket_cap_mb)
        )
        self._enabled = True
        self._callback_queued = False
        self._next = 0  # the next bucket to launch
        self._rank = rank = get_rank()
        ordered = list(reversed(members))  # NOTE [bucket order]
        entries = [(_bucket_key(m), m.local.numel() * m.local.element_size()) for m in ordered]
        cap_bytes = max(1, int(self.bucket_cap_mb * 1024 * 1024))
        # torch DDP's rule: a small first bucket only when no cap was given
        first_cap_bytes = min(cap_bytes, FIRST_BUCKET_BYTES) if bucket_cap_mb is None else cap_bytes
        self._buckets = [
            _make_bucket([ordered[i] for i in indices], rank, average)
            for indices in assign_buckets(entries, cap_bytes, first_cap_bytes)
        ]
        self._where: dict[int, tuple[_Bucket, Member]] = {}
        for bucket in self._buckets:
            # Groups are made by every rank together (NOTE [group creation order]): now, not
            # in the middle of a backward pass that a rank outside the placement sits out.
            _groups.ensure_placement_groups(bucket.placement, rank)
            for member in bucket.members:
                self._where[id(member.param)] = (bucket, member)
        self._handles = [
            m.param.register_post_accumulate_grad_hook(self._on_grad_ready) for m in ordered
        ]
        for m in ordered:
            if m.is_global:
                m.param._grad_sync = self  # type: ignore[attr-defined]
                drop_grad_layout_hook(m.param)  # type: ignore[arg-type]
            if m.view is not None:
                hook = functools.partial(self._before_accumulate, m)
                self._handles.append(m.param.register_hook(hook))

    # -- public ----------------------------------------------------------------------
    @property
    def buckets(self) -> list[list[str]]:
        """The parameter names of each bucket, in launch order."""
        return [[m.name for m in b.members] for b in self._buckets]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside the block only accumulate gradients (partial sums).

        The first backward after the block reduces the accumulated sum, as torch DDP's
        ``no_sync``: run every micro-batch but the last inside it.
        """
        previous, self._enabled = self._enabled, False
        try:
            yield
        finally:
            self._enabled = previous

    def remove(self) -> None:
        """Stop reducing: gradients go back to the per-parameter path (global parameters)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for bucket in self._buckets:
            for m in bucket.members:
                if getattr(m.param, "_grad_sync", None) is self:
                    del m.param._grad_sync  # type: ignore[attr-defined]
                    keep_grad_layout(m.param)

    # -- during backward -------------------------------------------------------------
    def _before_accumulate(self, m: Member, grad: torch.Tensor) -> torch.Tensor | None:
        """Before AccumulateGrad adds ``grad`` in place to a global ``.grad`` in the bucket:
        relabel a B ``.grad`` P in place (NOTE [gradients are bucket views]), and hand over
        ``grad`` contiguous (a weight's gradient often arrives transposed in memory, and an
        add reading it strided is far slower than one blocked copy first)."""
        if not m.is_global:
            # AccumulateGrad ran twice before the launch: the first gradient is in the view
            # divided already, so the second must be too (its add is into the view).
            divisor = self._where[id(m.param)][0].divisor
            if m.filled and not m.divide_at_launch and divisor != 1:
                return grad * (1.0 / divisor)
            return None
        current = m.param.grad
        if (
            not isinstance(current, GlobalTensor)
            or not isinstance(grad, GlobalTensor)
            or current._local.data_ptr() != m.view.data_ptr()  # type: ignore[union-attr]
            or current.placement != grad.placement
        ):
            return None
        if current._layout != grad._layout:
            changed = []
            for axis, (now, new) in enumerate(zip(current.sbp, grad.sbp, strict=True)):
                if now == new:
                    continue
                if not (isinstance(now, Broadcast) and new == _SUM):
                    return None  # not B -> P: the add boxes it (correct, not in place)
                changed.append(axis)
            coords = current.placement.coords_of(self._rank)
            if any(coords[axis] != 0 for axis in changed):
                current._local.zero_()  # B -> P keeps the value on the first rank only
            m.param.grad = wrap(
                current._local, meta_of(grad._layout, tuple(grad.shape), grad.dtype)
            )
        if grad._local.is_contiguous():
            return None
        return wrap(grad._local.contiguous(), meta_of(grad._layout, tuple(grad.shape), grad.dtype))

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._enabled:
            return
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._callback_queued = True
        bucket, member = self._where[id(param)]
        if bucket.launched:
            raise RuntimeError(
                f"sbpflow: the gradient of {member.name!r} arrived again after its bucket was "
                "reduced in this backward pass (its AccumulateGrad ran twice, e.g. under "
                "reentrant activation checkpointing). Use torch.utils.checkpoint with "
                "use_reentrant=False, or run that backward inside no_sync()."
            )
        if not member.ready:
            member.ready = True
            bucket.num_ready += 1
        if bucket.flat is not None:  # again if AccumulateGrad ran twice: the view has the sum
            self._fill_on_arrival(bucket, member)
        while self._next < len(self._buckets) and self._buckets[self._next].num_ready == len(
            self._buckets[self._next].members
        ):
            self._launch(self._buckets[self._next])
            self._next += 1

    def _fill_on_arrival(self, bucket: _Bucket, m: Member) -> None:
        """Copy a gradient into the bucket as it arrives, when its layout is the bucket's."""
        grad = m.param.grad
        if grad is None:
            return
        if not m.is_global:
            _fill(bucket, m, grad)
            # The fresh gradient is freed now, so backward's next allocation reuses its memory
            # (freed only at the end of backward, it came back as fresh pages every step).
            m.param.grad = m.view
            return
        if not isinstance(grad, GlobalTensor):
            return  # _partial_piece says what is wrong at launch
        meta = m.partial_meta
        assert meta is not None
        if grad._meta is meta or (grad._layout == meta.layout and grad.shape == m.param.shape):
            _fill(bucket, m, grad._local)
            m.param.grad = m.partial_grad  # the gradient is freed now; nothing is divided
        # any other layout waits for the launch, which decides the axes to reduce

    def _finish(self) -> None:
        """End of backward: launch what is left (in order), wait for all, write ``.grad``."""
        try:
            for bucket in self._buckets[self._next :]:
                self._launch(bucket)
            for bucket in self._buckets:
                self._write_back(bucket)
        finally:
            self._callback_queued = False
            self._next = 0
            for bucket in self._buckets:
                bucket.num_ready, bucket.launched, bucket.pending = 0, False, None
                for m in bucket.members:
                    m.ready = m.filled = m.has_grad = m.divide_at_launch = False

    def _launch(self, bucket: _Bucket) -> None:
        bucket.launched = True
        flat = bucket.flat
        if flat is None:
            return  # the parameters have no piece here
        rest = [m for m in bucket.members if not m.filled]
        # gradients copied in on arrival are partial on all the bucket's axes
        axes = bucket.axes if len(rest) < len(bucket.members) else _reduce_axes(bucket)
        for m in rest:
            piece = _partial_piece(m, axes)
            if piece is None:
                m.view.zero_()  # type: ignore[union-attr]
            else:
                _fill(bucket, m, piece)
        for m in bucket.members:
            if m.divide_at_launch:
                m.view.mul_(1.0 / bucket.divisor)  # type: ignore[union-attr]
        if all(m.has_grad for m in bucket.members):
            flat[bucket.numel :].fill_(1.0)
        else:
            flags = [1.0 if m.has_grad else 0.0 for m in bucket.members]
            flat[bucket.numel :].copy_(torch.tensor(flags, dtype=bucket.dtype))
        rank = self._rank
        if not axes:  # every gradient is already broadcast: nothing to reduce
            bucket.pending = collectives.PendingCollective("all_reduce", (rank,), flat, None)
            return
        group = _groups.group_along(bucket.placement, axes, rank)  # NOTE [teardown] in comm
        bucket.pending = collectives.all_reduce_async(flat, group, "sum")
        _trace.record(None, ["all_reduce"])

    def _write_back(self, bucket: _Bucket) -> None:
        if bucket.pending is None:
            return
        flat = bucket.pending.wait()
        flags = flat[bucket.numel :].tolist()
        for m, flag in zip(bucket.members, flags, strict=True):
            if flag > 0:
                m.param.grad = m.reduced_grad


def _bucket_key(m: Member) -> Any:
    local = m.local
    return (m.layout.placement, m.data_axes, local.dtype, local.device)


def _make_bucket(members: list[Member], rank: int, average: bool) -> _Bucket:
    """The bucket of ``members``, with its flat buffer if ``rank`` holds a piece."""
    first = members[0]
    placement = first.layout.placement
    bucket = _Bucket(
        members=members,
        placement=placement,
        axes=first.data_axes,
        numel=sum(m.local.numel() for m in members),
        dtype=first.local.dtype,
        device=first.local.device,
    )
    if rank not in placement:
        return bucket
    flat = torch.zeros(bucket.numel + len(members), dtype=bucket.dtype, device=bucket.device)
    bucket.flat = flat
    if average:
        bucket.divisor = 1
        for axis in bucket.axes:
            bucket.divisor *= placement.shape[axis]
    offset = 0
    for m in members:
        local = m.local
        m.view = flat[offset : offset + local.numel()].view(local.shape)
        offset += local.numel()
        if not m.is_global:
            m.reduced_grad = m.view
            continue
        shape, sbp = tuple(m.param.shape), m.layout.sbp
        partial = tuple(_SUM if a in bucket.axes else s for a, s in enumerate(sbp))
        m.partial_meta = meta_of(Layout(placement, partial), shape, local.dtype)
        m.partial_grad = wrap(m.view, m.partial_meta)
        m.reduced_grad = wrap(m.view, meta_of(m.layout, shape, local.dtype))
    return bucket


def _fill(bucket: _Bucket, m: Member, piece: torch.Tensor) -> None:
    """Put this rank's partial gradient ``piece`` of ``m`` in its place in the bucket."""
    view = m.view
    assert view is not None
    if piece.numel() != view.numel():
        raise RuntimeError(
            f"sbpflow: the gradient of {m.name!r} has {piece.numel()} local elements, "
            f"its parameter {view.numel()}; was the parameter replaced or resized after "
            "its gradients were set up to be synced? Set them up again afterwards."
        )
    if piece.shape != view.shape:
        piece = piece.reshape(view.shape)
    if piece.data_ptr() == view.data_ptr() and piece.stride() == view.stride():
        # accumulated in place (zero_grad(set_to_none=False)); divided once, at the launch.
        # Already filled: a second AccumulateGrad added to it, divided as needed (pre-hook).
        if not m.filled:
            m.divide_at_launch = bucket.divisor != 1
    elif bucket.divisor != 1:
        # times the reciprocal, as torch DDP averages (a multiply is cheaper than a divide)
        torch.mul(piece, 1.0 / bucket.divisor, out=view)
    else:
        view.copy_(piece)
    m.filled = m.has_grad = True


def _reduce_axes(bucket: _Bucket) -> tuple[int, ...]:
    """The bucket's data axes on which some gradient is not already broadcast."""
    if not all(m.is_global for m in bucket.members):
        return bucket.axes  # a local gradient is always a partial sum
    axes: set[int] = set()
    for m in bucket.members:
        grad = m.param.grad
        if grad is None:
            continue
        if not isinstance(grad, GlobalTensor) or grad.placement != bucket.placement:
            return bucket.axes
        axes.update(a for a in bucket.axes if not isinstance(grad.sbp[a], Broadcast))
    return tuple(sorted(axes))


def _partial_piece(m: Member, axes: tuple[int, ...]) -> torch.Tensor | None:
    """This rank's piece of ``m``'s gradient laid out partial-sum on ``axes`` (None: no grad)."""
    grad = m.param.grad
    if grad is None or not m.is_global:
        return grad
    if not isinstance(grad, GlobalTensor):
        raise TypeError(
            f"the gradient of the global parameter {m.name!r} is a plain "
            f"{type(grad).__name__}; expected a global tensor. Was .grad set by hand?"
        )
    sbp = tuple(_SUM if a in axes else s for a, s in enumerate(m.layout.sbp))
    boxed = grad.to_global(m.layout.placement, sbp, check_meta=False)
    return boxed._local
