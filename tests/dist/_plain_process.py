"""Run a test module's function in a plain Python process: no launcher, a world of one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_in_plain_process(module: str, function: str, *args: str, timeout: float = 300) -> None:
    """``module.function(*args)`` in a fresh interpreter without the launcher's variables;
    raises AssertionError with its stderr when it fails."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    code = f"import sys; from {module} import {function} as f; f(*sys.argv[1:])"
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr
