"""The transfers of a pipelined step, posted by the runtime itself: sends that do not wait
for their receiver, receives posted early, and a pair of lanes per pair of placements.

Boxing computes what a change of placement sends and receives and hands the messages to a
transport (NOTE [transports] in sbpflow/boxing/executor.py); inside a step the runtime's
scope gives each crossing a transport of this module (NOTE [crossings in a step] in
_scope.py), which moves the messages with comm's point-to-point functions on the lanes'
groups.

# NOTE [deferred sends]
# In a pipelined step a stage's sends must not wait for their receiver: stage s
# sends micro-batch k's activation and goes on with k+1 while stage s+1 is still
# busy, and a weight used on the first and last stage is sent forward long before
# the last stage reads it. Inside ``step_transfers()`` a lane's transport posts
# each send with ``isend`` on a private copy of the data, keeps the request and
# the copy, and returns; its receives are posted with ``irecv`` and waited for at
# once (the caller reads the data next). Leaving the block waits for every send.
# Messages between two ranks on one group are matched in the order they are
# posted (gloo and NCCL both keep point-to-point order per pair and group); the
# runtime keeps that order equal on both sides by running the same program on
# every rank (NOTE [one program, one message order] in _scope.py). Both backends
# take lone isend/irecv calls, so this works on NCCL as on gloo; on NCCL ``wait``
# orders the current stream after the transfer instead of blocking. Each transfer
# is reported to the block's ``observer`` (direction, peer, bytes, wait start and
# end) so the runtime can record what ran.
#
# NOTE [lanes]
# Messages between two ranks on one group are matched in posting order, so a
# pipeline whose ranks post two kinds of message in different orders (zero
# bubble with several stages per rank sends stage 2's gradient before stage 0's
# next activation, while the receiver needs the activation first) would hand one
# message's data to the other's receive. So a crossing from placement A to B
# moves its tensor on lane ``((A, B), 0)`` and its gradient back on lane
# ``((A, B), 1)``: each lane is a process group of its own over the ranks of A
# and B (comm's ``transfer_group`` with the lane as its tag), so messages are
# matched in order within a lane only.
#
# The lanes are made when the stages are set up, before a step's first action,
# by every rank with the same stages and in the same order (``make_lanes``; NOTE
# [group creation order] in sbpflow/comm/_groups.py), never by a transfer in the
# middle of a step. In a pipeline, data flows from a stage to the stages after
# it: its output to the next, a skip connection or a weight tied to a later
# stage further on, whichever ranks hold them (a V or looped schedule puts stage
# 0 and the last stage on one rank, so stage 1 sends back to rank 0). So the
# pairs made are those of (stage i's placement, stage j's placement) for every
# i < j on different placements (``lane_pairs``), each with both its lanes, and
# those from each placement of the step's global inputs to each stage's
# placement. A crossing between other placements (a weight of a later stage
# used on an earlier one, a placement made inside ``build``) is the one case
# that still makes its pair at its first forward, in program order on every
# rank, while all their members are in that transfer.
#
# NOTE [receives posted early]
# A receive posted only when the data is needed waits for the sender's gloo
# thread to write it (gloo sends the data once the receiver has posted), and on
# a rank whose cores are busy computing that takes a millisecond or more per
# message. Inside ``step_transfers()`` the runtime may post receives before the
# program asks for them (``post_early``): gloo then moves the data while this
# rank computes, and the program's receive takes it from there. Gloo matches the
# messages between two ranks on one group in posting order, and every receive on
# a lane first takes the oldest receive posted early for its lane and peer, so
# the n-th receive gets the n-th message whoever posted it. It must be for the
# shape and dtype the program asks for: a receive whose buffer differs raises
# (and the early receive stays first in line). A receive posted early that no
# transfer of its step takes because the step moved other tensors than the step
# it was planned from stays posted, with its buffer, for the next receive from
# that peer on that lane, whichever step makes it: posted receives cannot be
# withdrawn, and a fresh receive behind it would get the message after the one it
# waits for. One left by a step that failed is filled by its sender and dropped
# (NOTE [a failed step's messages] in _failed_step.py). They are dropped with the
# groups at teardown. Only gloo (CPU) receives are posted early: NCCL runs a
# group's sends and receives in order on one stream, so an early receive would
# hold back this rank's sends. _early.py says which receives a step posts early.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ....boxing.executor import Transport
from ....comm import _p2p
from ....comm._errors import named
from ....comm._world import get_rank, on_teardown
from ....placement import Placement
from ._failed_step import (
    check_in_step,
    count_step,
    lane_name,
    note_sent,
    note_taken,
    refuse_if_out_of_step,
)
from ._stages import Stage

__all__ = [
    "Message",
    "Receive",
    "StepTransfers",
    "lane_pairs",
    "make_lanes",
    "refuse_if_out_of_step",
    "step_transfers",
]

Lane = tuple[Hashable, int]  # (the pair of placements, 0 forward or 1 gradient)
Route = tuple[str, tuple[int, ...], Lane]  # (device type, every rank of both placements, lane)


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
    """One receive of a transfer: its lane's route, the peer, and the buffer's shape and
    dtype. It names the group rather than holding it, so a record of receives never keeps
    a group alive past teardown."""

    route: Route
    peer: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def make_lanes(stages: Sequence[Stage], inputs: Iterable[Placement] = ()) -> None:
    """Make the lanes of every pair in ``lane_pairs(stages, inputs)`` (NOTE [lanes]). Every
    rank calls it, with the same stages and inputs, before the step's first action."""
    for src, dst in lane_pairs(stages, inputs):
        members = _members(src, dst)
        _lane_group(dst.type, members, ((src, dst), 0))
        for index in (0, 1):  # named on every rank (NOTE [a failed step's messages])
            lane_name((dst.type, members, ((src, dst), index)))


def lane_pairs(
    stages: Sequence[Stage], inputs: Iterable[Placement] = ()
) -> list[tuple[Placement, Placement]]:
    """The pairs of placements a step with ``stages`` and inputs on ``inputs`` moves data
    between, in one order on every rank (NOTE [lanes]): (stage i's, stage j's placement)
    for i < j on two placements of one device type, then (an input's placement, a stage's)."""
    placements = [s.placement for s in sorted(stages, key=lambda s: s.stage_id)]
    pairs = [
        (src, dst)
        for i, src in enumerate(placements)
        for dst in placements[i + 1 :]
        if src != dst and src.type == dst.type
    ]
    held = list(dict.fromkeys(placements))
    for src in dict.fromkeys(inputs):
        if src not in held:
            pairs += [(src, dst) for dst in held if src.type == dst.type]
    return list(dict.fromkeys(pairs))


def _members(src: Placement, dst: Placement) -> tuple[int, ...]:
    return tuple(sorted(set(src.flat_ranks) | set(dst.flat_ranks)))


def _lane_group(device_type: str, members: tuple[int, ...], on: Lane) -> Any:
    """This rank's group for lane ``on`` (``None``: not a member, or one rank); the pair's
    two lanes are made together, in order (NOTE [lanes])."""
    pair = on[0]
    forward = _p2p.transfer_group(device_type, members, (pair, 0))
    backward = _p2p.transfer_group(device_type, members, (pair, 1))
    return forward if on[1] == 0 else backward


@dataclass
class StepTransfers:
    """One step's transfers: the sends its lanes posted, waited for when its
    ``step_transfers()`` block ends; and the receives posted early in it (NOTE [receives
    posted early]). The scopes of the step's micro-batches hold it."""

    observer: Callable[[Message], None] | None = None
    pending: list[tuple[Any, torch.Tensor]] = field(default_factory=list)
    # Called with each receive the block's transfers make, after its data arrived.
    on_receive: Callable[[Receive], None] | None = None
    running: bool = True  # until its block ends

    def lane(self, src: Placement, dst: Placement, index: int) -> Transport:
        """The transport of lane ``index`` of the crossings from ``src`` to ``dst``."""
        return functools.partial(self._exchange, lane=((src, dst), index))

    def _exchange(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, torch.Tensor]],
        device_type: str,
        members: tuple[int, ...],
        lane: Lane,
    ) -> None:
        """A lane's transport (NOTE [transports] in sbpflow/boxing/executor.py)."""
        group = _lane_group(device_type, members, lane)
        if group is None:
            assert not sends and not recvs, f"pieces to move outside the ranks {list(members)}"
            return
        route = (device_type, members, lane)
        with named("send_recv", members):
            if self.running:
                self._post(sends, recvs, group, route)
            else:  # after its step (a graph kept with create_graph): wait for each message
                refuse_if_out_of_step()
                works = [_p2p.isend(t.contiguous(), peer, group) for peer, t in sends]
                for peer, t in sends:
                    note_sent(route, peer, t)
                for peer, buffer in recvs:
                    _receive(buffer, peer, group, route)
                for work in works:
                    work.wait()

    def post_early(self, receives: Sequence[Receive]) -> None:
        """Post ``receives`` now; the next receives from their peers take them (NOTE
        [receives posted early]). Receives on a lane not made (any more) are skipped."""
        for each in receives:
            device_type, members, on = each.route
            group = _p2p.made_group(device_type, members, on)
            if device_type != "cpu" or group is None:
                continue
            buffer = torch.empty(each.shape, dtype=each.dtype)
            work = _p2p.irecv(buffer, each.peer, group)
            _early.setdefault((each.route, each.peer), deque()).append((each, work, buffer))

    def wait(self) -> None:
        """Wait for every send posted so far (the receivers have taken the data)."""
        pending, self.pending = self.pending, []
        with named("send (deferred)", [get_rank()]):
            for k, (work, _) in enumerate(pending):
                try:
                    work.wait()
                except BaseException:
                    _abandoned.extend(pending[k:])  # gloo may still read their buffers
                    raise

    def _post(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, torch.Tensor]],
        group: Any,
        route: Route,
    ) -> None:
        """Post the sends (kept here), then receive; report each message."""
        observe = self.observer
        for peer, tensor in sends:
            # A copy: the caller's tensor (a view of an activation) may change before it is sent.
            data = tensor.detach().clone(memory_format=torch.contiguous_format)
            start = time.monotonic()
            work = _p2p.isend(data, peer, group)
            note_sent(route, peer, data)
            self.pending.append((work, data))
            if observe is not None:
                observe(Message("send", peer, _nbytes(data), start, time.monotonic()))
        for peer, buffer in recvs:
            start = time.monotonic()
            _receive(buffer, peer, group, route)
            if observe is not None:
                observe(Message("recv", peer, _nbytes(buffer), start, time.monotonic()))
            if self.on_receive is not None:
                self.on_receive(Receive(route, peer, tuple(buffer.shape), buffer.dtype))


@contextlib.contextmanager
def step_transfers(observer: Callable[[Message], None] | None = None) -> Iterator[StepTransfers]:
    """A step's transfers: inside the block its lanes' transports do not wait for their sends
    (NOTE [deferred sends]), and receives may be posted early (NOTE [receives posted early]).

    The sends are waited for when the block ends; when it raises they are left
    pending with their buffers kept alive.
    """
    refuse_if_out_of_step()
    count_step()
    state = StepTransfers(observer)
    try:
        yield state
        state.running = False
        state.wait()
    except BaseException as error:
        # A failed step: its receivers may never come. Keep the sends' buffers alive (a
        # pending send reads them) instead of waiting, so the error surfaces now.
        state.running = False
        _abandoned.extend(state.pending)
        state.pending = []
        check_in_step(error, _early, _receive, _abandoned)
        raise


_abandoned: list[tuple[Any, torch.Tensor]] = []
on_teardown(_abandoned.clear)

# Per (lane's route, peer): the receives posted early and not yet taken, oldest first, with
# their buffers; they outlive the step that posted them (NOTE [receives posted early]).
_early: dict[tuple[Route, int], deque[tuple[Receive, Any, torch.Tensor]]] = {}
on_teardown(_early.clear)


def _receive(buffer: torch.Tensor, peer: int, group: Any, route: Route) -> None:
    """Receive the next message from ``peer`` into ``buffer``: through the oldest receive
    posted early for that peer and lane if one waits (NOTE [receives posted early])."""
    early = _early.get((route, peer)) if _early else None
    if early:
        _take_early(early, buffer)
    else:
        _p2p.irecv(buffer, peer, group).wait()
    note_taken(route, peer)


def _take_early(early: deque[tuple[Receive, Any, torch.Tensor]], buffer: torch.Tensor) -> None:
    """Receive into ``buffer`` the oldest message posted early for its lane and peer."""
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
