"""Every script in ``examples/`` runs the way the README says a user runs it.

Each example is started through ``python -m sbpflow.distributed.launch`` in a fresh set of
processes and must exit 0 and end its output with the line it promises.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p for p in (REPO_ROOT / "examples").glob("*.py") if not p.name.startswith("_"))
TIMEOUT_S = 120

# example file -> (ranks to launch, pattern its last line of stdout must match).
# An example missing here still has to run cleanly on 2 ranks; add it to pin its output.
EXPECTED: dict[str, tuple[int, str]] = {
    "train_data_parallel.py": (4, r"final loss (?P<loss>\d+\.\d+)"),
}
DEFAULT = (2, r".+")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(example: Path) -> None:
    num_ranks, pattern = EXPECTED.get(example.name, DEFAULT)
    argv = [sys.executable, "-m", "sbpflow.distributed.launch", "--nproc_per_node", str(num_ranks)]
    try:
        result = subprocess.run(
            [*argv, str(example.relative_to(REPO_ROOT))],
            cwd=REPO_ROOT,
            env=_env(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as error:
        pytest.fail(
            f"{example.name} did not finish in {TIMEOUT_S}s\n{error.stdout}\n{error.stderr}"
        )
    output = f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    assert result.returncode == 0, output
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert lines, output
    match = re.fullmatch(pattern, lines[-1].strip())
    assert match, f"last line {lines[-1]!r} does not match {pattern!r}\n{output}"
    if "loss" in match.groupdict():
        assert float(match["loss"]) < 0.2, f"the model did not learn\n{output}"


def test_there_are_examples() -> None:
    assert "train_data_parallel.py" in [p.name for p in EXAMPLES]
