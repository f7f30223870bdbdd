"""A table in shared memory through which the ranks of one host gather small int vectors.

# NOTE [shared-memory meta check]
# The metadata check (NOTE [meta check]) runs on every user-level
# ``to_global``, so its latency is paid on every call. Over gloo one round
# costs a few hundred microseconds on 2 ranks and about a millisecond on 4
# ranks of a busy machine: thread hand-offs and socket wake-ups, for 200 bytes.
# When every rank of the world runs on one host, the ranks gather through a
# file in /dev/shm that each has mapped instead, in microseconds.
#
# Layout: per rank two slots, used by alternate calls, each
# ``[seq, values..., checksum]`` in int64. A rank writes its values and their
# checksum, then the call's sequence number; a reader takes a slot once it
# shows this call's number and a checksum that matches what it read (so a
# CPU that makes writes visible out of order cannot hand out a half-written
# row). Two slots suffice: a rank finishes call k+1 only after every rank has
# published k+1, that is, after every rank has finished reading call k, so
# nobody overwrites a slot that is still being read.
#
# Waiting, the setup at the first check and ``SBPFLOW_SHARED_MEMORY=0`` are
# those of every shared-memory transport (``_shared_memory``).
"""

from __future__ import annotations

import array
import mmap
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from . import _shared_memory


class SharedTable:
    """One host's table: ``gather(values)`` returns every rank's values, in rank order."""

    def __init__(self, buffer: mmap.mmap, rank: int, world: int, width: int, pids: Sequence[int]):
        self._buffer = buffer
        self._cells = memoryview(buffer).cast("q")
        self._rank = rank
        self._world = world
        self._width = width
        self._seq = 0
        self._broken: str | None = None
        wake_cell = self._probe_base() + world  # its first 4 bytes are the futex word
        self._waiter = _shared_memory.Waiter(
            buffer, 8 * wake_cell, range(world), pids, "the shared-memory table"
        )

    @property
    def _slot_size(self) -> int:
        return self._width + 2

    @staticmethod
    def size_in_bytes(world: int, width: int) -> int:
        # two slots per rank, the probe row, the wake-up word
        return 8 * (2 * world * (width + 2) + world + 1)

    def _slot(self, rank: int, seq: int) -> int:
        return (rank * 2 + seq % 2) * self._slot_size

    def write_probe(self) -> None:
        self._cells[self._probe_base() + self._rank] = self._rank + 1

    def probe_sees_everyone(self) -> bool:
        base = self._probe_base()
        return all(self._cells[base + r] == r + 1 for r in range(self._world))

    def _probe_base(self) -> int:
        return 2 * self._world * self._slot_size

    def gather(self, values: Sequence[int], timeout_s: float) -> list[list[int]]:
        """Publish ``values`` and wait for every rank's; raise ``RuntimeError`` past ``timeout_s``."""
        if self._broken is not None:
            raise RuntimeError(
                f"an earlier metadata check failed ({self._broken}), so the ranks are out of step; "
                "restart the job."
            )
        if len(values) != self._width:
            raise ValueError(f"expected {self._width} values, got {len(values)}")
        self._seq += 1
        seq = self._seq
        mine = self._slot(self._rank, seq)
        cells = self._cells
        cells[mine + 1 : mine + 1 + self._width] = array.array("q", values)
        cells[mine + self._width + 1] = hash((seq, *values))
        cells[mine] = seq
        self._waiter.announce(seq * self._world + self._rank)
        rows: list[list[int] | None] = [None] * self._world
        try:
            self._waiter.wait(lambda: self._take_rows(seq, rows), timeout_s)
        except RuntimeError as error:
            self._broken = str(error)
            raise
        return rows  # type: ignore[return-value]

    def _take_rows(self, seq: int, rows: list[list[int] | None]) -> list[int]:
        """Fill in the rows published for call ``seq``; return the ranks still missing."""
        cells, width = self._cells, self._width
        missing = []
        for rank in range(self._world):
            if rows[rank] is not None:
                continue
            base = self._slot(rank, seq)
            if cells[base] == seq:
                row = cells[base + 1 : base + 1 + width].tolist()
                if cells[base + width + 1] == hash((seq, *row)):
                    rows[rank] = row
                    continue
            missing.append(rank)
        return missing

    def close(self) -> None:
        self._waiter.close()
        self._cells.release()
        self._buffer.close()


def map_table(path: str, rank: int, world: int, width: int, pids: Sequence[int]) -> SharedTable:
    """Map the table file at ``path`` (made by ``create_file``) as ``rank``'s view."""
    buffer = _shared_memory.map_file(path, SharedTable.size_in_bytes(world, width))
    return SharedTable(buffer, rank, world, width, pids)


def create_file(path: str, world: int, width: int) -> None:
    """A new zero-filled table file, readable and writable by this user only."""
    _shared_memory.create_file(path, SharedTable.size_in_bytes(world, width))


def open_for_world(
    group: dist.ProcessGroup,
    width: int,
    gather_objects: Callable[[Any, dist.ProcessGroup], list[Any]],
) -> SharedTable | None:
    """Map one table shared by every rank of ``group`` (the world), or ``None`` everywhere.

    A collective over the world (``_shared_memory.open_for_group``).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    return _shared_memory.open_for_group(
        group,
        "meta",
        SharedTable.size_in_bytes(world, width),
        lambda path, pids: map_table(path, rank, world, width, pids),
        gather_objects,
    )
