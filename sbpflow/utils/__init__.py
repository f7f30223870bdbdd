"""Utilities around global tensors that are not part of the tensor model itself."""

from __future__ import annotations

from .._rng import checkpoint_contexts
from . import data

__all__ = ["checkpoint_contexts", "data"]
