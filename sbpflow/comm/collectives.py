"""Collectives on groups of ranks, with uneven pieces and named failures.

Every function takes ``group``: the tuple of member ranks in mesh order and the
process-group handle from ``_groups.group_of`` (``None`` for one rank). Pieces
may be uneven (balanced splits); they are padded to the largest piece for the
wire and trimmed after. A failure (a timeout, a peer that died) is re-raised
as ``CollectiveError`` naming the operation and the ranks.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from ._groups import world_group
from ._world import timeout_seconds

Group = tuple[tuple[int, ...], "dist.ProcessGroup | None"]

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the operation and ranks."""


@contextlib.contextmanager
def _named(op: str, ranks: Sequence[int]) -> Iterator[None]:
    try:
        yield
    except CollectiveError:
        raise
    except (RuntimeError, ValueError) as error:  # DistBackendError subclasses RuntimeError
        text = str(error)
        hint = ""
        if "timed out" in text.lower() or "timeout" in text.lower():
            hint = (
                f" It timed out after the collective timeout ({timeout_seconds():.0f} s): a rank "
                "probably stopped early, raised, or took a different code path. Set "
                "SBPFLOW_TIMEOUT to change the limit."
            )
        raise CollectiveError(
            f"sbpflow: {op} over ranks {list(ranks)} failed.{hint} Backend said: {text}"
        ) from error


def _pad_to(t: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    if t.shape[dim] == length:
        return t
    pad_shape = list(t.shape)
    pad_shape[dim] = length - t.shape[dim]
    return torch.cat([t, t.new_zeros(pad_shape)], dim=dim)


def all_gather(local: torch.Tensor, dim: int, group: Group, sizes: Sequence[int]) -> torch.Tensor:
    """Concatenate the members' pieces along ``dim`` (piece ``k`` has ``sizes[k]``)."""
    ranks, handle = group
    if handle is None:
        return local
    num = len(ranks)
    longest = max(sizes)
    piece = _pad_to(local, dim, longest).movedim(dim, 0).contiguous()
    out = piece.new_empty((num * piece.shape[0], *piece.shape[1:]))
    with _named("all_gather", ranks):
        dist.all_gather_into_tensor(out, piece, group=handle)
    if all(s == longest for s in sizes):
        return out.movedim(0, dim) if dim == 0 else _merge_leading(out, num, dim)
    pieces = [out[k * longest : k * longest + s] for k, s in enumerate(sizes)]
    return torch.cat(pieces, dim=0).movedim(0, dim).contiguous()


def _merge_leading(out: torch.Tensor, num: int, dim: int) -> torch.Tensor:
    # out is (num * n, rest...) with dim moved to the front; put the member
    # index next to `dim` and merge them.
    n = out.shape[0] // num
    stacked = out.view(num, n, *out.shape[1:])  # (num, n, rest...)
    moved = stacked.movedim(1, dim + 1).movedim(0, dim)  # (..., num, n, ...)
    shape = list(moved.shape)
    shape[dim : dim + 2] = [num * n]
    return moved.reshape(shape)


def all_reduce(local: torch.Tensor, group: Group, reduce_op: str, inplace: bool) -> torch.Tensor:
    ranks, handle = group
    if handle is None:
        return local
    out = local if inplace and local.is_contiguous() else local.contiguous().clone()
    with _named("all_reduce", ranks):
        dist.all_reduce(out, op=_REDUCE_OPS[reduce_op], group=handle)
    return out


def reduce_scatter(
    block: torch.Tensor, dim: int, group: Group, sizes: Sequence[int], reduce_op: str
) -> torch.Tensor:
    """Reduce the members' blocks and give member ``k`` chunk ``k`` along ``dim``."""
    ranks, handle = group
    if handle is None:
        return block
    index = _my_index(ranks)
    longest = max(sizes)
    moved = block.movedim(dim, 0)
    if all(s == longest for s in sizes):
        src = moved.contiguous()
    else:
        chunks = torch.split(moved, list(sizes), dim=0)
        src = torch.cat([_pad_to(c, 0, longest) for c in chunks], dim=0)
    out = src.new_empty((longest, *src.shape[1:]))
    with _named("reduce_scatter", ranks):
        dist.reduce_scatter_tensor(out, src, op=_REDUCE_OPS[reduce_op], group=handle)
    out = out[: sizes[index]]
    return out if dim == 0 else out.movedim(0, dim).contiguous()


def all_to_all(
    local: torch.Tensor,
    src_dim: int,
    dst_dim: int,
    group: Group,
    src_sizes: Sequence[int],
    dst_sizes: Sequence[int],
) -> torch.Tensor:
    """Turn a split along ``src_dim`` into a split along ``dst_dim`` within the group.

    Member ``k`` holds piece ``k`` along ``src_dim`` (``src_sizes[k]`` long) and
    ends with chunk ``k`` along ``dst_dim`` (``dst_sizes[k]`` long) of the whole.
    """
    ranks, handle = group
    if handle is None:
        return local
    index = _my_index(ranks)
    send_chunks = torch.split(local, list(dst_sizes), dim=dst_dim)
    send = torch.cat([c.reshape(-1) for c in send_chunks]) if local.numel() else local.reshape(-1)
    recv_shapes = []
    for k in range(len(ranks)):
        shape = list(local.shape)
        shape[src_dim] = src_sizes[k]
        shape[dst_dim] = dst_sizes[index]
        recv_shapes.append(shape)
    recv_numels = [int(torch.Size(s).numel()) for s in recv_shapes]
    recv = local.new_empty(sum(recv_numels))
    with _named("all_to_all", ranks):
        dist.all_to_all_single(
            recv, send, recv_numels, [c.numel() for c in send_chunks], group=handle
        )
    pieces = [p.view(s) for p, s in zip(torch.split(recv, recv_numels), recv_shapes)]
    if src_dim == 0:
        shape = list(recv_shapes[0])
        shape[0] = sum(src_sizes)
        return recv.view(shape)
    return torch.cat(pieces, dim=src_dim)


def broadcast(buffer: torch.Tensor, src_rank: int, group: Group) -> torch.Tensor:
    """Overwrite ``buffer`` on every member with ``src_rank``'s (in place)."""
    ranks, handle = group
    if handle is None:
        return buffer
    with _named("broadcast", ranks):
        dist.broadcast(buffer, src=src_rank, group=handle)
    return buffer


def exchange(
    sends: Sequence[tuple[int, torch.Tensor]],
    recvs: Sequence[tuple[int, torch.Tensor]],
    device_type: str,
) -> None:
    """Point-to-point: send each ``(peer, tensor)``, receive into each ``(peer, buffer)``."""
    ops = [dist.P2POp(dist.isend, t.contiguous(), peer) for peer, t in sends]
    ops += [dist.P2POp(dist.irecv, buf, peer) for peer, buf in recvs]
    if not ops:
        return
    peers = sorted({p for p, _ in sends} | {p for p, _ in recvs})
    world_group(device_type)  # make sure the world exists for this backend
    with _named("send_recv", peers):
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def all_gather_meta(vector: torch.Tensor) -> torch.Tensor:
    """Gather one int64 vector per world rank (CPU, gloo): shape ``(world, len)``."""
    handle = world_group("cpu")
    world = dist.get_world_size()
    if handle is None:
        return vector.view(1, -1)
    out = vector.new_empty(world * vector.numel())
    with _named("metadata check (all_gather)", range(world)):
        dist.all_gather_into_tensor(out, vector, group=handle)
    return out.view(world, -1)


def _my_index(ranks: Sequence[int]) -> int:
    return list(ranks).index(dist.get_rank())


def get_rank() -> int:
    return dist.get_rank()


def all_gather_object(obj: object) -> list:
    """Gather one picklable object per world rank (slow path, for error reports)."""
    handle = world_group("cpu")
    if handle is None:
        return [obj]
    out: list = [None] * dist.get_world_size()
    with _named("metadata check (all_gather_object)", range(dist.get_world_size())):
        dist.all_gather_object(out, obj, group=handle)
    return out
