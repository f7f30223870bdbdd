"""Packing uneven chunks into a padded buffer for collectives.

Collectives need equal-sized pieces; balanced splits are uneven. ``pad_chunks``
copies chunk ``k`` (``sizes[k]`` rows along dim 0) into row block ``k`` of a
``(len(sizes) * longest, ...)`` buffer, zero-filling the tail of each block.
On CUDA with CuPy ``pad_chunks`` is one kernel launch that writes every byte of the buffer once (data or zero), instead of a
zero fill plus one copy per chunk, for the balanced sizes collectives use (other
sizes take the torch path). sbpflow's reduce_scatter of an uneven dim-0 split on CUDA
packs with it: measured on an H200 at 1.5x to 3.2x the bandwidth of its torch path
(docs/benchmarks.md, "GPU").

# NOTE [vectorized padding]
# The kernel moves the widest word (16, 8, 4, 2 or 1 bytes) that divides a row
# and both buffers' addresses, one word per thread in a grid-stride loop: a
# byte per thread reaches a fraction of the device's copy bandwidth, a 16-byte
# word nearly all of it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

_KERNEL_SOURCE = r"""
// Block row blockIdx.y packs chunk k = blockIdx.y of a balanced split of n rows into
// `parts` chunks: chunk k starts at row k * base + min(k, extra) and holds base + (k < extra)
// rows (base = n / parts, extra = n % parts); every block of the output is `longest` rows.
template <typename T>
__device__ void pad_balanced(const T* src, T* dst, long long n, long long parts,
                             long long row_words) {
    long long k = blockIdx.y;
    long long base = n / parts, extra = n % parts;
    long long longest = base + (extra > 0 ? 1 : 0);
    long long size = base + (k < extra ? 1 : 0);
    long long start = k * base + (k < extra ? k : extra);
    const T* from = src + start * row_words;
    T* to = dst + k * longest * row_words;
    long long filled = size * row_words, words = longest * row_words;
    long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += step) {
        to[i] = i < filled ? from[i] : T{};
    }
}

#define PAD_BALANCED(NAME, T)                                                          \
extern "C" __global__ void NAME(const T* src, T* dst, long long n, long long parts,     \
                                long long row_words) {                                 \
    pad_balanced<T>(src, dst, n, parts, row_words);                                    \
}
PAD_BALANCED(pad_balanced_16, uint4)
PAD_BALANCED(pad_balanced_8, unsigned long long)
PAD_BALANCED(pad_balanced_4, unsigned int)
PAD_BALANCED(pad_balanced_2, unsigned short)
PAD_BALANCED(pad_balanced_1, unsigned char)
"""

_WORDS = (16, 8, 4, 2, 1)


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
    if sum(sizes) != rows.shape[0]:
        raise ValueError(f"chunk sizes {list(sizes)} do not add up to {rows.shape[0]} rows.")
    longest = max(sizes) if sizes else 0
    if rows.is_cuda and rows.numel() > 0 and _is_balanced(sizes) and cupy_available():
        return _pad_chunks_cupy(rows.contiguous(), len(sizes), longest)
    return pad_chunks_torch(rows, sizes)


def _is_balanced(sizes: Sequence[int]) -> bool:
    """Whether ``sizes`` is the balanced split of its sum (the first ``n % p`` one longer)."""
    n, parts = sum(sizes), len(sizes)
    return parts > 0 and all(s == n // parts + (k < n % parts) for k, s in enumerate(sizes))


def pad_chunks_torch(rows: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """The torch path of ``pad_chunks`` (the reference): a zero fill, then one copy per chunk."""
    longest = max(sizes) if sizes else 0
    out = rows.new_zeros((len(sizes) * longest, *rows.shape[1:]))
    for k, chunk in enumerate(torch.split(rows, list(sizes), dim=0)):
        out[k * longest : k * longest + chunk.shape[0]] = chunk
    return out


@functools.cache
def _kernel(word: int, device_index: int) -> Any:
    import cupy

    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=_KERNEL_SOURCE, options=("--std=c++14",))
        return module.get_function(f"pad_balanced_{word}")


def _word_size(row_bytes: int, *pointers: int) -> int:
    """The widest word dividing the row length and every address (NOTE [vectorized padding])."""
    return next(w for w in _WORDS if row_bytes % w == 0 and all(p % w == 0 for p in pointers))


class _Stream(NamedTuple):
    """What CuPy's kernel launch reads of a stream: its handle (torch's current stream)."""

    ptr: int


def _pad_chunks_cupy(rows: torch.Tensor, parts: int, longest: int) -> torch.Tensor:
    import cupy

    out = rows.new_empty((parts * longest, *rows.shape[1:]))
    if out.numel() == 0:
        return out
    row_bytes = rows[0].numel() * rows.element_size()
    word = _word_size(row_bytes, rows.data_ptr(), out.data_ptr())
    words_per_block = longest * row_bytes // word
    threads = 256
    blocks_x = max(1, min((words_per_block + threads - 1) // threads, 4096 // parts + 1))
    index = rows.device.index if rows.device.index is not None else torch.cuda.current_device()
    stream = _Stream(torch.cuda.current_stream(rows.device).cuda_stream)
    with cupy.cuda.Device(index):
        _kernel(word, index)(
            (blocks_x, parts),
            (threads,),
            (
                cupy.uint64(rows.data_ptr()),
                cupy.uint64(out.data_ptr()),
                cupy.int64(rows.shape[0]),
                cupy.int64(parts),
                cupy.int64(row_bytes // word),
            ),
            stream=stream,
        )
    return out
