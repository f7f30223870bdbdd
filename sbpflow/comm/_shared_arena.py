"""CPU collectives through shared memory, for groups whose members share one host.

# NOTE [shared-memory collectives]
# Gloo moves CPU tensors between the processes of one host over loopback
# TCP: every byte is copied into a socket, through the kernel and out again,
# and a ring all_gather passes it on world - 1 times in sequence. The members
# of a group on one host can instead map one file in /dev/shm (the arena) and
# copy through it: a member writes its bytes once and every member reads what
# it needs, at memory speed. Measured on a 2-core machine, a 64 MiB all_gather
# on 2 ranks takes about a third of gloo's time (docs/benchmarks.md).
#
# Layout: a header page (the futex word, a probe cell and an arrival counter
# per member), then two sets ("parities") of one slot per member. A slot is a
# 64-byte header (the signature of the collective: op, size, dtype) and
# ``slot_bytes`` of data. A collective runs in rounds; each round moves at
# most a slot's worth per member and alternates the parity:
#
#   write: every member copies its part into its own slot,
#   sync:  it publishes the next arrival count and waits for everyone's,
#   read:  every member copies (or reduces) what it needs out of the slots.
#
# Two parities make one sync per round enough: a member writes into a parity
# again two rounds later, after the sync of the round between, which nobody
# passes before every member has finished reading the round before it. The
# all_reduce reduces in place (member k reduces the k-th piece of the round
# into its own slot, which nobody else reads in that step) and needs a second
# sync before the members read the reduced pieces.
#
# Ordering: the data is written with ordinary stores, then the arrival count.
# On x86 (TSO) stores become visible in program order, and loads are not
# reordered with other loads, so a member that sees the count sees the data.
# Other architectures keep gloo (``SUPPORTED``).
#
# In the first round every member compares the signatures in all slots, so
# members that run different collectives raise on every member rather than
# exchange garbage. Waiting is bounded like any collective: past the timeout,
# or when a member process exits, it raises, and the arena refuses further use
# (its members are out of step).
"""

from __future__ import annotations

import array
import mmap
import platform
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import _shared_memory

SUPPORTED = platform.machine().lower() in ("x86_64", "amd64")

_HEADER_BYTES = 4096
_SLOT_HEADER_BYTES = 64
_MAX_MEMBERS = (_HEADER_BYTES // 8 - 1) // 2
# Slot sizes grow by 4x from the smallest that holds a collective, up to the
# largest; a bigger collective runs in several rounds. 4 MiB per slot: a round
# then copies for about 0.3 ms, against a sync of tens of microseconds.
_MIN_SLOT_BYTES = 64 * 1024
MAX_SLOT_BYTES = 4 * 1024 * 1024

_OPS = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 3, "all_to_all": 4}
_REDUCE_CODES = {"sum": 1, "max": 2}


def slot_bytes_for(need: int) -> int:
    """The slot size to hold ``need`` bytes per member, within the bounds."""
    size = _MIN_SLOT_BYTES
    while size < need and size < MAX_SLOT_BYTES:
        size *= 4
    return min(size, MAX_SLOT_BYTES)


def segmented_need(members: int, piece_bytes: int) -> int:
    """Slot bytes a collective that cuts the slot per member needs for pieces of ``piece_bytes``
    (reduce_scatter, all_to_all; see ``SharedArena._segment_bytes``)."""
    return members * (-(-piece_bytes // 64) * 64)


def size_in_bytes(members: int, slot_bytes: int) -> int:
    return _HEADER_BYTES + 2 * members * (_SLOT_HEADER_BYTES + slot_bytes)


class SharedArena:
    """One member's view of a group's arena; the methods mirror torch's collectives.

    Members are numbered in process-group order (sorted ranks), as torch's
    tensor collectives order their pieces.
    """

    def __init__(
        self,
        buffer: mmap.mmap,
        member: int,
        ranks: Sequence[int],
        pids: Sequence[int],
        slot_bytes: int,
    ):
        if slot_bytes % 64 or slot_bytes < 64 * len(ranks):
            raise ValueError(
                f"slot_bytes must be a multiple of 64 and at least 64 per member, got {slot_bytes} "
                f"for {len(ranks)} members"
            )
        self._buffer = buffer
        self._cells = memoryview(buffer).cast("q")
        self._bytes = torch.frombuffer(buffer, dtype=torch.uint8)
        self._member = member
        self._members = len(ranks)
        self._ranks = list(ranks)
        self.slot_bytes = slot_bytes
        self._waiter = _shared_memory.Waiter(
            buffer, 0, ranks, pids, f"the shared-memory arena of ranks {list(ranks)}"
        )
        self._arrivals = 0
        self._round = 0
        self._broken: str | None = None

    # -- the header page: [futex word][probe per member][arrival count per member]

    def write_probe(self) -> None:
        self._cells[1 + self._member] = self._member + 1

    def probe_sees_everyone(self) -> bool:
        return all(self._cells[1 + k] == k + 1 for k in range(self._members))

    def _sync(self, timeout_s: float) -> None:
        self._arrivals += 1
        count, base, cells = self._arrivals, 1 + self._members, self._cells
        cells[base + self._member] = count
        self._waiter.announce(count * self._members + self._member)
        self._waiter.wait(
            lambda: [k for k in range(self._members) if cells[base + k] < count], timeout_s
        )

    # -- slots

    def _slot_offset(self, parity: int, member: int) -> int:
        return _HEADER_BYTES + (parity * self._members + member) * (
            _SLOT_HEADER_BYTES + self.slot_bytes
        )

    def _slot(self, parity: int, member: int) -> torch.Tensor:
        start = self._slot_offset(parity, member) + _SLOT_HEADER_BYTES
        return self._bytes[start : start + self.slot_bytes]

    def _rounds(
        self,
        op: str,
        agreed: tuple[int, int],
        extent: int,
        per_round: int,
        timeout_s: float,
        write: Callable[[int, int, int], None],
        read: Callable[[int, int, int], None],
    ) -> None:
        """Run rounds over byte offsets ``0, per_round, ...`` up to the largest ``extent``.

        ``write(parity, start, stop)`` fills this member's slot for the round,
        ``read(parity, start, stop)`` takes what it needs once everyone has.
        ``agreed`` must be equal on every member (else every member raises);
        ``extent`` may differ, and the largest sets the number of rounds.
        """
        if self._broken is not None:
            raise RuntimeError(
                f"an earlier collective on this group failed ({self._broken}), so its ranks are "
                "out of step; restart the job."
            )
        try:
            start, stop = 0, None
            while stop is None or start < stop:
                parity = self._round % 2
                self._round += 1
                end = start + per_round
                write(parity, start, end)
                if stop is None:
                    self._write_signature(parity, _OPS[op], *agreed, extent)
                self._sync(timeout_s)
                if stop is None:
                    stop = self._check_signatures(parity, op)
                read(parity, start, end)
                start = end
        except BaseException as error:  # an interrupt mid-round leaves the members out of step too
            self._broken = str(error) or type(error).__name__
            raise

    def _write_signature(self, parity: int, *values: int) -> None:
        cell = self._slot_offset(parity, self._member) // 8
        self._cells[cell : cell + len(values)] = array.array("q", values)

    def _check_signatures(self, parity: int, op: str) -> int:
        """The largest extent over the members; raise if they run different collectives."""
        rows = []
        for member in range(self._members):
            cell = self._slot_offset(parity, member) // 8
            rows.append(self._cells[cell : cell + 4].tolist())
        mine = rows[self._member]
        for member, row in enumerate(rows):
            if row[:3] != mine[:3]:
                raise RuntimeError(
                    f"the ranks run different collectives on this group: this rank (rank "
                    f"{self._ranks[self._member]}) {_describe(mine)}, rank {self._ranks[member]} "
                    f"{_describe(row)}. Every rank of a group must make the same collective calls "
                    "in the same order."
                )
        return max(row[3] for row in rows)

    # -- the collectives (tensors contiguous, on the CPU; pieces in member order)

    def all_gather(self, out: torch.Tensor, piece: torch.Tensor, timeout_s: float) -> None:
        """``out`` (members x ``piece``) gets every member's ``piece``."""
        src, dst = _as_bytes(piece), _as_bytes(out)
        size = src.numel()
        if size == 0:
            return
        me = self._member

        def write(parity: int, start: int, stop: int) -> None:
            n = min(stop, size) - start
            self._slot(parity, me)[:n].copy_(src[start : start + n])

        def read(parity: int, start: int, stop: int) -> None:
            n = min(stop, size) - start
            for k in range(self._members):
                source = src[start : start + n] if k == me else self._slot(parity, k)[:n]
                dst[k * size + start : k * size + start + n].copy_(source)

        self._rounds("all_gather", (size, 0), size, self.slot_bytes, timeout_s, write, read)

    def reduce_scatter(
        self, out: torch.Tensor, block: torch.Tensor, reduce_op: str, timeout_s: float
    ) -> None:
        """``out`` gets the reduction over members of piece ``member`` of their ``block``s."""
        src, dst = _as_bytes(block), _as_bytes(out)
        size = dst.numel()
        if size == 0:
            return
        me, members, dtype = self._member, self._members, out.dtype
        width = self._segment_bytes()

        def write(parity: int, start: int, stop: int) -> None:
            n = min(stop, size) - start
            slot = self._slot(parity, me)
            for k in range(members):
                slot[k * width : k * width + n].copy_(src[k * size + start : k * size + start + n])

        def read(parity: int, start: int, stop: int) -> None:
            n = min(stop, size) - start
            parts = [self._slot(parity, j)[me * width : me * width + n] for j in range(members)]
            _reduce_into(
                dst[start : start + n].view(dtype), [p.view(dtype) for p in parts], reduce_op
            )

        signature = (size, _type_code(dtype, reduce_op))
        self._rounds("reduce_scatter", signature, size, width, timeout_s, write, read)

    def all_reduce(self, tensor: torch.Tensor, reduce_op: str, timeout_s: float) -> None:
        """Reduce ``tensor`` over the members, in place."""
        data = _as_bytes(tensor)
        size = data.numel()
        if size == 0:
            return
        me, members, dtype = self._member, self._members, tensor.dtype
        itemsize = tensor.element_size()

        def write(parity: int, start: int, stop: int) -> None:
            n = min(stop, size) - start
            self._slot(parity, me)[:n].copy_(data[start : start + n])

        def read(parity: int, start: int, stop: int) -> None:
            items = (min(stop, size) - start) // itemsize
            bounds = [(k * items // members * itemsize) for k in range(members + 1)]
            lo, hi = bounds[me], bounds[me + 1]
            mine = self._slot(parity, me)[lo:hi].view(dtype)
            others = [self._slot(parity, j)[lo:hi].view(dtype) for j in range(members) if j != me]
            _reduce_into(mine, [mine, *others], reduce_op)
            self._sync(timeout_s)  # every piece is reduced
            for k in range(members):
                lo, hi = bounds[k], bounds[k + 1]
                data[start + lo : start + hi].copy_(self._slot(parity, k)[lo:hi])

        signature = (size, _type_code(dtype, reduce_op))
        self._rounds("all_reduce", signature, size, self.slot_bytes, timeout_s, write, read)

    def all_to_all(
        self,
        out: torch.Tensor,
        send: torch.Tensor,
        out_splits: Sequence[int],
        in_splits: Sequence[int],
        timeout_s: float,
    ) -> None:
        """Send piece ``k`` of ``send`` (``in_splits[k]`` items) to member ``k``; receive in order."""
        src, dst = _as_bytes(send), _as_bytes(out)
        itemsize = send.element_size()
        sends = _pieces([n * itemsize for n in in_splits])
        recvs = _pieces([n * itemsize for n in out_splits])
        me = self._member
        width = self._segment_bytes()

        def write(parity: int, start: int, stop: int) -> None:
            slot = self._slot(parity, me)
            for k, (offset, length) in enumerate(sends):
                n = min(stop, length) - start
                if n > 0 and k != me:  # its own piece a member copies straight across
                    slot[k * width : k * width + n].copy_(src[offset + start : offset + start + n])

        def read(parity: int, start: int, stop: int) -> None:
            for j, (offset, length) in enumerate(recvs):
                n = min(stop, length) - start
                if n > 0:
                    if j == me:
                        source = src[sends[me][0] + start : sends[me][0] + start + n]
                    else:
                        source = self._slot(parity, j)[me * width : me * width + n]
                    dst[offset + start : offset + start + n].copy_(source)

        extent = max((length for _, length in sends), default=0)
        self._rounds("all_to_all", (itemsize, 0), extent, width, timeout_s, write, read)

    def _segment_bytes(self) -> int:
        """A slot cut into one segment per member, each 64-byte aligned."""
        return self.slot_bytes // self._members // 64 * 64

    def close(self) -> None:
        """Let go of the mapping; it is unmapped once no tensor views it any more.

        Not ``mmap.close()``: tensors from ``torch.frombuffer`` keep the mmap
        object alive but do not stop ``close()`` from unmapping it under them.
        """
        self._waiter.close()
        self._cells.release()
        del self._bytes, self._buffer


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    assert t.is_contiguous(), "shared-memory collectives take contiguous tensors"
    return t.reshape(-1).view(torch.uint8)


def _pieces(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """``(offset, length)`` of consecutive pieces."""
    out, offset = [], 0
    for length in lengths:
        out.append((offset, length))
        offset += length
    return out


def _reduce_into(dst: torch.Tensor, parts: Sequence[torch.Tensor], reduce_op: str) -> None:
    """``dst`` = the reduction of ``parts`` in order (``dst`` may be ``parts[0]``)."""
    if len(parts) == 1:
        dst.copy_(parts[0])
        return
    combine = torch.add if reduce_op == "sum" else torch.maximum
    combine(parts[0], parts[1], out=dst)
    for part in parts[2:]:
        combine(dst, part, out=dst)


_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)  # fmt: skip


def _describe(signature: Sequence[int]) -> str:
    op_code, size, type_code = signature[:3]
    op = next((name for name, code in _OPS.items() if code == op_code), f"op #{op_code}")
    if op == "all_to_all":
        return f"runs all_to_all of {size}-byte items"
    text = f"runs {op} of {size} bytes" + (" per rank" if op != "all_reduce" else "")
    if type_code:
        dtype_index, reduce_code = divmod(type_code, 4)
        dtype = _DTYPES[dtype_index - 1] if dtype_index <= len(_DTYPES) else "another dtype"
        reduce_op = next(name for name, code in _REDUCE_CODES.items() if code == reduce_code)
        text += f" ({dtype}, {reduce_op})"
    return text


def _type_code(dtype: torch.dtype, reduce_op: str) -> int:
    code = _DTYPES.index(dtype) + 1 if dtype in _DTYPES else len(_DTYPES) + 1
    return code * 4 + _REDUCE_CODES[reduce_op]


def map_arena(
    path: str, member: int, ranks: Sequence[int], pids: Sequence[int], slot_bytes: int
) -> SharedArena:
    buffer = _shared_memory.map_file(path, size_in_bytes(len(ranks), slot_bytes))
    return SharedArena(buffer, member, ranks, pids, slot_bytes)


def open_for_group(
    handle: dist.ProcessGroup,
    ranks: Sequence[int],
    slot_bytes: int,
    gather_objects: Callable[[Any, dist.ProcessGroup], list[Any]],
) -> SharedArena | None:
    """An arena for the group of ``handle`` (``ranks`` in process-group order), or ``None``.

    A collective over the group, with the same verdict on every member
    (``_shared_memory.open_for_group``).
    """
    if len(ranks) > _MAX_MEMBERS:
        return None
    member = dist.get_rank(handle)
    return _shared_memory.open_for_group(
        handle,
        "arena",
        size_in_bytes(len(ranks), slot_bytes),
        lambda path, pids: map_arena(path, member, ranks, pids, slot_bytes),
        gather_objects,
        supported=SUPPORTED,  # a member elsewhere may be of another architecture
    )
