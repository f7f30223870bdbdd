"""The parts of ``bench/gpu/run.py``; each returns a JSON-able dict of what it measured.

Every part runs on CUDA when it is there and on the CPU otherwise (so that the
script can be smoke-tested on a machine without a GPU: ``--quick``).
"""

from __future__ import annotations

import copy
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench._floor import Floor

ROOT = Path(__file__).resolve().parents[2]


def run(part: str, quick: bool) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    out = {"machine": machine()}
    out.update(globals()[f"_{part}"](quick))
    return out


def device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
            nccl=".".join(map(str, torch.cuda.nccl.version())),
        )
        try:
            import cupy

            info["cupy"] = cupy.__version__
        except Exception as error:  # not installed, or built for another CUDA
            info["cupy"] = f"unavailable ({type(error).__name__})"
    else:
        info["gpu"] = None
    return info


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# -- tests ----------------------------------------------------------------------------------

TEST_FILES = (
    "tests/gpu",
    "tests/unit/test_devices.py",
    "tests/dist/test_device_moves.py",
    "tests/dist/test_amp.py",
    "tests/dist/test_checkpoint.py",
)


def _tests(quick: bool) -> dict[str, Any]:
    """pytest over the GPU tier and every device-move, AMP and checkpoint test: counts per file."""
    files = TEST_FILES[:2] if quick else TEST_FILES
    xml = Path(os.environ.get("TMPDIR", "/tmp")) / f"sbpflow-gpu-tests-{os.getpid()}.xml"
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
         *files],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    print(done.stdout[-6000:], done.stderr[-3000:], flush=True)
    by_file: dict[str, dict[str, int]] = {}
    failures: list[str] = []
    for case in ElementTree.parse(xml).getroot().iter("testcase"):
        name = case.get("classname", "").replace(".", "/") + ".py"
        counts = by_file.setdefault(name, {"passed": 0, "failed": 0, "skipped": 0})
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
            failures.append(f"{case.get('classname')}::{case.get('name')}")
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    return {
        "exit": done.returncode,
        "summary": summary,
        "seconds": round(seconds, 1),
        "by_file": by_file,
        "failures": failures[:20],
    }


# -- dispatch -------------------------------------------------------------------------------


def _one_rank_world() -> tuple[Any, Any]:
    """sbpflow's world of one (NCCL for cuda tensors) and a DTensor mesh over it."""
    from torch.distributed.device_mesh import DeviceMesh

    import sbpflow

    sbpflow.env.ensure_initialized()
    where = device().type
    return sbpflow.placement(where, [0]), DeviceMesh(where, [0])


def _dispatch(quick: bool) -> dict[str, Any]:
    """Microseconds per op call, median over repetitions of ``inner`` calls each, interleaved."""
    from torch.distributed.tensor import Replicate, distribute_module, distribute_tensor

    import sbpflow

    placement, mesh = _one_rank_world()
    b = sbpflow.sbp.broadcast
    sizes = {"small": 64, "large": 256 if quick else 8192}
    rows: dict[str, dict[str, float]] = {}
    for label, n in sizes.items():
        torch.manual_seed(0)
        dtype = torch.bfloat16 if label == "large" and device().type == "cuda" else torch.float32
        x = torch.randn(n, n, device=device(), dtype=dtype)
        w = torch.randn(n, n, device=device(), dtype=dtype)
        linear = nn.Linear(n, n, device=device(), dtype=dtype)
        gx, gw = (sbpflow.to_global(t, placement, b, check_meta=False) for t in (x, w))
        dx, dw = (distribute_tensor(t, mesh, [Replicate()]) for t in (x, w))
        fx, fw = Floor.wrap(x), Floor.wrap(w)
        g_linear = copy.deepcopy(linear).to_global(placement, b)
        d_linear = distribute_module(copy.deepcopy(linear), mesh)
        f_linear = copy.deepcopy(linear)
        for name, p in list(f_linear.named_parameters()):
            setattr(f_linear, name, nn.Parameter(Floor.wrap(p.detach())))
        cases: dict[str, dict[str, Callable[[], Any]]] = {
            f"add {label}": {
                "plain": lambda x=x, w=w: x + w,
                "floor": lambda a=fx, c=fw: a + c,
                "sbpflow": lambda a=gx, c=gw: a + c,
                "dtensor": lambda a=dx, c=dw: a + c,
            },
            f"mm {label}": {
                "plain": lambda x=x, w=w: x @ w,
                "floor": lambda a=fx, c=fw: a @ c,
                "sbpflow": lambda a=gx, c=gw: a @ c,
                "dtensor": lambda a=dx, c=dw: a @ c,
            },
            f"linear {label}": {
                "plain": lambda m=linear, a=x: m(a),
                "floor": lambda m=f_linear, a=fx: m(a),
                "sbpflow": lambda m=g_linear, a=gx: m(a),
                "dtensor": lambda m=d_linear, a=dx: m(a),
            },
        }
        for op, impls in cases.items():
            want = impls["plain"]().float()
            for name in ("floor", "sbpflow", "dtensor"):
                got = impls[name]()
                local = got._local if name == "floor" else got.to_local()
                if not torch.allclose(local.float(), want, atol=1e-2, rtol=1e-2):
                    raise AssertionError(f"{name} {op} differs from plain torch")
            inner = 20 if label == "large" else 200
            rows[op] = _interleaved_us(impls, reps=5 if quick else 15, inner=inner)
    return {"rows": rows, "sizes": sizes}


def _interleaved_us(impls: dict[str, Callable[[], Any]], reps: int, inner: int) -> dict[str, float]:
    names = list(impls)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(reps + 2):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            call = impls[name]
            _sync()
            start = time.perf_counter()
            for _ in range(inner):
                call()
            _sync()
            if rep >= 2:
                samples[name].append((time.perf_counter() - start) / inner * 1e6)
    return {name: statistics.median(s) for name, s in samples.items()}


# -- gpt2 -------------------------------------------------------------------------------------


def _gpt2(quick: bool) -> dict[str, Any]:
    """Step time and peak memory of GPT-2 small: plain and global, eager and compiled."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import sbpflow

    placement, _ = _one_rank_world()
    where = device()
    if quick:
        config = GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=128, n_positions=64)
        seq, batches, steps = 32, [4], 3
    else:
        config = GPT2Config()  # 124M parameters: 768 wide, 12 layers, 12 heads, vocab 50257
        seq, batches, steps = 1024, [32, 16, 8], 10
    config.use_cache = False
    torch.manual_seed(0)
    base = GPT2LMHeadModel(config)
    base.loss_type = "ForCausalLM"  # the library warns (a graph break) without one
    parameters = sum(p.numel() for p in base.parameters())
    autocast = torch.autocast(where.type, dtype=torch.bfloat16)

    def make(kind: str, compiled: bool, batch: int) -> tuple[Callable[[], float], Any]:
        model = copy.deepcopy(base).to(where)
        torch.manual_seed(1)
        ids = torch.randint(0, config.vocab_size, (batch, seq), device=where)
        if kind == "sbpflow":
            model.to_global(placement, sbpflow.sbp.broadcast)
            ids = sbpflow.to_global(ids, placement, sbpflow.sbp.split(0))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        # compiled: the whole model, as users write it (torch.compile(model))
        run = torch.compile(model) if compiled else model

        def loss_fn(tokens: torch.Tensor) -> torch.Tensor:
            return run(input_ids=tokens, labels=tokens).loss

        def step() -> float:
            with autocast:
                loss = loss_fn(ids)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return time.perf_counter()

        return step, loss_fn

    variants = [("plain", False), ("sbpflow", False), ("plain", True), ("sbpflow", True)]
    rows: dict[str, dict[str, Any]] = {}
    batch = None
    for kind, compiled in variants:
        label = f"{kind} {'compiled' if compiled else 'eager'}"
        torch._dynamo.reset()
        for candidate in batches if batch is None else [batch]:
            try:
                rows[label] = _time_steps(make, kind, compiled, candidate, steps)
                batch = candidate
                break
            except torch.OutOfMemoryError:
                rows[label] = {"error": f"out of memory at batch {candidate}"}
                _free()
            except Exception as error:  # reported in the table, the other variants still run
                rows[label] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
                _free()
                break
        print(label, rows[label], flush=True)
    return {
        "rows": rows,
        "parameters": parameters,
        "seq": seq,
        "batch": batch,
        "steps": steps,
        "layers": config.n_layer,
        "width": config.n_embd,
    }


def _free() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _time_steps(make: Any, kind: str, compiled: bool, batch: int, steps: int) -> dict[str, Any]:
    _free()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    step, _ = make(kind, compiled, batch)
    warm_start = time.perf_counter()
    for _ in range(3):
        step()
    _sync()
    warmup_s = time.perf_counter() - warm_start
    totals, hosts = [], []
    for _ in range(steps):
        _sync()
        start = time.perf_counter()
        issued = step()
        _sync()
        end = time.perf_counter()
        totals.append((end - start) * 1e3)
        hosts.append((issued - start) * 1e3)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    result = {
        "batch": batch,
        "step_ms": statistics.median(totals),
        "host_ms": statistics.median(hosts),
        "peak_gib": peak,
        "warmup_s": round(warmup_s, 1),
    }
    del step
    _free()
    return result


# -- boxing -----------------------------------------------------------------------------------

LAYOUTS = ("S(0)", "S(1)", "B", "P")


def _sbp_of(name: str) -> Any:
    from sbpflow import sbp

    return {"S(0)": sbp.split(0), "S(1)": sbp.split(1), "B": sbp.broadcast, "P": sbp.partial_sum}[
        name
    ]


def _boxing(quick: bool) -> dict[str, Any]:
    """Every pair of one-axis layouts: NCCL at world size 1 here, gloo on CUDA tensors on 2 ranks."""
    import torch.multiprocessing as mp

    from sbpflow.testing import free_port

    one = _box_pairs(world=1, rank=0, shape=(64, 48) if quick else (4096, 4096))
    port = free_port()
    out_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"sbpflow-gpu-boxing-{os.getpid()}"
    out_dir.mkdir(parents=True, exist_ok=True)
    mp.spawn(_boxing_rank, args=(port, str(out_dir)), nprocs=2, join=True)
    import json

    two = json.loads((out_dir / "rank0.json").read_text())
    return {"world1": one, "world2_gloo": two}


def _boxing_rank(rank: int, port: int, out_dir: str) -> None:
    import json

    import torch.distributed as dist

    import sbpflow
    from sbpflow.comm import _groups

    warnings.filterwarnings("ignore")
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )  # fmt: skip
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    # NCCL refuses two ranks on one GPU: this check runs every collective on gloo, which
    # takes CUDA tensors for the collectives it implements.
    dist.init_process_group("gloo")
    _groups.backend_for = lambda device_type: "gloo"  # type: ignore[assignment]
    sbpflow.env.ensure_initialized()
    result = _box_pairs(world=2, rank=rank, shape=(13, 6))
    if rank == 0:
        (Path(out_dir) / "rank0.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _box_pairs(world: int, rank: int, shape: tuple[int, ...]) -> dict[str, Any]:
    """For every (src, dst): the collectives that ran, whether the value is the single-process
    one, and (at world size 1) the time per call."""
    import sbpflow

    where = device()
    placement = sbpflow.placement(where.type, list(range(world)))
    torch.manual_seed(0)
    full = torch.randn(*shape, device=where)
    out: dict[str, Any] = {}
    for src in LAYOUTS:
        for dst in LAYOUTS:
            key = f"{src} -> {dst}"
            try:
                g = _global_of(full, placement, src, rank, world)
                with sbpflow.boxing.trace() as trace:
                    moved = g.to_global(sbp=_sbp_of(dst))
                value = moved.to_global(sbp=sbpflow.sbp.broadcast).to_local()
                ok = bool(torch.allclose(value, full, atol=1e-5))
                row: dict[str, Any] = {"ok": ok, "collectives": dict(trace.collectives())}
                if world == 1:
                    target = _sbp_of(dst)
                    row["us"] = _time_call(lambda g=g, d=target: g.to_global(sbp=d))
                out[key] = row
            except Exception as error:
                out[key] = {"ok": False, "error": f"{type(error).__name__}: {str(error)[:200]}"}
    return out


def _global_of(full: torch.Tensor, placement: Any, layout: str, rank: int, world: int) -> Any:
    import sbpflow

    if layout.startswith("S"):
        dim = int(layout[2])
        local = torch.tensor_split(full, world, dim=dim)[rank].contiguous()
    elif layout == "P":
        local = full if rank == 0 else torch.zeros_like(full)
    else:
        local = full
    return sbpflow.to_global(local, placement, _sbp_of(layout), shape=full.shape)


def _time_call(call: Callable[[], Any], reps: int = 20) -> float:
    for _ in range(3):
        call()
    _sync()
    start = time.perf_counter()
    for _ in range(reps):
        call()
    _sync()
    return (time.perf_counter() - start) / reps * 1e6


# -- kernels ----------------------------------------------------------------------------------


def _padded(chunk: torch.Tensor, rows: int) -> torch.Tensor:
    """``chunk`` with zero rows appended up to ``rows`` (a cat: one copy of the chunk)."""
    if chunk.shape[0] == rows:
        return chunk
    return torch.cat([chunk, chunk.new_zeros((rows - chunk.shape[0], *chunk.shape[1:]))])


def _kernels(quick: bool) -> dict[str, Any]:
    """``pad_chunks``: CuPy kernel vs the torch paths, GB/s counting bytes read and written."""
    import sbpflow_kernels
    from sbpflow.comm.collectives import _packed_chunks
    from sbpflow_kernels.pack import pad_chunks_torch

    where = device()
    cases = {
        # name: (rows, row shape, dtype, chunk count)
        "4 ranks, 64 MiB fp32, rows of 4 KiB": (16385, (1024,), torch.float32, 4),
        "8 ranks, 64 MiB bf16, rows of 8 KiB": (8191, (4096,), torch.bfloat16, 8),
        "8 ranks, 4 MiB bf16, rows of 1.5 KiB": (2731, (768,), torch.bfloat16, 8),
        "4 ranks, 1 MiB fp32, rows of 12 B": (87381, (3,), torch.float32, 4),
    }
    if quick:
        cases = {k: (n // 64 + 3, s, d, c) for k, (n, s, d, c) in cases.items()}
    rows_out: dict[str, Any] = {}
    for name, (num_rows, row_shape, dtype, count) in cases.items():
        rows = torch.randn(num_rows, *row_shape, device=where).to(dtype)
        sizes = [len(c) for c in torch.tensor_split(torch.arange(num_rows), count)]
        longest = max(sizes)

        def hot_path(rows: torch.Tensor = rows, sizes: list[int] = sizes, n: int = longest) -> Any:
            # what reduce_scatter did before: pad each chunk, then concatenate
            return torch.cat([_padded(c, n) for c in torch.split(rows, sizes)], dim=0)

        paths = {
            "cupy": lambda r=rows, s=sizes: sbpflow_kernels.pad_chunks(r, s),
            # what sbpflow's collectives do without the kernel: a copy per chunk, zero tails
            "torch copies + tails": lambda r=rows, s=sizes, n=longest: _packed_chunks(
                r, s, n, range(len(s))
            ),
            "torch fill + copies": lambda r=rows, s=sizes: pad_chunks_torch(r, s),
            "torch pad + cat": hot_path,
        }
        reference = pad_chunks_torch(rows, sizes)
        moved = rows.numel() * rows.element_size() + reference.numel() * reference.element_size()
        copy_dst = torch.empty_like(reference)
        copy_src = torch.empty_like(reference)
        row: dict[str, Any] = {"bytes": moved}
        for label, call in paths.items():
            if label == "cupy" and not sbpflow_kernels.cupy_available():
                row[label] = None
                continue
            if not torch.equal(call(), reference):
                raise AssertionError(f"{label} differs from the reference on {name}")
            seconds = _event_seconds(call)
            row[label] = {"us": seconds * 1e6, "gbps": moved / seconds / 1e9}
        copy_s = _event_seconds(lambda d=copy_dst, s=copy_src: d.copy_(s))
        row["copy_gbps"] = 2 * copy_dst.numel() * copy_dst.element_size() / copy_s / 1e9
        rows_out[name] = row
    return {"rows": rows_out}


def _event_seconds(call: Callable[[], Any], reps: int = 30) -> float:
    """Median seconds per call (CUDA events on the GPU, the wall clock on the CPU)."""
    for _ in range(3):
        call()
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            call()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)
