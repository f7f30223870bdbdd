"""examples/pipeline.py, launched on 2 CPU ranks, trains exactly as single-process training does.

The example runs unchanged through ``python -m sbpflow.distributed.launch`` inside a small
wrapper that saves the random state the program starts from, runs the program (``runpy``),
and saves each rank's pieces of the parameters, ``x`` and ``y``. It prints one line per step,
``step i loss L``, on the rank that holds the loss (rank 1) only, with L a number.
The single-process reference is computed here: the example's stage classes (taken from its
source), built from the ranks' saved random states, give the same stages, ``x`` and ``y``
(``to_global`` with broadcast keeps the first rank's data: rank 0's stage 0 and ``x``, rank
1's stage 1 and ``y``) and train 20 steps of SGD with the same 2 micro-batches per step. Every printed loss (6 decimals)
and every final parameter must agree within 1e-5.
"""

from __future__ import annotations

import ast
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = REPO_ROOT / "examples" / "pipeline.py"
TIMEOUT_S = 120
_TOL = 1e-5

WRAPPER = """
    import os
    import runpy
    import sys

    import torch

    import sbpflow

    out, rank = sys.argv[1], os.environ["RANK"]
    torch.save(torch.get_rng_state(), os.path.join(out, f"rng{rank}.pt"))
    program = runpy.run_path(sys.argv[2], run_name="__main__")
    params = {
        name: p.detach().to_local().clone()
        for name, p in program["module_pipeline"].named_parameters()
    }
    pieces = {"x": program["x"].to_local(), "y": program["y"].to_local()}
    from torch._dynamo.utils import counters  # graphs compiled (none unless enable_compile)
    graphs = counters["stats"]["unique_graphs"]
    torch.save({"params": params, "graphs": graphs, **pieces}, os.path.join(out, f"rank{rank}.pt"))
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _example_classes() -> dict[str, Any]:
    """The example's module classes, executed from its source (its script part is left out)."""
    tree = ast.parse(EXAMPLE.read_text())
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.startswith("Stage")]
    namespace: dict[str, Any] = {"torch": torch}
    exec(compile(ast.Module(body=classes, type_ignores=[]), str(EXAMPLE), "exec"), namespace)
    return namespace


def _draw(rng_state: torch.Tensor) -> tuple[Any, Any, torch.Tensor, torch.Tensor]:
    """What one rank of the example draws, in its order: the two stages, then x, then y."""
    classes = _example_classes()
    torch.set_rng_state(rng_state)
    stage0, stage1 = classes["Stage0Module"](), classes["Stage1Module"]()
    x = torch.randn(16, 1, 28, 28)
    y = torch.randint(0, 10, (16,))
    return stage0, stage1, x, y


def _reference(rng_states: list[torch.Tensor]) -> dict[str, Any]:
    """The example's training in this process: same init, data, accumulation and optimizer.

    Each rank's default generator starts from its own seed, and ``to_global`` with broadcast
    keeps the data of the group's first rank: stage 0 and ``x`` are rank 0's draws (placement
    [0]), stage 1 and ``y`` rank 1's (placement [1]).
    """
    stage0, _, x, _ = _draw(rng_states[0])
    _, stage1, _, y = _draw(rng_states[1])
    params = [*stage0.parameters(), *stage1.parameters()]
    sgd = torch.optim.SGD(params, lr=0.001)
    losses = []
    for _ in range(20):
        micro = []
        for xm, ym in zip(x.chunk(2), y.chunk(2), strict=True):
            loss = torch.nn.functional.cross_entropy(stage1(stage0(xm)), ym)
            (loss / 2).backward()
            micro.append(loss.item())
        sgd.step()
        sgd.zero_grad()
        losses.append(sum(micro) / 2)
    named = {f"m_stage0.{n}": p for n, p in stage0.named_parameters()}
    named |= {f"m_stage1.{n}": p for n, p in stage1.named_parameters()}
    return {"losses": losses, "params": named, "x": x, "y": y}


COMPILE_LINE = "        self.config.enable_compile(True)\n"
ACCUMULATION_LINE = "        self.config.set_gradient_accumulation_steps(2)\n"


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "enable_compile"])
def test_pipeline_example_matches_single_process_training(tmp_path: Path, compiled: bool) -> None:
    """Losses printed by examples/pipeline.py on 2 ranks and its final parameters equal the
    same training in one process (see the module docstring for the reference); also with
    ``self.config.enable_compile(True)`` added to its graph, where each rank must have
    compiled its stage (Dynamo's graph count) and the result must not change."""
    wrapper = tmp_path / "run_example.py"
    wrapper.write_text(textwrap.dedent(WRAPPER))
    example = EXAMPLE
    if compiled:
        source = EXAMPLE.read_text()
        assert source.count(ACCUMULATION_LINE) == 1
        example = tmp_path / "pipeline_compiled.py"
        example.write_text(source.replace(ACCUMULATION_LINE, ACCUMULATION_LINE + COMPILE_LINE))
    argv = [sys.executable, "-m", "sbpflow.distributed.launch", "--nproc_per_node", "2"]
    result = subprocess.run(
        [*argv, str(wrapper), str(tmp_path), str(example)],
        cwd=REPO_ROOT,
        env=_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    output = f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    assert result.returncode == 0, output
    assert "no SBP rule" not in result.stderr, output

    # Rank 1 holds the loss (it is on placement [1]) and prints it as a number, one line per
    # step; rank 0 prints nothing (no empty piece, no tensor).
    lines = result.stdout.splitlines()
    steps = [m for m in (re.fullmatch(r"step (\d+) loss (\S+)", line) for line in lines) if m]
    assert len(steps) == len(lines) and [int(m[1]) for m in steps] == list(range(20)), output
    assert "tensor(" not in result.stdout, output
    printed = [float(m[2]) for m in steps]
    assert all(math.isfinite(loss) for loss in printed), output

    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    graphs = [r["graphs"] for r in ranks]
    assert all(g >= 1 for g in graphs) if compiled else graphs == [0, 0], graphs
    want = _reference([torch.load(tmp_path / f"rng{r}.pt") for r in (0, 1)])
    assert torch.equal(ranks[0]["x"], want["x"]) and torch.equal(ranks[1]["y"], want["y"])
    assert ranks[1]["x"].numel() == 0 and ranks[0]["y"].numel() == 0  # ranks outside hold none

    errors = [abs(got - ref) for got, ref in zip(printed, want["losses"], strict=True)]
    assert max(errors) <= _TOL, (printed, want["losses"])
    assert want["losses"][-1] < want["losses"][0]  # it trains
    for name, ref in want["params"].items():
        holder = 0 if name.startswith("m_stage0") else 1
        got = ranks[holder]["params"][name]
        assert ranks[1 - holder]["params"][name].numel() == 0, name
        err = (got - ref.detach()).abs().max().item()
        assert err <= _TOL, f"{name}: differs from the reference by {err}"
