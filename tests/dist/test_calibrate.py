"""``sbpflow.boxing.calibrate`` on real gloo ranks: constants agree, are stored, and price plans.

No timing is asserted (CI machines are noisy); only that the measured
constants are positive, bit-identical on every rank, stored, shared again from
rank 0's stored file as a new job's world setup does, and used by the
planner. Every job puts the cost model and the cache directory back as it
found them, since the rank pools are shared by the whole session.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import sbpflow
from sbpflow import sbp
from sbpflow.boxing import cost
from sbpflow.testing import DistributedPool
from sbpflow.testing._transport import environ

_SIZES = (4096, 65536, 262144)  # small: the test checks plumbing, not the machine
_SHAPE = (256, 128)


def _constants(model: cost.CostModel) -> list[tuple[str, float, float]]:
    return [("link", model.link.alpha, model.link.beta)] + [
        (op, link.alpha, link.beta) for op, link in model.per_op
    ]


def _plan_summary() -> tuple[list[str], float]:
    placement = sbpflow.placement("cpu", [0, 1])
    plan = sbpflow.boxing.plan(
        _SHAPE, torch.float32, (placement, sbp.split(0)), (placement, sbp.broadcast)
    )
    return [step.op for step in plan.steps], plan.cost


@contextlib.contextmanager
def _cache_dir(path: str) -> Iterator[None]:
    """Calibrations read and written under ``path``; the cost model is reset on the way out."""
    try:
        with environ({"SBPFLOW_CACHE_DIR": path}):
            yield
    finally:
        cost.reset()


def _world_on_cpu() -> sbpflow.placement:
    """Every rank on gloo: the default placement is CUDA where it is available, and NCCL
    refuses two ranks on one GPU."""
    return sbpflow.placement("cpu", list(range(sbpflow.env.get_world_size())))


def _calibrate_job(cache_dir: str) -> dict[str, Any]:
    with _cache_dir(cache_dir):
        cost.reset()
        default_plan = _plan_summary()
        result = sbpflow.boxing.calibrate(_world_on_cpu(), sizes=_SIZES, repeats=2, per_axis=True)
        installed = cost.model_for("cpu")
        calibrated_plan = _plan_summary()
        cost.reset()  # forget the installed model, as a new job starts
        assert cost.model_for("cpu") == cost.CostModel.default("gloo")  # files are not read here
        sbpflow.boxing.load_calibration("cpu")  # asked for: rank 0 reads, every rank installs
        loaded = cost.model_for("cpu")
        loaded_plan = _plan_summary()
        return {
            "measured": result.measured,
            "backend": result.backend,
            "world_size": result.world_size,
            "alpha": result.alpha,
            "beta": result.beta,
            "ops": {op: (link.alpha, link.beta) for op, link in result.ops.items()},
            "axes": {axis: (link.alpha, link.beta) for axis, link in result.axes.items()},
            "num_samples": len(result.samples),
            "path": result.path,
            "installed": _constants(installed),
            "expected": _constants(result.model),
            "loaded": _constants(loaded),
            "default_plan": default_plan,
            "calibrated_plan": calibrated_plan,
            "loaded_plan": loaded_plan,
            "text": str(result),
        }


def _calibrate_without_saving_job(cache_dir: str) -> tuple[bool, list[str]]:
    with _cache_dir(cache_dir):
        result = sbpflow.boxing.calibrate(_world_on_cpu(), sizes=(4096,), repeats=1, save=False)
        return result.path is None, sorted(os.listdir(cache_dir)) if os.path.isdir(
            cache_dir
        ) else []


def _bad_placement_job() -> str:
    try:
        sbpflow.boxing.calibrate(sbpflow.placement("cpu", [0, 5]))
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_calibration_agrees_is_stored_and_prices_plans(
    dist_pool: DistributedPool, tmp_path: Path
) -> None:
    """Two ranks calibrate gloo; the reference is the plan this process builds with the same constants."""
    results = dist_pool.run(_calibrate_job, str(tmp_path))
    first = results[0]
    assert first["measured"] and first["backend"] == "gloo" and first["world_size"] == 2
    assert first["alpha"] > 0 and first["beta"] > 0
    assert set(first["ops"]) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}
    assert all(a > 0 and b > 0 for a, b in first["ops"].values())
    assert first["axes"] == {0: (first["alpha"], first["beta"])}  # a 1-D mesh: the whole fit
    assert first["num_samples"] == 4 * len(_SIZES)
    for other in results[1:]:  # bit-identical on every rank, so plans agree
        for key in (
            "alpha",
            "beta",
            "ops",
            "installed",
            "loaded",
            "calibrated_plan",
            "loaded_plan",
        ):
            assert other[key] == first[key], key

    # Installed, and loaded from rank 0's stored file on request after the in-memory model
    # is forgotten.
    assert first["installed"] == first["expected"]
    assert first["loaded"] == first["expected"]
    path = Path(first["path"])
    assert path.parent == tmp_path and path.name.endswith("-gloo-2.json")
    record = json.loads(path.read_text())
    assert (record["alpha"], record["beta"]) == (first["alpha"], first["beta"])
    assert len(record["samples"]) == first["num_samples"]

    # Plans use it: the same plan as this process makes with the calibrated model installed.
    ops = {op: cost.LinkCost(a, b) for op, (a, b) in first["ops"].items()}
    model = cost.CostModel(cost.LinkCost(first["alpha"], first["beta"]), tuple(sorted(ops.items())))
    try:
        cost.set_model("gloo", model)
        assert first["calibrated_plan"] == _plan_summary()
        assert first["loaded_plan"] == first["calibrated_plan"]
    finally:
        cost.reset()
    assert first["calibrated_plan"][1] != first["default_plan"][1]
    assert "alpha" in first["text"] and "stored in" in first["text"]


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_save_false_writes_nothing(dist_pool: DistributedPool, tmp_path: Path) -> None:
    results = dist_pool.run(_calibrate_without_saving_job, str(tmp_path / "cache"))
    assert results == [(True, [])] * 2


@pytest.mark.parametrize("dist_pool", [1], indirect=True)
def test_world_of_one_measures_nothing(dist_pool: DistributedPool, tmp_path: Path) -> None:
    (result,) = dist_pool.run(_calibrate_without_saving_job, str(tmp_path))
    assert result == (True, [])


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_placement_outside_the_world_is_an_error_on_every_rank(dist_pool: DistributedPool) -> None:
    messages = dist_pool.run(_bad_placement_job)
    for message in messages:
        assert "names ranks [5]" in message and "the world has 2 ranks" in message
