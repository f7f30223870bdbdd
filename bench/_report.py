"""Writing a benchmark's results into its own section of ``docs/benchmarks.md``."""

from __future__ import annotations

import os
import platform
import statistics
from pathlib import Path

import torch


def write_section(path: Path, text: str, start: str, end: str) -> None:
    """Replace the text between ``start`` and ``end`` markers in ``path``, keeping the rest.

    ``text`` includes both markers; a file without them gets the section appended.
    """
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    if start in old and end in old:
        head, rest = old.split(start, 1)
        tail = rest.split(end, 1)[1]
        new = head + text + tail
    else:
        new = old.rstrip("\n") + "\n\n" + text + "\n"
    path.write_text(new)


def machine() -> str:
    """The machine line every benchmark table names."""
    cpu = f"{os.cpu_count()}-core {platform.machine()} CPU"
    return f"{cpu}, one host, torch {torch.__version__}, Python {platform.python_version()}"


def verdict(label: str, target: float, ratios: list[float], of: str = "") -> str:
    """``- label: target <= 1.05x[ of]; median of the runs 0.97x: met; worst run 1.01x: met``:
    a target judged on the median of the runs' ratios and on the worst run."""
    middle, worst = statistics.median(ratios), max(ratios)
    return (
        f"- {label}: target <= {target:.2f}x{of}; median of the runs {middle:.2f}x: "
        f"{'met' if middle <= target else 'missed'}; worst run {worst:.2f}x: "
        f"{'met' if worst <= target else 'missed'}"
    )
