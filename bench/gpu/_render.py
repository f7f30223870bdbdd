"""Rendering ``bench/gpu/run.py``'s results folder as one section of ``docs/benchmarks.md``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SECTION_START = "<!-- bench:gpu:start -->"
SECTION_END = "<!-- bench:gpu:end -->"


def section(folder: Path) -> str:
    parts = {p.stem: json.loads(p.read_text()) for p in folder.glob("*.json") if "." not in p.stem}
    status = {p.name.split(".")[0]: json.loads(p.read_text()) for p in folder.glob("*.status.json")}
    machines = {name: _machine(r.get("machine", {})) for name, r in parts.items()}
    one_machine = len(set(machines.values())) <= 1
    lines = [SECTION_START, "## GPU: what a CUDA user gets", ""]
    if one_machine:
        lines += [
            f"Machine: {next(iter(machines.values()), 'unknown')}. Produced by "
            f"`python bench/gpu/run.py` (one command, {_total_seconds(status)}); each part "
            "below ran in a process of its own.",
            "",
        ]
    else:
        lines += [
            "Produced by `python bench/gpu/run.py`, each part in a process of its own; the "
            "parts below come from runs on two machines, each named under its part.",
            "",
        ]
    notes = folder / "notes.md"
    if notes.exists():
        lines += [notes.read_text().strip(), ""]
    for name, render in (
        ("tests", _tests),
        ("dispatch", _dispatch),
        ("gpt2", _gpt2),
        ("boxing", _boxing),
        ("kernels", _kernels),
    ):
        if name in parts:
            body = render(parts[name])
            if not one_machine:
                seconds = status.get(name, {}).get("seconds")
                took = f", {seconds:.0f} s" if seconds is not None else ""
                body[2:2] = [f"Machine: {machines[name]}{took}.", ""]
            lines += body
        elif name in status:
            lines += [f"### {name}", "", f"Did not finish: exit {status[name]['exit']}.", ""]
    lines.append(SECTION_END)
    return "\n".join(lines)


def _machine(m: dict[str, Any]) -> str:
    if not m:
        return "unknown"
    if not m.get("gpu"):
        return f"no GPU (a CPU smoke run), {m.get('cpus')} CPU cores, torch {m['torch']}"
    return (
        f"one {m['gpu']} ({m['gpu_memory_gib']} GiB), {m['cpus']} CPU cores, torch {m['torch']}, "
        f"CUDA {m['cuda']}, NCCL {m['nccl']}, CuPy {m.get('cupy')}, Python {m['python']}"
    )


def _total_seconds(status: dict[str, Any]) -> str:
    total = sum(s["seconds"] for s in status.values())
    return f"{total:.0f} s for the parts run" if status else "time not recorded"


def _tests(r: dict[str, Any]) -> list[str]:
    lines = [
        "### Tests on the device",
        "",
        f"`pytest` over the GPU tier and every device-move, AMP and checkpoint test: "
        f"**{r['summary']}** ({r['seconds']:.0f} s).",
        "",
        "| file | passed | failed | skipped |",
        "|---|---:|---:|---:|",
    ]
    for name, c in sorted(r["by_file"].items()):
        lines.append(f"| `{name}` | {c['passed']} | {c['failed']} | {c['skipped']} |")
    if r["failures"]:
        lines += ["", "Failed: " + ", ".join(f"`{f}`" for f in r["failures"])]
    return [*lines, ""]


def _dispatch(r: dict[str, Any]) -> list[str]:
    lines = [
        "### Per-op cost on CUDA, 1 rank",
        "",
        f"Microseconds per call, median of interleaved repetitions (each call synchronised "
        f"in batches). Small: {r['sizes']['small']}x{r['sizes']['small']} float32, where the "
        f"framework's Python is the whole cost; large: {r['sizes']['large']}x"
        f"{r['sizes']['large']} bfloat16, where the kernel is. Every layout is broadcast on a "
        "one-rank placement (DTensor: `Replicate`), so no collective runs.",
        "",
        "| op | plain | floor | sbpflow | DTensor | sbpflow - plain | DTensor - plain |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for op, t in r["rows"].items():
        lines.append(
            f"| {op} | {t['plain']:.1f} | {t['floor']:.1f} | {t['sbpflow']:.1f} | "
            f"{t['dtensor']:.1f} | {t['sbpflow'] - t['plain']:+.1f} | "
            f"{t['dtensor'] - t['plain']:+.1f} |"
        )
    return [*lines, ""]


def _gpt2(r: dict[str, Any]) -> list[str]:
    lines = [
        "### GPT-2 small on one GPU: plain vs global, eager vs compiled",
        "",
        f"Hugging Face `GPT2LMHeadModel`, {r['parameters'] / 1e6:.0f}M parameters "
        f"({r['layers']} layers, {r['width']} wide), seq {r['seq']}, batch {r['batch']}, bf16 "
        "autocast, AdamW (torch's default implementation for the parameters' type), "
        f"median of {r['steps']} steps after 3 warm-up steps. sbpflow: parameters broadcast, "
        "batch split on a one-rank cuda placement. Compiled: `torch.compile(model)`, the "
        "whole model as users write it, the optimizer eager. *host* is when "
        "Python has issued the whole step; when it is well below the step time, the GPU is "
        "the bottleneck and the per-op cost is hidden behind the kernels.",
        "",
        "| variant | step (ms) | host (ms) | vs plain eager | peak memory (GiB) | warm-up (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    base = r["rows"].get("plain eager", {}).get("step_ms")
    for label, row in r["rows"].items():
        if "error" in row:
            error = " ".join(row["error"].split())[:160]
            lines.append(f"| {label} | failed: {error} | | | | |")
            continue
        ratio = f"{row['step_ms'] / base:.2f}x" if base else "-"
        peak = f"{row['peak_gib']:.1f}" if row["peak_gib"] is not None else "-"
        lines.append(
            f"| {label} | {row['step_ms']:.1f} | {row['host_ms']:.1f} | {ratio} | {peak} | "
            f"{row['warmup_s']:.0f} |"
        )
    return [*lines, ""]


def _boxing(r: dict[str, Any]) -> list[str]:
    lines = [
        "### Boxing on CUDA",
        "",
        "Every one-axis layout change, its value checked against the single-process tensor. "
        "World size 1 runs on NCCL (time per call at 4096x4096 float32); 2 ranks on one GPU "
        "run every collective on gloo with CUDA tensors (NCCL refuses two ranks on one "
        "device), 13x6 so that splits are uneven.",
        "",
        "| change | NCCL, 1 rank | µs | gloo on CUDA, 2 ranks | collectives (2 ranks) |",
        "|---|---|---:|---|---|",
    ]
    one, two = r["world1"], r["world2_gloo"]
    for key in one:
        a, b = one[key], two.get(key, {})
        lines.append(
            f"| `{key}` | {_ok(a)} | {a.get('us', 0):.0f} | {_ok(b)} | "
            f"{', '.join(f'{k} {v}' for k, v in b.get('collectives', {}).items()) or '-'} |"
        )
    return [*lines, ""]


def _ok(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"error: {row['error']}"
    return "equal" if row.get("ok") else "**differs**"


def _kernels(r: dict[str, Any]) -> list[str]:
    lines = [
        "### `sbpflow_kernels.pad_chunks` against the torch paths",
        "",
        "Packing a balanced (uneven) split's chunks into equal padded blocks, as a "
        "reduce_scatter of an uneven split needs. GB/s counts bytes read and written; "
        "*copy* is a plain device-to-device copy of the padded buffer's size, the ceiling.",
        "",
        "| case | CuPy kernel | torch: copies + tails (sbpflow without the kernel) | "
        "torch: fill + copies | torch: pad + cat (old hot path) | copy | kernel / copy |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in r["rows"].items():

        def cell(label: str, row: dict[str, Any] = row) -> str:
            v = row.get(label)
            return "-" if v is None else f"{v['gbps']:.0f} GB/s ({v['us']:.0f} µs)"

        cupy = row.get("cupy")
        frac = f"{cupy['gbps'] / row['copy_gbps']:.0%}" if cupy else "-"
        lines.append(
            f"| {name} | {cell('cupy')} | {cell('torch copies + tails')} | "
            f"{cell('torch fill + copies')} | "
            f"{cell('torch pad + cat')} | {row['copy_gbps']:.0f} GB/s | {frac} |"
        )
    return [*lines, ""]
