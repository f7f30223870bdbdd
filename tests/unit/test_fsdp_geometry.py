"""Where a fully sharded parameter's pieces sit in a block's flat rows, in one process.

NOTE [fully sharded layouts] in sbpflow/nn/parallel/_fsdp_param.py. Every member of a data
group is simulated here: each one's ``ShardedParam`` is built from its own shard, copies it
into its row, and the rows stacked (in process-group order) stand for what the all_gather
returns; each member must then read back the unsharded piece its layout gives it, cut from
the single-process tensor. The reduce_scatter is simulated the same way (the rows summed
over members), against the sum of the members' gradients computed in one process.
"""

from __future__ import annotations

import pytest
import torch

from sbpflow._global import GlobalTensor
from sbpflow._layout import Layout, local_piece
from sbpflow.comm.collectives import group_slots
from sbpflow.nn.parallel._fsdp_param import (
    ShardedParam,
    shard_dim,
    sharded_layout,
    unsharded_layout,
)
from sbpflow.placement import Placement
from sbpflow.sbp import Broadcast, Split

B, S0, S1 = Broadcast(), Split(0), Split(1)


@pytest.mark.parametrize(
    ("sbp", "ndim", "want"),
    [
        ((B,), 2, 0),  # 1-D: dim 0
        ((B, S1), 2, 0),  # row-parallel weight on (data, tensor): dim 0 is free
        ((B, S0), 2, 1),  # column-parallel weight: a later axis splits dim 0
        ((B, S0), 1, None),  # its bias: every dim is split later: stays broadcast
        ((B,), 0, None),  # a 0-d parameter
        ((S0, B), 2, 0),  # an earlier axis splitting dim 0 is fine
    ],
)
def test_shard_dim_is_the_first_dim_no_later_axis_splits(sbp: tuple, ndim: int, want: int) -> None:
    """Data axis 0: the first tensor dim no axis after it splits, or None."""
    placement = Placement("cpu", [0, 1] if len(sbp) == 1 else [[0, 1], [2, 3]])
    assert shard_dim(Layout(placement, sbp), ndim) == want


def _members(placement: Placement, rank: int) -> list[int]:
    """The ranks of ``rank``'s data group (axis 0), in mesh order."""
    return list(placement.group_along(0, rank))


def _param_of(full: torch.Tensor, layout: Layout, rank: int) -> GlobalTensor:
    """This rank's shard of ``full`` laid out as ``layout``, as a parameter holds it."""
    return GlobalTensor(local_piece(full, layout, rank).clone(), layout, full.shape)


CASES = [
    # (mesh, unsharded sbp, logical shape): even, uneven and empty pieces, dim 1, 2-D meshes
    ([0, 1], (B,), (6, 3)),
    ([0, 1, 2, 3], (B,), (13, 5)),  # 4, 3, 3, 3 rows
    ([0, 1, 2, 3], (B,), (2,)),  # 1, 1, 0, 0: members with nothing
    ([3, 1, 0, 2], (B,), (7, 2)),  # mesh order is not rank order: rows in group slots
    ([[0, 1], [2, 3]], (B, S0), (6, 5)),  # column-parallel: dim 1 sharded, uneven
    ([[0, 1], [2, 3]], (B, S1), (5, 6)),  # row-parallel: dim 0, uneven
    ([[2, 3], [0, 1]], (B, B), (3,)),  # 2, 1 over a data group in reverse rank order
]


@pytest.mark.parametrize(("ranks", "sbp", "shape"), CASES)
def test_rows_gather_back_each_members_unsharded_piece(
    ranks: list, sbp: tuple, shape: tuple
) -> None:
    """copy_in on every member, rows stacked in slot order, copy_out = the unsharded piece."""
    placement = Placement("cpu", ranks)
    unsharded = Layout(placement, sbp)
    full = torch.randn(shape)
    dim = shard_dim(unsharded, len(shape))
    assert dim is not None
    layout = sharded_layout(unsharded, dim)
    assert unsharded_layout(layout) == unsharded
    for rank in placement.flat_ranks:
        members = _members(placement, rank)
        slots = group_slots(members)
        params = {
            r: ShardedParam("w", _param_of(full, layout, r), [], dim, full.dtype, r)
            for r in members
        }
        width = params[rank].padded_numel
        assert all(p.padded_numel == width for p in params.values())
        rows = torch.full((len(members), width), float("nan"))
        for k, r in enumerate(members):
            params[r].copy_in(rows[slots[k]])
        mine = params[rank]
        mine.unsharded = torch.empty(unsharded.local_shape(shape, rank))
        mine.copy_out(rows, slots)
        torch.testing.assert_close(
            mine.unsharded, local_piece(full, unsharded, rank), rtol=0, atol=0
        )


@pytest.mark.parametrize(("ranks", "sbp", "shape"), CASES)
@pytest.mark.parametrize("add", [False, True])
def test_rows_reduce_to_each_members_shard_of_the_summed_gradient(
    ranks: list, sbp: tuple, shape: tuple, add: bool
) -> None:
    """grad_into_rows on every member, rows summed over members, shard_of = this member's
    shard of the sum of the members' gradients (``add``: into rows that hold a first
    gradient already, as accumulation without sync does)."""
    placement = Placement("cpu", ranks)
    unsharded = Layout(placement, sbp)
    dim = shard_dim(unsharded, len(shape))
    assert dim is not None
    layout = sharded_layout(unsharded, dim)
    for rank in placement.flat_ranks:
        members = _members(placement, rank)
        slots = group_slots(members)
        grads = {r: torch.randn(shape) for r in members}  # each member's partial, logical
        earlier = {r: torch.randn(shape) for r in members}
        full = torch.zeros(shape)
        params = {}
        summed = None
        for r in members:
            p = ShardedParam("w", _param_of(full, layout, r), [], dim, full.dtype, r)
            params[r] = p
            rows = torch.zeros((len(members), p.padded_numel))
            if add:
                p.grad_into_rows(local_piece(earlier[r], unsharded, r), rows, slots, add=False)
            p.grad_into_rows(local_piece(grads[r], unsharded, r), rows, slots, add=add)
            summed = rows if summed is None else summed + rows
        assert summed is not None
        want_full = sum(grads.values()) + (sum(earlier.values()) if add else 0)
        got = params[rank].shard_of(summed[slots[members.index(rank)]])
        want = local_piece(want_full, layout, rank)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
