"""Pure parts of calibration: the alpha-beta fit, the stored file, and the in-memory cost model.

The reference for the fit is the cost model itself: samples generated from
known constants with cost.py's formulas must give those constants back. The
planner never reads stored files on its own (NOTE [agreed constants] in
cost.py): in a single process ``load_calibration`` installs them on request.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import sbpflow
from sbpflow import sbp
from sbpflow.boxing import _calibration_store as store
from sbpflow.boxing import cost
from sbpflow.boxing.calibrate import Calibration, Sample, _fit, load_calibration


@pytest.fixture(autouse=True)
def _clean_cost_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    monkeypatch.setenv("SBPFLOW_CACHE_DIR", str(tmp_path))
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    cost.reset()
    yield
    cost.reset()


def _samples(
    alpha: float, beta: float, ops: tuple[str, ...] = ("all_reduce", "all_gather")
) -> list[Sample]:
    model = cost.CostModel(cost.LinkCost(alpha, beta))
    return [
        Sample(op, p, size, getattr(model, op)(p, size))
        for op in ops
        for p in (2, 4)
        for size in (4096, 1 << 20, 64 << 20)
    ]


_FALLBACK = cost.LinkCost(60e-6, 1.5e9)


@pytest.mark.parametrize("alpha, beta", [(60e-6, 1.5e9), (1e-3, 2e8), (5e-6, 100e9)])
def test_fit_recovers_the_constants_it_was_generated_with(alpha: float, beta: float) -> None:
    samples = _samples(alpha, beta, ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"))
    link = _fit(samples, _FALLBACK)
    assert link.alpha == pytest.approx(alpha, rel=1e-6)
    assert link.beta == pytest.approx(beta, rel=1e-6)


def test_fit_keeps_both_constants_positive() -> None:
    # Times that fall with size (noise) say nothing about bandwidth: the fallback's is kept.
    noisy = [Sample("all_reduce", 2, 4096, 2e-3), Sample("all_reduce", 2, 1 << 20, 1e-3)]
    link = _fit(noisy, _FALLBACK)
    assert link.beta == _FALLBACK.beta and link.alpha > 0
    # Latency too small to see (fits negative): floored, bandwidth still fitted.
    fake = cost.CostModel(cost.LinkCost(-1e-6, 1e9))  # what the samples below follow
    samples = [Sample("all_gather", 4, n, fake.all_gather(4, n)) for n in (4096, 1 << 20, 1 << 26)]
    link = _fit(samples, _FALLBACK)
    assert 0 < link.alpha <= 1e-6 and 1e9 <= link.beta <= 3e9  # between the small and large sizes
    # One size only: latency and bandwidth cannot be told apart; still positive.
    link = _fit([Sample("all_gather", 4, 1 << 20, 1e-3)], _FALLBACK)
    assert link.alpha > 0 and link.beta > 0


_RECORD = {
    "version": store.FORMAT_VERSION,
    "world_size": 4,
    "alpha": 2e-3,
    "beta": 1e8,
    "ops": {"all_gather": {"alpha": 3e-3, "beta": 5e7}},
}


def test_the_planner_never_reads_the_stored_file(tmp_path: Path) -> None:
    default_cost = _s0_to_b_cost()
    store.save(_RECORD, store.path_for("gloo", 1))
    store.save(_RECORD, store.path_for("gloo", 4))
    cost.reset()
    assert cost.model_for("cpu") == cost.CostModel.default("gloo")
    assert _s0_to_b_cost() == default_cost


def test_store_round_trip_and_load_calibration_installs_it(tmp_path: Path) -> None:
    default_cost = _s0_to_b_cost()
    path = store.path_for("gloo", 4)
    assert path.parent == tmp_path and path.name.startswith("calibration-")
    store.save(_RECORD, path)
    assert store.load("gloo", 4) is not None
    result = load_calibration("cpu", world_size=4)
    assert result is not None and result.path == str(path) and result.world_size == 4
    model = cost.model_for("cpu")
    assert model == result.model
    assert model.link == cost.LinkCost(2e-3, 1e8)
    assert model.link_for("all_gather") == cost.LinkCost(3e-3, 5e7)
    assert model.link_for("all_reduce") == model.link
    assert _s0_to_b_cost() != default_cost
    assert cost.model_for("cuda") == cost.CostModel.default("nccl")  # other backend untouched


def test_load_calibration_takes_the_exact_world_size_or_the_newest_file() -> None:
    store.save(dict(_RECORD, alpha=1e-4, beta=1e9), store.path_for("gloo", 4))
    assert store.load("gloo", 2) is None  # exact world size only
    assert load_calibration("cpu", world_size=2) is None
    assert cost.model_for("cpu") == cost.CostModel.default("gloo")  # nothing installed
    result = load_calibration()  # newest of this machine, any world size
    assert result is not None and result.link == cost.LinkCost(1e-4, 1e9)
    assert cost.model_for("cpu").link == cost.LinkCost(1e-4, 1e9)


def test_load_calibration_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="device_type must be 'cpu' or 'cuda', got 'tpu'"):
        load_calibration("tpu")
    with pytest.raises(ValueError, match="world_size must be a positive int or None, got 0"):
        load_calibration("cpu", world_size=0)
    assert cost.installed_model("gloo") is None


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        json.dumps({"version": store.FORMAT_VERSION, "alpha": -1.0, "beta": 1e9}),
        json.dumps({"version": store.FORMAT_VERSION, "alpha": float("inf"), "beta": 1e9}),
        json.dumps({"version": store.FORMAT_VERSION, "alpha": 1e-4, "beta": float("nan")}),
        json.dumps({"version": store.FORMAT_VERSION, "alpha": 1e-4}),
        json.dumps({"version": 999, "alpha": 1e-4, "beta": 1e9}),
        json.dumps({"version": store.FORMAT_VERSION, "alpha": 1e-4, "beta": 1e9, "ops": {"x": 1}}),
    ],
)
def test_bad_files_are_ignored(content: str) -> None:
    path = store.path_for("gloo", 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    assert store.load("gloo", 1) is None
    assert store.load_newest("gloo") is None
    assert load_calibration() is None
    assert cost.model_for("cpu") == cost.CostModel.default("gloo")


def test_set_model_installs_checks_and_reprices_plans() -> None:
    before = cost.generation()
    installed = cost.CostModel(cost.LinkCost(5e-3, 1e7))
    cost.set_model("gloo", installed)
    assert cost.generation() > before
    assert cost.model_for("cpu") is installed and cost.installed_model("gloo") is installed
    assert _s0_to_b_cost() == pytest.approx(installed.all_gather(2, 64 * 64 * 4))
    cost.reset("gloo")
    assert cost.installed_model("gloo") is None
    with pytest.raises(ValueError, match="backend must be 'gloo' or 'nccl', got 'mpi'"):
        cost.set_model("mpi", installed)
    with pytest.raises(
        TypeError, match=r"model must be a sbpflow\.boxing\.cost\.CostModel, got float"
    ):
        cost.set_model("gloo", 1.0)  # type: ignore[arg-type]
    odd = cost.CostModel(installed.link, (("broadcast", installed.link),))
    with pytest.raises(ValueError, match=r"per-op constants for \['broadcast'\]"):
        cost.set_model("gloo", odd)


def test_the_shared_vector_round_trips_every_constant_bit_for_bit() -> None:
    """What rank 0 broadcasts in load_calibration decodes to the very model it encoded."""
    per_op = tuple(
        (op, cost.LinkCost(1e-6 * (i + 1) / 3, 1e9 / (i + 7)))
        for i, op in enumerate(cost.PER_OP_NAMES)
    )
    for model in (
        cost.CostModel(cost.LinkCost(1 / 3 * 1e-4, 2e9 / 7), per_op),
        cost.CostModel(cost.LinkCost(1e-4, 2e9), per_op[1:2]),
        cost.CostModel.default("nccl"),
    ):
        vector = cost.to_vector(model)
        assert len(vector) == cost.VECTOR_SIZE
        assert cost.from_vector(vector) == model
    assert cost.to_vector(None) == [0.0] * cost.VECTOR_SIZE
    assert cost.from_vector([0.0] * cost.VECTOR_SIZE) is None
    # Ops outside the vector's fixed list are dropped from a stored record, never sent.
    record = dict(_RECORD, ops={"gossip": {"alpha": 1.0, "beta": 1.0}})
    assert cost.model_from_record(record).per_op == ()


def test_cache_dir_defaults_to_user_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SBPFLOW_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert store.cache_dir() == tmp_path / "xdg" / "sbpflow"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert store.cache_dir() == Path(os.path.expanduser("~")) / ".cache" / "sbpflow"


def test_calibration_prints_its_constants() -> None:
    result = Calibration("gloo", 4, cost.LinkCost(1e-4, 2e9), measured=False)
    assert "alpha 100.0 us/message, beta 2.00 GB/s" in str(result)
    assert "not measured" in str(result)
    assert result.model == cost.CostModel(cost.LinkCost(1e-4, 2e9))


def test_calibrate_is_exported() -> None:
    assert "calibrate" in sbpflow.boxing.__all__
    assert callable(sbpflow.boxing.calibrate)


def _s0_to_b_cost() -> float:
    placement = sbpflow.placement("cpu", [0, 1])
    plan = sbpflow.boxing.plan(
        (64, 64), torch.float32, (placement, sbp.split(0)), (placement, sbp.broadcast)
    )
    return plan.cost
