"""Writes through views of global tensors, against single-process torch.

A write into a view reaches the base where the view's rule kept the layout
(the value then equals plain torch on the logical tensor, computed in the
same process); where the view holds a copy (its rule re-laid the input out,
or it fell back), the write is a ValueError on every rank naming the fix,
never a write that silently does not happen (NOTE [view writes]). The same
holds for a tensor detached from a view (``.detach()``, ``.data``), which
shares the view's data in plain torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from sbpflow.testing import DistributedPool

from ._ops_support import S0, S1, B, P, logical, make, placement, sbp_name

_X = torch.arange(12.0).reshape(3, 4)


def _setitem(x: torch.Tensor) -> None:
    x[:, 1] = 5


def _zero_diagonal(x: torch.Tensor) -> None:
    x.diagonal().zero_()


def _scale_row(x: torch.Tensor) -> None:
    x[1].mul_(2)


def _add_to_columns(x: torch.Tensor) -> None:
    x[:, 1:3].add_(1)


def _transposed_add(x: torch.Tensor) -> None:
    x.t().add_(1)


def _detached_column(x: torch.Tensor) -> None:
    x[:, 1].detach().mul_(2)


def _data_of_row(x: torch.Tensor) -> None:
    x[1].data.mul_(2)


_WRITES: dict[str, Callable[[torch.Tensor], None]] = {
    "x[:, 1] = 5": _setitem,
    "x.diagonal().zero_()": _zero_diagonal,
    "x[1].mul_(2)": _scale_row,
    "x[:, 1:3].add_(1)": _add_to_columns,
    "x.t().add_(1)": _transposed_add,
    "x[:, 1].detach().mul_(2)": _detached_column,
    "x[1].data.mul_(2)": _data_of_row,
}
# Writes whose view keeps its base's layout (no copy): they must reach the base.
_KEPT = {
    ("x[:, 1] = 5", "S(0)"), ("x[:, 1:3].add_(1)", "S(0)"), ("x[1].mul_(2)", "S(1)"),
    ("x[:, 1] = 5", "P"), ("x[1].mul_(2)", "P"), ("x[:, 1:3].add_(1)", "P"),
    ("x[:, 1].detach().mul_(2)", "S(0)"), ("x[:, 1].detach().mul_(2)", "P"),
    ("x[1].data.mul_(2)", "S(1)"), ("x[1].data.mul_(2)", "P"),
    *((name, s) for name in _WRITES for s in ("B",)),
    *((("x.t().add_(1)", s) for s in ("S(0)", "S(1)", "P"))),
}  # fmt: skip


def run_writes(ranks: Any) -> list[tuple[str, str, str]]:
    """Worker: (write, layout, 'equal' | 'differs' | the ValueError's message)."""
    pl = placement(ranks)
    out = []
    for name, write in _WRITES.items():
        want = _X.clone()
        write(want)
        for s in (B, P, S0, S1):
            x = make(_X, pl, s, 1)
            try:
                write(x)
            except ValueError as error:
                out.append((name, sbp_name(s), str(error)))
                continue
            out.append((name, sbp_name(s), "equal" if torch.equal(logical(x), want) else "differs"))
    return out


@pytest.mark.parametrize("dist_pool", [2, 4], indirect=True)
def test_writes_through_views_reach_the_base_or_raise(dist_pool: DistributedPool) -> None:
    """Where the view kept the layout, the write equals plain torch; elsewhere it is a
    ValueError naming the fix (box to broadcast); never a silently lost write."""
    results = dist_pool.run(run_writes, list(range(dist_pool.world_size)))
    for rank, per_rank in enumerate(results):
        assert per_rank == results[0], f"rank {rank} disagrees with rank 0"
        for name, sbp, got in per_rank:
            where = f"rank {rank}: {name} on {sbp}"
            assert got != "differs", f"{where}: the write was lost"
            if (name, sbp) in _KEPT:
                assert got == "equal", f"{where}: {got}"
            else:
                assert got != "equal" and "to_global(sbp=sbpflow.sbp.broadcast)" in got, where
