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
# NOTE [transfer tags]
# Messages between two ranks on one group are matched in the order they are
# posted (gloo and NCCL both keep point-to-point order per pair and group).
# A caller that posts two kinds of message between the same ranks in orders
# that may differ on the two sides puts each kind on a group of its own:
# ``transfer_group`` with a ``tag`` makes (once) and warms up a group of those
# ranks for that tag alone, and ``isend``/``irecv``/``batch_exchange`` move
# messages on the group it returns.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ._errors import named
from ._groups import group_of
from ._world import device_for, ensure_initialized, on_teardown

__all__ = ["batch_exchange", "exchange", "irecv", "isend", "made_group", "transfer_group"]

_ready: set[tuple[str, tuple[int, ...], Hashable]] = set()  # (device type, members, tag): warm
on_teardown(_ready.clear)


def exchange(
    sends: Sequence[tuple[int, torch.Tensor]],
    recvs: Sequence[tuple[int, torch.Tensor]],
    device_type: str,
    ranks: Sequence[int],
) -> None:
    """Send each ``(peer, tensor)`` and receive into each ``(peer, buffer)``, within ``ranks``.

    ``ranks``: every rank of the transfer (source and destination placements);
    peers are world ranks among them. Every world rank calls this (NOTE
    [transfer groups]); a rank outside ``ranks`` passes no pieces.
    """
    handle = transfer_group(device_type, ranks)
    if handle is None:
        assert not sends and not recvs, f"pieces to move outside the ranks {sorted(set(ranks))}"
        return
    with named("send_recv", tuple(ranks)):
        batch_exchange(sends, recvs, handle)


def batch_exchange(
    sends: Sequence[tuple[int, torch.Tensor]],
    recvs: Sequence[tuple[int, torch.Tensor]],
    group: dist.ProcessGroup,
) -> None:
    """Post every send and receive on ``group`` as one batch and wait for all of them."""
    if not sends and not recvs:
        return
    ops = [dist.P2POp(dist.isend, t.contiguous(), peer, group=group) for peer, t in sends]
    ops += [dist.P2POp(dist.irecv, buf, peer, group=group) for peer, buf in recvs]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def isend(tensor: torch.Tensor, peer: int, group: dist.ProcessGroup) -> dist.Work:
    """Post a send of ``tensor`` (contiguous, not changed until the send completes) to
    ``peer`` on ``group``; the caller waits for the returned request."""
    work = dist.isend(tensor, peer, group=group)
    assert work is not None, "isend from a rank outside the group"
    return work


def irecv(buffer: torch.Tensor, peer: int, group: dist.ProcessGroup) -> dist.Work:
    """Post a receive from ``peer`` into ``buffer`` on ``group``; the caller waits for it."""
    work = dist.irecv(buffer, peer, group=group)
    assert work is not None, "irecv on a rank outside the group"
    return work


# Per (device type, ranks, tag) of a transfer: this rank's group handle once made and
# warmed up; None within one rank or for a rank outside the ranks (its part, making the
# group, done). A training loop makes the same transfers step after step.
_handles: dict[tuple[Any, ...], dist.ProcessGroup | None] = {}
on_teardown(_handles.clear)


def transfer_group(
    device_type: str, ranks: Sequence[int], tag: Hashable = None
) -> dist.ProcessGroup | None:
    """This rank's group for transfers within ``ranks`` (a group of its own for ``tag``: NOTE
    [transfer tags]), made and warmed up on first use; ``None`` within one rank or when this
    rank is not among ``ranks``. Every world rank calls it (NOTE [transfer groups])."""
    key = (device_type, tuple(ranks), tag)
    if key in _handles:
        return _handles[key]
    members = tuple(sorted(set(ranks)))
    if len(members) == 1:  # a copy within one rank: no group (every rank skips it alike)
        _handles[key] = None
        return None
    ensure_initialized()
    got = group_of(device_type, [members], dist.get_rank(), tag)
    if got is not None and (device_type, members, tag) not in _ready:
        with named("send_recv", members):  # the group's first collective (NOTE [transfer groups])
            dist.all_reduce(torch.zeros(1, device=device_for(device_type)), group=got[1])
        _ready.add((device_type, members, tag))
    if got is not None:
        assert got[1] is not None, f"a group of one rank for the ranks {list(members)}"
    handle = _handles[key] = got[1] if got is not None else None
    return handle


def made_group(device_type: str, ranks: Sequence[int], tag: Hashable = None) -> Any:
    """This rank's group of ``transfer_group(device_type, ranks, tag)`` if that call was made
    (and the groups not dropped since), else ``None``; never makes one."""
    return _handles.get((device_type, tuple(ranks), tag))
