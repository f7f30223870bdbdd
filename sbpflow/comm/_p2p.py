"""Point-to-point transfers between placements, on a group of the ranks involved.

# NOTE [transfer groups]
# A transfer between two placements (boxing's ``send_recv``) runs on a process
# group of the placements' device type (gloo for cpu, NCCL for cuda) made of
# the union of their ranks, not on the default group: NCCL then sets up
# connections among those ranks only. Creating that group is a world
# collective (NOTE [group creation order]), so every rank calls ``exchange``:
# every rank runs every boxing step, and ranks outside the union create the
# group and return.
#
# NCCL undefines ``batch_isend_irecv`` on a subset of a group's ranks when it
# is the group's first collective. So the first transfer on a group starts
# with a one-element all_reduce that every member enters (all of them reach
# ``exchange``, including members with nothing to send or receive); from then
# on only the ranks with pieces to move take part.
#
# NOTE [deferred sends]
# In a pipelined step (sbpflow/nn/pipeline/runtime/) a stage's sends must
# not wait for their receiver: stage s sends micro-batch k's activation and
# goes on with k+1 while stage s+1 is still busy, and a weight used on the
# first and last stage is sent forward long before the last stage reads it.
# Inside ``deferred_sends()`` ``exchange`` posts each send with ``isend`` on a
# private copy of the data, keeps the request and the copy, and returns; its
# receives are posted with ``irecv`` and waited for at once (the caller reads
# the data next). Leaving the block waits for every send. Messages between two
# ranks on one group are matched in the order they are posted (gloo and NCCL
# both keep point-to-point order per pair and group); the runtime keeps that
# order equal on both sides by running the same program on every rank (NOTE
# [one program, one message order] in sbpflow/nn/pipeline/runtime/_scope.py).
# Both backends take lone isend/irecv calls, so this works on NCCL as on gloo; on NCCL
# ``wait`` orders the current stream after the transfer instead of blocking.
# Each transfer is reported to the block's ``observer`` (direction, peer,
# bytes, wait start and end) so the runtime can record what ran.
#
# NOTE [lanes]
# Messages between two ranks on one group are matched in posting order, so a
# pipeline whose ranks post two kinds of message in different orders (zero
# bubble with several stages per rank sends stage 2's gradient before stage 0's
# next activation, while the receiver needs the activation first) would hand
# one message's data to the other's receive. A transfer may name a lane:
# ``(key, 0)`` for a tensor's move in forward, ``(key, 1)`` for its gradient's
# move back. Each lane is a process group of its own over the same ranks, so
# messages are matched in order within a lane only. The two lanes of a key are
# created together at the first use of either (a forward, in program order on
# every rank: NOTE [group creation order] in _groups.py), each started with the
# warm-up all_reduce below while all their members are in that forward transfer.
#
# NOTE [receives posted early]
# A receive posted only when the data is needed waits for the sender's gloo
# thread to write it (gloo sends the data once the receiver has posted), and on
# a rank whose cores are busy computing that takes a millisecond or more per
# message. Inside ``deferred_sends()`` a caller may post receives before the
# program asks for them (``post_early``): gloo then moves the data while this
# rank computes, and the program's receive takes it from there. Gloo matches
# the messages between two ranks on one group in posting order, and every
# receive of a transfer (in a pipelined step or not) first takes the oldest
# receive posted early for its group and peer, so the n-th receive gets the
# n-th message whoever posted it. It must be for the shape and dtype the
# program asks for: a receive whose buffer differs raises (and the early
# receive stays first in line). A receive posted early that no transfer of its
# step takes (the step failed, or moved other tensors than the step it was
# planned from) stays posted, with its buffer, for the next receive from that
# peer on that group, whichever call makes it: posted receives cannot be
# withdrawn, and a fresh receive behind it would get the message after the one
# it waits for. They are dropped with the groups at teardown. Only gloo (CPU)
# receives are posted early: NCCL runs a group's sends and receives in order on
# one stream, so an early receive would hold back this rank's sends.
# sbpflow/nn/pipeline/runtime/_early.py says which receives a pipelined step
# posts early.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ._errors import named
from ._groups import group_of
from ._world import device_for, ensure_initialized, on_teardown

_ready: set[tuple[str, tuple[int, ...], Hashable]] = (
    set()
)  # (device type, members, lane): warmed up
on_teardown(_ready.clear)


@dataclass(frozen=True)
class Message:
    """One point-to-point message this rank took part in (NOTE [deferred sends])."""

    direction: str  # "send" or "recv"
    peer: int
    nbytes: int
    start: float  # time.monotonic(): posting a send, or starting to wait for a receive
    end: float  # a send: when it was posted (it completes later); a receive: when it arrived


@dataclass(frozen=True)
class Receive:
    """One receive of a transfer: its group (device type, ranks, lane), the peer, and the
    buffer's shape and dtype. It names the group rather than holding it, so a record of
    receives never keeps a group alive past teardown."""

    route: tuple[Any, ...]
    peer: int
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class DeferredSends:
    """The sends posted inside one ``deferred_sends()`` block, waited for when it ends; and
    the receives posted early in it (NOTE [receives posted early])."""

    observer: Callable[[Message], None] | None = None
    pending: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list)
    # Called with each receive the block's transfers make, after its data arrived.
    on_receive: Callable[[Receive], None] | None = None

    def post_early(self, receives: Sequence[Receive]) -> None:
        """Post ``receives`` now; the next receives from their peers take them (NOTE
        [receives posted early]). Receives on a group not made (any more) are skipped."""
        for each in receives:
            handle = _handles.get(each.route)
            if each.route[0] != "cpu" or handle is None or handle is _OUTSIDE:
                continue
            buffer = torch.empty(each.shape, dtype=each.dtype)
            work = dist.irecv(buffer, each.peer, group=handle)
            assert work is not None, "irecv on a rank outside the group"
            _early.setdefault((each.route, each.peer), deque()).append((each, work, buffer))

    def wait(self) -> None:
        """Wait for every send posted so far (the receivers have taken the data)."""
        pending, self.pending = self.pending, []
        with named("send (deferred)", [dist.get_rank()] if dist.is_initialized() else []):
            for work, _ in pending:
                work.wait()


_deferred: DeferredSends | None = None


@contextlib.contextmanager
def deferred_sends(observer: Callable[[Message], None] | None = None) -> Iterator[DeferredSends]:
    """Inside the block, ``exchange`` does not wait for its sends (NOTE [deferred sends]),
    and receives may be posted early (NOTE [receives posted early]).

    The sends are waited for when the block ends; when it raises they are left
    pending with their buffers kept alive. Blocks do not nest.
    """
    global _deferred
    if _deferred is not None:
        raise RuntimeError("deferred_sends() blocks do not nest")
    _deferred = state = DeferredSends(observer)
    try:
        yield state
    except BaseException:
        # A failed step: its receivers may never come. Keep the sends' buffers alive (a
        # pending send reads them) instead of waiting, so the error surfaces now.
        _abandoned.extend(state.pending)
        state.pending = []
        raise
    finally:
        _deferred = None
    state.wait()


_abandoned: list[tuple[dist.Work, torch.Tensor]] = []
on_teardown(_abandoned.clear)

# Per (group route, peer): the receives posted early and not yet taken, oldest first, with
# their buffers; they outlive the step that posted them (NOTE [receives posted early]).
_early: dict[tuple[tuple[Any, ...], int], deque[tuple[Receive, dist.Work, torch.Tensor]]] = {}
on_teardown(_early.clear)


def exchange(
    sends: Sequence[tuple[int, torch.Tensor]],
    recvs: Sequence[tuple[int, torch.Tensor]],
    device_type: str,
    ranks: Sequence[int],
    lane: tuple[Hashable, int] | None = None,
) -> None:
    """Send each ``(peer, tensor)`` and receive into each ``(peer, buffer)``, within ``ranks``.

    ``ranks``: every rank of the transfer (source and destination placements);
    peers are world ranks among them. Every world rank calls this (NOTE
    [transfer groups]); a rank outside ``ranks`` passes no pieces. ``lane``:
    ``(key, 0 or 1)``, a group of its own for these ranks (NOTE [lanes]).
    """
    key = (device_type, tuple(ranks), lane)
    handle = _handles.get(key, _UNSEEN)
    if handle is _UNSEEN:
        handle = _handles[key] = _resolve(device_type, ranks, lane)
    if handle is None or handle is _OUTSIDE:
        assert not sends and not recvs, f"pieces to move outside the ranks {sorted(set(ranks))}"
        return
    with named("send_recv", key[1]):
        if _deferred is not None:
            _post(_deferred, sends, recvs, handle, key)
        elif _early and any(_early.get((key, peer)) for peer, _ in recvs):
            _exchange_behind_early(sends, recvs, handle, key)
        elif sends or recvs:
            ops = [dist.P2POp(dist.isend, t.contiguous(), peer, group=handle) for peer, t in sends]
            ops += [dist.P2POp(dist.irecv, buf, peer, group=handle) for peer, buf in recvs]
            for work in dist.batch_isend_irecv(ops):
                work.wait()


# Per (device type, ranks, lane) of a transfer: this rank's group handle once made and
# warmed up, None within one rank, _OUTSIDE for a rank outside the ranks (its part, making
# the groups, done). A pipelined step makes the same transfers on every micro-batch.
_UNSEEN: Any = object()
_OUTSIDE: Any = object()
_handles: dict[tuple[Any, ...], Any] = {}
on_teardown(_handles.clear)


def _resolve(device_type: str, ranks: Sequence[int], lane: tuple[Hashable, int] | None) -> Any:
    """This rank's group for a transfer within ``ranks``, made (and warmed up) here; ``None``
    for a transfer within one rank, ``_OUTSIDE`` when this rank is not among ``ranks``."""
    members = tuple(sorted(set(ranks)))
    if len(members) == 1:  # a copy within one rank: no group (every rank skips it alike)
        return None
    ensure_initialized()
    rank = dist.get_rank()
    lanes = [lane] if lane is None else [(lane[0], 0), (lane[0], 1)]  # both lanes of a key
    found = None
    for each in lanes:
        got = group_of(device_type, [members], rank, each)
        if got is not None and (device_type, members, each) not in _ready:
            with named(
                "send_recv", members
            ):  # the group's first collective (NOTE [transfer groups])
                dist.all_reduce(torch.zeros(1, device=device_for(device_type)), group=got[1])
            _ready.add((device_type, members, each))
        if each == lane:
            found = got
    if found is None:
        return _OUTSIDE
    assert found[1] is not None, f"a group of one rank for the ranks {list(members)}"
    return found[1]


def _exchange_behind_early(
    sends: Sequence[tuple[int, torch.Tensor]],
    recvs: Sequence[tuple[int, torch.Tensor]],
    handle: dist.ProcessGroup,
    key: tuple[Any, ...],
) -> None:
    """A transfer outside a pipelined step while receives posted early wait on its group:
    post the sends, receive one by one (the early receives first), wait for the sends."""
    works = [dist.isend(t.contiguous(), peer, group=handle) for peer, t in sends]
    for peer, buffer in recvs:
        _receive(buffer, peer, handle, key)
    for work in works:
        assert work is not None, "isend from a rank outside the group"
        work.wait()


def _post(
    state: DeferredSends,
    sends: Sequence[tuple[int, torch.Tensor]],
    recvs: Sequence[tuple[int, torch.Tensor]],
    handle: dist.ProcessGroup | None,
    key: tuple[Any, ...],
) -> None:
    """Post the sends (kept in ``state``), then receive; report each message."""
    observe = state.observer
    for peer, tensor in sends:
        # A copy: the caller's tensor (a view of an activation) may change before it is sent.
        data = tensor.detach().clone(memory_format=torch.contiguous_format)
        start = time.monotonic()
        work = dist.isend(data, peer, group=handle)
        assert work is not None, "isend from a rank outside the group"
        state.pending.append((work, data))
        if observe is not None:
            observe(Message("send", peer, _nbytes(data), start, time.monotonic()))
    for peer, buffer in recvs:
        start = time.monotonic()
        _receive(buffer, peer, handle, key)
        if observe is not None:
            observe(Message("recv", peer, _nbytes(buffer), start, time.monotonic()))
        if state.on_receive is not None:
            state.on_receive(Receive(key, peer, tuple(buffer.shape), buffer.dtype))


def _receive(
    buffer: torch.Tensor, peer: int, handle: dist.ProcessGroup | None, key: tuple[Any, ...]
) -> None:
    """Receive the next message from ``peer`` into ``buffer``: through the oldest receive
    posted early for that peer and group if one waits (NOTE [receives posted early])."""
    early = _early.get((key, peer)) if _early else None
    if early:
        _take_early(early, buffer)
        return
    work = dist.irecv(buffer, peer, group=handle)
    assert work is not None, "irecv on a rank outside the group"
    work.wait()


def _take_early(
    early: deque[tuple[Receive, dist.Work, torch.Tensor]], buffer: torch.Tensor
) -> None:
    """Receive into ``buffer`` the oldest message posted early for its group and peer."""
    posted, work, data = early[0]
    if posted.shape != tuple(buffer.shape) or posted.dtype != buffer.dtype:
        raise RuntimeError(
            f"a transfer receives a {tuple(buffer.shape)} {buffer.dtype} tensor from rank "
            f"{posted.peer}, but the receive posted early for that message was for a "
            f"{posted.shape} {posted.dtype} tensor: this step's transfers differ from those "
            "of the previous step with inputs of the same shapes (NOTE [receives posted early]). "
            "A pipelined build whose transfers depend on its data needs "
            "graph.config.enable_early_receives(False) from its first step on."
        )
    work.wait()  # a timeout leaves it first in line, its buffer kept
    early.popleft()
    buffer.copy_(data)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
