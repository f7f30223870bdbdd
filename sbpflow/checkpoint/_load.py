"""``load``: fill a state dict of global tensors from a checkpoint, in any layout and world size.

Reads through ``torch.distributed.checkpoint.load`` on the storage group
(NOTE [checkpoint DCP calls] in _save.py); each rank reads the chunk its
layout holds (NOTE [checkpoint chunks] in _chunks.py).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .._global import GlobalTensor
from .._layout import Layout
from ..comm._storage import gather_from_every_rank, storage_group
from ..comm._world import get_rank
from ._atomic import METADATA_FILE, is_checkpoint, leftovers
from ._chunks import Chunk, read_chunk, readable_sbp
from ._flat import Path, flatten, is_stateful, set_at
from ._save import as_path, wait_for_pending_save

__all__ = ["load"]

_ERRORS: dict[str, type[Exception]] = {
    "FileNotFoundError": FileNotFoundError,
    "ValueError": ValueError,
    "TypeError": TypeError,
}


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create an empty optimizer's state (one step with lr 0 on zero gradients).

    A fresh optimizer has no state to fill; ``torch.distributed.checkpoint``'s
    ``get_optimizer_state_dict`` creates it the same way. With lr 0 and zero
    gradients the parameters do not move.
    """
    if optimizer.state:
        return
    given = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)
                given.append(param)
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = torch.zeros_like(group["lr"]) if torch.is_tensor(group["lr"]) else 0.0
    try:
        optimizer.step()
    finally:
        for group, rate in zip(optimizer.param_groups, rates, strict=True):
            group["lr"] = rate
        for param in given:
            param.grad = None


def _saved_keys(path: str) -> set[str]:
    """The checkpoint's keys, or none where it cannot be read (``_problem`` then says why)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return set(FileSystemReader(path).read_metadata().state_dict_metadata)
    except Exception:
        return set()


def _target_state(key: str, obj: Any, saved: set[str]) -> Any:
    """``obj``'s state dict to fill. A fresh optimizer's state is created only where the
    checkpoint holds some: one saved before its first step holds none, and creating it
    would leave the loaded optimizer one (zero) step ahead of the saved one."""
    if isinstance(obj, torch.optim.Optimizer) and any(k.startswith(f"{key}.state.") for k in saved):
        _init_optimizer_state(obj)
    return obj.state_dict()


def _problem(path: str, flat: dict[str, tuple[Path, Any]]) -> tuple[str, str] | None:
    """What keeps this rank from loading ``flat`` from ``path``: (error type, message), or None."""
    if not is_checkpoint(path):
        left = leftovers(path)
        found = "no such directory" if not os.path.isdir(path) else f"no {METADATA_FILE} in it"
        message = f"no checkpoint at {path!r} ({found})."
        if left:
            message += f" A save that did not finish left {left}."
        return "FileNotFoundError", message + " Pass the path given to sbpflow.save."
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        saved = FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as error:  # a truncated or foreign file: say which, on every rank
        return "ValueError", f"cannot read the checkpoint metadata in {path!r}: {error!r}."
    missing = [key for key in flat if key not in saved]
    if missing:
        return "ValueError", (
            f"the checkpoint at {path!r} has no entry for state_dict key(s) {missing[:8]}"
            f"{' and more' if len(missing) > 8 else ''}; it holds {sorted(saved)[:8]}"
            f"{' and more' if len(saved) > 8 else ''}. Load a state_dict whose keys were saved "
            "(drop the others), or save them first."
        )
    for key, (_, value) in flat.items():
        entry = saved[key]
        if isinstance(value, torch.Tensor) != isinstance(entry, TensorStorageMetadata):
            held = (
                f"a tensor of shape {list(entry.size)}"
                if isinstance(entry, TensorStorageMetadata)
                else "a Python value"
            )
            return "TypeError", (
                f"the checkpoint holds {held} at {key!r} but the state_dict holds "
                f"{type(value).__name__}; pass a value of the saved kind there."
            )
        if isinstance(entry, TensorStorageMetadata) and tuple(entry.size) != tuple(value.shape):
            return "ValueError", (
                f"the checkpoint holds shape {list(entry.size)} at {key!r} but the state_dict "
                f"holds shape {list(value.shape)}; load into a tensor of the saved (logical) shape."
            )
    return None


def _agree(problem: tuple[str, str] | None) -> None:
    """Raise on every rank if any rank found a problem (the first such rank's)."""
    found = gather_from_every_rank(problem, "check")
    for rank, entry in enumerate(found):
        if entry is not None:
            kind, message = entry
            where = f" (found on rank {rank})" if len(found) > 1 else ""
            raise _ERRORS[kind](message + where)


def load(path: str | os.PathLike[str], state_dict: dict[str, Any]) -> None:
    """Fill ``state_dict`` in place from the checkpoint at ``path``; every rank calls it.

    Each global tensor receives its own layout's piece of the saved logical
    tensor, whatever placement, SBP and world size saved it (resharding);
    plain tensors receive the whole saved tensor; Python values are replaced.
    Objects with ``state_dict()``/``load_state_dict()`` at the top level (a
    module, an optimizer, a ``GradScaler``) are filled through them; a fresh
    optimizer's state is created first. A key missing from the checkpoint, a
    shape that differs or a missing checkpoint raises on every rank.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from ._planners import ChunkLoadPlanner

    path = as_path(path, "sbpflow.load")
    if not isinstance(state_dict, dict):
        raise TypeError(
            f"sbpflow.load fills a dict in place, got {type(state_dict).__name__}; pass e.g. "
            '{"model": model, "optim": optimizer}.'
        )
    wait_for_pending_save()
    stateful = {k: v for k, v in state_dict.items() if is_stateful(v)}
    saved = _saved_keys(path) if stateful else set()
    resolved = {
        k: _target_state(k, v, saved) if k in stateful else v for k, v in state_dict.items()
    }
    flat = flatten(resolved)
    _agree(_problem(path, flat))

    rank = get_rank()
    entries: dict[str, Any] = {}
    chunks: dict[str, Chunk | None] = {}
    reboxed: list[tuple[GlobalTensor, torch.Tensor, Layout]] = []
    for key, (_, value) in flat.items():
        if isinstance(value, GlobalTensor):
            layout = Layout(value.placement, readable_sbp(value.sbp))
            if layout == value._layout:
                entries[key] = value._local.detach()  # read straight into the tensor
            else:
                local = value._local
                entries[key] = local.new_empty(layout.local_shape(value.shape, rank))
                reboxed.append((value, entries[key], layout))
            chunks[key] = read_chunk(layout, value.shape, rank)
        elif isinstance(value, torch.Tensor):
            entries[key] = value.detach()  # DCP copies into it
        else:
            entries[key] = value
    planner = ChunkLoadPlanner(chunks)
    dcp.load(
        entries,
        storage_reader=FileSystemReader(path),
        planner=planner,
        process_group=storage_group(),
    )
    with torch.no_grad():
        for value, read, layout in reboxed:  # broadcast -> partial: local, no collective
            whole = GlobalTensor(read, layout, value.shape)
            value._local.copy_(whole.to_global(value.placement, value.sbp, check_meta=False)._local)
    for key, (path_of, value) in flat.items():
        if not isinstance(value, torch.Tensor):
            set_at(
                resolved if path_of[0] in stateful else state_dict, path_of, planner.state_dict[key]
            )
    for key, obj in stateful.items():
        obj.load_state_dict(resolved[key])
