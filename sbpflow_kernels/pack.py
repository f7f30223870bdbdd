"""Packing uneven chunks into a padded buffer (and back) for collectives.

Collectives need equal-sized pieces; balanced splits are uneven. ``pad_chunks``
copies chunk ``k`` (``sizes[k]`` rows along dim 0) into row block ``k`` of a
``(len(sizes) * longest, ...)`` buffer, zero-filling the tail of each block;
``unpad_chunks`` is its inverse. On CUDA with CuPy this is one kernel launch
instead of one copy per chunk plus a concatenation.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

_KERNEL_SOURCE = r"""
extern "C" __global__ void pad_rows(const unsigned char* src, unsigned char* dst,
                                    const long long* offsets, const long long* sizes,
                                    long long longest, long long row_bytes, long long total) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    long long per_chunk = longest * row_bytes;
    long long k = i / per_chunk;
    long long within = i % per_chunk;
    long long row = within / row_bytes;
    dst[i] = row < sizes[k] ? src[(offsets[k] + row) * row_bytes + within % row_bytes] : 0;
}
"""


@functools.lru_cache(maxsize=1)
def cupy_available() -> bool:
    """True when CuPy imports and sees a CUDA device."""
    try:
        import cupy  # noqa: F401

        return bool(torch.cuda.is_available())
    except Exception:  # ImportError, or a CuPy built for another CUDA
        return False


def pad_chunks(rows: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """Reference semantics: ``cat([pad(chunk_k, longest) for k])`` along dim 0."""
    longest = max(sizes) if sizes else 0
    if sum(sizes) != rows.shape[0]:
        raise ValueError(f"chunk sizes {list(sizes)} do not add up to {rows.shape[0]} rows.")
    if rows.is_cuda and cupy_available() and rows.numel() > 0:
        return _pad_chunks_cupy(rows.contiguous(), sizes, longest)
    chunks = torch.split(rows, list(sizes), dim=0)
    out = rows.new_zeros((len(sizes) * longest, *rows.shape[1:]))
    for k, chunk in enumerate(chunks):
        out[k * longest : k * longest + chunk.shape[0]] = chunk
    return out


def unpad_chunks(padded: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """Inverse of ``pad_chunks``: drop each block's zero tail and concatenate."""
    longest = padded.shape[0] // max(len(sizes), 1)
    return torch.cat([padded[k * longest : k * longest + s] for k, s in enumerate(sizes)], dim=0)


@functools.lru_cache(maxsize=1)
def _kernel() -> Any:
    import cupy

    return cupy.RawKernel(_KERNEL_SOURCE, "pad_rows")


def _pad_chunks_cupy(rows: torch.Tensor, sizes: Sequence[int], longest: int) -> torch.Tensor:
    import cupy

    out = rows.new_empty((len(sizes) * longest, *rows.shape[1:]))
    row_bytes = rows[0].numel() * rows.element_size() if rows.shape[0] else 0
    offsets = [0]
    for s in sizes[:-1]:
        offsets.append(offsets[-1] + s)
    total = out.numel() * out.element_size()
    if total == 0:
        return out
    with cupy.cuda.ExternalStream(torch.cuda.current_stream(rows.device).cuda_stream):
        src = cupy.asarray(rows.view(-1).view(torch.uint8))
        dst = cupy.asarray(out.view(-1).view(torch.uint8))
        offs = cupy.asarray(offsets, dtype=cupy.int64)
        szs = cupy.asarray(list(sizes), dtype=cupy.int64)
        threads = 256
        blocks = (total + threads - 1) // threads
        _kernel()(
            (blocks,),
            (threads,),
            (src, dst, offs, szs, cupy.int64(longest), cupy.int64(row_bytes), cupy.int64(total)),
        )
    return out
