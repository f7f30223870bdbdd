"""Utilities around global tensors that are not part of the tensor model itself."""

from __future__ import annotations

from . import data

__all__ = ["data"]
