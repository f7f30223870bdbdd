"""``gather`` and ``scatter_add`` on global tensors, against single-process torch.

Each case runs the op on plain tensors (the single-process reference, in the
same test) and on global tensors laid out as the case says, and compares the
logical output and the gradient of every floating input (gather's backward is
a ``scatter_add``, scatter_add's is a ``gather``). It also asserts the output
SBP the rule picks (a split index keeps its split, a partial source stays
partial) and that no op falls back to broadcasting every input. On 4 ranks
the short dims leave some ranks an empty piece of the index.
"""

from __future__ import annotations

import pytest
import torch

from sbpflow.sbp import Broadcast, Partial, Split
from sbpflow.testing import DistributedPool

from ._grad_cases import Case, randint, randn, run_cases
from ._ops_support import world

S0, S1, S2, B, P = Split(0), Split(1), Split(2), Broadcast(), Partial("sum")


def _gather(dim: int):
    return lambda x, i: torch.gather(x, dim, i)


def _scatter_add(dim: int):
    return lambda x, i, s: torch.scatter_add(x, dim, i, s)


def _scatter_add_in_place(x: torch.Tensor, i: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (x * 1).scatter_add_(1, i, s)


def _cases() -> list[Case]:
    x = randn(6, 5, seed=1)
    along = randint(5, 6, 3, seed=2)  # picks 3 of the 5 columns, per row
    short = randint(5, 4, 3, seed=3)  # covers only the first 4 rows of x
    down = randint(6, 3, 5, seed=4)  # gather along dim 0: 3 picks per column
    x3, along3 = randn(4, 6, 5, seed=5), randint(6, 4, 2, 5, seed=6)
    src = randn(6, 3, seed=7)
    return [
        Case("gather self and index split off dim", _gather(1), [x, along], [S0, S0], (S0,)),
        Case("gather index split on dim", _gather(1), [x, along], [B, S1], (S1,)),
        Case("gather index split, source whole", _gather(1), [x, along], [B, S0], (S0,)),
        Case("gather shorter index split off dim", _gather(1), [x, short], [B, S0], (S0,)),
        Case("gather partial source", _gather(1), [x, along], [P, B], (P,)),
        Case("gather dim 0, index split on it", _gather(0), [x, down], [B, S0], (S0,)),
        Case("gather dim 0, both split on dim 1", _gather(0), [x, down], [S1, S1], (S1,)),
        Case("gather 3-D, batch split", _gather(1), [x3, along3], [S0, S0], (S0,)),
        Case("gather 3-D, last dim split", _gather(1), [x3, along3], [S2, S2], (S2,)),
        Case("scatter_add split off dim", _scatter_add(1), [x, along, src], [S0, S0, S0], (S0,)),
        Case("scatter_add split on dim", _scatter_add(1), [x, along, src], [P, S1, S1], (P,)),
        Case("scatter_add partial", _scatter_add(1), [x, along, src], [P, B, P], (P,)),
        Case("scatter_add_ split off dim", _scatter_add_in_place, [x, along, src], [S0, S0, S0], (S0,)),
    ]  # fmt: skip


def run_gather_cases() -> list[str]:
    return run_cases(_cases(), world())


@pytest.mark.parametrize("dist_pool", [2, 4], indirect=True)
def test_gather_and_scatter_add_match_single_process(dist_pool: DistributedPool) -> None:
    """gather/scatter_add with split, partial and broadcast inputs equal torch on the logical
    tensors (values and gradients), keep the expected layout and never fall back."""
    for rank, problems in enumerate(dist_pool.run(run_gather_cases)):
        assert problems == [], f"rank {rank}: {problems}"
