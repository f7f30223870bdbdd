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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ._errors import named
from ._groups import group_of
from ._world import device_for, ensure_initialized, on_teardown

_ready: set[tuple[str, tuple[int, ...]]] = set()  # (device type, members): warmed up for P2P
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
    members = tuple(sorted(set(ranks)))
    if len(members) == 1:  # a copy within one rank: no group (every rank skips it alike)
        assert not sends and not recvs, f"pieces to send within the one rank {members[0]}"
        return
    ensure_initialized()
    found = group_of(device_type, [members], dist.get_rank())
    if found is None:
        assert not sends and not recvs, f"pieces to move outside the ranks {list(members)}"
        return
    handle = found[1]
    ops = [dist.P2POp(dist.isend, t.contiguous(), peer, group=handle) for peer, t in sends]
    ops += [dist.P2POp(dist.irecv, buf, peer, group=handle) for peer, buf in recvs]
    with named("send_recv", members):
        if (device_type, members) not in _ready:
            dist.all_reduce(torch.zeros(1, device=device_for(device_type)), group=handle)
            _ready.add((device_type, members))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
