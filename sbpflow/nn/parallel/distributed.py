"""``DistributedDataParallel``: data parallelism for a model that keeps local tensors.

As in OneFlow and PyTorch, each rank holds the whole model and its own slice of the
batch. In sbpflow's terms the wrapper is the same data parallelism as a global model's:
its parameters are broadcast over a placement (copied from the placement's first rank
when wrapped), each rank's local gradient is read as a partial sum, and the gradients
are reduced P -> B in the buckets of ``GradientSync`` while backward runs, divided by
the number of replicas (the mean over ranks, as torch DDP).
"""

from __future__ import annotations

from typing import Any

import torch

from ..._global import GlobalTensor
from ..._layout import Layout
from ...comm._world import get_rank, get_world_size
from ...placement import Placement
from ...sbp import Broadcast
from ...tensor import to_global
from ._params import LocalParam
from ._reducer import GradientSync

__all__ = ["DistributedDataParallel"]


class DistributedDataParallel(torch.nn.Module):
    """Wrap ``module`` (local tensors) for data-parallel training on every rank of ``placement``.

    - At wrap time the parameters and buffers are broadcast from the placement's first
      rank (every rank must wrap the same architecture; a mismatch is an error on every
      rank).
    - ``broadcast_buffers``: buffers (e.g. batch-norm statistics) are broadcast from the
      first rank again before each forward.
    - Gradients are averaged over the ranks in buckets of ``bucket_cap_mb`` MB launched
      during backward; all are done when ``backward()`` returns. A parameter no rank used
      keeps ``.grad`` None. Left at None, buckets hold 25 MB and the first one 1 MiB; a
      number given applies to every bucket (torch DDP's rules).
    - ``no_sync()`` accumulates local gradients; the next backward outside it averages them.
    - Attributes not found on the wrapper are looked up on ``module`` (``ddp.lr``);
      ``ddp.module`` is the wrapped module.

    ``placement`` defaults to every rank of the world, on the device type of the
    module's parameters.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        bucket_cap_mb: float | None = None,
        broadcast_buffers: bool = True,
        placement: Placement | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(
                f"DistributedDataParallel wraps an nn.Module, got {type(module).__name__}."
            )
        placement = _check_placement(module, placement)
        self.module = module
        self.broadcast_buffers = bool(broadcast_buffers)
        self.placement = placement
        self._replicated = Layout(placement, (Broadcast(),) * placement.ndim)
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                self._copy_from_first_rank(tensor, check_meta=True)
        members = [
            LocalParam(name, param, placement)
            for name, param in module.named_parameters()
            if param.requires_grad
        ]
        self._sync = GradientSync(members[::-1], bucket_cap_mb)  # NOTE [bucket order]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.broadcast_buffers:
            with torch.no_grad():
                for buffer in self.module.buffers():
                    self._copy_from_first_rank(buffer, check_meta=False)
        return self.module(*args, **kwargs)

    def no_sync(self) -> Any:
        """A context in which backward only accumulates local gradients (torch DDP's)."""
        return self._sync.no_sync()

    @property
    def buckets(self) -> list[list[str]]:
        """The parameter names of each gradient bucket, in launch order."""
        return self._sync.buckets

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules", {})
            if "module" in modules:
                return getattr(modules["module"], name)
            raise

    def _copy_from_first_rank(self, tensor: torch.Tensor, check_meta: bool) -> None:
        placement = self._replicated.placement
        replicated = to_global(
            tensor.detach(), placement, self._replicated.sbp, check_meta=check_meta
        )
        tensor.copy_(replicated.to_local())


def _check_placement(module: torch.nn.Module, placement: Placement | None) -> Placement:
    tensors = [*module.parameters(), *module.buffers()]
    globals_ = [t for t in tensors if isinstance(t, GlobalTensor)]
    if globals_:
        raise TypeError(
            "DistributedDataParallel wraps a module of local tensors, but this one holds global "
            "tensors. A global model is already data parallel, its gradients reduced in buckets "
            "by default; use sbpflow.nn.parallel.sync_gradients(module, bucket_cap_mb=...) to "
            "choose the bucket size."
        )
    device_type = tensors[0].device.type if tensors else "cpu"
    if placement is None:
        placement = Placement(device_type, list(range(get_world_size())))
    if not isinstance(placement, Placement):
        raise TypeError(
            f"placement must be an sbpflow.placement, got {type(placement).__name__}: "
            f"{placement!r}; e.g. sbpflow.placement('cpu', [0, 1])."
        )
    if get_rank() not in placement:
        raise ValueError(
            f"rank {get_rank()} is not in the DistributedDataParallel placement {placement}; "
            "every rank that wraps the module must be one of its replicas."
        )
    if placement.type != device_type:
        raise ValueError(
            f"the module's tensors are on {device_type!r} but the placement is "
            f"{placement.type!r}; move the module (module.to(...)) or use "
            f"sbpflow.placement({device_type!r}, ranks)."
        )
    return placement
