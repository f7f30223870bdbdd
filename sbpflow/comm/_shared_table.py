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
# Waiting spins (yielding the CPU) for a short while, then sleeps on a futex:
# one 32-bit word of the table, which every rank overwrites with a token of
# its own (unique per call and rank) after publishing, and then wakes all
# sleepers. A rank reads the word before it looks at the slots and sleeps only
# while the word still holds what it read, so a publication between the look
# and the sleep is never missed (sleeps last at most 0.1 s, which also bounds
# the cost of a wake-up lost to a CPU that reorders more than x86 does).
# Without futexes it polls with short sleeps. Waiting is bounded like a
# collective: past the collective timeout it raises, and a peer process that
# exited is noticed within about a tenth of a second. The table is set up once, at the first
# check, by gloo collectives over the world; any rank that cannot map it (no
# /dev/shm, another host, a container with its own /dev/shm) makes every rank
# keep the gloo path. ``SBPFLOW_SHARED_MEMORY=0`` turns the table off.
"""

from __future__ import annotations

import array
import ctypes
import mmap
import os
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from . import _futex

_DIRECTORY = "/dev/shm"
# 64 yielding spins last about 0.1 ms (measured, 2-core x86 machine): a peer that is
# already running arrives within them; 2000 measured no better (and starve peers
# when ranks outnumber cores).
_SPINS = 64
_MAX_SLEEP_S = 2.5e-4  # polling step where futexes are not available
_LIVENESS_EVERY_S = 0.1  # also the longest futex sleep: how fast a dead peer is seen


class SharedTable:
    """One host's table: ``gather(values)`` returns every rank's values, in rank order."""

    def __init__(self, buffer: mmap.mmap, rank: int, world: int, width: int, pids: Sequence[int]):
        self._buffer = buffer
        self._cells = memoryview(buffer).cast("q")
        self._rank = rank
        self._world = world
        self._width = width
        self._pids = list(pids)
        self._seq = 0
        self._broken: str | None = None
        self._words = memoryview(buffer).cast("i")
        self._wake_cell = self._probe_base() + world  # its first 4 bytes are the futex word
        self._wake_address = 0
        self._anchor: ctypes.c_char | None = None
        if _futex.AVAILABLE:
            self._anchor = ctypes.c_char.from_buffer(buffer, 8 * self._wake_cell)
            self._wake_address = ctypes.addressof(self._anchor)

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
        if self._wake_address:
            self._words[2 * self._wake_cell] = (seq * self._world + self._rank) % 2**31
            _futex.wake_all(self._wake_address)
        try:
            return self._wait_for_all(seq, timeout_s)
        except RuntimeError as error:
            self._broken = str(error)
            raise

    def _wait_for_all(self, seq: int, timeout_s: float) -> list[list[int]]:
        rows: list[list[int] | None] = [None] * self._world
        cells, width = self._cells, self._width
        spins = 0
        start = time.monotonic()
        next_liveness = start + _LIVENESS_EVERY_S
        while True:
            token = self._words[2 * self._wake_cell]
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
            if not missing:
                return rows  # type: ignore[return-value]
            spins += 1
            if spins <= _SPINS:
                os.sched_yield()
                continue
            if self._wake_address:
                _futex.wait(self._wake_address, token, _LIVENESS_EVERY_S)
            else:
                time.sleep(min(_MAX_SLEEP_S, 1e-5 * (spins - _SPINS)))
            now = time.monotonic()
            if now - start > timeout_s:
                raise RuntimeError(
                    f"timed out after {timeout_s:.0f} s in the shared-memory table: ranks "
                    f"{missing} never arrived"
                )
            if now >= next_liveness:
                next_liveness = now + _LIVENESS_EVERY_S
                self._raise_if_exited(missing)

    def _raise_if_exited(self, missing: Sequence[int]) -> None:
        for rank in missing:
            if not _is_alive(self._pids[rank]):
                raise RuntimeError(
                    f"rank {rank} (pid {self._pids[rank]}) exited while the others waited for it"
                )

    def close(self) -> None:
        self._anchor = None
        self._cells.release()
        self._words.release()
        self._buffer.close()


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    try:  # an exited process its parent has not reaped yet is a zombie ("Z")
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def map_table(path: str, rank: int, world: int, width: int, pids: Sequence[int]) -> SharedTable:
    """Map the table file at ``path`` (made by ``create_file``) as ``rank``'s view."""
    fd = os.open(path, os.O_RDWR)
    try:
        buffer = mmap.mmap(fd, SharedTable.size_in_bytes(world, width))
    finally:
        os.close(fd)
    return SharedTable(buffer, rank, world, width, pids)


def create_file(path: str, world: int, width: int) -> None:
    """A new zero-filled table file, readable and writable by this user only."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, SharedTable.size_in_bytes(world, width))
    finally:
        os.close(fd)


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def enabled_by_environment() -> bool:
    return os.environ.get("SBPFLOW_SHARED_MEMORY", "1").strip().lower() not in ("0", "false", "no")


def open_for_world(
    group: dist.ProcessGroup,
    width: int,
    gather_objects: Callable[[Any, dist.ProcessGroup], list[Any]],
) -> SharedTable | None:
    """Map one table shared by every rank of ``group`` (the world), or ``None`` everywhere.

    A collective over the world: every rank calls it at the same point, and
    every rank reaches the same verdict. ``gather_objects(obj, group)`` is the
    all_gather of picklable objects it talks through.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    usable = os.path.isdir(_DIRECTORY) and enabled_by_environment()
    path = ""
    if rank == 0 and usable:
        path = os.path.join(_DIRECTORY, f"sbpflow-meta-{uuid.uuid4().hex}")
        try:
            create_file(path, world, width)
        except OSError:
            path = ""
    # Rank 0 made the file before the first gather, which hands its path to everyone.
    here = (socket.gethostname(), _boot_id(), usable, os.getpid(), path)
    hosts: list[tuple[str, str, bool, int, str]] = gather_objects(here, group)
    shared_path = hosts[0][4]
    table = None
    if shared_path and all(h[:3] == hosts[0][:3] for h in hosts):
        try:
            table = map_table(shared_path, rank, world, width, [h[3] for h in hosts])
            table.write_probe()
        except OSError:
            table = None
    dist.barrier(group=group)
    ok = table is not None and table.probe_sees_everyone()
    verdicts: list[bool] = gather_objects(ok, group)
    if path:
        os.unlink(path)  # every rank has mapped it (or given up): nothing is left behind
    if all(verdicts):
        return table
    if table is not None:
        table.close()
    return None
