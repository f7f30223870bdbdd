"""Alpha-beta cost of one boxing step: latency per message plus bytes over bandwidth.

Pure code. The constants are per backend; ``sbpflow.boxing.calibrate`` measures
them on the running machine, and these defaults stand in until it has.
"""

from __future__ import annotations

from dataclasses import dataclass

# Defaults: gloo over loopback TCP on a small machine moves ~1-2 GB/s with
# ~50-100 us per message (measured on a 2-core CPU host with 4 ranks); NCCL
# within a node is ~10 us and ~100 GB/s. Local copies run at memory speed.
_DEFAULTS = {
    "gloo": (60e-6, 1.5e9),
    "nccl": (10e-6, 100e9),
}
_LOCAL_BANDWIDTH = 10e9  # bytes/s for a local copy (slice to a new buffer, zero fill)
_STEP_OVERHEAD = 5e-6  # seconds of bookkeeping per step, so fewer steps win ties


@dataclass(frozen=True)
class LinkCost:
    """Latency (seconds per message) and bandwidth (bytes per second) of a backend."""

    alpha: float
    beta: float  # bandwidth, bytes/s

    def transfer(self, num_messages: int, num_bytes: float) -> float:
        return num_messages * self.alpha + num_bytes / self.beta


@dataclass(frozen=True)
class CostModel:
    """Costs of collectives on groups of ``p`` ranks for one backend.

    ``block_bytes`` is the size of the (sub)tensor the group handles together:
    the whole tensor an all_gather produces, or that an all_reduce reduces.
    """

    link: LinkCost

    @staticmethod
    def default(backend: str) -> CostModel:
        alpha, beta = _DEFAULTS.get(backend, _DEFAULTS["gloo"])
        return CostModel(LinkCost(alpha, beta))

    def all_gather(self, p: int, block_bytes: float) -> float:
        return _STEP_OVERHEAD + self.link.transfer(p - 1, (p - 1) / p * block_bytes)

    def reduce_scatter(self, p: int, block_bytes: float) -> float:
        return _STEP_OVERHEAD + self.link.transfer(p - 1, (p - 1) / p * block_bytes)

    def all_reduce(self, p: int, block_bytes: float) -> float:
        return _STEP_OVERHEAD + self.link.transfer(2 * (p - 1), 2 * (p - 1) / p * block_bytes)

    def all_to_all(self, p: int, block_bytes: float) -> float:
        return _STEP_OVERHEAD + self.link.transfer(p - 1, (p - 1) / (p * p) * block_bytes)

    def send_recv(self, num_messages: int, max_bytes_per_rank: float) -> float:
        return _STEP_OVERHEAD + self.link.transfer(num_messages, max_bytes_per_rank)

    def local(self, num_bytes: float) -> float:
        return _STEP_OVERHEAD + num_bytes / _LOCAL_BANDWIDTH


# -- the models the planner uses -----------------------------------------------------

_calibrated: dict[str, CostModel] = {}
_generation = 0


def model_for(device_type: str) -> CostModel:
    """The cost model for placements of ``device_type`` (calibrated if measured)."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    return _calibrated.get(backend) or CostModel.default(backend)


def set_model(backend: str, model: CostModel) -> None:
    """Install measured constants; cached plans are invalidated."""
    global _generation
    _calibrated[backend] = model
    _generation += 1


def generation() -> int:
    """Bumped whenever the cost constants change, so cached plans are re-planned."""
    return _generation
