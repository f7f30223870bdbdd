"""The job one simulated host's ranks run in ``test_two_hosts.py`` (through the launcher).

On the 2x2 mesh ``[[0, 1], [2, 3]]`` with ranks 0, 1 on one host and 2, 3 on the
other, axis 0 crosses the network and axis 1 stays inside a host. Every rank:
1. boxes every SBP pair of the 2-D matrix (``tests/dist/test_boxing_nd.py``'s "2x2"
   suite) and checks its own result against the single-process reference: its piece
   of the logical tensor for a layout without partial axes, else the logical tensor
   after boxing to broadcast; and that the collectives that ran are the plan's;
2. trains the data x tensor parallel MLP of ``examples/train_tensor_parallel.py``
   and compares it with the same training in one process.
It prints ``two-host job ok on rank R`` and exits 0 only if everything held.
"""

from __future__ import annotations

import copy
import runpy
from pathlib import Path

import torch

import sbpflow
from sbpflow._layout import Layout
from sbpflow.env import get_rank
from sbpflow.sbp import Broadcast, Partial, broadcast, split
from tests.boxing_support import make_locals, reference
from tests.dist.test_boxing_nd import run_suite, suite

ROOT = Path(__file__).resolve().parents[2]


def check_boxing_matrix() -> list[str]:
    rank = get_rank()
    problems = []
    results = run_suite("2x2")
    for (shape, src, dst), (local, ran, planned, untouched) in zip(
        suite("2x2"), results, strict=True
    ):
        label = f"{src.describe()} -> {dst.describe()} shape {list(shape)}"
        if ran != planned:
            problems.append(f"{label}: ran {ran}, the plan has {planned}")
        if not untouched:
            problems.append(f"{label}: the input was modified")
        expected = reference(shape)
        if any(isinstance(s, Partial) for s in dst.sbp):
            whole = Layout(dst.placement, (Broadcast(), Broadcast()))
            y = sbpflow.GlobalTensor(local, dst, shape).to_global(whole.placement, whole.sbp)
            ok = torch.equal(y.to_local(), expected)
        else:
            ok = torch.equal(local, make_locals(expected, dst)[rank])
        if not ok:
            problems.append(f"{label}: wrong values on rank {rank}")
    return problems


def train_data_by_tensor_parallel() -> bool:
    """The example's 2x2 variant, 5 steps: True when it matches single-process training."""
    example = runpy.run_path(str(ROOT / "examples" / "train_tensor_parallel.py"))
    torch.manual_seed(0)  # the same initial model and data on every rank
    model = example["make_model"](16, 32, 4)
    batches = example["make_batches"](5, 16)
    trained = copy.deepcopy(model)
    example["train"](trained, batches, 0.1)
    layout = example["megatron_layout"]
    _, matches = example["run_variant"](
        "data x tensor parallel",
        sbpflow.placement("cpu", [[0, 1], [2, 3]]),
        lambda name, t: (broadcast, layout(name, t)),
        (split(0), broadcast),
        model,
        trained,
        batches,
        0.1,
    )
    return bool(matches)


def main() -> None:
    if sbpflow.env.get_world_size() != 4:
        raise SystemExit("run on two hosts with two ranks each")
    problems = check_boxing_matrix()
    if not train_data_by_tensor_parallel():
        problems.append("data x tensor parallel training differs from single-process training")
    if problems:
        print(f"rank {get_rank()}: {len(problems)} problems:\n" + "\n".join(problems[:20]))
        raise SystemExit(1)
    print(f"two-host job ok on rank {get_rank()}", flush=True)


if __name__ == "__main__":
    main()
