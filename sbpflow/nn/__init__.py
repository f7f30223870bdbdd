"""Modules on global tensors: ``Module.to_global``, ``Graph`` for training steps with pipeline
stages (``pipeline``), and ``parallel`` (gradient sync, DistributedDataParallel)."""

from . import parallel, pipeline
from .module import module_to_global
from .pipeline import Block, BlockConfig, Graph, GraphConfig

__all__ = [
    "Block",
    "BlockConfig",
    "Graph",
    "GraphConfig",
    "module_to_global",
    "parallel",
    "pipeline",
]
