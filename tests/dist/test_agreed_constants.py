"""Ranks with different stored calibrations still plan alike: world rank 0's constants win.

Four gloo ranks, each reading its own ``SBPFLOW_CACHE_DIR``: rank 0 holds one
calibration file, the other ranks a file with very different constants (the
test first checks, by planning with each model directly, that the two would
choose different plans for many cases); in a second run rank 0 holds none.
Each job loads the stored constants, as a user asks for them, with
``sbpflow.boxing.load_calibration()`` under the rank's own directory. Then every
``to_global`` of the 1-D matrix (tests/dist/test_boxing_1d.py) and the 2x2 matrix
(tests/dist/test_boxing_nd.py) must run, on every rank, the plan this process
builds with rank 0's model (the defaults when rank 0 has no file), traced with
``sbpflow.boxing.trace()``, and give the single-process reference value.

A stored file is read only on request: fresh interpreters (a world of one, whether
sbpflow or the user made the default group) with a stored file plan with the
defaults until they call ``load_calibration()`` (NOTE [stored constants]).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import sbpflow
from sbpflow.boxing import _calibration_store as store
from sbpflow.boxing import cost
from sbpflow.comm import _world
from sbpflow.env import get_rank
from sbpflow.tensor import GlobalTensor
from sbpflow.testing._transport import environ
from tests.boxing_support import assemble, make_locals, reference

from ._reference import logical, placement, source_local
from .test_boxing_1d import Case, check_values, one_d_cases
from .test_boxing_nd import suite

_ROOT = Path(__file__).resolve().parents[2]
_WORLD = 4
_ONE_D_PLACEMENTS = [(0,), (0, 1), (0, 1, 2), (0, 1, 2, 3), (3, 1), (2, 0, 3, 1)]

# Rank 0's file: slower than the defaults, no per-op constants.
_RECORD_FIRST = {"version": store.FORMAT_VERSION, "alpha": 2e-4, "beta": 5e8}
# The other ranks' file: a fast link whose all_to_all and all_reduce crawl.
_RECORD_OTHERS = {
    "version": store.FORMAT_VERSION,
    "alpha": 1e-6,
    "beta": 1e11,
    "ops": {
        "all_to_all": {"alpha": 5e-2, "beta": 1e6},
        "all_reduce": {"alpha": 5e-2, "beta": 1e6},
    },
}
Steps = list[tuple[str, tuple[int, ...], str, str]]


def _steps(plan: sbpflow.boxing.BoxingPlan) -> Steps:
    return [(s.op, s.axes, s.src.describe(), s.dst.describe()) for s in plan.steps]


def _traced(t: sbpflow.boxing.Trace) -> Steps:
    return [step for plan in t.plans for step in _steps(plan)]


# -- jobs (module level, so the ranks can import them) -------------------------------


def _agree(cache_dirs: list[str]) -> list[float]:
    """Forget the installed constants and load the stored ones with this rank's directory."""
    with environ({"SBPFLOW_CACHE_DIR": cache_dirs[get_rank()]}):
        cost.reset()
        sbpflow.boxing.load_calibration("cpu")
    return cost.to_vector(cost.installed_model("gloo"))


def one_d_job(cache_dirs: list[str], cases: list[Case]) -> dict[str, Any]:
    rank = get_rank()
    try:
        installed = _agree(cache_dirs)
        results = []
        for src_ranks, dst_ranks, shape, src, dst, seed in cases:
            value = logical(shape, seed)
            local = source_local(value, src_ranks, src, rank, seed)
            x = local.to_global(placement(src_ranks), src)
            with sbpflow.boxing.trace() as t:
                y = x.to_global(placement(dst_ranks), dst)
            results.append((y.to_local().detach(), _traced(t), tuple(y.shape), str(y.sbp[0])))
        return {"installed": installed, "results": results}
    finally:
        cost.reset()  # back to the session's agreed model: its cache dir is empty


def two_d_job(cache_dirs: list[str], name: str, indices: list[int]) -> dict[str, Any]:
    rank = get_rank()
    try:
        installed = _agree(cache_dirs)
        results = []
        cases = suite(name)
        for shape, src, dst in (cases[i] for i in indices):
            pieces = make_locals(reference(shape), src)
            x = GlobalTensor(pieces.get(rank, torch.empty(0, 0)), src, shape)
            with sbpflow.boxing.trace() as t:
                y = x.to_global(dst.placement, dst.sbp, check_meta=False)
            results.append((y.to_local().detach(), _traced(t)))
        return {"installed": installed, "results": results}
    finally:
        cost.reset()


# -- the test ---------------------------------------------------------------------------


def _cache_dirs(tmp_path: Path, first: dict[str, Any] | None) -> list[str]:
    """One directory per rank: ``first``'s file for rank 0 (or none), the others' file elsewhere."""
    dirs = []
    for rank in range(_WORLD):
        path = tmp_path / f"rank{rank}"
        path.mkdir()
        record = first if rank == 0 else _RECORD_OTHERS
        if record is not None:
            with environ({"SBPFLOW_CACHE_DIR": str(path)}):
                store.save(record, store.path_for("gloo", _WORLD))
        dirs.append(str(path))
    return dirs


def _differing(
    cases: list[tuple[Any, Any, Any]], one: cost.CostModel, other: cost.CostModel
) -> list[int]:
    """Indices of the cases whose plan under ``one`` is not their plan under ``other``."""
    return [
        i
        for i, (s, a, b) in enumerate(cases)
        if _steps(sbpflow.boxing.plan(s, torch.float32, a, b, cost_model=one))
        != _steps(sbpflow.boxing.plan(s, torch.float32, a, b, cost_model=other))
    ]


@pytest.mark.parametrize("rank0_has_a_file", [True, False], ids=["rank0-file", "rank0-none"])
def test_ranks_with_different_files_run_rank0s_plans(
    pool: Any, tmp_path: Path, rank0_has_a_file: bool
) -> None:
    """Reference: plans this process builds with rank 0's model; values from plain torch."""
    first = _RECORD_FIRST if rank0_has_a_file else None
    agreed = cost.model_from_record(first) if first else cost.CostModel.default("gloo")
    others = cost.model_from_record(_RECORD_OTHERS)
    all_one_d = one_d_cases(_ONE_D_PLACEMENTS)
    all_one_d_layouts = [
        (shape, (placement(sr), src), (placement(dr), dst))
        for sr, dr, shape, src, dst, _ in all_one_d
    ]
    all_two_d = suite("2x2")
    # The claim that makes this test worth running: the other ranks' file, on its own,
    # chooses different plans than rank 0's model for many of these cases. Only those
    # cases run on the ranks: in the others, a rank that used its own file would run the
    # same plan, and the boxing tests check every case's values already.
    one_d_differing = _differing(all_one_d_layouts, agreed, others)
    two_d_differing = _differing(all_two_d, agreed, others)
    assert len(one_d_differing) >= 20
    assert len(two_d_differing) >= 100
    one_d = [all_one_d[i] for i in one_d_differing]
    one_d_layouts = [all_one_d_layouts[i] for i in one_d_differing]
    two_d = [all_two_d[i] for i in two_d_differing]

    dirs = _cache_dirs(tmp_path, first)
    ranks = pool(_WORLD)
    expected_vector = cost.to_vector(agreed if first else None)

    per_rank = ranks.run(one_d_job, dirs, one_d)
    problems = []
    for rank, got in enumerate(per_rank):
        assert got["installed"] == expected_vector, f"rank {rank} installed {got['installed']}"
    for i, (shape, src, dst) in enumerate(one_d_layouts):
        want = _steps(sbpflow.boxing.plan(shape, torch.float32, src, dst, cost_model=agreed))
        if src == dst:
            want = []  # to_global to the same layout runs no plan
        for rank, got in enumerate(per_rank):
            if got["results"][i][1] != want:
                problems.append(
                    f"1-D case {i}: rank {rank} ran {got['results'][i][1]}, want {want}"
                )
    problems += check_values(one_d, [got["results"] for got in per_rank])

    per_rank = ranks.run(two_d_job, dirs, "2x2", two_d_differing)
    for rank, got in enumerate(per_rank):
        assert got["installed"] == expected_vector, f"rank {rank} installed {got['installed']}"
    for i, (shape, src, dst) in enumerate(two_d):
        label = f"{src.describe()} -> {dst.describe()} shape {list(shape)}"
        want = _steps(sbpflow.boxing.plan(shape, torch.float32, src, dst, cost_model=agreed))
        if src == dst:
            want = []
        for rank, got in enumerate(per_rank):
            if got["results"][i][1] != want:
                problems.append(f"{label}: rank {rank} ran {got['results'][i][1]}, want {want}")
        pieces = {r: per_rank[r]["results"][i][0] for r in dst.placement.flat_ranks}
        if not torch.equal(assemble(shape, dst, pieces), reference(shape)):
            problems.append(f"{label}: wrong values")
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems[:30])


# -- a stored file, in fresh interpreters ---------------------------------------------

_FRESH_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch.distributed as dist
    import sbpflow
    from sbpflow.boxing import cost

    if sys.argv[1] == "user":
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    sbpflow.env.ensure_initialized()
    x = sbpflow.ones(4, placement=sbpflow.placement("cpu", [0]), sbp=sbpflow.sbp.broadcast)
    before = cost.to_vector(cost.installed_model("gloo"))
    loaded = sbpflow.boxing.load_calibration("cpu")
    print(json.dumps({
        "before": before,
        "loaded": loaded is not None,
        "installed": cost.to_vector(cost.installed_model("gloo")),
    }))
    """
)


@pytest.mark.parametrize("who_makes_the_group", ["sbpflow", "user"])
def test_a_stored_file_changes_no_plan_until_loaded(
    tmp_path: Path, who_makes_the_group: str
) -> None:
    """The reference is the model the stored record describes, built in this process."""
    with environ({"SBPFLOW_CACHE_DIR": str(tmp_path)}):
        store.save(_RECORD_OTHERS, store.path_for("gloo", 1))
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(PYTHONPATH=str(_ROOT), SBPFLOW_CACHE_DIR=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", _FRESH_SCRIPT, who_makes_the_group],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["before"] == cost.to_vector(None)  # the defaults: the file was not read
    assert result["loaded"] is True
    assert result["installed"] == cost.to_vector(cost.model_from_record(_RECORD_OTHERS))


def _pool_state() -> tuple[bool, list[float]]:
    return _world.is_world_ready(), cost.to_vector(cost.installed_model("gloo"))


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_pool_ranks_agreed_when_they_joined_the_world(dist_pool: Any) -> None:
    """Joining the world installs nothing: every rank runs the defaults."""
    assert dist_pool.run(_pool_state) == [(True, [0.0] * cost.VECTOR_SIZE)] * 2
