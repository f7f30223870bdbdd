"""Sharded checkpoints of global tensors, through ``torch.distributed.checkpoint``.

``sbpflow.save(state_dict, path)`` writes each rank's chunks into one DCP
checkpoint directory, atomically; ``sbpflow.load(path, state_dict)`` fills a
state dict in place in any layout and world size; ``async_save`` writes in the
background; ``export_safetensors`` writes one consolidated safetensors file.
See docs/checkpoints.md.
"""

from ._load import load
from ._safetensors import export_safetensors
from ._save import async_save, save

__all__ = ["async_save", "export_safetensors", "load", "save"]
