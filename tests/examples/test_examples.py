"""Every script in ``examples/`` runs the way the README says a user runs it.

Each example is started through ``python -m sbpflow.distributed.launch`` in a fresh set of
processes and must exit 0, end its output with the lines it promises, and run every op
through an SBP rule (no "no SBP rule" fallback warning).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p for p in (REPO_ROOT / "examples").glob("*.py") if not p.name.startswith("_"))
TIMEOUT_S = 120

FINAL_LOSS = r"final loss (?P<loss>\d+\.\d+)"
MATCHES = r"matches single-process training: True"

# example file -> its runs: (ranks to launch, patterns the last lines of stdout must match,
# in order). An example missing here still has to run cleanly on 2 ranks; add it to pin its
# output. A pattern with a ``loss`` group also checks that the model learned.
RUNS: dict[str, list[tuple[int, tuple[str, ...]]]] = {
    "train_data_parallel.py": [(4, (FINAL_LOSS, MATCHES))],
    "train_tensor_parallel.py": [
        (2, (r"tensor parallel on .*", r"single process: .*", FINAL_LOSS, MATCHES)),
        (4, (r"data x tensor parallel on .*", r"single process: .*", FINAL_LOSS, MATCHES)),
    ],
    "pipeline_two_stages.py": [(2, (FINAL_LOSS, MATCHES))],
    "sampler.py": [],  # its output is checked line by line in test_sampler_example_matches_torch
    "ddp_linear.py": [],  # its output is checked in test_ddp_linear_example_finds_the_solution
}
DEFAULT = [(2, (r".+",))]
CASES = [
    (example, num_ranks, patterns)
    for example in EXAMPLES
    for num_ranks, patterns in RUNS.get(example.name, DEFAULT)
]


# The README's demo command installs torch and sbpflow only. numpy is not a dependency
# (the test extras bring it in), so the examples run with it hidden, as on a user's machine.
NO_NUMPY = Path(__file__).resolve().parent / "_no_numpy"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(NO_NUMPY), str(REPO_ROOT), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _launch(example: str, num_ranks: int) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run ``example`` through the launcher as a user would; it must exit 0 with no fallback."""
    argv = [sys.executable, "-m", "sbpflow.distributed.launch", "--nproc_per_node", str(num_ranks)]
    try:
        result = subprocess.run(
            [*argv, example],
            cwd=REPO_ROOT,
            env=_env(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"{example} did not finish in {TIMEOUT_S}s\n{error.stdout}\n{error.stderr}")
    output = f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    assert result.returncode == 0, output
    assert "no SBP rule" not in result.stderr, f"an op fell back to broadcast\n{output}"
    return result, output


@pytest.mark.parametrize(
    ("example", "num_ranks", "patterns"),
    CASES,
    ids=[f"{example.name}-{num_ranks}ranks" for example, num_ranks, _ in CASES],
)
def test_example_runs(example: Path, num_ranks: int, patterns: tuple[str, ...]) -> None:
    result, output = _launch(str(example.relative_to(REPO_ROOT)), num_ranks)
    lines = [line.strip() for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) >= len(patterns), output
    for line, pattern in zip(lines[-len(patterns) :], patterns, strict=True):
        match = re.fullmatch(pattern, line)
        assert match, f"line {line!r} does not match {pattern!r}\n{output}"
        if "loss" in match.groupdict():
            assert float(match["loss"]) < 0.2, f"the model did not learn\n{output}"


def test_there_are_examples() -> None:
    names = [p.name for p in EXAMPLES]
    assert "train_data_parallel.py" in names
    assert set(RUNS) <= set(names), f"RUNS names missing examples: {set(RUNS) - set(names)}"


def test_sampler_example_matches_torch() -> None:
    """examples/sampler.py on 2 ranks: every printed share equals torch's DistributedSampler's.

    The reference is ``torch.utils.data.DistributedSampler(data, 2, rank, ...)`` built here;
    the global batch printed last must be the two ranks' first loader batches concatenated.
    """
    result, output = _launch("examples/sampler.py", 2)
    share = re.compile(
        r"rank (\d): data set of (\d+), shuffle=(True|False), drop_last=(True|False), "
        r"epoch (\d+) -> \[([\d, ]*)\]"
    )
    seen = set()
    for match in share.finditer(result.stdout):
        rank, num_items, epoch = int(match[1]), int(match[2]), int(match[5])
        shuffle, drop_last = match[3] == "True", match[4] == "True"
        printed = [int(i) for i in match[6].split(",") if i.strip()]
        reference = DistributedSampler(range(num_items), 2, rank, shuffle, drop_last=drop_last)
        reference.set_epoch(epoch)
        assert printed == list(reference), f"{match[0]!r}: torch gives {list(reference)}"
        seen.add((rank, num_items, shuffle, drop_last, epoch))
    configs = [(False, False, 0), (False, True, 0), (True, False, 0), (True, False, 1)]
    expected = {(r, n, *config) for r in (0, 1) for n in (1, 2, 3) for config in configs}
    assert seen == expected, output

    values = [10, 20, 30]
    first_batches = [
        [values[i] for i in list(DistributedSampler(values, 2, r))[:2]] for r in (0, 1)
    ]
    last_line = result.stdout.strip().splitlines()[-1]
    assert last_line == f"global batch (4,) S(0): {first_batches[0] + first_batches[1]}", output


def test_ddp_linear_example_finds_the_solution() -> None:
    """examples/ddp_linear.py (OneFlow's DDP program) on 2 ranks: both ranks end with
    w = [[2.0000], [3.0000]], the exact solution of the two ranks' linear systems (a
    single-process least-squares solve on all four samples, computed here, agrees)."""
    result, output = _launch("examples/ddp_linear.py", 2)
    x = torch.tensor([[1.0, 2.0], [2.0, 3.0], [4.0, 6.0], [3.0, 1.0]], dtype=torch.float64)
    y = torch.tensor([[8.0], [13.0], [26.0], [9.0]], dtype=torch.float64)
    solution = torch.linalg.lstsq(x, y).solution.flatten().tolist()
    found = re.findall(r"rank (\d) w: \[\[(-?\d+\.\d{4})\], \[(-?\d+\.\d{4})\]\]", result.stdout)
    assert sorted(rank for rank, _, _ in found) == ["0", "1"], output
    for _, w0, w1 in found:
        assert [float(w0), float(w1)] == pytest.approx(solution, abs=1e-4), output
        assert (w0, w1) == ("2.0000", "3.0000"), output
