"""Modules on global tensors: ``Module.to_global``, and ``Graph`` for training steps with pipeline stages."""

from .graph import Block, BlockConfig, Graph, GraphConfig
from .module import module_to_global

__all__ = ["Block", "BlockConfig", "Graph", "GraphConfig", "module_to_global"]
