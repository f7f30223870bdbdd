"""Compiled-mode benchmark: per-step time of a small transformer, eager and compiled.

One run spawns 2 gloo ranks and times one training step (forward, loss,
backward, gradient reduction) of a small transformer (few layers, small
width, so per-op dispatch matters) laid out data parallel, in six ways:

- **plain eager / plain compiled**: the local model on this rank's half of the
  batch, its gradients all-reduced one by one after backward (what a hand-written
  data-parallel step does); compiled with ``torch.compile``;
- **plain compiled, global mean**: the same, with the loss sbpflow and DTensor
  compute: the mean over the whole batch's non-ignored tokens (each rank's sum of
  token losses over the all-reduced count, a functional collective inside the
  compiled function), for a like-for-like ratio;
- **sbpflow eager / sbpflow compiled**: the global model, parameters ``B``, batch
  ``S(0)``; the parameters' hooks all-reduce the partial gradients;
- **DTensor eager / DTensor compiled**: ``distribute_module`` (replicated
  parameters), batch ``Shard(0)``; the partial gradients are redistributed to
  ``Replicate()`` after backward.

The compiled variants compile the loss function (model and loss) with the
default backend (Inductor, C++ on CPU); the gradient reduction stays eager in
all of them. The three frameworks compute the same loss (checked once before
timing). Per-op host time is the step time divided by the number of ATen ops
one plain eager step runs (forward and backward, counted with a dispatch mode).
Host CPU is the CPU time of each rank's main thread per step: the host work of
the step without the time spent waiting for the other rank.

Usage (from the repository root)::

    python bench/compile/run.py                    # 2 ranks
    python bench/compile/run.py --quick            # a fast smoke run
    python bench/compile/run.py --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import sbpflow  # noqa: E402
from bench._ranks import join_world, slowest_rank_times  # noqa: E402
from bench._report import machine, write_section  # noqa: E402
from sbpflow.testing import free_port  # noqa: E402

WORLD = 2
IMPLS = (
    "plain eager",
    "plain compiled",
    "plain compiled, global mean",
    "sbpflow eager",
    "sbpflow compiled",
    "DTensor eager",
    "DTensor compiled",
)
# Targets (medians): sbpflow compiled / DTensor compiled, sbpflow eager / sbpflow compiled,
# sbpflow compiled / plain compiled.
TARGET_VS_DTENSOR, TARGET_SPEEDUP, TARGET_VS_PLAIN = 1.05, 1.5, 1.10


class Layer(nn.Module):
    """A pre-norm transformer layer: attention written as matmul + softmax, then a GELU MLP."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        heads = self.qkv(self.ln1(x)).reshape(batch, seq, 3, self.num_heads, dim // self.num_heads)
        q, k, v = heads.permute(2, 0, 3, 1, 4).unbind(0)
        scores = torch.matmul(q, k.transpose(-2, -1)) / (q.shape[-1] ** 0.5)
        attn = torch.matmul(torch.softmax(scores, dim=-1), v)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Transformer(nn.Module):
    def __init__(self, vocab: int, dim: int, num_heads: int, num_layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Layer(dim, num_heads) for _ in range(num_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def loss_of(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def loss(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())

    return loss


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def global_mean_loss_of(
    model: nn.Module, group: Any
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Cross-entropy averaged over the whole batch's non-ignored tokens, by hand."""
    from torch.distributed import _functional_collectives as funcol

    def loss(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        flat = targets.flatten()
        total = F.cross_entropy(model(tokens).flatten(0, 1), flat, reduction="sum")
        count = funcol.all_reduce((flat != -100).sum().to(total.dtype), "sum", group)
        return total / count

    return loss


def _build(config: dict[str, Any], rank: int, mesh: Any) -> tuple[dict[str, Any], int]:
    """The step of each implementation (checked once: the frameworks agree on the loss), and
    the ATen ops one plain eager step runs."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module

    torch.manual_seed(0)
    model = Transformer(config["vocab"], config["dim"], config["heads"], config["layers"])
    batch, seq = config["batch"], config["seq"]
    tokens = torch.randint(0, config["vocab"], (batch, seq))
    targets = torch.randint(0, config["vocab"], (batch, seq))
    mine = torch.tensor_split(torch.arange(batch), WORLD)[rank]
    tok_loc, tgt_loc = tokens[mine].contiguous(), targets[mine].contiguous()

    plain = copy.deepcopy(model)
    plain_global = copy.deepcopy(model)
    pl = sbpflow.placement("cpu", list(range(WORLD)))
    sbp_model = copy.deepcopy(model).to_global(pl, sbpflow.sbp.broadcast)
    sbp_args = tuple(
        sbpflow.to_global(t, pl, sbpflow.sbp.split(0), check_meta=False) for t in (tok_loc, tgt_loc)
    )
    dt_model = distribute_module(copy.deepcopy(model), mesh)
    dt_args = tuple(
        DTensor.from_local(t, mesh, [Shard(0)], run_check=False) for t in (tok_loc, tgt_loc)
    )

    bucketed = config["bucketed"]
    # sbpflow reduces a global model's gradients in buckets by default (one bucket at this
    # size); one bucket per parameter, each launched as its gradient arrives, otherwise.
    sbpflow.nn.parallel.sync_gradients(sbp_model, bucket_cap_mb=None if bucketed else 1e-6)

    def reduce_plain(module: nn.Module = plain) -> None:
        grads = [p.grad for p in module.parameters()]
        if not bucketed:
            for g in grads:
                dist.all_reduce(g)
            return
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        for g, r in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
            g.copy_(r)

    def reduce_dtensor() -> None:
        params = list(dt_model.parameters())
        if not bucketed:
            for p in params:
                p.grad = p.grad.redistribute(mesh, [Replicate()])
            return
        locals_ = [p.grad.to_local() for p in params]
        flat = torch._utils._flatten_dense_tensors(locals_)
        dist.all_reduce(flat)
        reduced = torch._utils._unflatten_dense_tensors(flat, locals_)
        for p, r in zip(params, reduced, strict=True):
            p.grad = DTensor.from_local(r, mesh, [Replicate()], run_check=False)

    def step(fn: Callable[..., torch.Tensor], m: nn.Module, args: Any, reduce: Any) -> Any:
        def run() -> torch.Tensor:
            for p in m.parameters():
                p.grad = None
            loss = fn(*args)
            loss.backward()
            if reduce is not None:
                reduce()
            return loss

        return run

    steps = {
        "plain eager": step(loss_of(plain), plain, (tok_loc, tgt_loc), reduce_plain),
        "plain compiled": step(
            torch.compile(loss_of(plain)), plain, (tok_loc, tgt_loc), reduce_plain
        ),
        "plain compiled, global mean": step(
            torch.compile(global_mean_loss_of(plain_global, dist.group.WORLD)),
            plain_global,
            (tok_loc, tgt_loc),
            lambda: reduce_plain(plain_global),
        ),
        "sbpflow eager": step(loss_of(sbp_model), sbp_model, sbp_args, None),
        "sbpflow compiled": step(torch.compile(loss_of(sbp_model)), sbp_model, sbp_args, None),
        "DTensor eager": step(loss_of(dt_model), dt_model, dt_args, reduce_dtensor),
        "DTensor compiled": step(
            torch.compile(loss_of(dt_model)), dt_model, dt_args, reduce_dtensor
        ),
    }
    reference = loss_of(model)(tokens, targets)
    reference.backward()
    want = [p.grad for p in model.parameters()]
    for name, run in steps.items():
        loss = run()  # compiles the compiled ones
        if name in ("plain eager", "plain compiled"):
            continue  # each rank's own mean: not the one-process loss
        if name.startswith("plain"):
            m: nn.Module = plain_global
            got = loss.detach().clone()
            dist.all_reduce(got)  # the ranks' shares of the mean
            got = got.item()
            grads = [p.grad for p in m.parameters()]  # summed over the ranks: the mean's
        else:
            m = sbp_model if name.startswith("sbpflow") else dt_model
            got = loss.full_tensor().item() if isinstance(loss, DTensor) else loss.item()
            grads = [p.grad.to_local() for p in m.parameters()]  # broadcast / replicated: whole
        grad_error = max((g - w).abs().max().item() for g, w in zip(grads, want, strict=True))
        if abs(got - reference.item()) > 1e-4 or grad_error > 1e-4:
            raise AssertionError(
                f"{name} differs from one process on rank {rank}: loss {got} "
                f"against {reference.item()}, gradients by {grad_error}"
            )
    counter = _CountOps()
    with counter:
        steps["plain eager"]()
    return steps, counter.count


def _time(
    steps: dict[str, Any], reps: int, warmup: int, inner: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Seconds per step per repetition, the slower rank's, implementations interleaved; and
    the CPU seconds the rank's main thread spent per step (its host work: Python, dispatch
    and kernels, without the time it waited for the other rank), the larger rank's."""
    out: dict[str, list[float]] = {name: [] for name in IMPLS}
    cpu: dict[str, list[float]] = {name: [] for name in IMPLS}
    for rep in range(warmup + reps):
        k = rep % len(IMPLS)
        for name in IMPLS[k:] + IMPLS[:k]:
            run = steps[name]
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.thread_time()
            for _ in range(inner):
                run()
            elapsed = (time.perf_counter() - start) / inner
            elapsed_cpu = (time.thread_time() - start_cpu) / inner
            if rep >= warmup:
                out[name].append(elapsed)
                cpu[name].append(elapsed_cpu)
    return slowest_rank_times(out), slowest_rank_times(cpu)


def _worker(rank: int, port: int, config: dict[str, Any], result_path: str) -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    join_world(rank, WORLD, port)  # one thread per rank: 2 cores, 2 ranks
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", list(range(WORLD)))
    start = time.perf_counter()
    steps, num_ops = _build(config, rank, mesh)
    build_s = time.perf_counter() - start
    times, cpu = _time(steps, config["reps"], config["warmup"], config["inner"])
    if rank == 0:
        result = {"times": times, "cpu": cpu, "ops": num_ops, "build": build_s}
        Path(result_path).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# -- report ----------------------------------------------------------------------------


def summarize(
    times: dict[str, list[float]], cpu: dict[str, list[float]], num_ops: int
) -> dict[str, dict[str, float]]:
    """Per implementation: step ms, per-op µs and host CPU ms per step, min and median."""
    return {
        name: {
            "min": min(ts) * 1e3,
            "med": statistics.median(ts) * 1e3,
            "op_min": min(ts) * 1e6 / num_ops,
            "op_med": statistics.median(ts) * 1e6 / num_ops,
            "cpu_min": min(cpu[name]) * 1e3,
            "cpu_med": statistics.median(cpu[name]) * 1e3,
        }
        for name, ts in times.items()
    }


def ratios(rows: dict[str, dict[str, float]]) -> dict[str, float]:
    med = {name: r["med"] for name, r in rows.items()}
    return {
        "sbpflow compiled / DTensor compiled": med["sbpflow compiled"] / med["DTensor compiled"],
        "sbpflow eager / sbpflow compiled": med["sbpflow eager"] / med["sbpflow compiled"],
        "sbpflow compiled / plain compiled": med["sbpflow compiled"] / med["plain compiled"],
        "sbpflow compiled / plain compiled, global mean": (
            med["sbpflow compiled"] / med["plain compiled, global mean"]
        ),
        "sbpflow compiled / plain compiled, global mean: host CPU": (
            rows["sbpflow compiled"]["cpu_med"] / rows["plain compiled, global mean"]["cpu_med"]
        ),
    }


def misses(r: dict[str, float]) -> list[str]:
    out = []
    if r["sbpflow compiled / DTensor compiled"] > TARGET_VS_DTENSOR:
        out.append(f"sbpflow compiled / DTensor compiled > {TARGET_VS_DTENSOR}")
    if r["sbpflow eager / sbpflow compiled"] < TARGET_SPEEDUP:
        out.append(f"sbpflow eager / sbpflow compiled < {TARGET_SPEEDUP}")
    if r["sbpflow compiled / plain compiled"] > TARGET_VS_PLAIN:
        out.append(f"sbpflow compiled / plain compiled > {TARGET_VS_PLAIN}")
    return out


def render(rows: dict[str, dict[str, float]], r: dict[str, float]) -> str:
    lines = [
        "| implementation | step ms | per-op host µs | host CPU ms per step |",
        "|---|---|---|---|",
    ]
    for name, row in rows.items():
        lines.append(
            f"| {name} | {row['min']:.2f} / {row['med']:.2f} "
            f"| {row['op_min']:.1f} / {row['op_med']:.1f} "
            f"| {row['cpu_min']:.2f} / {row['cpu_med']:.2f} |"
        )
    lines += ["", "| ratio (medians) | measured | target |", "|---|---|---|"]
    targets = (
        f"<= {TARGET_VS_DTENSOR}",
        f">= {TARGET_SPEEDUP}",
        f"<= {TARGET_VS_PLAIN}",
        "(like for like, no target)",
        "(like for like, no target)",
    )
    for (name, value), target in zip(r.items(), targets, strict=True):
        lines.append(f"| {name} | {value:.2f} | {target} |")
    return "\n".join(lines)


SECTION_START = "<!-- bench:compile:start -->"
SECTION_END = "<!-- bench:compile:end -->"


def section(
    rows: dict[str, dict[str, float]],
    r: dict[str, float],
    config: dict[str, Any],
    num_ops: int,
    load: str,
) -> str:
    args = " ".join(f"--{k} {config[k]}" for k in ("layers", "dim", "batch", "reps", "inner"))
    args += "" if config["bucketed"] else " --per-parameter"
    off = misses(r)
    verdict = ["Targets met (medians)."] if not off else ["Off target:", *[f"- {m}" for m in off]]
    return "\n".join(
        [
            SECTION_START,
            "## Compiled mode: a small transformer step, eager and under `torch.compile`",
            "",
            f"Machine: `{machine()}`; {WORLD} ranks, one thread each; load average {load}.",
            "",
            f"Reproduce: `python bench/compile/run.py {args} --out docs/benchmarks.md`",
            "",
            f"A {config['layers']}-layer transformer (width {config['dim']}, {config['heads']} "
            f"heads, vocabulary {config['vocab']}), batch {config['batch']} x {config['seq']} "
            "tokens split over the ranks (data parallel). One step: forward, cross-entropy, "
            "backward and the gradients' all_reduce, eager in every implementation: "
            + (
                "one bucket (sbpflow: `sync_gradients`; DTensor and plain torch: the flattened "
                "gradients, one `dist.all_reduce`). "
                if config["bucketed"]
                else "one collective per parameter (sbpflow: a bucket per parameter, DTensor's "
                "`redistribute` to `Replicate()`, plain torch's `dist.all_reduce`). "
            )
            + "sbpflow and DTensor compute the mean loss of the whole batch, so their step holds "
            "one more collective (an all_reduce of the mean's divisor: the count of non-ignored "
            "tokens, inside the compiled forward); plain torch takes each rank's local mean, "
            "and `plain compiled, global mean` computes the whole batch's mean by hand (a "
            "functional all_reduce of the count in the compiled function), the like-for-like "
            "baseline. "
            "Gradients and loss of sbpflow, DTensor and the plain global mean are checked against one process "
            "before timing. Compiled: `torch.compile` of model and loss, "
            "default backend (Inductor, C++). "
            f"Per-op host time: step time / {num_ops}, the ATen ops of one plain eager step. "
            "Host CPU: the CPU time of each rank's main thread per step (Python, dispatch and "
            "kernels; not the time it waits for the other rank), the larger rank's.",
            "",
            f"{config['reps']} samples of {config['inner']} steps per implementation after "
            f"{config['warmup']} warmup, interleaved, a barrier before each, the slower rank's "
            "time; `min / median`.",
            "",
            render(rows, r),
            "",
            *verdict,
            SECTION_END,
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2, help="transformer layers (default 2)")
    parser.add_argument("--dim", type=int, default=32, help="model width (default 32)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--reps", type=int, default=11, help="timed samples (default 11)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed repetitions (default 2)")
    parser.add_argument("--inner", type=int, default=10, help="steps per sample (default 10)")
    parser.add_argument(
        "--per-parameter",
        action="store_true",
        help="reduce gradients one collective per parameter (default: one bucket)",
    )
    parser.add_argument("--quick", action="store_true", help="3 samples of 3 steps: a smoke run")
    parser.add_argument("--out", type=Path, help="write the results into this file's section")
    args = parser.parse_args(argv)
    config = {
        "layers": args.layers,
        "dim": args.dim,
        "heads": 2,
        "vocab": 64,
        "batch": args.batch,
        "seq": 16,
        "reps": args.reps,
        "warmup": args.warmup,
        "inner": args.inner,
        "bucketed": not args.per_parameter,
    }
    if args.quick:
        config.update(reps=3, warmup=1, inner=3)
    print(f"# compile benchmark on {machine()}", flush=True)
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "results.json")
        mp.spawn(_worker, args=(free_port(), config, path), nprocs=WORLD, join=True)
        result = json.loads(Path(path).read_text())
    load = f"{load_start:.1f} at start, {os.getloadavg()[0]:.1f} at end (1 min)"
    rows = summarize(result["times"], result["cpu"], result["ops"])
    r = ratios(rows)
    print(render(rows, r))
    print(f"(build and compile: {result['build']:.0f} s; ATen ops per plain step: {result['ops']})")
    off = misses(r)
    print("\n".join(["off target:", *off]) if off else "targets met")
    if args.out is not None:
        write_section(
            args.out, section(rows, r, config, result["ops"], load), SECTION_START, SECTION_END
        )
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
