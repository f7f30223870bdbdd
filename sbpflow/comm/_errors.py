"""The error every failed collective becomes: it names the operation, the ranks, and what
each rank was doing.

# NOTE [what the ranks were doing]
# A collective that times out says little by itself: the rank that waits
# cannot see that its peer went on to another call. So each rank publishes its
# current sbpflow call on the backend's store (torch.distributed's default
# store, which every rank reaches) as it enters a user-level call (to_global,
# reading a global tensor's value) or boxes an op's inputs:
#   key ``sbpflow/call/<rank>``, value ``"to_global at train.py:42"``,
# where ``train.py:42`` is the first stack frame outside sbpflow, torch and the
# standard library: the user's line. A ``set`` is one message to the store
# with no reply to wait for (under 10 us; NOTE [call agreement] in
# _meta_check.py has the numbers). Only a failure reads the others' entries
# (``check`` first, so a rank that never published costs no wait) and the
# error then says, e.g., "rank 1 was last in to_global at train.py:42".
# The failing rank's own part comes from its stack at the failure: the user's
# line, and the sbpflow call if the rank published one at that line (a
# collective run where nothing was published, such as a gradient bucket's
# all_reduce under ``loss.backward()``, is named by its line only: an older
# published call would be a wrong answer). A peer that exited shows as a
# closed connection; the error then says that this line is a collective every
# rank must reach, since the usual cause is a branch only some ranks take
# (``if rank == 0: print(loss.item())``).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from types import FrameType

import torch
import torch.distributed as dist

from ._world import timeout_seconds


def _dir(path: str) -> str:
    return os.path.realpath(path) + os.sep


# Frames in these directories are not the user's (sbpflow, torch, the standard library).
_SKIPPED_DIRS = (
    _dir(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    _dir(os.path.dirname(torch.__file__)),
    _dir(sysconfig.get_paths()["stdlib"]),
)
_outside: dict[str, bool] = {}  # per source file name: one realpath each
_KEY = "sbpflow/call/"
_current = ("", "")  # this rank's latest published (call, user's line)


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the operation and ranks."""


def user_site() -> str:
    """``file.py:line`` of the first stack frame outside sbpflow, torch and the standard library."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        outside = _outside.get(name)
        if outside is None:
            outside = not name.startswith("<") and not _dir(name).startswith(_SKIPPED_DIRS)
            _outside[name] = outside
        if outside:
            return f"{os.path.basename(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return "an unknown line"


def default_store() -> dist.Store | None:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def publish(call: str, site: str) -> None:
    """Tell the other ranks that this rank is now in ``call`` at ``site`` (a user's line)."""
    global _current
    _current = (call, site)
    store = default_store()
    if store is not None:
        with contextlib.suppress(RuntimeError, OSError):
            store.set(f"{_KEY}{dist.get_rank()}", f"{call} at {site}")


def others_calls() -> dict[int, str]:
    """The latest call each other rank published (ranks that published none are left out)."""
    store = default_store()
    if store is None:
        return {}
    me, found = dist.get_rank(), {}
    for rank in range(dist.get_world_size()):
        key = f"{_KEY}{rank}"
        if rank == me:
            continue
        with contextlib.suppress(RuntimeError, OSError):
            if store.check([key]):
                found[rank] = store.get(key).decode()
    return found


def _this_rank_in(site: str) -> str:
    """This rank's call at ``site`` (the user's line of the failing collective)."""
    call, published_site = _current
    return f"{call} at {site}" if call and published_site == site else f"the call at {site}"


def _doing() -> str:
    others = others_calls()
    if not others:
        return ""
    lines = "; ".join(f"rank {r} was last in {call}" for r, call in sorted(others.items()))
    return f" {lines[0].upper()}{lines[1:]}."


# How many communications this rank has entered: every collective and point-to-point
# transfer runs inside ``named``. A caller reads it before and after a piece of work to
# learn whether that work needed this rank to communicate.
_entered = 0


def communications_entered() -> int:
    """The number of communications this rank has taken part in so far."""
    return _entered


@contextlib.contextmanager
def named(op: str, ranks: Sequence[int]) -> Iterator[None]:
    global _entered
    _entered += 1
    try:
        yield
    except CollectiveError:
        raise
    except (RuntimeError, ValueError) as error:  # DistBackendError subclasses RuntimeError
        text = str(error)
        hint = ""
        lowered = text.lower()
        if "connection closed" in lowered or "connection reset" in lowered:
            hint = (
                " A peer rank closed its connection: it exited, crashed (see its output) or "
                "finished the program without making this call; every rank must make the same "
                "sbpflow calls, so look for a branch only some ranks take (if rank == 0: ...)."
            )
        elif "timed out" in lowered or "timeout" in lowered:
            hint = (
                f" It timed out after the collective timeout ({timeout_seconds():.0f} s): a rank "
                "probably stopped early, raised, or took a different code path. Set "
                "SBPFLOW_TIMEOUT to change the limit."
            )
        doing = _this_rank_in(user_site())
        raise CollectiveError(
            f"sbpflow: {op} over ranks {list(ranks)} failed in {doing}, a collective: every rank "
            f"in it must reach it.{hint}{_doing()} Backend said: {text}"
        ) from error


def gather_reports(topic: str, report: str, within: float) -> dict[int, str]:
    """Every rank's ``report`` on ``topic``, through the store (a side channel: no
    collective that a rank stuck elsewhere could cross). This rank's is set first; the
    others' are those that arrived within ``within`` seconds (ranks missing then are left
    out; 0: no wait). With one rank, or no store, only this rank's."""
    store = default_store()
    if store is None:
        return {0 if not dist.is_initialized() else dist.get_rank(): report}
    me, world = dist.get_rank(), dist.get_world_size()
    keys = {rank: f"sbpflow/report/{topic}/{rank}" for rank in range(world)}
    with contextlib.suppress(RuntimeError, OSError):
        store.set(keys[me], report)
        if within > 0:
            with contextlib.suppress(RuntimeError, OSError):  # a timeout: take what arrived
                store.wait(list(keys.values()), datetime.timedelta(seconds=within))
    found = {}
    for rank, key in keys.items():
        with contextlib.suppress(RuntimeError, OSError):
            if store.check([key]):
                found[rank] = store.get(key).decode()
    return found
