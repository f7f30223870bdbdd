"""``export_safetensors``: one consolidated ``.safetensors`` file of the logical tensors."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from .._global import GlobalTensor
from ..comm._storage import gather_from_every_rank
from ..comm._world import get_rank
from ..placement import Placement
from ..sbp import Broadcast
from ._flat import flatten, is_stateful
from ._save import as_path

__all__ = ["export_safetensors"]


def _save_file() -> Any:
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ImportError(
            "sbpflow.export_safetensors needs the safetensors package, which is not installed; "
            "run `pip install safetensors` (or `pip install sbpflow[test]`)."
        ) from None
    return save_file


def _own_storage(tensor: torch.Tensor, seen: set[int]) -> torch.Tensor:
    """``tensor`` on the CPU, contiguous, sharing memory with no other exported tensor."""
    tensor = tensor.detach().cpu().contiguous()
    storage = tensor.untyped_storage()
    if storage.data_ptr() in seen or storage.nbytes() != tensor.nbytes:
        tensor = tensor.clone()  # tied weights, views: safetensors refuses shared memory
    seen.add(tensor.untyped_storage().data_ptr())
    return tensor


def export_safetensors(state_dict: dict[str, Any], file: str | os.PathLike[str]) -> None:
    """Write the logical tensors of ``state_dict`` to one safetensors ``file``; every rank calls it.

    Global tensors are gathered whole to rank 0, which writes the file (the
    other ranks hold no full copy). Keys are the flat checkpoint keys
    (``fc.weight``, ``model.fc.weight`` for a nested dict). Plain tensors are
    taken from rank 0. Python values (ints, floats, strings, lists) go to the
    file's metadata, JSON-encoded, under their keys. Read the file back with
    ``safetensors.torch.load_file``. Needs ``pip install safetensors``.
    """
    save_file = _save_file()
    file = as_path(file, "sbpflow.export_safetensors")
    if not isinstance(state_dict, dict):
        raise TypeError(
            f"state_dict must be a dict, got {type(state_dict).__name__}; pass e.g. "
            "model.state_dict()."
        )
    flat = flatten({k: v.state_dict() if is_stateful(v) else v for k, v in state_dict.items()})
    is_writer = get_rank() == 0
    tensors: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] = {}
    seen: set[int] = set()
    with torch.no_grad():
        for key, (_, value) in flat.items():
            if isinstance(value, GlobalTensor):
                first = Placement(value.placement.type, [0])
                whole = value.to_global(first, Broadcast())  # rank 0 holds the logical tensor
                if is_writer:
                    tensors[key] = _own_storage(whole._local, seen)
            elif isinstance(value, torch.Tensor):
                if is_writer:
                    tensors[key] = _own_storage(value, seen)
            else:
                try:
                    metadata[key] = json.dumps(value)
                except TypeError:
                    raise TypeError(
                        f"export_safetensors cannot store the {type(value).__name__} at {key!r}: "
                        "safetensors holds tensors, and other values must be JSON-encodable "
                        "(ints, floats, strings, lists, dicts). Leave it out of the state_dict."
                    ) from None
    error = None
    if is_writer:
        try:
            save_file(tensors, file, metadata=metadata or None)
        except (OSError, ValueError, RuntimeError) as exc:
            error = f"rank 0 could not write {file!r}: {exc}"
    (error, *_) = gather_from_every_rank(error, "exported")
    if error is not None:
        raise OSError(error)
