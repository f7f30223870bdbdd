"""The planner is pure: it builds plans with no process group and never imports communication.

Two checks. A fresh interpreter (so no test before this one can have set up
a world) builds 2-D, 3-D and cross-placement plans, with process-group
creation instrumented, and must end with ``torch.distributed`` still
uninitialised, no group made and no world-ready callback run; a stored
calibration with extreme constants sits in its cache dir, and the plans must
be the ones the default constants give (the planner reads no files). And the
imports of every planning module under sbpflow/boxing/, read with ``ast``
(module level and inside functions), name neither ``sbpflow.comm`` nor
``torch.distributed``.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
_BOXING = _ROOT / "sbpflow" / "boxing"
# The modules that run plans or measure the machine, and so may communicate.
_COMMUNICATING = {"executor.py", "calibrate.py", "_redistribute.py"}
_FORBIDDEN = ("sbpflow.comm", "torch.distributed")

_PLANNING_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    import torch.distributed as dist

    made = []
    for name in ("init_process_group", "new_group", "new_subgroups"):
        real = getattr(dist, name)
        def record(*args, _name=name, _real=real, **kwargs):
            made.append(_name)
            return _real(*args, **kwargs)
        setattr(dist, name, record)

    import sbpflow
    from sbpflow.boxing import _calibration_store as store, cost
    from sbpflow.comm import _world
    from sbpflow.sbp import broadcast as B, partial_sum as P, split

    # Extreme stored constants on this machine, for every world size a job might have.
    record = {"version": store.FORMAT_VERSION, "alpha": 1.0, "beta": 1.0,
              "ops": {"all_to_all": {"alpha": 1e-9, "beta": 1e15}}}
    for world_size in (1, 2, 4, 8):
        store.save(record, store.path_for("gloo", world_size))

    mesh2 = sbpflow.placement("cpu", [[0, 1], [2, 3]])
    mesh3 = sbpflow.placement("cpu", [[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
    flat = sbpflow.placement("cpu", [0, 1, 2, 3])
    other = sbpflow.placement("cpu", [[4, 5], [6, 7]])
    cases = [
        ((8, 6), (mesh2, (split(0), split(1))), (mesh2, (split(1), split(0)))),
        ((8, 6), (mesh2, (P, split(0))), (mesh2, (B, B))),
        ((8, 6, 4), (mesh3, (split(0), B, P)), (mesh3, (split(2), split(1), split(0)))),
        ((7, 5), (mesh2, (split(0), split(1))), (flat, split(1))),
        ((7, 5), (flat, P), (other, (split(0), B))),
    ]
    default = cost.CostModel.default("gloo")
    out = []
    for shape, src, dst in cases:
        plan = sbpflow.boxing.plan(shape, torch.float32, src, dst)
        explicit = sbpflow.boxing.plan(shape, torch.float32, src, dst, cost_model=default)
        graph = plan.to_networkx()
        out.append({
            "steps": [step.op for step in plan.steps],
            "same_as_defaults": plan is explicit,
            "text": str(plan),
            "graph_edges": graph.number_of_edges(),
        })
    print(json.dumps({
        "plans": out,
        "initialized": dist.is_initialized(),
        "world": dist.distributed_c10d.GroupMember.WORLD is not None,
        "made": made,
        "world_ready": _world.is_world_ready(),
        "model_is_default": cost.model_for("cpu") == default,
    }))
    """
)


def test_plans_need_no_process_group_and_read_no_files(tmp_path: Path) -> None:
    """The reference is the plan priced with the default constants, passed explicitly."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = str(_ROOT)
    env["SBPFLOW_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", _PLANNING_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["initialized"] is False
    assert result["world"] is False
    assert result["made"] == []
    assert result["world_ready"] is False
    assert result["model_is_default"] is True
    assert len(list(tmp_path.glob("calibration-*.json"))) == 4  # the files were there to read
    for plan in result["plans"]:
        assert plan["steps"], plan["text"]  # every case needs at least one step
        assert plan["same_as_defaults"], plan["text"]
        assert plan["graph_edges"] >= len(plan["steps"])
    assert "send_recv" in result["plans"][-1]["steps"]  # the disjoint placements move data


def forbidden_imports(source: str, module: str) -> list[str]:
    """Every import in ``source`` (any depth) that resolves under ``_FORBIDDEN``.

    ``module`` is the importing module's dotted name, to resolve relative imports.
    """
    package = module.rsplit(".", 1)[0].split(".")
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            targets = [stem] + [f"{stem}.{alias.name}" for alias in node.names]
        for target in targets:
            if any(target == f or target.startswith(f + ".") for f in _FORBIDDEN):
                found.append(f"line {node.lineno}: {target}")
                break
    return found


def _planning_modules() -> list[Path]:
    return sorted(p for p in _BOXING.glob("*.py") if p.name not in _COMMUNICATING)


@pytest.mark.parametrize("path", _planning_modules(), ids=lambda p: p.name)
def test_planning_modules_import_no_communication(path: Path) -> None:
    module = f"sbpflow.boxing.{path.stem}" if path.stem != "__init__" else "sbpflow.boxing.x"
    assert forbidden_imports(path.read_text(), module) == []


def test_the_import_check_sees_every_form() -> None:
    """The check above can fail: each way of importing communication is caught."""
    module = "sbpflow.boxing.cost"
    for source in (
        "from ..comm import _world",
        "from ..comm._world import get_world_size",
        "from .. import comm",
        "import sbpflow.comm._groups",
        "import torch.distributed as dist",
        "from torch import distributed",
        "from torch.distributed import ReduceOp",
        "def f():\n    from ..comm._world import get_rank\n    return get_rank()",
        "class C:\n    def m(self):\n        import torch.distributed\n",
    ):
        assert forbidden_imports(source, module), source
    assert (
        forbidden_imports("from . import _steps\nimport torch\nfrom ..sbp import Split", module)
        == []
    )
    assert {p.name for p in _planning_modules()} >= {
        "cost.py",
        "planner.py",
        "plan.py",
        "_steps.py",
    }
