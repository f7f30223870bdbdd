"""The parameters of one fully sharded module: gathered and reduced as one flat buffer each.

# NOTE [one gather, one reduction per block]
# ``ParamGroup`` holds the parameters one ``fully_shard`` call manages (a block) and
# moves them together (NOTE [flat collectives] in comm/collectives.py):
#   - unshard: every member copies its shards into its own row of the gather's buffer
#     (the cast to the compute dtype on the way, so a reduced-precision policy also
#     halves the bytes sent) and one ``all_gather`` of the rows starts, in place; it may
#     run while another block computes (prefetch). Waiting for it allocates the group's
#     unsharded buffer, fills it from the rows (one view per parameter) and drops the
#     rows. A block in flight holds its rows; a gathered one its unsharded buffer.
#   - reshard: the unsharded buffer's storage is resized to 0 bytes. The views (and the
#     tensors autograd saved for backward, which alias them) keep their shapes and point
#     at the same storage, which the next unshard refills with the same values; so a
#     backward pass after a reshard finds its saved parameters again once the block is
#     gathered once more (``_fsdp_state`` does that before the block's backward).
#   - reduce: the block's partial gradients (P on the data axis) go into the rows of one
#     ``reduce_scatter``, member k's part of each gradient into row k, converted to the
#     reduce dtype, and after them one flag per parameter (1 where this rank had a
#     gradient), so a parameter no rank computed a gradient for keeps ``.grad`` None.
#     Packing and sending are two calls: the unsharded gradients are dropped between them,
#     so they are not alive with the collective's buffers (the result, gloo's copy).
#     Each rank's result is its shard of every gradient, S(d) on the data axis: a sum, as
#     P -> S(d) is, so a loss averaged over the whole batch gets the single-process
#     gradient. Without gradient sync (``set_requires_gradient_sync(False)``) the rows
#     are kept and the next backward adds into them; the first synced backward reduces
#     them all.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..._global import GlobalTensor, _post_hooks, _pre_hooks, is_layout_hook, wrap
from ..._layout import Layout
from ...boxing import tracing as _trace
from ...boxing._redistribute import box_below_autograd
from ...comm import collectives
from ...comm._mesh import MESHES
from ...placement import Placement
from ...sbp import Partial
from ._fsdp_param import DATA_AXIS, ShardedParam

__all__ = ["ParamGroup", "PendingReduction", "ShardedState"]

_SUM = Partial("sum")


class ShardedState(enum.Enum):
    """Where a fully sharded module's parameters are (NOTE [one gather, one reduction per
    block])."""

    SHARDED = "sharded"  # only this rank's shards: no gathered memory
    GATHERING = "gathering"  # the all_gather is in flight (started ahead: a prefetch)
    UNSHARDED = "unsharded"  # gathered: the module can compute


class ParamGroup:
    """The parameters of one fully sharded module, gathered and reduced together."""

    def __init__(
        self,
        params: list[ShardedParam],
        placement: Placement,
        rank: int,
        compute_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
    ) -> None:
        self.params = params
        self.placement = placement
        self.compute_dtype, self.reduce_dtype = compute_dtype, reduce_dtype
        self.state = ShardedState.SHARDED
        self.requires_gradient_sync = True
        self.group: collectives.Group | None = None
        self.slots: list[int] = []
        self._gathering: collectives.PendingCollective | None = None
        self._accumulated: torch.Tensor | None = None  # rows kept without gradient sync
        self.num_members = placement.shape[DATA_AXIS]
        self.member = placement.coords_of(rank)[DATA_AXIS] if rank in placement else 0
        offset = 0
        for p in params:
            p.offset = offset
            offset += p.padded_numel
        self.row_numel = offset  # the parameters' part of a row; the flags follow
        if params and rank in placement:
            self.group = MESHES.of(placement, "fully_shard").group((DATA_AXIS,))
            assert self.group is not None
            self.slots = collectives.group_slots(self.group[0])
        first = params[0].param._local if params else torch.empty(0)
        self.device = first.device
        numel = sum(p.unsharded.numel() for p in params) if self.group else 0
        self._unsharded = torch.empty(numel, dtype=compute_dtype, device=self.device)
        at = 0
        for p in params:
            if self.group is not None:
                p.unsharded = self._unsharded[at : at + p.unsharded.numel()].view(p.unsharded.shape)
                at += p.unsharded.numel()
        self._storage = self._unsharded.untyped_storage()
        self._nbytes = self._storage.nbytes()
        self._storage.resize_(0)

    # -- gather -----------------------------------------------------------------------
    def unshard(self) -> None:
        """Start gathering (SHARDED -> GATHERING); nothing if already started or done."""
        if self.state is not ShardedState.SHARDED:
            return
        self.state = ShardedState.GATHERING
        if self.group is None:
            return  # no parameter, or a rank outside the placement: no data to move
        rows = torch.empty(
            (self.num_members, self.row_numel), dtype=self.compute_dtype, device=self.device
        )
        row = rows[self.slots[self.member]]  # gathered in place: no buffer of its own
        for p in self.params:
            p.copy_in(row)
        self._gathering = collectives.all_gather_async(rows, row, self.group)
        _trace.record(None, ["all_gather"])

    def wait_unsharded(self) -> None:
        """Make the parameters usable (-> UNSHARDED), gathering now if not started."""
        if self.state is ShardedState.UNSHARDED:
            return
        self.unshard()
        pending, self._gathering = self._gathering, None
        if pending is not None:
            rows = pending.wait()
            self._storage.resize_(self._nbytes)
            # The same values again: the tensors autograd saved (a compiled graph saves the
            # local pieces themselves) must not see a new version.
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self._unsharded):
                for p in self.params:
                    p.copy_out(rows, self.slots)
        self.state = ShardedState.UNSHARDED

    def reshard(self) -> None:
        """Free the gathered parameters (-> SHARDED); a gather in flight is finished first."""
        if self.state is ShardedState.SHARDED:
            return
        pending, self._gathering = self._gathering, None
        if pending is not None:
            pending.wait()  # the collective must complete on every member before its buffer goes
        self._storage.resize_(0)
        self.state = ShardedState.SHARDED

    @property
    def unsharded_bytes(self) -> int:
        """Bytes of gathered parameters this rank holds now, in flight or unsharded (0 when
        sharded)."""
        pending = self._gathering
        in_flight = 0 if pending is None else pending.tensor.nbytes
        return self._storage.nbytes() + in_flight

    # -- reduce ------------------------------------------------------------------------
    def pack_gradients(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Put the block's partial gradients (one per parameter, None where it got none)
        into the rows of its reduce_scatter, added to the rows kept without gradient sync;
        the caller drops the gradients before ``start_reduction`` sends the rows."""
        if self.group is None:
            self._set_outside_grads(grads)
            return
        rows = self._accumulated
        add = rows is not None
        if rows is None:
            rows = torch.empty(
                (self.num_members, self.row_numel + len(self.params)),
                dtype=self.reduce_dtype,
                device=self.device,
            )
            rows[:, self.row_numel :] = 0
        for i, (p, grad) in enumerate(zip(self.params, grads, strict=True)):
            if grad is not None:
                p.grad_into_rows(self._partial_local(p, grad), rows, self.slots, add)
                rows[:, self.row_numel + i] += 1
            elif not add:
                p.zero_rows(rows)
        self._accumulated = rows

    def start_reduction(self) -> PendingReduction | None:
        """Start reducing the packed rows to this rank's shards; None when nothing is sent
        (kept for a later reduction without gradient sync, or a rank outside the placement)."""
        rows = self._accumulated
        if rows is None or not self.requires_gradient_sync:
            return None
        assert self.group is not None
        self._accumulated = None
        out = rows.new_empty(rows.shape[1])
        pending = collectives.reduce_scatter_async(out, rows, self.group, "sum")
        _trace.record(None, ["reduce_scatter"])
        # The collective's handle keeps what it still reads (gloo has copied ``rows``
        # already): dropping them here frees them as soon as the backend allows.
        return PendingReduction(self, pending)

    def _partial_local(self, p: ShardedParam, grad: torch.Tensor) -> torch.Tensor:
        """This rank's piece of ``grad`` laid out as the unsharded parameter, partial on the
        data axis (what the reduce_scatter sums)."""
        if not isinstance(grad, GlobalTensor):
            raise TypeError(
                f"the gradient of the gathered parameter {p.name!r} is a plain "
                f"{type(grad).__name__}; a global tensor's gradient must be global."
            )
        unsharded = p.unsharded_meta.layout
        sbp = list(unsharded.sbp)
        sbp[DATA_AXIS] = _SUM
        target = Layout(unsharded.placement, tuple(sbp))
        if grad._layout != target:
            grad = box_below_autograd(grad, target)
        return grad._local

    def _set_outside_grads(self, grads: Sequence[torch.Tensor | None]) -> None:
        """A rank outside the placement holds empty shards; so are its gradients."""
        for p, grad in zip(self.params, grads, strict=True):
            if grad is not None and p.param.grad is None:
                p.param.grad = wrap(p.param._local.new_zeros(p.param._local.shape), p.param._meta)


@dataclass(eq=False)
class PendingReduction:
    """A block's reduce_scatter in flight; ``finish`` waits and adds the shards to ``.grad``."""

    group: ParamGroup
    pending: collectives.PendingCollective

    def finish(self) -> None:
        out = self.pending.wait()
        group = self.group
        flags = out[group.row_numel :].tolist()
        with torch.no_grad():
            for p, flag in zip(group.params, flags, strict=True):
                if flag > 0:
                    _accumulate(p, p.shard_of(out))


def _accumulate(p: ShardedParam, shard: torch.Tensor) -> None:
    """``p.param.grad += shard`` (this rank's shard of the reduced gradient), through the
    parameter's gradient hooks (NOTE [hooks of a fully sharded parameter])."""
    param = p.param
    local = param._local
    if shard.dtype != local.dtype or not shard.is_contiguous():
        shard = shard.to(local.dtype, memory_format=torch.contiguous_format)
    grad = wrap(shard, param._meta)
    pre = _user_hooks(_pre_hooks(param))  # NOTE [hook dicts after a swap] in _global
    for hook in pre:
        out = hook(grad)
        grad = grad if out is None else out
    current = param.grad
    if current is None:
        param.grad = grad
    elif (
        isinstance(current, GlobalTensor)
        and isinstance(grad, GlobalTensor)
        and current._layout == grad._layout == param._layout
    ):
        current._local.add_(grad._local)
    else:
        param.grad = current + grad
    for post in _user_hooks(_post_hooks(param)):
        post(param)


# NOTE [hooks of a fully sharded parameter]
# A fully sharded parameter gets its gradient from its block's reduce_scatter, not from
# autograd's AccumulateGrad, so autograd never runs its hooks. They run here, as torch
# FSDP2 runs post-accumulate-grad hooks: a hook made with ``register_hook`` gets the
# reduced gradient (the logical gradient, laid out as the sharded parameter) before it
# is added to ``.grad`` and may return a replacement; a post-accumulate-grad hook runs
# once ``.grad`` holds it. The layout hooks of ``keep_grad_layout`` have nothing to do here.


def _user_hooks(hooks: Any) -> list[Any]:
    return [h for h in (hooks or {}).values() if not is_layout_hook(h)]
