"""Optional CuPy kernels for sbpflow's communication buffers, with torch reference paths.

Nothing here imports CuPy at module import time: ``import sbpflow`` and this
package work on a machine without CUDA or CuPy, and every function falls back
to its torch reference path there.
"""

from __future__ import annotations

from .pack import cupy_available, pad_chunks

__all__ = ["cupy_available", "pad_chunks"]
