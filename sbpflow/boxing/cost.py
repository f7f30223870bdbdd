"""Alpha-beta cost of one boxing step: latency per message plus bytes over bandwidth.

Pure code: no process group, no files. The constants are per backend and the
same on every rank of a job (NOTE [agreed constants]); ``sbpflow.boxing.calibrate``
measures them, and these defaults stand in until it has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "CostModel",
    "LinkCost",
    "generation",
    "installed_model",
    "model_for",
    "reset",
    "set_model",
]

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
        return _DEFAULT_MODELS.get(backend, _DEFAULT_MODELS["gloo"])

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
#
# NOTE [agreed constants]
# Two ranks that priced a step differently could pick different plans for the
# same to_global, enter different collectives and hang. So the constants a
# job plans with are one value, the same on every rank by construction: this
# module holds them in memory only (it reads no file and no world size), and
# they change only in ways every rank takes part in: ``calibrate()``
# (broadcasts rank 0's fits), ``load_calibration()`` in a job (world rank 0
# reads its stored record and broadcasts it as the fixed-size vector below),
# or ``set_model`` called alike on every rank. With none of them, every job
# on every machine plans with the defaults. A plan may also be
# priced with an explicit model (``plan(..., cost_model=...)``).

# The ops a model may price with their own constants (CostModel.per_op), in
# the order of the agreed vector.
PER_OP_NAMES = ("all_gather", "all_reduce", "all_to_all", "reduce_scatter", "send_recv")
BACKENDS = ("gloo", "nccl")
# present flag, link alpha and beta, then per op: present flag, alpha, beta
VECTOR_SIZE = 3 + 3 * len(PER_OP_NAMES)

_DEFAULT_MODELS = {backend: CostModel(LinkCost(*_DEFAULTS[backend])) for backend in BACKENDS}
_installed: dict[str, CostModel] = {}
_generation = 0


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def model_for(device_type: str) -> CostModel:
    """The job's agreed cost model for placements of ``device_type``.

    The model installed for its backend (``set_model``; ``calibrate`` and
    ``load_calibration`` install through it), else the defaults above. Never reads a file (NOTE [agreed constants]).
    """
    backend = backend_for(device_type)
    return _installed.get(backend) or _DEFAULT_MODELS[backend]


def installed_model(backend: str) -> CostModel | None:
    """The model installed for ``backend``, or ``None`` while the defaults apply."""
    _check_backend(backend)
    return _installed.get(backend)


def set_model(backend: str, model: CostModel) -> None:
    """Install ``model`` for ``backend``; plans are priced with it from now on.

    In a job, install the same model on every rank (NOTE [agreed constants]).
    """
    _check_backend(backend)
    if not isinstance(model, CostModel):
        raise TypeError(
            f"model must be a sbpflow.boxing.cost.CostModel, got {type(model).__name__}: "
            f"{model!r}; e.g. CostModel(LinkCost(alpha=60e-6, beta=1.5e9))."
        )
    unknown = [op for op, _ in model.per_op if op not in PER_OP_NAMES]
    if unknown:
        raise ValueError(
            f"model has per-op constants for {unknown}, but only {PER_OP_NAMES} are priced "
            "with their own constants; drop the others from CostModel.per_op."
        )
    _install(backend, model)


def reset(backend: str | None = None) -> None:
    """Forget installed constants (of ``backend``, or of every backend): back to the defaults."""
    global _generation
    if backend is None:
        _installed.clear()
    else:
        _check_backend(backend)
        _installed.pop(backend, None)
    _generation += 1


def generation() -> int:
    """Bumped whenever the installed constants change (the planner's hot cache checks it)."""
    return _generation


def _install(backend: str, model: CostModel) -> None:
    global _generation
    _installed[backend] = model
    _generation += 1


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}.")


def model_from_record(record: dict[str, Any]) -> CostModel:
    """The model a stored calibration record describes (see ``_calibration_store``).

    Per-op constants of ops outside ``PER_OP_NAMES`` are dropped: no step is
    priced with them, and the agreed vector has no room for them.
    """
    per_op = tuple(
        (op, LinkCost(float(c["alpha"]), float(c["beta"])))
        for op, c in sorted(record.get("ops", {}).items())
        if op in PER_OP_NAMES
    )
    return CostModel(LinkCost(float(record["alpha"]), float(record["beta"])), per_op)


# -- the fixed-size vector one rank shares with the others ----------------------------


def to_vector(model: CostModel | None) -> list[float]:
    """``model`` as ``VECTOR_SIZE`` floats (all zeros for ``None``), for a broadcast."""
    values = [0.0] * VECTOR_SIZE
    if model is None:
        return values
    values[:3] = [1.0, model.link.alpha, model.link.beta]
    for op, link in model.per_op:
        if op not in PER_OP_NAMES:
            raise ValueError(
                f"per-op constants for {op!r} cannot be shared; a model prices only "
                f"{PER_OP_NAMES} with their own constants."
            )
        at = 3 + 3 * PER_OP_NAMES.index(op)
        values[at : at + 3] = [1.0, link.alpha, link.beta]
    return values


def from_vector(values: list[float]) -> CostModel | None:
    """The model ``to_vector`` encoded (``None`` when its present flag is off)."""
    assert len(values) == VECTOR_SIZE, f"expected {VECTOR_SIZE} floats, got {len(values)}"
    if values[0] == 0.0:
        return None
    per_op = tuple(
        (op, LinkCost(values[at + 1], values[at + 2]))
        for op, at in ((op, 3 + 3 * i) for i, op in enumerate(PER_OP_NAMES))
        if values[at] != 0.0
    )
    return CostModel(LinkCost(values[1], values[2]), tuple(sorted(per_op)))
