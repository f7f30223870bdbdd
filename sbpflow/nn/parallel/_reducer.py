"""Reducing partial-sum gradients in buckets while backward runs: the engine of data parallelism.

# NOTE [bucketed gradient sync]
# A data-parallel parameter is broadcast (B) on its data axes and its gradient
# arrives there as a partial sum (P): each rank holds the gradient of its own
# slice of the batch. ``GradientSync`` reduces a set of such parameters
# (``GlobalParam`` or ``LocalParam``, in ``_params``):
#   1. its buckets are fixed when it is made, from its parameters in launch
#      order (NOTE [bucket order] in ``_buckets``), and each bucket gets one flat
#      buffer for good (NOTE [gradients are bucket views]);
#   2. a pre-hook prepares each gradient before AccumulateGrad writes it to
#      ``.grad`` and a post-accumulate-grad hook marks it ready and copies it into
#      its place in the flat buffer;
#   3. as soon as a bucket's gradients are all ready, and every bucket before it
#      has been launched, an ``all_reduce(async_op=True)`` of its flat buffer
#      starts over the group along the bucket's data axes, while backward goes
#      on computing earlier layers' gradients;
#   4. at the end of backward (torch's ``queue_callback``, as torch DDP does) the
#      buckets still open are launched, with zeros for gradients that never
#      came, every launch is waited for, and each ``.grad`` is set to its reduced
#      piece of the flat buffer, laid out as the parameter.
# Only the axes where the parameter is B and some gradient of the bucket is not
# (P, or S which becomes P locally) are reduced; a gradient that is B on such
# an axis is boxed B -> P (zeros off the axis' first rank) so the sum is right.
# Averaging (DistributedDataParallel) multiplies each gradient by the reciprocal
# of the number of replicas as it is copied in, as torch DDP does (the same
# values as torch DDP's), so no pass over the buffer is added.
#
# A global model gets this with nothing to call (NOTE [data parallel by
# default] in ``_default``); ``sync_gradients`` and ``DistributedDataParallel``
# make one explicitly.
#
# Unused parameters: a gradient that is None on every rank of the group stays
# None (the optimizer skips it, as with torch DDP's find_unused_parameters).
# Each bucket carries one flag per parameter after the gradients, 1 where this
# rank had a gradient, so this is known after the same all_reduce. A local
# (DDP) parameter unused on some ranks only gets the mean of the others' and
# zeros.
#
# Gradient accumulation: inside ``no_sync()`` the hooks leave the buckets of
# the parameters it holds alone, so ``.grad`` keeps accumulating the partial
# sums; the first backward outside it reduces the accumulated sum, including
# gradients that were computed only in earlier micro-batches (they are read
# from ``.grad`` at the end of backward). Without ``no_sync`` every backward
# reduces, and the sums of reduced gradients are the same values.
#
# What stays on the per-parameter path (the gradient boxed to the parameter's
# layout by the pre-hook, nothing bucketed): ``torch.autograd.grad`` (the
# gradient is returned, not accumulated) and ``backward(create_graph=True)``
# (``.grad`` must keep its history; a bucket copy has none).

# NOTE [bucket states]
# A bucket is in one ``BucketState`` at a time; one backward pass is a round:
#   IDLE      between rounds: the views hold the last reduced gradients.
#   FILLING   the round has begun for it (its first gradient, or the end of
#             backward): gradients are copied in as they arrive.
#   LAUNCHED  its all_reduce is in flight: nothing may touch the buffer.
#   PAUSED    a parameter of it is inside ``no_sync()``: this round leaves it alone.
# IDLE -> FILLING on the round's first event for the bucket (after the check of
# NOTE [who else holds a gradient]); FILLING -> LAUNCHED at its launch; LAUNCHED
# -> IDLE once waited for and written back; PAUSED -> IDLE at the end of the
# round. A gradient that arrives for a LAUNCHED bucket (its AccumulateGrad ran
# again: reentrant activation checkpointing, or two pipelined micro-batches'
# backward passes interleaved on one rank) first waits for the bucket and writes
# it back; the bucket is then FILLING again and launched once more at the end
# of backward, with the reduced gradients of its other parameters relabelled
# B -> P, so the sum stays exact. A round whose backward pass raised never
# reaches its end: the next round finds its callback gone and starts afresh.

# NOTE [who owns a sync]
# A ``GradientSync`` lives as long as what made it holds it: each global
# parameter it reduces (the parameter's gradients are handed over to it,
# ``hand_over_gradients`` in ``_global``, whose table ``GradientSync.of(p)`` reads
# and which holds the sync weakly), or the ``DistributedDataParallel`` wrapper. A
# global parameter holds it through its gradient pre-hook: the dict of those hooks
# is kept in the parameter's ``__dict__`` (``register_grad_hook``), where the
# garbage collector sees the cycle sync -> parameter -> hook -> sync and frees it
# once the model is dropped. The other hooks hold it weakly: the post-accumulate
# ones are kept by C++ autograd metadata the collector cannot see into (a strong
# reference there would keep the parameters, the sync and its buffers alive
# forever), and a plain parameter's hooks must not keep the sync of a dropped
# wrapper reducing. The parameters are never held weakly:
# ``torch.utils.swap_tensors`` (``module.to(...)``) refuses tensors with weakrefs.

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

# NOTE [gradients handed over as pieces]
# The usual gradient of a global parameter (``.grad`` None, its bucket filling,
# laid out as the bucket reduces it, its local piece as large as the parameter:
# data parallelism alone) is copied into the bucket and dropped right after
# AccumulateGrad. Handed to AccumulateGrad as it is, it would first be detached,
# one more op through the global dispatcher for each parameter and step. So the
# pre-hook hands AccumulateGrad its plain local piece instead (autograd accepts a
# hook's result of the same dtype, device and size), and the post-accumulate-grad
# hook, which runs right after, copies that ``.grad`` into the bucket and sets
# ``.grad`` to the bucket's view laid out partial, as for a global gradient: the
# same values, one dispatch less. Only when the sync's hooks are the parameter's
# last pre-hook and its only post-accumulate-grad hook, so that no other tensor
# hook sees the plain piece (a hook put on the AccumulateGrad node itself, which
# the sync cannot see, would).

# NOTE [who else holds a gradient]
# A ``.grad`` kept past ``zero_grad(set_to_none=True)`` (``g = p.grad``, a slice of
# it, its ``.detach()``, an optimizer's set-aside gradients) would be overwritten
# by the next backward's copy into the same buffer: a silent wrong value. So the
# reduced gradients are handed out on a storage of their own over the same
# memory (``torch.from_dlpack`` of the buffer: one per bucket and round, it keeps
# the buffer alive), of which the sync keeps only a weak reference: every tensor
# made from what was handed out (views, ``.detach()``, ``.data``) uses that
# storage, so it is alive exactly as long as one of them is. When a round begins
# for a bucket:
#   - the storage is gone: nobody holds a piece; the buffer is written again;
#   - it is alive and every gradient handed out is still its parameter's
#     ``.grad`` (``zero_grad(set_to_none=False)``, accumulation): it is updated
#     in place, and so is whatever shares it, as in one process;
#   - it is alive and some ``.grad`` handed out is not ``.grad`` any more:
#     someone may hold its piece, and the bucket moves to a new buffer (the
#     gradients still in it copied along) instead of overwriting theirs.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..._global import (
    gradient_owner,
    hand_over_gradients,
    register_grad_hook,
    take_back_gradients,
)
from ...boxing import tracing as _trace
from ...comm import collectives
from ...comm._mesh import MESHES
from ...comm._world import get_rank
from ...placement import Placement
from ...sbp import Broadcast
from ._buckets import assign_buckets
from ._params import NO_SYNC, GlobalParam, LocalParam, ReducedParam

__all__ = ["BucketState", "GradientSync", "accumulating", "check_bucket_cap", "paused"]

# With ``bucket_cap_mb`` left at its default, buckets hold 25 MB and the first bucket of
# each kind 1 MiB, so reduction starts early in backward; a cap given explicitly applies to
# every bucket. Both as torch DDP (its ``_DEFAULT_FIRST_BUCKET_BYTES`` is used only when
# ``bucket_cap_mb`` is None).
DEFAULT_BUCKET_CAP_MB = 25.0
FIRST_BUCKET_BYTES = 1024 * 1024


class BucketState(enum.Enum):
    """Where a bucket is in the running backward pass (NOTE [bucket states])."""

    IDLE = "idle"
    FILLING = "filling"
    LAUNCHED = "launched"
    PAUSED = "paused"


@dataclass(eq=False)
class _Bucket:
    members: list[ReducedParam]
    placement: Placement
    axes: tuple[int, ...]  # where its parameters are broadcast: the axes it may reduce over
    numel: int
    dtype: torch.dtype
    device: torch.device
    flat: torch.Tensor | None = None  # the gradients, then one flag per member
    state: BucketState = BucketState.IDLE
    num_ready: int = 0
    launched: bool = False  # launched at least once this round
    pending: collectives.PendingCollective | None = None
    # NOTE [who else holds a gradient]: the storage the last reduced gradients were handed out
    # on (weakly; None: none handed out), and the members that got one
    handed: Callable[[], object | None] | None = None
    handed_to: tuple[ReducedParam, ...] = ()


class GradientSync:
    """Reduces the gradients of ``members`` (given in launch order) in buckets that overlap
    backward (NOTE [bucketed gradient sync]).

    Made with nothing to call for a global model's parameters (``_default``), by
    ``sync_gradients`` and by ``DistributedDataParallel``. ``explicit``: made by one of
    the last two (a user's settings), not by default.
    """

    def __init__(
        self,
        members: Sequence[ReducedParam],
        bucket_cap_mb: float | None,
        *,
        explicit: bool = True,
    ) -> None:
        check_bucket_cap(bucket_cap_mb)
        self.bucket_cap_mb = (
            DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else float(bucket_cap_mb)
        )
        self.explicit = explicit
        self._members = list(members)
        self._round: Callable[[], Any] | None = None  # the end-of-backward callback, weakly
        self._next = 0  # the next bucket to launch
        self._rank = get_rank()
        cap_bytes = max(1, int(self.bucket_cap_mb * 1024 * 1024))
        # torch DDP's rule: a small first bucket only when no cap was given
        first_cap_bytes = min(cap_bytes, FIRST_BUCKET_BYTES) if bucket_cap_mb is None else cap_bytes
        self._caps = (cap_bytes, first_cap_bytes)
        self._buckets = self._make_buckets()
        self._where = {id(m.param): m for m in self._members}
        self._handles = []
        # A global parameter's pre-hook holds the sync; the other hooks hold it weakly (NOTE
        # [who owns a sync]).
        me = weakref.ref(self)
        for index, m in enumerate(self._members):
            held = functools.partial(_itself, self) if isinstance(m, GlobalParam) else me
            before = _pre_hook(held, index)
            self._handles.append(register_grad_hook(m.param, before))
            after = _post_hook(me, index)
            self._handles.append(m.param.register_post_accumulate_grad_hook(after))
            if isinstance(m, GlobalParam):
                m.receipt, m.post_receipt = before, after  # NOTE [gradients handed over as pieces]
                hand_over_gradients(m.param, self, before)  # found by GradientSync.of

    def __deepcopy__(self, memo: Any) -> None:
        """A copy of a global parameter gets no sync: its copy joins buckets of its own
        (``copy.deepcopy(model)``); a ``DistributedDataParallel`` is not copied."""
        self._refuse_copy()

    def __reduce__(self) -> Any:
        self._refuse_copy()
        return (_no_sync_object, ())

    def _refuse_copy(self) -> None:
        if any(isinstance(m, LocalParam) for m in self._members):
            raise TypeError(
                "a DistributedDataParallel cannot be copied or pickled; copy or save the module "
                "it wraps (ddp.module) and wrap the copy."
            )

    # -- public ----------------------------------------------------------------------
    @property
    def buckets(self) -> list[list[str]]:
        """The parameter names of each bucket, in launch order."""
        return [[m.name for m in b.members] for b in self._buckets]

    @property
    def params(self) -> list[torch.Tensor]:
        """The parameters whose gradients it reduces, in launch order."""
        return [m.param for m in self._members]

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside the block only accumulate gradients (partial sums).

        The first backward after the block reduces the accumulated sum, as torch DDP's
        ``no_sync``: run every micro-batch but the last inside it.
        """
        return paused(self.params)

    def remove(self) -> None:
        """Stop reducing: global parameters go back to the default path (``_default``)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for m in self._members:
            take_back_gradients(m.param, self)

    @staticmethod
    def of(param: torch.Tensor) -> GradientSync | None:
        """The sync that reduces the gradients of the global parameter ``param``, if any."""
        owner = gradient_owner(param)
        if not isinstance(owner, GradientSync):
            return None
        m = owner._where.get(id(param))
        return owner if m is not None and m.param is param else None

    def reduce_accumulated(self) -> None:
        """Reduce, in the buckets and at once, the gradients accumulated in ``.grad`` (at the
        end of the backward pass whose gradients made the members, NOTE [data parallel by
        default] in ``_default``); buckets inside ``no_sync()`` are left alone."""
        self._finish()

    def _make_buckets(self) -> list[_Bucket]:
        """Buckets of the members, in order, for their current sizes (NOTE [bucket order])."""
        members, rank = self._members, self._rank
        entries = [(m.bucket_key(), m.local.numel() * m.local.element_size()) for m in members]
        buckets = [
            _make_bucket([members[i] for i in indices], rank)
            for indices in assign_buckets(entries, *self._caps)
        ]
        for bucket in buckets:
            # Groups are made by every rank together (NOTE [group creation order]): now, not
            # in the middle of a backward pass that a rank outside the placement sits out.
            MESHES.of(bucket.placement, "gradient buckets")
        return buckets

    # -- during backward -------------------------------------------------------------
    def _before(self, m: ReducedParam, grad: torch.Tensor) -> torch.Tensor | None:
        """Pre-hook, before AccumulateGrad adds ``grad`` to ``.grad``."""
        if not accumulating():
            return m.own_layout_grad(grad)
        if m.view is None:
            return None  # the parameter has no piece here
        self._open_round()  # first: it may make the buckets again
        bucket = m.bucket
        if bucket.state is BucketState.LAUNCHED:  # it arrives again (NOTE [bucket states])
            if isinstance(m, LocalParam):
                raise RuntimeError(
                    f"sbpflow: the gradient of {m.label} arrived again after its bucket was "
                    "reduced in this backward pass (its AccumulateGrad ran twice, e.g. under "
                    "reentrant activation checkpointing). Use torch.utils.checkpoint with "
                    "use_reentrant=False, or run that backward inside no_sync()."
                )
            self._complete(bucket)
        if bucket.state is BucketState.IDLE:
            self._begin(bucket)
        if bucket.state is BucketState.FILLING:
            piece = m.hand_piece(grad)  # NOTE [gradients handed over as pieces]
            if piece is not None:
                return piece
        # Paused too: the add into a .grad in the bucket stays local (NOTE [gradients are
        # bucket views]).
        return m.before_accumulate(grad)

    def _after(self, m: ReducedParam) -> None:
        """Post-accumulate-grad hook: the gradient is in ``.grad``."""
        if torch.is_grad_enabled():
            return  # create_graph: the pre-hook kept it on the per-parameter path
        bucket = m.bucket
        if bucket.flat is None or bucket.state is not BucketState.FILLING:
            return  # no piece here, or paused
        if not m.ready:
            m.ready = True
            bucket.num_ready += 1
        m.fill_on_arrival()  # again if AccumulateGrad ran twice: the view has the sum
        buckets = self._buckets
        while self._next < len(buckets):
            nxt = buckets[self._next]
            if nxt.flat is None:  # this rank holds no piece of it
                self._next += 1
                continue
            if nxt.state is BucketState.IDLE and not nxt.launched:
                self._begin(nxt)
            if nxt.state is BucketState.FILLING and nxt.num_ready == len(nxt.members):
                self._launch(nxt)
            elif nxt.state is not BucketState.PAUSED:
                break
            self._next += 1

    def _open_round(self) -> None:
        """Once per backward pass: queue the end-of-backward callback; check the parameters."""
        if self._round is not None:
            if self._round() is not None:
                return
            self._reset()  # the backward pass that opened the round raised: start afresh
        finish = functools.partial(self._finish)
        torch.autograd.Variable._execution_engine.queue_callback(finish)
        # Held weakly: the graph task drops it when it ends, run or not (NOTE [bucket states]).
        self._round = weakref.ref(finish)
        if any([m.changed() for m in self._members]):
            # ``p.data = ...`` (``module.to(...)``) gave a parameter another dtype, shape or
            # layout: new buckets, from the same order on every rank.
            self._buckets = self._make_buckets()

    def _begin(self, bucket: _Bucket) -> None:
        """The round's first event for ``bucket``: paused, or FILLING in a buffer of its own."""
        if NO_SYNC.any_held() and any(m.paused for m in bucket.members):
            bucket.state = BucketState.PAUSED
            return
        _move_if_held_elsewhere(bucket)
        bucket.state = BucketState.FILLING

    def _finish(self) -> None:
        """End of backward: launch what is left (in order), wait for all, write ``.grad``."""
        try:
            for bucket in self._buckets:
                if bucket.flat is None:
                    continue
                if bucket.state is BucketState.IDLE and not bucket.launched:
                    self._begin(bucket)
                if bucket.state is BucketState.FILLING:
                    self._launch(bucket)
            for bucket in self._buckets:
                if bucket.state is BucketState.LAUNCHED:
                    self._complete(bucket)
        finally:
            self._reset()

    def _reset(self) -> None:
        self._round = None
        self._next = 0
        for bucket in self._buckets:
            bucket.state, bucket.num_ready, bucket.launched = BucketState.IDLE, 0, False
            bucket.pending = None
            for m in bucket.members:
                m.reset()

    def _launch(self, bucket: _Bucket) -> None:
        flat = bucket.flat
        assert flat is not None
        bucket.state, bucket.launched = BucketState.LAUNCHED, True
        rest = [m for m in bucket.members if not m.filled]
        # gradients copied in on arrival are partial on all the bucket's axes
        axes = bucket.axes if len(rest) < len(bucket.members) else _reduce_axes(bucket)
        for m in rest:
            piece = m.piece_for_launch(axes)
            if piece is None:
                m.view.zero_()  # type: ignore[union-attr]
            else:
                m.fill(piece)
        for m in bucket.members:
            if m.divide_at_launch:
                m.view.mul_(1.0 / m.divisor)  # type: ignore[union-attr]
        if all(m.has_grad for m in bucket.members):
            flat[bucket.numel :].fill_(1.0)
        else:
            flags = [1.0 if m.has_grad else 0.0 for m in bucket.members]
            flat[bucket.numel :].copy_(torch.tensor(flags, dtype=bucket.dtype))
        rank = self._rank
        if not axes:  # every gradient is already broadcast: nothing to reduce
            bucket.pending = collectives.PendingCollective("all_reduce", (rank,), flat, None)
            return
        lines = MESHES.of(bucket.placement, "gradient buckets").lines(axes)  # NOTE [teardown]
        assert lines, f"rank {rank} is not in {bucket.placement}"
        for _, group in lines[:-1]:  # axes with no group of their own: one after another
            collectives.all_reduce_async(flat, group, "sum").wait()
        bucket.pending = collectives.all_reduce_async(flat, lines[-1][1], "sum")
        recorded = [axes] if len(lines) == 1 else [line_axes for line_axes, _ in lines]
        _trace.record(None, ["all_reduce"] * len(lines), recorded)

    def _complete(self, bucket: _Bucket) -> None:
        """Wait for ``bucket``'s all_reduce and set each ``.grad`` to its reduced piece."""
        pending = bucket.pending
        assert pending is not None
        flat = pending.wait()
        flags = flat[bucket.numel :].tolist()
        members = tuple(m for m, flag in zip(bucket.members, flags, strict=True) if flag > 0)
        for m, local in zip(members, _hand_out(bucket, members), strict=True):
            m.param.grad = m.reduced_grad(local)
        for m in bucket.members:
            m.reset()
        bucket.state, bucket.num_ready, bucket.pending = BucketState.IDLE, 0, None


def _no_sync_object() -> None:
    return None


def _itself(sync: GradientSync) -> GradientSync:
    return sync


def _pre_hook(
    sync: Callable[[], GradientSync | None], index: int
) -> Callable[[torch.Tensor], torch.Tensor | None]:
    def before_accumulate(grad: torch.Tensor) -> torch.Tensor | None:
        me = sync()
        return None if me is None else me._before(me._members[index], grad)

    return before_accumulate


def _post_hook(sync: weakref.ref[GradientSync], index: int) -> Callable[[torch.Tensor], None]:
    def after_accumulate(param: torch.Tensor) -> None:
        me = sync()
        if me is not None:
            me._after(me._members[index])

    return after_accumulate


def check_bucket_cap(bucket_cap_mb: object) -> None:
    """Raise if ``bucket_cap_mb`` is neither None nor a positive number of megabytes."""
    if bucket_cap_mb is None:
        return
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)):
        raise TypeError(
            f"bucket_cap_mb must be a number of megabytes or None (the default, 25), got "
            f"{type(bucket_cap_mb).__name__}: {bucket_cap_mb!r}; e.g. bucket_cap_mb=25."
        )
    if not bucket_cap_mb > 0:
        raise ValueError(
            f"bucket_cap_mb must be positive, got {bucket_cap_mb!r}; e.g. bucket_cap_mb=25."
        )


def accumulating() -> bool:
    """Whether the running backward pass accumulates gradients into ``.grad`` without a graph
    of their own: not ``torch.autograd.grad`` and not ``create_graph=True``."""
    if torch.is_grad_enabled():
        return False
    try:
        return torch._C._will_engine_execute_node(torch._C._current_autograd_node())
    except RuntimeError:  # torch.autograd.grad: a leaf's gradient is returned, not accumulated
        return False


def paused(params: Sequence[torch.Tensor]) -> contextlib.AbstractContextManager[None]:
    """Hold ``params`` in a ``no_sync()`` block: their buckets are left alone meanwhile."""
    return NO_SYNC.block(params)


def _make_bucket(members: list[ReducedParam], rank: int) -> _Bucket:
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
    divisor = 1
    for axis in bucket.axes:
        divisor *= placement.shape[axis]
    for m in members:
        m.bucket = bucket
        m.divisor = divisor if isinstance(m, LocalParam) else 1
    if rank in placement:
        flat = torch.zeros(bucket.numel + len(members), dtype=bucket.dtype, device=bucket.device)
        _attach(bucket, flat)
    return bucket


def _attach(bucket: _Bucket, flat: torch.Tensor) -> None:
    """Give ``bucket`` the buffer ``flat``: each member's view of its place in it."""
    bucket.flat = flat
    offset = 0
    for m in bucket.members:
        shape = m.local.shape
        numel = m.local.numel()
        m.attach(flat[offset : offset + numel].view(shape), bucket.axes)
        offset += numel


def _move_if_held_elsewhere(bucket: _Bucket) -> None:
    """Move ``bucket`` to a new buffer if a gradient it handed out, no longer its parameter's
    ``.grad``, may still be held (NOTE [who else holds a gradient])."""
    flat, handed = bucket.flat, bucket.handed
    assert flat is not None
    if handed is None or handed() is None:
        bucket.handed, bucket.handed_to = None, ()
        return
    start = flat.data_ptr()
    end = start + flat.numel() * flat.element_size()
    held: dict[int, tuple[ReducedParam, torch.Tensor]] = {}  # .grad still in the bucket
    for m in bucket.members:
        local = m.grad_local()
        if local is not None and local is not m.view and start <= local.data_ptr() < end:
            held[id(local)] = (m, local)
    still_grad = {id(m) for m, _ in held.values()}
    if all(id(m) in still_grad for m in bucket.handed_to):
        return
    moved = flat.clone()
    _attach(bucket, moved)
    members = tuple(m for m, _ in held.values())
    pieces = []
    for _, local in held.values():
        offset = (local.data_ptr() - start) // flat.element_size()
        pieces.append(moved.as_strided(local.shape, local.stride(), offset))
    for m, piece in zip(members, _hand_out(bucket, members, pieces), strict=True):
        m.param.grad = m.regrad(piece)


def _hand_out(
    bucket: _Bucket,
    members: Sequence[ReducedParam],
    pieces: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """``pieces`` of the bucket's buffer (default: ``members``' views), on a storage of their
    own that the bucket watches (NOTE [who else holds a gradient])."""
    flat = bucket.flat
    assert flat is not None
    if pieces is None:
        pieces = [m.view for m in members]  # type: ignore[misc]  # views, as flat is set
    bucket.handed_to = tuple(members)
    if not members:
        bucket.handed = None
        return []
    try:
        shown = torch.from_dlpack(flat.detach())
    except (BufferError, RuntimeError, TypeError):  # a dtype DLPack has no code for
        bucket.handed = _unknown
        return [piece.detach() for piece in pieces]
    bucket.handed = weakref.ref(shown.untyped_storage())
    base = flat.storage_offset()
    # detached: a gradient is no view (of ``shown``), as torch's own are not
    return [
        shown.as_strided(piece.shape, piece.stride(), piece.storage_offset() - base).detach()
        for piece in pieces
    ]


def _unknown() -> object:
    """What the bucket knows of gradients it handed out without a storage of their own: they
    may be held anywhere."""
    return True


def _reduce_axes(bucket: _Bucket) -> tuple[int, ...]:
    """The bucket's data axes on which some gradient is not already broadcast."""
    if not all(isinstance(m, GlobalParam) for m in bucket.members):
        return bucket.axes  # a local gradient is always a partial sum
    axes: set[int] = set()
    for m in bucket.members:
        grad = m.param.grad
        if grad is None:
            continue
        layout = getattr(grad, "_layout", None)
        if layout is None or layout.placement != bucket.placement:
            return bucket.axes
        axes.update(a for a in bucket.axes if not isinstance(layout.sbp[a], Broadcast))
    return tuple(sorted(axes))
