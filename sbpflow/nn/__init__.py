"""Modules on global tensors: ``Module.to_global``, ``Graph`` for training steps with pipeline
stages, and ``parallel`` (gradient sync, DistributedDataParallel)."""

from . import parallel
from .graph import Block, BlockConfig, Graph, GraphConfig
from .module import module_to_global

__all__ = ["Block", "BlockConfig", "Graph", "GraphConfig", "module_to_global", "parallel"]
