"""Reading global tensors: repr, item, tolist, numpy and format show the LOGICAL value.

Compared with the same calls on the plain logical tensor in the same process,
on every rank, for split, broadcast and partial layouts, and on ranks outside
the tensor's placement (they receive the value too).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import sbpflow
from sbpflow.testing import DistributedPool

from ._ops_support import S0, S1, B, P, make, placement, world


def _expected_repr(value: torch.Tensor, pl: sbpflow.Placement, sbp: str, extra: str = "") -> str:
    return repr(value)[:-1] + f", placement={pl!r}, sbp={sbp}{extra})"


def read_values(ranks: list[int]) -> list[str]:
    """Worker: every reading call against the plain tensor; returns mismatches."""
    pl = placement(ranks)
    value = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 4
    bad = []
    for sbp in (S0, S1, B, P):
        x = make(value, pl, sbp, 1)
        checks = {
            "repr": (repr(x), _expected_repr(value, pl, str(sbp))),
            "str": (str(x), _expected_repr(value, pl, str(sbp))),
            "format": (f"{x}", _expected_repr(value, pl, str(sbp))),
            "tolist": (x.tolist(), value.tolist()),
            "numpy": (x.numpy().tolist(), value.numpy().tolist()),
            "sum.item": (x.sum().item(), value.sum().item()),
            "float": (float(x.sum()), float(value.sum())),
            "f-string": (f"{x.mean():>7f}", f"{value.mean().item():>7f}"),
            "bool": (bool(x.sum() > 10), bool(value.sum() > 10)),
        }
        bad += [
            f"{name} {sbp}: {got!r} != {want!r}"
            for name, (got, want) in checks.items()
            if got != want
        ]
    scalar = make(torch.tensor(2.5), pl, P, 2)
    if scalar.item() != 2.5:
        bad.append(f"P scalar item {scalar.item()}")
    leaf = make(value, pl, S0, 3).requires_grad_()
    if repr(leaf) != _expected_repr(value, pl, "S(0)", ", requires_grad=True"):
        bad.append(f"leaf repr {leaf!r}")
    if not repr(leaf * 2).endswith(f"sbp={(leaf * 2).sbp[0]}, grad_fn=<MulBackward0>)"):
        bad.append(f"grad_fn repr {leaf * 2!r}")
    try:
        leaf.numpy()
        bad.append("numpy() on a tensor requiring grad did not raise")
    except RuntimeError:
        pass
    try:
        f"{x:>7f}"
        bad.append("a format spec on a non-scalar did not raise")
    except TypeError:
        pass
    return bad


def read_outside(ranks: list[int]) -> dict[str, Any]:
    """Worker: a tensor on some ranks only; every rank reads it."""
    pl = placement(ranks)
    value = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    x = make(value, pl, S0)
    loss = make(torch.tensor(1.25), pl, P)
    return {"tolist": x.tolist(), "item": loss.item(), "repr": repr(x), "format": f"{loss:.3f}"}


@pytest.mark.parametrize("dist_pool", [2, 4], indirect=True)
def test_reading_shows_the_logical_value(dist_pool: DistributedPool) -> None:
    for rank, bad in enumerate(dist_pool.run(read_values, list(range(dist_pool.world_size)))):
        assert bad == [], f"rank {rank}: {bad}"


@pytest.mark.parametrize("dist_pool", [4], indirect=True)
def test_ranks_outside_the_placement_read_it_too(dist_pool: DistributedPool) -> None:
    results = dist_pool.run(read_outside, [2, 1])
    assert results[0]["tolist"] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert results[0]["item"] == 1.25 and results[0]["format"] == "1.250"
    assert "placement=placement('cpu', [2, 1]), sbp=S(0))" in results[0]["repr"]
    assert all(r == results[0] for r in results)


def test_world_of_one_reads_without_collectives() -> None:
    """In a world of one (no launcher) the value is local: no collective runs."""
    x = torch.arange(4.0).to_global(world(), B)
    with sbpflow.boxing.trace() as t:
        assert x.tolist() == [0.0, 1.0, 2.0, 3.0] and x.sum().item() == 6.0
    assert t.collectives() == {}
