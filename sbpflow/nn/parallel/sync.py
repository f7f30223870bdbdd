"""``sync_gradients`` and ``no_sync``: configuring the bucketed gradient reduction of a global model.

A global model trained data parallel (parameters broadcast on the data axes, batch split
on dim 0) has its gradients reduced in buckets that overlap backward with nothing to call
(NOTE [data parallel by default] in ``_default``). ``sync_gradients(model, bucket_cap_mb=...)``
fixes the buckets of its parameters up front with the cap given; ``no_sync(model)`` holds
the reduction for gradient accumulation.
"""

from __future__ import annotations

import contextlib

import torch

from ..._global import GlobalTensor
from ._params import GlobalParam, data_axes
from ._reducer import GradientSync, check_bucket_cap, paused

__all__ = ["GradientSync", "no_sync", "sync_gradients"]


def sync_gradients(module: torch.nn.Module, bucket_cap_mb: float | None = None) -> GradientSync:
    """Reduce ``module``'s data-parallel gradients in buckets of ``bucket_cap_mb`` MB.

    A global model's gradients are reduced in buckets by default; this is the way to
    choose the bucket size, and to have the buckets fixed before the first backward
    pass. Call it once, after the module's parameters have their final layouts
    (``module.to_global(...)``). Every parameter broadcast on some mesh axis is reduced
    over the axes where its gradient arrives partial; the others keep the per-parameter
    path. The returned object's ``no_sync()`` is ``no_sync(module)``; its ``remove()``
    gives the parameters back to the default buckets. Every rank must call this.

    ``bucket_cap_mb``: the size of a bucket in MB. Left at None (the default), buckets
    hold 25 MB and the first one 1 MiB, so reduction starts early in backward; a number
    given applies to every bucket. These are torch DDP's rules.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"sync_gradients expects an nn.Module, got {type(module).__name__}.")
    members, local, defaults = [], [], {}
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        if not isinstance(param, GlobalTensor):
            local.append(name)
            continue
        sync = GradientSync.of(param)
        if sync is not None and sync.explicit:
            raise ValueError(
                f"the gradients of {name!r} are already synced by another GradientSync; call "
                "sync_gradients once per module (or .remove() the first one)."
            )
        if sync is not None:
            defaults[id(sync)] = sync
        if data_axes(param._layout):
            members.append(GlobalParam(name, param))
    if local:
        raise TypeError(
            f"sync_gradients needs a global module, but {local[:3]} are plain tensors. Convert "
            "the module first (module.to_global(placement, sbpflow.sbp.broadcast)), or wrap a "
            "local module in sbpflow.nn.parallel.DistributedDataParallel instead."
        )
    check_bucket_cap(bucket_cap_mb)  # before anything changes
    for sync in defaults.values():  # buckets made by default: their parameters come here
        sync.remove()
    return GradientSync(members[::-1], bucket_cap_mb)  # NOTE [bucket order]


def no_sync(module: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
    """A context in which backward passes only accumulate ``module``'s gradients.

    For gradient accumulation without a reduction per micro-batch, as torch DDP's
    ``no_sync``: run every micro-batch but the last inside it; the first backward pass
    after the block reduces the accumulated sum. Inside the block a global model's
    gradients stay partial sums (correct values, read with a collective); a bucket
    that holds one of the module's parameters is left alone entirely. Works for a
    global module, a ``DistributedDataParallel`` and a module under ``sync_gradients``.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"no_sync expects an nn.Module (the model whose gradients accumulate), got "
            f"{type(module).__name__}; e.g. `with sbpflow.nn.parallel.no_sync(model):`."
        )
    return paused([p for p in module.parameters() if p.requires_grad])
