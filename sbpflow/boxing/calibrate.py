"""Measure the alpha-beta constants of the running backend: ``sbpflow.boxing.calibrate()``.

# NOTE [calibration]
# The planner prices a step as latency per message (alpha) plus bytes over
# bandwidth (beta), with the message and byte counts of cost.py. calibrate()
# times all_reduce, all_gather, reduce_scatter and all_to_all of a few sizes
# on the world (or a given placement), takes the slowest rank's best time of
# each, and fits alpha and 1/beta by least squares on the *same* formulas the
# planner uses (relative error, so the small sizes that pin alpha count as
# much as the large ones that pin beta). One fit over all samples gives the
# backend's link; one fit per collective gives that op its own constants,
# because backends implement them very differently (on gloo over loopback an
# all_gather moves a byte about as slowly as an all_reduce, where the textbook
# ring model says twice as fast). Rank 0's fits are broadcast so every rank
# plans with bit-identical constants; plans that differed between ranks would
# run different collectives and hang.
#
# NOTE [stored constants]
# calibrate() stores its fits per machine (_calibration_store), and nothing reads
# them unless asked: a plan never depends on a file the user did not name, so
# the same script plans the same on every machine (with the defaults, or the
# constants installed in memory). load_calibration() installs a stored record on
# request. In a single process it reads this machine's file. In a job it is a
# collective, and each rank reading its own host's file could make hosts with
# different files plan differently: world rank 0 alone reads its record and
# broadcasts it as one fixed-size float64 vector (cost.to_vector); every rank,
# rank 0 included, installs what arrived, or nothing (on every rank) when rank 0
# had no record. A rank planning differently is thereby impossible, not merely
# detected.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..comm import _bench
from ..comm._world import (
    ensure_initialized,
    get_local_rank,
    get_rank,
    get_world_size,
    is_initialized,
)
from ..placement import Placement
from . import _calibration_store as store
from . import cost as _cost

__all__ = ["Calibration", "Sample", "calibrate", "load_calibration"]

# Sizes of the block each collective handles: two small ones pin the latency,
# two large ones the bandwidth. The large ones sit past the CPU caches, where
# per-byte speed settles (gloo on a 2-core host moves a 16 MiB block ~2x faster
# per byte than a 64 MiB one), because the big steps are the ones whose price
# decides plans. A 4-rank gloo run on that host takes 10-30 s; the result is
# stored, so it is paid once per machine.
DEFAULT_SIZES = (4 << 10, 64 << 10, 32 << 20, 64 << 20)
_MIN_ALPHA = 1e-7  # a fit below 0.1 us per message is noise; floor it
_MAX_BETA = 1e13  # bytes/s; a fit above 10 TB/s is noise


@dataclass(frozen=True)
class Sample:
    """One timing: ``op`` on groups of ``num_ranks`` over a ``num_bytes`` block took ``seconds``."""

    op: str
    num_ranks: int
    num_bytes: int
    seconds: float
    axis: int | None = None  # the placement axis timed alone, None for the whole placement


@dataclass(frozen=True)
class Calibration:
    """What ``calibrate`` measured and installed.

    ``link`` is the fit over all samples on the whole placement and ``ops``
    the fit of each collective alone (together, the model the planner uses);
    ``axes`` holds the fit per placement axis when asked for. ``path``
    is the file the constants were stored in (``None`` if not stored).
    ``measured`` is False for a world of one, where there is nothing to time.
    """

    backend: str
    world_size: int
    link: _cost.LinkCost
    ops: dict[str, _cost.LinkCost] = field(default_factory=dict)
    axes: dict[int, _cost.LinkCost] = field(default_factory=dict)
    samples: tuple[Sample, ...] = ()
    path: str | None = None
    measured: bool = True

    @property
    def alpha(self) -> float:
        """Seconds per message."""
        return self.link.alpha

    @property
    def beta(self) -> float:
        """Bytes per second."""
        return self.link.beta

    @property
    def model(self) -> _cost.CostModel:
        """The cost model these constants make (what ``calibrate`` installs)."""
        return _cost.CostModel(self.link, tuple(sorted(self.ops.items())))

    def __str__(self) -> str:
        head = (
            f"{self.backend} on {self.world_size} ranks: alpha {self.alpha * 1e6:.1f} us/message, "
            f"beta {self.beta / 1e9:.2f} GB/s"
        )
        if not self.measured:
            return head + " (not measured: a world of one has nothing to time)"
        lines = [head]
        for name, link in [(op, self.ops[op]) for op in sorted(self.ops)] + [
            (f"axis {a}", self.axes[a]) for a in sorted(self.axes)
        ]:
            lines.append(
                f"  {name:<15}alpha {link.alpha * 1e6:8.1f} us  beta {link.beta / 1e9:6.2f} GB/s"
            )
        lines.append(
            f"  {'op':<15}{'axis':>5}{'ranks':>6}{'bytes':>11}{'measured':>12}{'model':>12}"
        )
        model = self.model
        for s in self.samples:
            if s.axis is None:
                predicted = _predict(model, s.op, s.num_ranks, s.num_bytes)
            else:
                predicted = _predict(
                    _cost.CostModel(self.axes[s.axis]), s.op, s.num_ranks, s.num_bytes
                )
            lines.append(
                f"  {s.op:<15}{'-' if s.axis is None else s.axis:>5}{s.num_ranks:>6}{s.num_bytes:>11}"
                f"{s.seconds * 1e3:>10.3f}ms{predicted * 1e3:>10.3f}ms"
            )
        if self.path:
            lines.append(f"  stored in {self.path}")
        return "\n".join(lines)


def calibrate(
    placement: Placement | None = None,
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 3,
    per_axis: bool = False,
    save: bool = True,
) -> Calibration:
    """Time collectives on this machine, fit alpha/beta, install and store them.

    Collective: every rank of the world must call it with the same arguments.
    ``placement`` defaults to all ranks of the world on ``"cuda"`` (NCCL) when
    CUDA is available, else ``"cpu"`` (gloo). ``sizes`` are block sizes in
    bytes (the block each collective handles, as in cost.py); all_reduce,
    all_gather, reduce_scatter and all_to_all are each timed ``repeats`` times
    per size and the fastest run kept. With ``per_axis=True`` each mesh axis
    of ``placement`` is also timed alone and fitted (reported in
    ``Calibration.axes``; the planner uses the whole-placement fit).

    The constants are installed with ``cost.set_model`` (identical on every
    rank) for the rest of this job and, with ``save=True``, written to
    ``calibration-<host>-<backend>-<world>.json`` in ``$SBPFLOW_CACHE_DIR``
    (default ``~/.cache/sbpflow``). A later job plans with them only if it asks,
    with ``load_calibration()`` (NOTE [stored constants]); otherwise every job
    plans with the default constants. In a world of one there is nothing to
    time: the current constants come back with ``measured=False``.
    """
    placement = _check_args(placement, sizes, repeats)
    ensure_initialized()
    world = get_world_size()
    backend = _cost.backend_for(placement.type)
    if placement.num_ranks < 2:
        model = _cost.model_for(placement.type)
        return Calibration(backend, world, model.link, dict(model.per_op), measured=False)

    whole = placement.groups_along(range(placement.ndim))
    plan: list[tuple[str, int, int, int | None, list[tuple[int, ...]]]] = [
        (op, placement.num_ranks, size, None, whole) for op in _bench.TIMED_OPS for size in sizes
    ]
    if per_axis:
        for axis, num in enumerate(placement.shape):
            if num > 1 and placement.ndim > 1:
                groups = placement.groups_along([axis])
                plan += [(op, num, size, axis, groups) for op in _bench.TIMED_OPS for size in sizes]

    local = [
        _bench.time_collective(op, size, placement.type, groups, repeats=repeats)
        for op, _, size, _, groups in plan
    ]
    seconds = _bench.max_over_world(local)
    samples = tuple(
        Sample(op, num, size, t, axis)
        for (op, num, size, axis, _), t in zip(plan, seconds, strict=True)
    )

    whole_samples = [s for s in samples if s.axis is None]
    axes_fitted = sorted({s.axis for s in samples if s.axis is not None})
    overall = _fit(whole_samples, _cost.CostModel.default(backend).link)
    fits = [overall]
    fits += [_fit([s for s in whole_samples if s.op == op], overall) for op in _bench.TIMED_OPS]
    fits += [_fit([s for s in samples if s.axis == a], overall) for a in axes_fitted]
    flat = _bench.broadcast_from_first([v for link in fits for v in (link.alpha, link.beta)])
    links = [_cost.LinkCost(flat[2 * i], flat[2 * i + 1]) for i in range(len(fits))]
    num_ops = len(_bench.TIMED_OPS)
    ops = dict(zip(_bench.TIMED_OPS, links[1 : 1 + num_ops], strict=True))
    axes = dict(zip(axes_fitted, links[1 + num_ops :], strict=True))
    if per_axis and placement.ndim == 1:
        axes = {0: links[0]}
    result = Calibration(backend, world, links[0], ops, axes, samples)

    _cost.set_model(backend, result.model)
    if save:
        path = store.path_for(backend, world)
        stored = True
        if get_local_rank() == 0:  # one writer per machine
            try:
                store.save(_record(result, placement), path)
            except OSError as error:  # the constants still hold for this run
                stored = False
                warnings.warn(
                    f"sbpflow.boxing.calibrate could not store its constants in {path} ({error}); "
                    "they are installed for this run only. Set SBPFLOW_CACHE_DIR to a writable "
                    "directory to keep them.",
                    stacklevel=2,
                )
        _bench.barrier()  # the file exists on every machine once any rank returns
        if stored:
            result = dataclasses.replace(result, path=str(path))
    return result


def load_calibration(
    device_type: str = "cpu", *, world_size: int | None = None
) -> Calibration | None:
    """Install the constants ``calibrate`` stored; plans never read them otherwise.

    Reads the record for ``device_type``'s backend (gloo for ``"cpu"``, NCCL for
    ``"cuda"``) measured on exactly ``world_size`` ranks, or, when ``world_size``
    is ``None``, the newest record in a single process and the record for the
    job's own world size in a job; installs it and returns it, or returns ``None``
    (installing nothing) when there is no readable record.

    In a job of several ranks this is a collective (every rank calls it, with the
    same arguments): world rank 0 reads its own machine's file and every rank
    installs rank 0's constants, bit for bit (NOTE [stored constants]).
    """
    if device_type not in ("cpu", "cuda"):
        raise ValueError(
            f"device_type must be 'cpu' or 'cuda', got {device_type!r}; e.g. load_calibration('cpu')."
        )
    if world_size is not None and (not isinstance(world_size, int) or world_size < 1):
        raise ValueError(f"world_size must be a positive int or None, got {world_size!r}.")
    backend = _cost.backend_for(device_type)
    in_a_job = is_initialized() and get_world_size() > 1
    record = None
    if not in_a_job or get_rank() == 0:
        wanted = world_size if world_size is not None or not in_a_job else get_world_size()
        record = _read_record(backend, wanted)
    if in_a_job:
        model = _shared_from_first_rank(record)
    else:
        model = None if record is None else _cost.model_from_record(record)
    if model is None:
        return None
    _cost.set_model(backend, model)
    stored_world = record.get("world_size") if record is not None else None
    return Calibration(
        backend,
        stored_world if isinstance(stored_world, int) else world_size or get_world_size(),
        model.link,
        dict(model.per_op),
        samples=() if record is None else _samples_of(record),
        path=None if record is None else record["path"],
    )


def _read_record(backend: str, world_size: int | None) -> dict[str, Any] | None:
    """This machine's stored record (for exactly ``world_size`` ranks, or the newest)."""
    try:
        if world_size is None:
            return store.load_newest(backend)
        return store.load(backend, world_size)
    except Exception as error:  # in a job, never leave the other ranks waiting in the broadcast
        warnings.warn(
            f"sbpflow could not read the stored {backend} calibration ({error!r}); nothing "
            "installed. Run sbpflow.boxing.calibrate() to store new constants.",
            stacklevel=3,
        )
        return None


def _shared_from_first_rank(record: dict[str, Any] | None) -> _cost.CostModel | None:
    """World rank 0's model from ``record`` (``None`` for none), the same on every rank."""
    values = [0.0] * _cost.VECTOR_SIZE
    if get_rank() == 0 and record is not None:
        try:
            values = _cost.to_vector(_cost.model_from_record(record))
        except Exception as error:  # never leave the other ranks waiting in the broadcast
            warnings.warn(
                f"sbpflow could not use the stored calibration {record.get('path')} ({error!r}); "
                "nothing installed.",
                stacklevel=3,
            )
    return _cost.from_vector(_bench.broadcast_from_first(values))


def _samples_of(record: dict[str, Any]) -> tuple[Sample, ...]:
    """The whole-placement samples of a stored record (for printing), or none if malformed."""
    try:
        samples = tuple(
            Sample(str(s["op"]), int(s["num_ranks"]), int(s["num_bytes"]), float(s["seconds"]))
            for s in record.get("samples", [])
            if s.get("axis") is None
        )
    except (KeyError, TypeError, ValueError, AttributeError):
        return ()
    return tuple(s for s in samples if s.op in _bench.TIMED_OPS)


def _check_args(placement: Placement | None, sizes: Sequence[int], repeats: int) -> Placement:
    if placement is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        return Placement(device_type, list(range(get_world_size())))
    if not isinstance(placement, Placement):
        raise TypeError(
            f"placement must be an sbpflow.placement, got {type(placement).__name__}: "
            f"{placement!r}; e.g. calibrate(sbpflow.placement('cpu', [0, 1, 2, 3]))."
        )
    world = get_world_size()
    outside = [r for r in placement.flat_ranks if r >= world]
    if outside:
        raise ValueError(
            f"calibrate: placement {placement} names ranks {outside} but the world has {world} "
            f"ranks (0..{world - 1}); use ranks of the running world."
        )
    if not sizes or any(not isinstance(s, int) or s <= 0 for s in sizes):
        raise ValueError(
            f"sizes must be positive byte counts, got {list(sizes)!r}; e.g. (4096, 1 << 20)."
        )
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}.")
    return placement


def _predict(model: _cost.CostModel, op: str, num_ranks: int, num_bytes: float) -> float:
    method = getattr(model, op)
    return float(method(num_ranks, num_bytes))


def _coefficients(op: str, num_ranks: int, num_bytes: int) -> tuple[float, float, float]:
    """``(overhead, messages, bytes)`` of ``op`` in cost.py's model: cost = overhead + m*alpha + b/beta."""
    overhead = _predict(_cost.CostModel(_cost.LinkCost(0.0, math.inf)), op, num_ranks, num_bytes)
    messages = _predict(_cost.CostModel(_cost.LinkCost(1.0, math.inf)), op, num_ranks, num_bytes)
    nbytes = _predict(_cost.CostModel(_cost.LinkCost(0.0, 1.0)), op, num_ranks, num_bytes)
    return overhead, messages - overhead, nbytes - overhead


def _fit(samples: Sequence[Sample], fallback: _cost.LinkCost) -> _cost.LinkCost:
    """Least squares for (alpha, 1/beta) in relative error, both kept positive.

    Each sample says ``m * alpha + b * inv_beta = t`` (``t`` net of the step
    overhead); dividing by ``t`` makes every residual relative. When the
    samples cannot pin a constant (noise makes it come out non-positive): a
    latency too small to see is floored and the bandwidth refitted; times
    that do not grow with size say nothing about bandwidth, so ``fallback``'s
    is kept and the latency refitted.
    """
    rows = []
    for s in samples:
        overhead, m, b = _coefficients(s.op, s.num_ranks, s.num_bytes)
        t = max(s.seconds - overhead, 1e-9)
        rows.append((m / t, b / t))
    smm = sum(m * m for m, _ in rows)
    sbb = sum(b * b for _, b in rows)
    smb = sum(m * b for m, b in rows)
    sm = sum(m for m, _ in rows)
    sb = sum(b for _, b in rows)
    det = smm * sbb - smb * smb
    if det > 0:
        alpha, inv_beta = (sm * sbb - sb * smb) / det, (sb * smm - sm * smb) / det
    else:  # one size only: the two effects cannot be told apart
        alpha, inv_beta = -1.0, -1.0
    if alpha >= _MIN_ALPHA and inv_beta >= 1 / _MAX_BETA:
        return _cost.LinkCost(alpha, 1.0 / inv_beta)
    if inv_beta >= 1 / _MAX_BETA and sbb > 0:  # latency too small to see
        alpha = _MIN_ALPHA
        inv_beta = sum(b * (1 - m * alpha) for m, b in rows) / sbb
    elif smm > 0:  # bandwidth not measurable: keep the fallback's
        inv_beta = 1 / fallback.beta
        alpha = sum(m * (1 - b * inv_beta) for m, b in rows) / smm
    if alpha >= _MIN_ALPHA and inv_beta >= 1 / _MAX_BETA:
        return _cost.LinkCost(alpha, 1.0 / inv_beta)
    return fallback


def _record(result: Calibration, placement: Placement) -> dict[str, object]:
    return {
        "version": store.FORMAT_VERSION,
        "backend": result.backend,
        "world_size": result.world_size,
        "host": store.hostname(),
        "placement": str(placement),
        "alpha": result.alpha,
        "beta": result.beta,
        "ops": {op: {"alpha": link.alpha, "beta": link.beta} for op, link in result.ops.items()},
        "axes": {
            str(a): {"alpha": link.alpha, "beta": link.beta} for a, link in result.axes.items()
        },
        "samples": [
            {
                "op": s.op,
                "num_ranks": s.num_ranks,
                "num_bytes": s.num_bytes,
                "seconds": s.seconds,
                "axis": s.axis,
            }
            for s in result.samples
        ],
        "torch": torch.__version__,
        "written_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "written_by_rank": get_rank(),
    }
