"""Every script in ``examples/`` runs the way the README says a user runs it.

Each example is started through ``python -m sbpflow.distributed.launch`` in a fresh set of
processes and must exit 0, end its output with the lines it promises, and run every op
through an SBP rule (no "no SBP rule" fallback warning).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
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
    "auto_parallel.py": [],  # needs scipy (so numpy): checked in test_auto_parallel_example.py
    "pipeline.py": [],  # run on 2 ranks and checked step by step in test_pipeline_example.py
    "sampler.py": [],  # its output is checked line by line in test_sampler_example_matches_torch
    "ddp_linear.py": [],  # its output is checked in test_ddp_linear_example_finds_the_solution
    "data_parallel.py": [],  # needs the examples extra: checked in test_data_parallel_example_*
}
DEFAULT = [(2, (r".+",))]
CASES = [
    (example, num_ranks, patterns)
    for example in EXAMPLES
    for num_ranks, patterns in RUNS.get(example.name, DEFAULT)
]


# numpy is not a dependency of sbpflow (the test and examples extras bring it in), so the
# examples run with it hidden, as on the machine of a user who installed sbpflow alone;
# those that need the examples extra (scikit-learn) say so with ``needs_extras``.
NO_NUMPY = Path(__file__).resolve().parent / "_no_numpy"


def _env(needs_extras: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    paths = [None if needs_extras else str(NO_NUMPY), str(REPO_ROOT), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _launch(
    example: str, num_ranks: int, *args: str, needs_extras: bool = False
) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run ``example`` through the launcher as a user would; it must exit 0 with no fallback."""
    argv = [sys.executable, "-m", "sbpflow.distributed.launch", "--nproc_per_node", str(num_ranks)]
    try:
        result = subprocess.run(
            [*argv, example, *args],
            cwd=REPO_ROOT,
            env=_env(needs_extras),
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


# -- examples/data_parallel.py: the README's first command -----------------------------

DIGITS = "examples/data_parallel.py"
DIGITS_RESULT = re.compile(
    r"final test accuracy (?P<accuracy>\d\.\d{4})\n"
    r"final test loss (?P<loss>\d+\.\d{6})\n"
    r"parameter checksum (?P<checksum>\d+\.\d{6})\n?$"
)
EPOCH_LINE = r"epoch \d+: train loss \d+\.\d{4}, test loss \d+\.\d{4}, test accuracy \d\.\d{4}"


def _digits_result(stdout: str, output: str) -> dict[str, float]:
    match = DIGITS_RESULT.search(stdout)
    assert match, f"no final result at the end of the output\n{output}"
    return {name: float(value) for name, value in match.groupdict().items()}


def _plain_reference(epochs: int, batch_size: int, lr: float) -> dict[str, float]:
    """The example's training in plain single-process PyTorch: its data set and model (imported
    from the example), torch's own DistributedSampler with one replica (the global batches are
    the same samples as the ranks' batches joined: rank r of n reads every n-th index), SGD."""
    spec = importlib.util.spec_from_file_location("data_parallel_example", REPO_ROOT / DIGITS)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    train_set, test_set = example.digits(torch.device("cpu"))
    torch.manual_seed(0)
    model = example.Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    sampler = DistributedSampler(train_set, num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(train_set, batch_size=batch_size, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    model.eval()
    x, y = test_set.tensors
    with torch.no_grad():
        logits = model(x)
    return {
        "accuracy": round((logits.argmax(1) == y).sum().item() / len(y), 4),
        "loss": F.cross_entropy(logits, y, reduction="sum").item() / len(y),
        "checksum": example.checksum(model),
    }


def test_data_parallel_example_matches_one_process() -> None:
    """examples/data_parallel.py in float32 (``--precision fp32``) on 2 ranks and on 1 rank
    ends where plain single-process PyTorch, computed here on the same global batches, ends:
    the same test accuracy, and test loss and parameter checksum within 1e-5 relative (the
    runs differ only in the order of float32 sums: the ranks' shares are reduced separately).
    With bfloat16 autocast each rank rounds its share of a gradient to 8 bits on its own, so
    that comparison would only hold to about 1e-3; float32 is the exact check."""
    args = ("--precision", "fp32", "--epochs", "1", "--batch-size", "32", "--lr", "0.01")
    want = _plain_reference(epochs=1, batch_size=32, lr=0.01)
    for num_ranks in (2, 1):
        result, output = _launch(DIGITS, num_ranks, *args, needs_extras=True)
        got = _digits_result(result.stdout, output)
        assert got["accuracy"] == want["accuracy"], (want, output)
        for name in ("loss", "checksum"):
            assert got[name] == pytest.approx(want[name], rel=1e-5, abs=1e-6), (name, want, output)


def test_data_parallel_example_learns_the_digits_and_resumes_where_it_stopped(
    tmp_path: Path,
) -> None:
    """The README's first command: examples/data_parallel.py on 2 ranks, bfloat16 autocast with
    GradScaler, trains its 4 epochs (saving a checkpoint after each) and reaches at least 95%
    accuracy on the 357 held-out digits (a model that did not learn scores about 10%); rank 0
    alone prints one line per epoch. A second invocation resumes from the checkpoint after
    epoch 3 (``--resume``) and trains epoch 4 again: its epoch line and final accuracy, loss
    and checksum equal the first run's exactly (same ranks, same layouts, same batches: the
    same computation)."""
    checkpoints = tmp_path / "checkpoints"
    first, output = _launch(DIGITS, 2, "--save-every-epoch", str(checkpoints), needs_extras=True)
    lines = first.stdout.strip().splitlines()
    assert lines[0].startswith("training on 2 rank(s)") and "amp" in lines[0], output
    assert [line for line in lines if line.startswith("epoch")] == [
        line for line in lines if re.fullmatch(EPOCH_LINE, line)
    ], output
    assert len([line for line in lines if line.startswith("epoch")]) == 4, output  # once each
    assert _digits_result(first.stdout, output)["accuracy"] >= 0.95, output
    assert sorted(p.name for p in checkpoints.iterdir()) == [f"epoch-{e}" for e in (1, 2, 3, 4)]
    resumed, resumed_output = _launch(
        DIGITS, 2, "--resume", str(checkpoints / "epoch-3"), needs_extras=True
    )
    epochs = [line for line in resumed.stdout.splitlines() if line.startswith("epoch")]
    assert len(epochs) == 1 and epochs[0].startswith("epoch 4:"), resumed_output
    assert epochs[0] in first.stdout.splitlines(), (output, resumed_output)
    assert _digits_result(resumed.stdout, resumed_output) == _digits_result(first.stdout, output)
