"""Optimizer step: AdamW with ``foreach=True`` against its per-parameter loop, on a small
Hugging Face Llama, as plain tensors, the minimal subclass and sbpflow global tensors.

The model is ``transformers.LlamaForCausalLM`` (vocabulary 1024, hidden 256, MLP 688, 4
layers, 4 heads, 2 key/value heads: 39 parameter tensors, 3.4M values). Every parameter gets
a fixed gradient once; then ``opt.step()`` alone is timed (the forward and backward do not
depend on the optimizer's path), one rank, one thread, in six forms interleaved in one
process (each repetition runs each form once, in an order rotating from one repetition to the
next):

- **plain** loop / foreach: the model as plain tensors;
- **floor** loop / foreach: every parameter and gradient wrapped in the minimal
  ``__torch_dispatch__`` subclass (unwrap, run the op, wrap; lists unwrapped too): what any
  Python tensor subclass pays per dispatched op;
- **sbpflow** loop / foreach: ``model.to_global(placement, broadcast)`` on a one-rank
  placement, the parameters of global data parallelism.

``--runs`` fresh processes; per run the median step time of each form and the ratio
foreach / loop. The dispatches of one sbpflow step (calls of global tensors' dispatcher) are
counted for both paths (a step after the first, which creates the optimizer's state). ``--device cuda`` runs on this rank's GPU (times after a
``torch.cuda.synchronize``).

Usage (from the repository root)::

    python bench/optim/run.py                   # 3 runs of 30 steps, cpu
    python bench/optim/run.py --device cuda
    python bench/optim/run.py --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import sbpflow  # noqa: E402
from bench._floor import Floor, floor_model  # noqa: E402
from bench._ranks import interleaved_step_times, join_world  # noqa: E402
from bench._report import machine, write_section  # noqa: E402
from sbpflow.testing import free_port  # noqa: E402

FORMS = ("plain", "floor", "sbpflow")
PATHS = ("loop", "foreach")
WARMUP = 5


def _markers(device: str) -> tuple[str, str]:
    """One section of docs/benchmarks.md per device."""
    return f"<!-- bench:optim-{device}:start -->", f"<!-- bench:optim-{device}:end -->"


CONFIG = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def _forms(base: nn.Module, device: str) -> dict[str, nn.Module]:
    placement = sbpflow.placement(device, [0])
    return {
        "plain": copy.deepcopy(base),
        "floor": floor_model(base),
        "sbpflow": copy.deepcopy(base).to_global(placement, sbpflow.sbp.broadcast),
    }


def _give_gradients(model: nn.Module, grads: list[torch.Tensor], form: str) -> None:
    placement = None
    for p, g in zip(model.parameters(), grads, strict=True):
        if form == "floor":
            p.grad = Floor.wrap(g.clone())
        elif form == "sbpflow":
            placement = placement or p.placement
            p.grad = sbpflow.to_global(
                g.clone(), placement, sbpflow.sbp.broadcast, check_meta=False
            )
        else:
            p.grad = g.clone()


def _count_dispatches(opt: torch.optim.Optimizer) -> int:
    """Dispatches of one step after the first (which creates the optimizer's state)."""
    opt.step()
    dispatcher = sbpflow.GlobalTensor._op_dispatcher
    inner, seen = dispatcher.dispatch, [0]

    def counting(func: Any, args: tuple, kwargs: dict) -> Any:
        seen[0] += 1
        return inner(func, args, kwargs)

    dispatcher.dispatch = counting  # type: ignore[method-assign]
    try:
        opt.step()
    finally:
        del dispatcher.dispatch
    return seen[0]


def one_run(reps: int, device: str) -> dict[str, Any]:
    """Median step ms of each form and path, and sbpflow's dispatches per step, in this process."""
    import transformers

    join_world(0, 1, free_port())
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).to(device)
    grads = [torch.randn_like(p) * 1e-2 for p in base.parameters()]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    steps: dict[str, Callable[[], None]] = {}
    dispatches: dict[str, int] = {}
    for form, model in _forms(base, device).items():
        _give_gradients(model, grads, form)
        for path in PATHS:
            m = model if path == "loop" else copy.deepcopy(model)
            if path == "foreach":
                _give_gradients(m, grads, form)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=path == "foreach")
            if form == "sbpflow":
                dispatches[path] = _count_dispatches(opt)

            def step(opt: torch.optim.Optimizer = opt) -> None:
                opt.step()
                sync()

            steps[f"{form} {path}"] = step
    times, _ = interleaved_step_times(steps, WARMUP, reps)
    return {
        "ms": {name: statistics.median(samples) for name, samples in times.items()},
        "dispatches": dispatches,
        "parameters": len(grads),
        "values": sum(g.numel() for g in grads),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30, help="timed steps per form and run")
    parser.add_argument("--runs", type=int, default=3, help="fresh processes")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--one-run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_run:
        print(json.dumps(one_run(args.reps, args.device)))
        return
    rows, ratios, vs_floor = [], {form: [] for form in FORMS}, []
    got: dict[str, Any] = {}
    for run in range(args.runs):
        command = [sys.executable, __file__, "--one-run", "--reps", str(args.reps)]
        command += ["--device", args.device]
        done = subprocess.run(command, check=True, capture_output=True, text=True)
        got = json.loads(done.stdout.strip().splitlines()[-1])
        ms = got["ms"]
        cells = []
        for form in FORMS:
            ratio = ms[f"{form} foreach"] / ms[f"{form} loop"]
            ratios[form].append(ratio)
            cells.append(f"{ms[f'{form} loop']:.2f} | {ms[f'{form} foreach']:.2f} | {ratio:.3f}")
        vs_floor.append(ms["sbpflow foreach"] / ms["floor foreach"])
        rows.append(f"| {run + 1} | " + " | ".join(cells) + f" | {vs_floor[-1]:.3f} |")
    header = " | ".join(
        f"{form} loop ms | {form} foreach ms | {form} foreach / loop" for form in FORMS
    )
    table = "\n".join(
        [
            f"| run | {header} | sbpflow / floor, foreach |",
            "|---" * (2 + 3 * len(FORMS)) + "|",
            *rows,
        ]
    )
    dispatches = got["dispatches"]
    summary = (
        f"sbpflow dispatches per step: loop {dispatches['loop']}, foreach "
        f"{dispatches['foreach']} ({got['parameters']} parameter tensors, "
        f"{got['values'] / 1e6:.1f}M values). Median of the runs, foreach / loop: "
        + ", ".join(f"{form} {statistics.median(ratios[form]):.3f}" for form in FORMS)
        + f"; sbpflow foreach / floor foreach {statistics.median(vs_floor):.3f}."
    )
    where = machine() if args.device == "cpu" else f"{torch.cuda.get_device_name()}, {machine()}"
    print(where)
    print(table)
    print(summary)
    if args.out is not None:
        start, end = _markers(args.device)
        text = f"""{start}
## Optimizer step ({args.device}): AdamW foreach vs its loop on global parameters

`python bench/optim/run.py --device {args.device} --reps {args.reps} --runs {args.runs} --out docs/benchmarks.md`.
Machine: {where}; one rank, one thread. A Hugging Face `LlamaForCausalLM` (vocabulary 1024,
hidden 256, MLP 688, 4 layers, 4 heads, 2 key/value heads), each parameter given a fixed
gradient once, then `AdamW.step()` alone timed with `foreach=False` (the per-parameter loop)
and `foreach=True`, as **plain** tensors, as **floor** (the minimal `__torch_dispatch__`
subclass: unwrap, run, wrap) and as **sbpflow** global tensors (`to_global(placement,
broadcast)` on one rank); interleaved in one process, median over {args.reps} steps, {args.runs}
fresh processes:

{table}

{summary} With `foreach=True` each `_foreach_*` call on global tensors is one dispatch and
one kernel on the local pieces (NOTE [foreach on the pieces] in `sbpflow/ops/_foreach.py`),
instead of one dispatch per parameter and op. torch takes foreach by default for CUDA
parameters only; on a CPU plain torch's own foreach step is slower than its loop on this model
(the plain columns), and a global one follows it.
{end}"""
        write_section(args.out, text, start, end)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
