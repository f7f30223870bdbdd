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


def _view_of_detached(x: torch.Tensor) -> None:
    x[:, 1].detach().view(-1).unsqueeze(0).mul_(2)


def _foreach_into_detached(x: torch.Tensor) -> None:
    torch._foreach_mul_([x[:, 1].detach()], 2.0)


def _data_set_to_view(x: torch.Tensor) -> None:
    p = x[:, 0].detach().clone()
    p.data = x[:, 1]
    p.mul_(2)


def _foreach_sgd_on_view(x: torch.Tensor) -> None:
    p = torch.nn.Parameter(x[:, 1])
    p.grad = torch.ones_like(p)
    torch.optim.SGD([p], lr=1.0, foreach=True).step()


_WRITES: dict[str, Callable[[torch.Tensor], None]] = {
    "x[:, 1] = 5": _setitem,
    "x.diagonal().zero_()": _zero_diagonal,
    "x[1].mul_(2)": _scale_row,
    "x[:, 1:3].add_(1)": _add_to_columns,
    "x.t().add_(1)": _transposed_add,
    "x[:, 1].detach().mul_(2)": _detached_column,
    "x[1].data.mul_(2)": _data_of_row,
    # every tensor sharing a detached copy's data holds the copy too
    "x[:, 1].detach().view(-1).unsqueeze(0).mul_(2)": _view_of_detached,
    "_foreach_mul_([x[:, 1].detach()], 2)": _foreach_into_detached,
    "p.data = x[:, 1]; p.mul_(2)": _data_set_to_view,
    "SGD([Parameter(x[:, 1])], foreach=True).step()": _foreach_sgd_on_view,
}
_LIKE_DETACHED_COLUMN = list(_WRITES)[-4:]
# Writes whose view keeps its base's layout (no copy): they must reach the base.
_KEPT = {
    ("x[:, 1] = 5", "S(0)"), ("x[:, 1:3].add_(1)", "S(0)"), ("x[1].mul_(2)", "S(1)"),
    ("x[:, 1] = 5", "P"), ("x[1].mul_(2)", "P"), ("x[:, 1:3].add_(1)", "P"),
    ("x[:, 1].detach().mul_(2)", "S(0)"), ("x[:, 1].detach().mul_(2)", "P"),
    ("x[1].data.mul_(2)", "S(1)"), ("x[1].data.mul_(2)", "P"),
    *((name, s) for name in _WRITES for s in ("B",)),
    *(("x.t().add_(1)", s) for s in ("S(0)", "S(1)", "P")),
    *((name, s) for name in _LIKE_DETACHED_COLUMN for s in ("S(0)", "P")),
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


def _scale(t: torch.Tensor) -> torch.Tensor:
    t.mul_(2)
    return t.sum()


def _scale_column(x: torch.Tensor) -> torch.Tensor:
    x[:, 1].mul_(2)
    return x.sum()


def _scale_detached_column(x: torch.Tensor) -> torch.Tensor:
    x[:, 1].detach().mul_(2)
    return x.sum()


def run_compiled_writes(ranks: Any) -> list[tuple[str, str]]:
    """Worker: compiled writes (aot_eager, whole graph) as (case, 'equal' | 'differs' |
    'refused' | the unexpected error)."""
    pl = placement(ranks)
    cases: list[tuple[str, Any, Callable[[torch.Tensor], torch.Tensor], Callable[..., Any]]] = [
        ("x[:, 1].mul_(2) on S(0)", S0, lambda x: x, _scale_column),
        ("x[:, 1].mul_(2) on S(1)", S1, lambda x: x, _scale_column),
        ("x[:, 1].detach().mul_(2) on S(1)", S1, lambda x: x, _scale_detached_column),
        ("eager d = x[:, 1].detach(), compiled d.mul_(2), S(1)", S1, lambda x: x[:, 1].detach(), _scale),
    ]  # fmt: skip
    out = []
    for name, sbp, argument, function in cases:
        want = _X.clone()
        function(argument(want))
        x = make(_X, pl, sbp, 1)
        torch._dynamo.reset()
        try:
            torch.compile(function, backend="aot_eager", fullgraph=True)(argument(x))
        except Exception as error:  # dynamo wraps the ValueError raised while tracing
            refused = "to_global(sbp=sbpflow.sbp.broadcast)" in str(error)
            out.append((name, "refused" if refused else f"{type(error).__name__}: {error}"))
            continue
        out.append((name, "equal" if torch.equal(logical(x), want) else "differs"))
    return out


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_compiled_writes_through_views_reach_the_base_or_raise(
    dist_pool: DistributedPool,
) -> None:
    """Under torch.compile too: a view keeping its base's layout takes the write, and a
    copy (made in the compiled region or before it) refuses it (NOTE [view writes])."""
    results = dist_pool.run(run_compiled_writes, list(range(dist_pool.world_size)))
    assert results[1] == results[0]
    assert results[0] == [
        ("x[:, 1].mul_(2) on S(0)", "equal"),
        ("x[:, 1].mul_(2) on S(1)", "refused"),
        ("x[:, 1].detach().mul_(2) on S(1)", "refused"),
        ("eager d = x[:, 1].detach(), compiled d.mul_(2), S(1)", "refused"),
    ]
