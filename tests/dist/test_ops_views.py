"""View and shape ops on global tensors, forward and backward.

Each case is compared with a single-process reference computed in the same
test on plain tensors (see ``_grad_cases``); the tests also assert that the
rules keep splits where NOTE [view rules] says they can and that no op falls
back to broadcasting every input.
"""

from __future__ import annotations

import pytest
import torch

from sbpflow.sbp import Broadcast, Partial, Split
from sbpflow.testing import DistributedPool

from ._grad_cases import Case, randint, randn, run_cases
from ._ops_support import placement

S0, S1, S2, B, P = Split(0), Split(1), Split(2), Broadcast(), Partial("sum")


def _one_axis_cases() -> list[Case]:
    x = randn(4, 6, 5, seed=1)
    odd = randn(5, 6, 3, seed=2)
    index = torch.tensor([0, 2, 2, 5])
    return [
        # view / reshape
        Case("view merge trailing", lambda t: t.view(4, 30), [x], [S0], (S0,)),
        Case("reshape merge leading", lambda t: t.reshape(24, 5), [x], [S0], (S0,)),
        Case("view split dim 1", lambda t: t.view(4, 2, 3, 5), [x], [S1], (S1,)),
        Case("view keeps odd batch", lambda t: t.reshape(5, 18), [odd], [S0], (S0,)),
        Case("view uneven merge gathers", lambda t: t.reshape(15, 6), [odd], [S0]),
        Case("flatten split inner dim", lambda t: t.flatten(1), [x], [S2]),
        Case("unflatten", lambda t: t.unflatten(1, (3, 2)), [x], [S0], (S0,)),
        Case("view partial", lambda t: t.view(24, 5), [x], [P], (P,)),
        Case(
            "reshape non-contiguous", lambda t: t.transpose(0, 1).reshape(6, 20), [x], [S1], (S0,)
        ),
        # dims moved
        Case("transpose", lambda t: t.transpose(0, 2), [x], [S0], (S2,)),
        Case("permute", lambda t: t.permute(2, 0, 1), [x], [S1], (S2,)),
        Case("t", lambda t: t[0].t(), [x], [S1], (S1,)),
        Case("movedim contiguous", lambda t: t.movedim(0, -1).contiguous(), [x], [S0], (S2,)),
        Case("unsqueeze", lambda t: t.unsqueeze(1), [x], [S1], (S2,)),
        Case("squeeze all", lambda t: t[:, :1].squeeze(), [x], [S0], (S0,)),
        # a dim that is 1 long locally (2 over 2 ranks) must not be squeezed
        Case(
            "squeeze keeps short split",
            lambda t: t.squeeze(1),
            [randn(2, 1, 5, seed=3)],
            [S0],
            (S0,),
        ),
        Case("squeeze dim", lambda t: t[:, :, :1].squeeze(-1), [x], [S1], (S1,)),
        Case("expand", lambda t: t[:, :1].expand(4, 6, 5), [x], [S0], (S0,)),
        Case("expand new dims", lambda t: t[0].expand(3, 6, 5), [x], [S1], (S1,)),
        # cutting along a dim
        Case("slice other dim", lambda t: t[:, 1:5:2], [x], [S0], (S0,)),
        Case("slice split dim", lambda t: t[1:3], [x], [S0]),
        Case("narrow", lambda t: t.narrow(2, 1, 3), [x], [S1], (S1,)),
        Case("select", lambda t: t[:, 2], [x], [S2], (S1,)),
        Case("select split dim", lambda t: t[3], [x], [S0]),
        Case("index_select other dim", lambda t: t.index_select(1, index), [x], [S0], (S0,)),
        Case(
            "index_select split index",
            lambda t, i: t.index_select(1, i),
            [x, index],
            [B, S0],
            (S1,),
        ),
        # many <-> one
        Case("cat", lambda t: torch.cat([t, t * 2], 1), [x], [S0], (S0,)),
        Case("cat two globals", lambda a, b: torch.cat([a, b], 2), [x, x + 1], [S1, S1], (S1,)),
        # a fresh key/value cache: cat skips the empty 1-D piece, the split or sum is kept
        Case(
            "cat after an empty piece",
            lambda t: torch.cat([torch.tensor([]), t], 1),
            [x],
            [S0],
            (S0,),
        ),
        Case(
            "cat partial after an empty piece",
            lambda t: torch.cat([torch.tensor([]), t], 2),
            [x],
            [P],
            (P,),
        ),
        Case("stack", lambda t: torch.stack([t, -t], 1), [x], [S2], (Split(3),)),
        Case("split", lambda t: torch.stack(t.split(2, 1), 0), [x], [S0], (S1,)),
        Case("split_with_sizes", lambda t: t.split([1, 5], 1)[1], [x], [S2], (S2,)),
        Case("chunk", lambda t: t.chunk(3, 2)[1], [x], [S0], (S0,)),
        Case("unbind", lambda t: t.unbind(1)[4], [x], [S2], (S1,)),
        Case("index by ints", lambda t: t[:, randint(6, 3, seed=3)], [x], [S0], (S0,)),
        Case("index split index", lambda t, i: t[i], [x, randint(4, 2, 3, seed=4)], [B, S1], (S1,)),
        Case(
            "index two tensors",
            lambda t: t[randint(4, 3, seed=5), :, randint(5, 3, seed=6)],
            [x],
            [S1],
            (S1,),
        ),
    ]


def _mesh_cases() -> list[Case]:
    x = randn(8, 6, 5, seed=4)
    short = randn(6, 2, seed=5)
    return [
        Case("view keeps both splits", lambda t: t.view(8, 30), [x], [(S0, S1)], (S0, S1)),
        Case("view nested splits line up", lambda t: t.view(4, 2, 30), [x], [(S0, S0)]),
        # 6 rows over 2x2: (2, 1, 2, 1) rows, viewed as 12: pieces do not line up
        Case("view nested splits gather", lambda t: t.reshape(12), [short], [(S0, S0)]),
        Case("transpose", lambda t: t.transpose(0, 2), [x], [(S0, S2)], (S2, S0)),
        Case(
            "slice and cat", lambda t: torch.cat([t[:, :2], t[:, 3:]], 1), [x], [(S0, S2)], (S0, S2)
        ),
        Case(
            "select and unsqueeze", lambda t: t.select(1, 4).unsqueeze(0), [x], [(S2, P)], (S2, P)
        ),
        Case("expand partial", lambda t: t[:, :1].expand(8, 6, 5), [x], [(P, S0)], (P, S0)),
        Case(
            "cat after an empty piece",
            lambda t: torch.cat([torch.tensor([]), t], -2),
            [x],
            [(S0, S2)],
            (S0, S2),
        ),
    ]


# -- jobs (module level, so the ranks can import them) ---------------------------------


def _one_axis_job() -> list[str]:
    return run_cases(_one_axis_cases(), placement([0, 1]))


def _mesh_job() -> list[str]:
    return run_cases(_mesh_cases(), placement([[0, 1], [2, 3]]))


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_views_on_two_ranks(dist_pool: DistributedPool) -> None:
    """Every view case matches the single-process reference, forward and backward."""
    problems = dist_pool.run(_one_axis_job)
    assert problems[0] == [], "\n".join(problems[0])
    assert problems[1] == problems[0]


@pytest.mark.parametrize("dist_pool", [4], indirect=True)
def test_views_on_2x2_mesh(dist_pool: DistributedPool) -> None:
    """Splits on both mesh axes (including nested splits of one dim) match the reference."""
    problems = dist_pool.run(_mesh_job)
    assert problems[0] == [], "\n".join(problems[0])
    assert all(p == problems[0] for p in problems)
