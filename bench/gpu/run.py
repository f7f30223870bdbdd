"""GPU benchmark: what a CUDA user gets, in one command on one device.

Each part runs in a process of its own, bounded in time, and writes its results
as JSON into ``--out-dir``; a crash or a timeout of one part is reported as such
and the others still run. Then the results are rendered as one section of
``docs/benchmarks.md`` naming the device, torch and CUDA:

- **tests**: ``tests/gpu`` and every device-move, AMP and checkpoint test, with counts;
- **dispatch**: the per-op cost of global tensors on CUDA, 1 rank: plain torch, the
  minimal wrapper subclass (floor), sbpflow and DTensor, on small ops (the framework's
  Python dominates) and large ones (the kernel dominates);
- **gpt2**: a GPT-2-small-size model (124M parameters, seq 1024), bf16 autocast,
  AdamW: plain eager, sbpflow global eager (parameters broadcast, batch split on a
  one-rank placement), plain ``torch.compile`` and sbpflow ``torch.compile`` of the loss
  function; step time, host time (when Python has issued the step), peak memory;
- **boxing**: every one-axis layout change through NCCL at world size 1, and on 2 ranks
  through gloo on CUDA tensors (NCCL refuses two ranks on one GPU), each compared
  with the single-process value;
- **kernels**: ``sbpflow_kernels.pad_chunks`` (CuPy) against the torch paths it
  replaces, in GB/s and as a fraction of a plain device-to-device copy.

Usage (from the repository root)::

    python bench/gpu/run.py --out-dir /tmp/gpu            # on a CUDA machine, every part
    python bench/gpu/run.py --quick --out-dir /tmp/gpu    # a fast smoke run (also on CPU)
    python bench/gpu/run.py --render /tmp/gpu --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PARTS = ("kernels", "boxing", "dispatch", "tests", "gpt2")
# Seconds each part may take on an H100/H200 before it is stopped (8 minutes in all).
LIMITS = {"tests": 180, "dispatch": 45, "gpt2": 220, "boxing": 45, "kernels": 30}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, help="where each part writes its JSON")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated parts")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # run one part in this process
    parser.add_argument("--render", type=Path, help="render a results folder, run nothing")
    parser.add_argument("--out", type=Path, help="write the section into this markdown file")
    args = parser.parse_args(argv)

    if args.part:
        from bench.gpu import _parts

        result = _parts.run(args.part, quick=args.quick)
        (args.out_dir / f"{args.part}.json").write_text(json.dumps(result, indent=1))
        return
    if args.render is None:
        if args.out_dir is None:
            parser.error("give --out-dir (to run) or --render (to render a results folder)")
        args.out_dir.mkdir(parents=True, exist_ok=True)
        for part in args.parts.split(","):
            _run_part(part, args.out_dir, args.quick)
    folder = args.render or args.out_dir
    from bench.gpu import _render

    text = _render.section(folder)
    (folder / "section.md").write_text(text)
    print(text)
    if args.out is not None:
        from bench._report import write_section

        write_section(args.out, text, _render.SECTION_START, _render.SECTION_END)


def _run_part(part: str, out_dir: Path, quick: bool) -> None:
    if part not in PARTS:
        raise SystemExit(f"unknown part {part!r}; the parts are {', '.join(PARTS)}.")
    command = [sys.executable, str(Path(__file__)), "--part", part, "--out-dir", str(out_dir)]
    if quick:
        command.append("--quick")
    log = out_dir / f"{part}.log"
    limit = LIMITS[part] * (4 if quick else 1)  # a smoke run on a CPU is slower than a GPU
    start = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    with log.open("w") as sink:
        try:
            code = subprocess.run(
                command, stdout=sink, stderr=subprocess.STDOUT, timeout=limit, env=env,
                cwd=ROOT,
            ).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            code = "timeout"
    seconds = time.perf_counter() - start
    status = {"part": part, "exit": code, "seconds": round(seconds, 1)}
    (out_dir / f"{part}.status.json").write_text(json.dumps(status))
    print(f"{part}: exit {code} in {seconds:.0f} s", flush=True)
    if code != 0:
        print("".join(log.read_text().splitlines(keepends=True)[-15:]), flush=True)


if __name__ == "__main__":
    main()
