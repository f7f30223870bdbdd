"""Alpha-beta cost of one boxing step: latency per message plus bytes over bandwidth.

Pure code. The constants are per backend; ``sbpflow.boxing.calibrate`` measures
them on the running machine and stores them per machine, and these defaults
stand in until it has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["CostModel", "LinkCost", "generation", "model_for", "reset", "set_model"]

# Defaults: gloo over loopback TCP on a small machine moves ~1-2 GB/s with
# ~50-100 us per message (measured on a 2-core CPU host with 4 ranks); NCCL
# within a node is ~10 us and ~100 GB/s. Local copies run at memory speed.
_DEFAULTS = {
    "gloo": (60e-6, 1.5e9),
    "nccl": (10e-6, 100e9),
}
_LOCAL_BANDWIDTH = 10e9  # bytes/s for a local copy (slice to a new buffer, zero fill)
_STEP_OVERHEAD = 5e-6  # seconds of bookkeeping per step, so fewer steps win ties


def _rounds(p: int) -> int:
    """Latency rounds of a collective on ``p`` ranks: ``ceil(log2 p)``."""
    return (p - 1).bit_length()


@dataclass(frozen=True)
class LinkCost:
    """Latency (seconds per message) and bandwidth (bytes per second) of a backend."""

    alpha: float
    beta: float  # bandwidth, bytes/s

    def transfer(self, num_messages: int, num_bytes: float) -> float:
        return num_messages * self.alpha + num_bytes / self.beta

    def __str__(self) -> str:
        return f"alpha {self.alpha * 1e6:.1f} us/message, beta {self.beta / 1e9:.2f} GB/s"


@dataclass(frozen=True)
class CostModel:
    """Costs of collectives on groups of ``p`` ranks for one backend.

    ``block_bytes`` is the size of the (sub)tensor the group handles together:
    the whole tensor an all_gather produces, or that an all_reduce reduces.
    ``per_op`` optionally gives one collective its own measured constants
    (gloo's all_to_all, say, is far slower per byte than its all_reduce);
    ops not listed use ``link``.

    Latency is counted in ``ceil(log2 p)`` rounds (the tree and recursive
    doubling/halving algorithms collective libraries use for latency-bound
    sizes), bandwidth as in the ring algorithms. With that count one
    collective over ``p * q`` ranks never costs more than the chain over
    ``p`` then ``q`` ranks it replaces, so the planner merges mesh axes
    whenever the layout allows it (NOTE [merged axes] in planner.py).
    """

    link: LinkCost
    per_op: tuple[tuple[str, LinkCost], ...] = ()

    @staticmethod
    def default(backend: str) -> CostModel:
        alpha, beta = _DEFAULTS.get(backend, _DEFAULTS["gloo"])
        return CostModel(LinkCost(alpha, beta))

    def __str__(self) -> str:
        lines = [f"CostModel: {self.link}"] + [f"  {op}: {link}" for op, link in self.per_op]
        return "\n".join(lines)

    def link_for(self, op: str) -> LinkCost:
        for name, link in self.per_op:
            if name == op:
                return link
        return self.link

    def all_gather(self, p: int, block_bytes: float) -> float:
        return _STEP_OVERHEAD + self.link_for("all_gather").transfer(
            _rounds(p), (p - 1) / p * block_bytes
        )

    def reduce_scatter(self, p: int, block_bytes: float) -> float:
        link = self.link_for("reduce_scatter")
        return _STEP_OVERHEAD + link.transfer(_rounds(p), (p - 1) / p * block_bytes)

    def all_reduce(self, p: int, block_bytes: float) -> float:
        link = self.link_for("all_reduce")
        return _STEP_OVERHEAD + link.transfer(2 * _rounds(p), 2 * (p - 1) / p * block_bytes)

    def all_to_all(self, p: int, block_bytes: float) -> float:
        link = self.link_for("all_to_all")
        return _STEP_OVERHEAD + link.transfer(_rounds(p), (p - 1) / (p * p) * block_bytes)

    def send_recv(self, num_messages: int, max_bytes_per_rank: float) -> float:
        return _STEP_OVERHEAD + self.link_for("send_recv").transfer(
            num_messages, max_bytes_per_rank
        )

    def local(self, num_bytes: float) -> float:
        return _STEP_OVERHEAD + num_bytes / _LOCAL_BANDWIDTH


# -- the models the planner uses -----------------------------------------------------

_calibrated: dict[str, CostModel] = {}
_stored: dict[tuple[str, int, str], CostModel | None] = {}  # file look-ups, once per key
_generation = 0


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def model_for(device_type: str) -> CostModel:
    """The cost model for placements of ``device_type``.

    In order: constants installed by ``set_model`` (``calibrate`` does this),
    else the ones ``calibrate`` stored for this machine (see
    ``_calibration_store``), else the defaults above.
    """
    backend = backend_for(device_type)
    model = _calibrated.get(backend)
    if model is not None:
        return model
    return _stored_model(backend) or CostModel.default(backend)


def _stored_model(backend: str) -> CostModel | None:
    # Looked up once per (backend, world size, cache dir) and kept, so every
    # plan of a process uses the same constants even if a file appears later.
    from ..comm._world import get_world_size  # reads the world size; creates nothing
    from . import _calibration_store as store

    key = (backend, get_world_size(), str(store.cache_dir()))
    if key not in _stored:
        record = store.load(backend, key[1])
        _stored[key] = None if record is None else model_from_record(record)
    return _stored[key]


def model_from_record(record: dict[str, Any]) -> CostModel:
    """The model a stored calibration record describes (see ``_calibration_store``)."""
    per_op = tuple(
        (op, LinkCost(float(c["alpha"]), float(c["beta"])))
        for op, c in sorted(record.get("ops", {}).items())
    )
    return CostModel(LinkCost(float(record["alpha"]), float(record["beta"])), per_op)


def set_model(backend: str, model: CostModel) -> None:
    """Install measured constants; cached plans are invalidated."""
    global _generation
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}.")
    _calibrated[backend] = model
    _generation += 1


def reset() -> None:
    """Forget installed constants and file look-ups (back to the stored file or defaults)."""
    global _generation
    _calibrated.clear()
    _stored.clear()
    _generation += 1


def generation() -> int:
    """Bumped whenever the cost constants change, so cached plans are re-planned."""
    return _generation
