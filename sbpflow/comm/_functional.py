"""Functional collectives: the form a collective takes inside a ``torch.compile`` trace.

# NOTE [traced collectives]
# Under ``torch.compile`` a global tensor's local pieces are fake (Dynamo
# propagating shapes) or functional (AOTAutograd tracing the graph), and the
# in-place ``torch.distributed`` calls the eager path makes would put a
# process-group object into the graph (which cannot be copied or lowered).
# There, each collective is instead the out-of-place op of
# ``torch.ops._c10d_functional`` followed by ``wait_tensor``: the compiled
# graph holds the collectives as ordinary nodes (Inductor may move the waits
# to overlap them), keyed by the process group's name. These ops run on gloo
# as well as NCCL. Point-to-point transfers have no functional form on every
# torch sbpflow supports, so they refuse to be traced (``refuse_traced``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .._compiling import traced

__all__ = [
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "reduce_scatter",
    "refuse_traced",
    "traced",
]

_ops = torch.ops._c10d_functional


def refuse_traced(what: str, t: torch.Tensor) -> None:
    """Raise if ``t`` belongs to a ``torch.compile`` trace: ``what`` has no functional form.

    Every rank calls it with its piece (maybe empty), so every rank raises alike.
    """
    if traced(t):
        raise NotImplementedError(
            f"sbpflow: {what} cannot run inside torch.compile (it has no functional "
            "collective); do it outside the compiled function, e.g. convert inputs and move "
            "tensors between placements before calling the compiled model."
        )


def _name(handle: dist.ProcessGroup) -> str:
    return handle.group_name


# NOTE [bool buffers]
# Inductor's C++ backend (torch 2.13) fails to generate vectorized code that reads a bool
# buffer a collective wrote through computed indices: Hugging Face's padding mask,
# gathered across the ranks and then indexed per position, stops GPT-2 and BERT with an
# InductorError (and a bool <-> uint8 view gives a C++ compile error instead). Bool data
# therefore travels as uint8 values, converted on each side; the values are 0 and 1 either
# way, and the two conversions are tiny (masks).


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.uint8) if t.dtype == torch.bool else t


def _like(out: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    return out.to(torch.bool) if original.dtype == torch.bool else out


def all_gather(piece: torch.Tensor, handle: dist.ProcessGroup) -> torch.Tensor:
    """The members' ``piece`` (1-D, contiguous) one after another, in process-group order."""
    size = handle.size()
    out = _ops.all_gather_into_tensor(_bytes_of(piece), size, _name(handle))
    return _like(_ops.wait_tensor(out), piece)


def all_reduce(tensor: torch.Tensor, handle: dist.ProcessGroup, reduce_op: str) -> torch.Tensor:
    return _ops.wait_tensor(_ops.all_reduce(tensor, reduce_op, _name(handle)))


def reduce_scatter(block: torch.Tensor, handle: dist.ProcessGroup, reduce_op: str) -> torch.Tensor:
    """This member's chunk (process-group order) of the reduction of every ``block`` (1-D)."""
    size = handle.size()
    return _ops.wait_tensor(_ops.reduce_scatter_tensor(block, reduce_op, size, _name(handle)))


def all_to_all(
    send: torch.Tensor,
    recv_numels: Sequence[int],
    send_numels: Sequence[int],
    handle: dist.ProcessGroup,
) -> torch.Tensor:
    out = _ops.all_to_all_single(
        _bytes_of(send), list(recv_numels), list(send_numels), _name(handle)
    )
    return _like(_ops.wait_tensor(out), send)


def broadcast(buffer: torch.Tensor, src_rank: int, handle: dist.ProcessGroup) -> torch.Tensor:
    """``src_rank``'s (a global rank) ``buffer`` on every member, as a new tensor."""
    src = dist.get_group_rank(handle, src_rank)
    out = _ops.broadcast(_bytes_of(buffer), src, _name(handle))
    return _like(_ops.wait_tensor(out), buffer)
