"""examples/auto_parallel.py, launched on 2 CPU ranks as the docs say, plans Megatron's layout
and trains as one process does.

The example compares its parameters with a plain copy trained in one process and prints
both final losses; here the printed layouts are checked against Megatron's hand layout
(``up`` split(0), ``down.weight`` split(1), the rest broadcast) and the two losses must
agree within 1e-5. Unlike the other examples it runs with numpy visible: planning needs
scipy, which needs numpy.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 180


def test_auto_parallel_example_plans_megatron_and_matches_one_process() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    argv = [sys.executable, "-m", "sbpflow.distributed.launch", "--nproc_per_node", "2"]
    result = subprocess.run(
        [*argv, "examples/auto_parallel.py"],
        cwd=REPO_ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    output = f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    assert result.returncode == 0, output
    assert "no SBP rule" not in result.stderr, output
    lines = [line.strip() for line in result.stdout.splitlines() if line.strip()]
    layouts, single, final, matches = lines[-4:]
    assert layouts == (
        "planned layouts (block 0): 0.norm.weight B, 0.norm.bias B, 0.up.weight S(0), "
        "0.up.bias S(0), 0.down.weight S(1), 0.down.bias B"
    ), output
    want = float(re.fullmatch(r"single process: final loss (\d+\.\d+)", single)[1])  # type: ignore[index]
    got = float(re.fullmatch(r"final loss (\d+\.\d+)", final)[1])  # type: ignore[index]
    assert abs(got - want) <= 1e-5, output
    assert matches == "matches single-process training: True", output
    assert "Plan on placement('cpu', [0, 1])" in result.stdout, output
