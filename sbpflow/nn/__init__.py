"""Modules on global tensors."""

from .module import module_to_global

__all__ = ["module_to_global"]
