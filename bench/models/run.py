"""Real models: Hugging Face GPT-2 and Llama under each sbpflow layout against its torch peer.

One invocation runs every suite below, each in fresh processes of 2 gloo ranks, ``--runs``
times; inside a run the variants of a suite are interleaved (every repetition runs each
once, in an order rotating from one repetition to the next, a step's time the slower
rank's; ``bench/_ranks.interleaved_step_times``). A step is ``zero_grad``, the forward with
``labels`` (the library's causal-LM loss), ``backward`` and AdamW's ``step`` (torch's default
implementation for the parameters' type: on CPU the per-parameter loop; with ``--adamw
foreach`` every variant, floor and torch peer alike, passes ``foreach=True``, what torch picks
by default on CUDA).

Models, from configs built in code (random weights, no download), dropout off, no cache:

- GPT-2: 4 layers, 256 wide, 4 heads, vocabulary 8192, eager attention (the library's);
- Llama: 4 layers, hidden 256, intermediate 1024, 8 heads and 4 key/value heads (GQA),
  vocabulary 8192, SDPA attention.

Sequences of 128 tokens, 4 per rank (data parallel: split on dim 0; tensor parallel: the
same 4 on both ranks).

Suites (torch peer first; the ratio column is each variant's median over the peer's, and in
eager mode the "/ floor" column its median over the floor's; "CPU ms" the median over runs of
each run's median CPU time per step, ``time.process_time`` of the slower rank's process with
gloo's threads, which other processes on a shared machine disturb far less than the wall
time, and "CPU ratio" that over the peer's):

- **dp-gpt2**, **dp-llama**: torch DDP; the floor; sbpflow global DP
  (``model.to_global(P, broadcast)``, batch ``split(0)``); compiled: ``torch.compile(DDP)``
  and sbpflow ``torch.compile(model)``;
- **tp-llama**: DTensor ``parallelize_module`` with torchtitan's plan (q/k/v/gate/up
  column-wise, o/down row-wise); the floor; sbpflow's Megatron layout (the same weights
  split); eager and ``torch.compile(model)``;
- **fsdp-llama**: torch ``fully_shard`` (FSDP2); the floor; sbpflow ``fully_shard``, on each
  decoder layer and then the root; eager and ``torch.compile(model)``.

The floor (eager only, ``bench/models/_floors.py``) is the same model, batch and layout done
by hand: every parameter and the batch in the minimal ``__torch_dispatch__`` subclass
``bench/_floor.Floor``, every collective a plain ``torch.distributed`` call on the locals,
with no layout logic: what any Python tensor subclass pays for that layout.

- DP: a replica per rank; gradients averaged with one flat all_reduce after backward;
- TP: the Megatron split on local shards (each rank computes its half of the heads and of
  the MLP); each attention and MLP block takes its input through an identity whose backward
  all_reduces the gradient and returns its output through one all_reduce (identity
  backward);
- FSDP: each decoder layer and the root keep their parameters as one flat shard per rank:
  all_gathered before the module's forward, freed after a layer's forward and gathered again
  when the gradient reaches its output (the root keeps them until its backward), the flat
  gradient reduce_scattered and averaged; AdamW steps on the flat shards (5 tensors, where the
  two ``fully_shard`` rows keep one shard per parameter).

Each floor checks once, before timing, that its loss and gradients equal the unsplit model's
in one process.

A variant that raises is reported with its error instead of a time.

Usage (from the repository root)::

    python bench/models/run.py                                 # every suite, 3 runs
    python bench/models/run.py --suites dp-gpt2 --runs 1 --reps 3 --modes eager
    python bench/models/run.py --suites dp-llama,fsdp-llama --modes compiled
    python bench/models/run.py --suites dp-gpt2 --modes compiled --adamw default,foreach
    python bench/models/run.py --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import sbpflow  # noqa: E402
from bench._ranks import interleaved_step_times, join_world  # noqa: E402
from bench._report import machine, write_section  # noqa: E402
from bench.models._floors import dp_floor, fsdp_floor, tp_floor  # noqa: E402
from sbpflow.sbp import broadcast, split  # noqa: E402
from sbpflow.testing import free_port  # noqa: E402

WORLD = 2
SEQ, BATCH_PER_RANK, VOCAB = 128, 4, 8192
WARMUP = 3
SUITES = ("dp-gpt2", "dp-llama", "tp-llama", "fsdp-llama")
SECTION_START, SECTION_END = "<!-- bench:models:start -->", "<!-- bench:models:end -->"


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=256, n_layer=4, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, attn_implementation="eager",
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # the library warns (a graph break) without one
    return model


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ,
        attention_dropout=0.0, use_cache=False, attn_implementation="sdpa",
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    model.loss_type = "ForCausalLM"
    return model


def megatron(name: str, tensor: torch.Tensor) -> Any:
    """sbpflow's Megatron layout of Llama: the weights torchtitan's plan splits."""
    module = name.split(".")[-2] if "." in name else ""
    if module in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        return split(0)
    return split(1) if module in ("o_proj", "down_proj") else broadcast


def _step(model: nn.Module, ids: Any, foreach: bool | None) -> Callable[[], None]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=foreach)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()

    return step


def _variants(
    suite: str, rank: int, compiled: bool, foreach: bool | None
) -> dict[str, Callable[[], Callable[[], None]]]:
    """Per variant, a builder returning its step (built lazily so one failing is reported)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    family, make = (suite.split("-")[1], {"gpt2": gpt2, "llama": llama}[suite.split("-")[1]])
    torch.manual_seed(0)
    base = make()
    world_ids = torch.randint(0, VOCAB, (WORLD * BATCH_PER_RANK, SEQ))
    local_ids = world_ids.chunk(WORLD)[rank].contiguous()
    placement = sbpflow.placement("cpu", list(range(WORLD)))
    mesh = init_device_mesh("cpu", (WORLD,))
    maybe = torch.compile if compiled else (lambda m: m)
    out: dict[str, Callable[[], Callable[[], None]]] = {}
    kind = suite.split("-")[0]
    if kind == "dp":

        def torch_ddp() -> Callable[[], None]:
            return _step(maybe(DistributedDataParallel(copy.deepcopy(base))), local_ids, foreach)

        def sbpflow_dp() -> Callable[[], None]:
            model = copy.deepcopy(base).to_global(placement, broadcast)
            ids = local_ids.to_global(placement, split(0), shape=world_ids.shape, check_meta=False)
            return _step(maybe(model), ids, foreach)

        out["torch DDP"] = torch_ddp
        if not compiled:
            out["floor"] = lambda: dp_floor(base, world_ids, rank, foreach)
        out["sbpflow global DP"] = sbpflow_dp
    elif kind == "tp":
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        def dtensor_tp() -> Callable[[], None]:
            model = copy.deepcopy(base)
            plan = {
                **{f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")},
                "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(),
            }
            for layer in model.model.layers:
                parallelize_module(layer, mesh, plan)
            return _step(maybe(model), world_ids[:BATCH_PER_RANK], foreach)

        def sbpflow_tp() -> Callable[[], None]:
            model = copy.deepcopy(base).to_global(placement, broadcast)
            model.to_global(placement, megatron)
            ids = world_ids[:BATCH_PER_RANK].to_global(placement, broadcast)
            return _step(maybe(model), ids, foreach)

        out["DTensor TP"] = dtensor_tp
        if not compiled:
            out["floor"] = lambda: tp_floor(base, world_ids[:BATCH_PER_RANK], rank, foreach)
        out["sbpflow TP"] = sbpflow_tp
    else:
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        from sbpflow.nn.parallel import fully_shard

        def torch_fsdp() -> Callable[[], None]:
            model = copy.deepcopy(base)
            for layer in model.model.layers:
                torch_fully_shard(layer, mesh=mesh)
            torch_fully_shard(model, mesh=mesh)
            return _step(maybe(model), local_ids, foreach)

        def sbpflow_fsdp() -> Callable[[], None]:
            model = copy.deepcopy(base)
            for layer in model.model.layers:
                fully_shard(layer, placement)
            fully_shard(model, placement)
            ids = local_ids.to_global(placement, split(0), shape=world_ids.shape, check_meta=False)
            return _step(maybe(model), ids, foreach)

        out["torch fully_shard"] = torch_fsdp
        if not compiled:
            out["floor"] = lambda: fsdp_floor(base, world_ids, rank, foreach)
        out["sbpflow fully_shard"] = sbpflow_fsdp
    del family
    return out


def _worker(
    rank: int, suite: str, compiled: bool, foreach: bool | None, port: int, reps: int, queue: Any
) -> None:
    warnings.filterwarnings("ignore")
    join_world(rank, WORLD, port)
    steps: dict[str, Callable[[], None]] = {}
    errors: dict[str, str] = {}
    for name, build in _variants(suite, rank, compiled, foreach).items():
        try:
            steps[name] = build()
            steps[name]()  # the first step: compiles, and surfaces a failure before timing
        except Exception as error:
            errors[name] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:160]}"
            if rank == 0:
                traceback.print_exc()
            steps.pop(name, None)
        failed = torch.tensor([name in errors], dtype=torch.int32)
        dist.all_reduce(failed)  # every rank keeps the same variants
        if failed.item() and name in steps:
            steps.pop(name)
            errors[name] = "failed on another rank"
    times, cpu = interleaved_step_times(steps, WARMUP, reps) if steps else ({}, {})
    if rank == 0:
        medians = {n: statistics.median(t) for n, t in times.items()}
        queue.put((medians, errors, {n: statistics.median(t) for n, t in cpu.items()}))
    dist.barrier()


def _one_run(
    suite: str, compiled: bool, foreach: bool | None, reps: int
) -> tuple[dict[str, float], dict[str, str], dict[str, float]]:
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(
        _worker,
        args=(suite, compiled, foreach, free_port(), reps, queue),
        nprocs=WORLD,
        start_method="spawn",
    )
    return queue.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suites", default=",".join(SUITES))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10, help="timed steps per variant and run")
    parser.add_argument("--eager-only", action="store_true", help="same as --modes eager")
    parser.add_argument(
        "--modes", default="eager,compiled", help="eager, compiled or both (comma-separated)"
    )
    parser.add_argument(
        "--adamw",
        default="default",
        help="AdamW's implementation: default (torch's choice for the parameters' type: the "
        "per-parameter loop on CPU), foreach, or both (comma-separated)",
    )
    parser.add_argument("--out", type=Path, help="write the results into this file's section")
    args = parser.parse_args()
    modes = ["eager"] if args.eager_only else args.modes.split(",")
    adamws = args.adamw.split(",")
    unknown = set(modes) - {"eager", "compiled"} | set(adamws) - {"default", "foreach"}
    if unknown or set(args.suites.split(",")) - set(SUITES):
        parser.error(
            f"--modes takes eager and/or compiled, --adamw default and/or foreach, and "
            f"--suites some of {','.join(SUITES)} (comma-separated); got --modes {args.modes} "
            f"--adamw {args.adamw} --suites {args.suites}"
        )
    load = os.getloadavg()[0]
    lines = [
        SECTION_START,
        "## Real models: Hugging Face GPT-2 and Llama against the torch peers",
        "",
        f"Machine: `{machine()}`; {WORLD} gloo ranks, one thread each; load average "
        f"{load:.1f} at start. `python bench/models/run.py --runs {args.runs} --reps "
        f"{args.reps} --adamw {args.adamw}`: GPT-2 (4 layers, 256 wide) and Llama (4 layers, hidden 256, "
        f"intermediate 1024, GQA), seq {SEQ}, {BATCH_PER_RANK} sequences per rank, AdamW; "
        f"median step time (ms) of each run, then the median of the {args.runs} runs' medians; "
        "ratio: the variant's over the torch peer's (first row of each group); / floor: the "
        "variant's over the floor's (eager: the same layout by hand on the minimal subclass); "
        "CPU ms: the step's CPU time (the process's, gloo's threads included), median of the "
        "runs' medians, and its ratio to the peer's; "
        "load: the 1-minute load average at the start of each run.",
        "",
        "| suite | mode | variant | ms per run | median ms | ratio | / floor | CPU ms | CPU ratio "
        "| load per run |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for suite in args.suites.split(","):
        for compiled, foreach in [
            (m == "compiled", a == "foreach")
            for m in ("eager", "compiled")
            if m in modes
            for a in ("default", "foreach")
            if a in adamws
        ]:
            runs, loads = [], []
            for _ in range(args.runs):
                loads.append(f"{os.getloadavg()[0]:.1f}")
                runs.append(_one_run(suite, compiled, foreach or None, args.reps))
            mode = ("compiled" if compiled else "eager") + (", foreach AdamW" if foreach else "")
            names = list(dict.fromkeys(n for times, errors, _ in runs for n in [*times, *errors]))
            per_run = {n: [times[n] for times, _, _ in runs if n in times] for n in names}
            middles = {n: statistics.median(t) for n, t in per_run.items() if t}
            cpu = {
                n: statistics.median([c[n] for _, _, c in runs if n in c]) for n in middles
            }  # the median over runs of each run's median CPU time per step
            peer, floor, cpu_peer = None, middles.get("floor"), None
            for name in names:
                error = next((errors[name] for _, errors, _ in runs if name in errors), None)
                if error or name not in middles:
                    lines.append(f"| {suite} | {mode} | {name} | failed: {error} | | | | | | |")
                    continue
                middle = middles[name]
                peer = middle if peer is None else peer
                cpu_peer = cpu[name] if cpu_peer is None else cpu_peer
                each = ", ".join(f"{t:.1f}" for t in per_run[name])
                over_floor = f"{middle / floor:.2f}" if floor else ""
                lines.append(
                    f"| {suite} | {mode} | {name} | {each} | {middle:.1f} | {middle / peer:.2f} "
                    f"| {over_floor} | {cpu[name]:.1f} | {cpu[name] / cpu_peer:.2f} "
                    f"| {', '.join(loads)} |"
                )
                print(lines[-1], flush=True)
    lines += ["", f"Load average at the end: {os.getloadavg()[0]:.1f} (1 min).", SECTION_END]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        write_section(args.out, text, SECTION_START, SECTION_END)


if __name__ == "__main__":
    main()
