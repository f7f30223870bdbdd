"""After a pipelined step raised: the messages it left between the ranks, settled or refused.

# NOTE [a failed step's messages]
# Messages between two ranks on a lane are matched in posting order, so after a
# failed step the next step's receives take whatever that step left in flight.
# The ranks may stop at different points: 1F1B sends a gradient that the peer,
# failing first, never takes; a rank holding several stages runs its
# micro-batches in another order than its peers; a receive posted early waits
# for a message nobody will send. The next step would then silently compute
# with the failed step's data. So every rank counts, per lane and peer, the
# messages it sent (with the shapes and dtypes of the last ``_LOGGED``) and
# those it took, and the pipelined steps it entered. A step that raises
# publishes these, and the receives it still has posted early, through the
# store (``gather_reports``: no collective that a rank stuck in a receive could
# cross), and reads every rank's, waiting up to the collective timeout (at most
# ``_AGREE_S``). When every rank reported on the same step, each receiver takes
# and drops the messages sent to it and not taken (through the receives it
# posted early first: they are first in line), then each sender fills the
# receives still posted early at its peers with messages of their shapes, which
# the peers take and drop. The next step then starts with nothing in flight and
# nothing posted, and the error is raised as it is. Otherwise (a rank did not
# report in time, was in another step, failed in a collective or was
# interrupted, or a message is older than the log) the error is raised with a
# note saying so, and every later pipelined step of this process raises before
# moving any data. Until the agreement has ended well, this rank counts as out
# of step, so an agreement cut short (a Ctrl-C) leaves it so.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from ....comm import _p2p
from ....comm._errors import CollectiveError, gather_reports, named
from ....comm._world import device_for, get_rank, get_world_size, on_teardown, timeout_seconds

__all__ = [
    "check_in_step",
    "count_step",
    "lane_name",
    "note_sent",
    "note_taken",
    "refuse_if_out_of_step",
]

Logged = list[tuple[tuple[int, ...], str]]  # shapes and dtypes, oldest first

_AGREE_S = 30.0
_LOGGED = 64
_routes: dict[str, Any] = {}  # each lane's route by its name (the same on every rank)
_names: dict[Any, str] = {}  # and back
_sent: dict[tuple[str, int], int] = {}  # per (lane's name, peer): messages sent
_recent: dict[tuple[str, int], deque[tuple[tuple[int, ...], str]]] = {}  # their shapes, dtypes
_taken: dict[tuple[str, int], int] = {}  # per (lane's name, peer): messages received
_steps = [0]  # pipelined steps entered
_failures = [0]  # failed steps so far, the same count on every rank while they agree
_out_of_step: list[str] = []  # why later steps may not run (empty: they may)


def _forget_counts() -> None:
    for kept in (_routes, _names, _sent, _recent, _taken):
        kept.clear()
    _steps[0] = _failures[0] = 0
    _out_of_step.clear()


on_teardown(_forget_counts)


def refuse_if_out_of_step() -> None:
    """Raise if an earlier failed step left the ranks' messages out of step (NOTE [a failed
    step's messages]); every rank that step left so raises here, before moving any data."""
    if _out_of_step:
        raise RuntimeError(
            f"an earlier pipelined step failed and left the ranks' messages out of step "
            f"({_out_of_step[0]}), so this step would take that step's data (NOTE [a failed "
            "step's messages] in sbpflow/nn/pipeline/runtime/_failed_step.py). This process "
            "cannot run another pipelined step: restart the job on every rank."
        )


def lane_name(route: Any) -> str:
    """A lane's name, the same on every rank: its pair of placements and direction."""
    name = _names.get(route)
    if name is None:
        (src, dst), index = route[2]
        name = f"the {('forward', 'gradient')[index]} lane between {src} and {dst}"
        _names[route] = name
        _routes[name] = route
    return name


def count_step() -> None:
    """A pipelined step starts moving data."""
    _steps[0] += 1


def note_taken(route: Any, peer: int) -> None:
    """The program took a message from ``peer`` on the lane ``route``."""
    key = (lane_name(route), peer)
    _taken[key] = _taken.get(key, 0) + 1


def note_sent(route: Any, peer: int, data: torch.Tensor) -> None:
    key = (lane_name(route), peer)
    _sent[key] = _sent.get(key, 0) + 1
    _recent.setdefault(key, deque(maxlen=_LOGGED)).append((tuple(data.shape), str(data.dtype)))


def check_in_step(
    error: BaseException,
    posted: dict[tuple[Any, int], deque[Any]],
    receive: Callable[[torch.Tensor, int, Any, Any], None],
    abandoned: list[tuple[Any, torch.Tensor]],
) -> None:
    """After ``error`` ended a step: agree with the other ranks on the messages in flight
    and settle them, or note on ``error`` that later steps cannot run (NOTE [a failed
    step's messages]). ``posted``: the receives posted early, per (route, peer), oldest
    first; ``receive``: the lanes' receive (through those first); ``abandoned``: where
    sends whose buffers must outlive this call go."""
    _failures[0] += 1
    provisional = "this rank's agreement on the failed step did not end"
    _out_of_step.append(provisional)
    me = get_rank()
    broken = isinstance(error, CollectiveError) or not isinstance(error, Exception)
    report: Any = "broken"
    if not broken:
        report = [
            (lane, me, peer, n, list(_recent[lane, peer])) for (lane, peer), n in _sent.items()
        ]
        report += [(lane, peer, me, -n, []) for (lane, peer), n in _taken.items()]
        report = (_steps[0], report, _posted_early(posted))
    # A rank that cannot take part publishes that and goes on (a Ctrl-C must not wait).
    within = 0.0 if broken else min(timeout_seconds(), _AGREE_S)
    topic = f"pipeline-step-failure-{_failures[0]}"
    reports = gather_reports(topic, repr(report), within)
    why, to_take, to_fill = _in_flight(reports, get_world_size(), me)
    if why is None:
        why = _settle(to_take, to_fill, receive, abandoned)
    if why is None:
        _out_of_step.remove(provisional)
        return
    _out_of_step[:] = [why]
    if not broken:  # a rank still on its way to the agreement reads that this one gave up
        gather_reports(topic, repr("broken"), 0.0)
    add_note = getattr(error, "add_note", None)  # Python 3.11 on
    if add_note is not None:
        add_note(
            f"sbpflow: {why}; the ranks' messages may be out of step, so every later "
            "pipelined step of this process raises (NOTE [a failed step's messages] in "
            "sbpflow/nn/pipeline/runtime/_failed_step.py)."
        )


def _posted_early(posted: dict[tuple[Any, int], deque[Any]]) -> list[tuple[str, int, Logged]]:
    """The receives this rank has posted early and not taken: per lane and peer, their
    shapes and dtypes, oldest first."""
    return [
        (lane_name(route), peer, [(r.shape, str(r.dtype)) for r, _, _ in queue])
        for (route, peer), queue in posted.items()
        if queue
    ]


Settle = list[tuple[str, int, Logged]]  # per lane and peer: the messages to take or send


def _in_flight(reports: dict[int, str], world: int, me: int) -> tuple[str | None, Settle, Settle]:
    """From every rank's report: why the failed step cannot be settled (``None``: it can);
    the messages in flight to ``me`` (per lane and sender); and the receives posted early
    at other ranks that ``me`` must fill (per lane and receiver)."""
    missing = sorted(set(range(world)) - set(reports))
    if missing:
        return f"rank(s) {missing} did not report on the failed step in time", [], []
    parsed = {rank: ast.literal_eval(report) for rank, report in reports.items()}
    broken = sorted(rank for rank, report in parsed.items() if report == "broken")
    if broken:
        return (
            f"the step failed in a collective, was interrupted or gave up on rank(s) {broken}",
            [],
            [],
        )
    steps = {rank: report[0] for rank, report in parsed.items()}
    if len(set(steps.values())) > 1:
        return f"the ranks failed in different steps (per rank: {steps})", [], []
    balance: dict[tuple[str, int, int], int] = {}
    logged: dict[tuple[str, int, int], Logged] = {}
    for _, counts, _ in parsed.values():
        for lane, src, dst, n, shapes in counts:
            balance[lane, src, dst] = balance.get((lane, src, dst), 0) + n  # sent up, taken down
            if shapes:
                logged[lane, src, dst] = shapes
    to_take, to_fill = [], []
    for (lane, src, dst), n in sorted(balance.items()):
        if n < 0 or n > len(logged.get((lane, src, dst), ())):
            return f"rank {src}'s messages to rank {dst} on {lane} cannot be matched", [], []
        if n and dst == me:
            to_take.append((lane, src, logged[lane, src, dst][-n:]))
    for dst, (_, _, posted) in sorted(parsed.items()):
        for lane, src, shapes in posted:
            left = shapes[balance.get((lane, src, dst), 0) :]  # in flight messages fill the first
            if left and src == me:
                to_fill.append((lane, dst, left))
            if left and dst == me:
                to_take.append((lane, src, left))
    return None, to_take, to_fill


def _settle(
    to_take: Settle,
    to_fill: Settle,
    receive: Callable[[torch.Tensor, int, Any, Any], None],
    abandoned: list[tuple[Any, torch.Tensor]],
) -> str | None:
    """Fill the receives posted early at the peers, then take and drop the messages in
    flight to this rank and those filling its own early receives (``None``: done; else why
    not). The fills go first and are waited for last: each meets a receive already posted,
    so no rank waits for another to reach this point (two ranks filling each other's)."""
    sends: list[Any] = []
    lane = ""
    try:
        with named("settling a failed step's messages", [get_rank()]):
            for lane, peer, shapes in to_fill:
                route, group = _route_and_group(lane)
                for shape, dtype in shapes:
                    data = _buffer(route[0], shape, dtype).zero_()
                    sends.append((_p2p.isend(data, peer, group), data))
                    note_sent(route, peer, data)
            for lane, peer, shapes in to_take:
                route, group = _route_and_group(lane)
                for shape, dtype in shapes:
                    receive(_buffer(route[0], shape, dtype), peer, group, route)
            for work, _ in sends:
                work.wait()
    except (CollectiveError, RuntimeError, ValueError, KeyError) as error:
        abandoned.extend(sends)
        return f"the failed step's messages on {lane} could not be settled ({error})"
    return None


def _route_and_group(lane: str) -> tuple[Any, Any]:
    route = _routes[lane]  # a KeyError: this rank never used the lane
    device_type, members, on = route
    return route, _p2p.made_group(device_type, members, on)


def _buffer(device_type: str, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    return torch.empty(
        shape, dtype=getattr(torch, dtype.split(".")[-1]), device=device_for(device_type)
    )
