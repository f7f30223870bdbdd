"""Where measured cost constants are kept between runs: one JSON file per machine.

Pure file I/O (no process group). ``calibrate`` writes
``<cache dir>/calibration-<hostname>-<backend>-<world size>.json``. Nothing
reads it unless asked: ``sbpflow.boxing.load_calibration()`` reads it in a
single process, and in a job only world rank 0 reads it and shares what it
read with every rank (NOTE [stored constants] in calibrate.py). The cost
model itself never reads files. The cache dir is ``$SBPFLOW_CACHE_DIR``, else
``$XDG_CACHE_HOME/sbpflow``, else ``~/.cache/sbpflow``.
"""

from __future__ import annotations

import json
import math
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

_PREFIX = "calibration-"
FORMAT_VERSION = 1


def cache_dir() -> Path:
    explicit = os.environ.get("SBPFLOW_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "sbpflow"


def hostname() -> str:
    # Keep the file name portable: no separators or odd characters.
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in socket.gethostname()) or "host"


def path_for(backend: str, world_size: int) -> Path:
    return cache_dir() / f"{_PREFIX}{hostname()}-{backend}-{world_size}.json"


def save(record: dict[str, Any], path: Path) -> None:
    """Write ``record`` atomically (ranks of one machine may write the same file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load(backend: str, world_size: int) -> dict[str, Any] | None:
    """The record this machine stored for ``backend`` on exactly ``world_size`` ranks, or ``None``.

    Unreadable or malformed files count as absent.
    """
    return _first_readable([path_for(backend, world_size)])


def load_newest(backend: str) -> dict[str, Any] | None:
    """The newest readable record this machine stored for ``backend``, any world size, or ``None``."""
    pattern = f"{_PREFIX}{hostname()}-{backend}-*.json"
    try:
        found = sorted(cache_dir().glob(pattern), key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        found = []
    return _first_readable(found)


def _first_readable(paths: list[Path]) -> dict[str, Any] | None:
    for path in paths:
        record = _read(path)
        if record is not None:
            record["path"] = str(path)
            return record
    return None


def _read(path: Path) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            record = json.load(f)
        constants = [(record["alpha"], record["beta"])]
        constants += [(c["alpha"], c["beta"]) for c in record.get("ops", {}).values()]
        ok = all(0 < float(v) < math.inf for pair in constants for v in pair)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not ok or record.get("version") != FORMAT_VERSION:
        return None
    return dict(record)
