"""``sync_gradients``: bucketed, overlapped gradient reduction for a global model.

A global model trained data parallel (parameters broadcast on the data axes, batch split
on dim 0) already gets the right gradients: ``keep_grad_layout``'s hook all-reduces each
one as it arrives, one synchronous collective per parameter. ``sync_gradients(model)``
replaces that with buckets launched asynchronously while backward runs (NOTE [bucketed
gradient sync] in ``_reducer``); the values are the same.
"""

from __future__ import annotations

import torch

from ..._global import GlobalTensor
from ._reducer import GradientSync, Member

__all__ = ["GradientSync", "sync_gradients"]


def sync_gradients(module: torch.nn.Module, bucket_cap_mb: float | None = None) -> GradientSync:
    """Reduce ``module``'s data-parallel gradients in buckets that overlap backward.

    Call it once, after the module's parameters have their final layouts
    (``module.to_global(...)``). Every parameter broadcast on some mesh axis is reduced
    over the axes where its gradient arrives partial; the others keep the per-parameter
    path. Use the returned object's ``no_sync()`` for gradient accumulation, and its
    ``remove()`` to go back to per-parameter reduction. Every rank must call this.

    ``bucket_cap_mb``: the size of a bucket in MB. Left at None (the default), buckets
    hold 25 MB and the first one 1 MiB, so reduction starts early in backward; a number
    given applies to every bucket. These are torch DDP's rules.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"sync_gradients expects an nn.Module, got {type(module).__name__}.")
    members, local = [], []
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        if not isinstance(param, GlobalTensor):
            local.append(name)
            continue
        if getattr(param, "_grad_sync", None) is not None:
            raise ValueError(
                f"the gradients of {name!r} are already synced by another GradientSync; call "
                "sync_gradients once per module (or .remove() the first one)."
            )
        member = Member(name, param, param._layout, is_global=True)
        if member.data_axes:
            members.append(member)
    if local:
        raise TypeError(
            f"sync_gradients needs a global module, but {local[:3]} are plain tensors. Convert "
            "the module first (module.to_global(placement, sbpflow.sbp.broadcast)), or wrap a "
            "local module in sbpflow.nn.parallel.DistributedDataParallel instead."
        )
    return GradientSync(members, bucket_cap_mb, average=False)
