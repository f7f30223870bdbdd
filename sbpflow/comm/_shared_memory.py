"""What the shared-memory transports of one host share: files, waiting, setup.

Two transports map a file in /dev/shm that every member of a group has
mapped: the metadata check's table (``_shared_table``, NOTE [shared-memory
meta check]) and the data arena of CPU collectives (``_shared_arena``, NOTE
[shared-memory collectives]). This module holds the parts they have in common:

- ``Waiter``: waiting for the other members, bounded like a collective. It
  spins (yielding the CPU) for a short while, then sleeps on a futex word of
  the file that every member overwrites with a token of its own after
  publishing, and wakes all sleepers. The word is read before the condition is
  checked, and a member sleeps only while the word still holds what it read,
  so a publication between the check and the sleep is never missed (sleeps
  last at most 0.1 s, which also bounds the cost of a wake-up lost to a CPU
  that reorders more than x86 does). Without futexes it polls with short
  sleeps. Past the collective timeout it raises, and a member process that
  exited is noticed within about a tenth of a second.
- ``open_for_group``: the setup, a collective over the group's gloo handle.
  The first member creates the file (exclusively, mode 0600), every member maps
  it and writes a probe, and the file is used only if every member sees every
  probe: any member that cannot map it (no /dev/shm, another host, a container
  with its own /dev/shm) makes every member keep the gloo path. The file is
  unlinked once everyone has mapped it, so nothing is left behind.
  ``SBPFLOW_SHARED_MEMORY=0`` turns both transports off.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch.distributed as dist

from . import _futex

DIRECTORY = "/dev/shm"
# 64 yielding spins last about 0.1 ms (measured, 2-core x86 machine): a peer that is
# already running arrives within them; 2000 measured no better (and starve peers
# when ranks outnumber cores).
_SPINS = 64
_MAX_SLEEP_S = 2.5e-4  # polling step where futexes are not available
_LIVENESS_EVERY_S = 0.1  # also the longest futex sleep: how fast a dead peer is seen


def enabled_by_environment() -> bool:
    return os.environ.get("SBPFLOW_SHARED_MEMORY", "1").strip().lower() not in ("0", "false", "no")


class Waiter:
    """Waits until no member is missing; ``announce`` wakes the members that wait.

    ``word_offset`` is the byte offset of the 32-bit futex word in ``buffer``.
    ``ranks`` and ``pids`` name each member (by its world rank) in messages and
    liveness checks.
    """

    def __init__(
        self,
        buffer: mmap.mmap,
        word_offset: int,
        ranks: Sequence[int],
        pids: Sequence[int],
        place: str,
    ):
        self._words = memoryview(buffer).cast("i")
        self._word = word_offset // 4
        self._ranks = list(ranks)
        self._pids = list(pids)
        self._place = place
        self._anchor: ctypes.c_char | None = None
        self._address = 0
        if _futex.AVAILABLE:
            self._anchor = ctypes.c_char.from_buffer(buffer, word_offset)
            self._address = ctypes.addressof(self._anchor)

    def announce(self, token: int) -> None:
        """Tell the waiting members that something changed (call after publishing)."""
        if self._address:
            self._words[self._word] = token % 2**31
            _futex.wake_all(self._address)

    def wait(self, missing_now: Callable[[], list[int]], timeout_s: float) -> None:
        """Return once ``missing_now()`` (member indices still missing) is empty.

        Raises ``RuntimeError`` past ``timeout_s`` or when a missing member's
        process has exited.
        """
        spins = 0
        start = time.monotonic()
        next_liveness = start + _LIVENESS_EVERY_S
        while True:
            token = self._words[self._word]
            missing = missing_now()
            if not missing:
                return
            spins += 1
            if spins <= _SPINS:
                os.sched_yield()
                continue
            if self._address:
                _futex.wait(self._address, token, _LIVENESS_EVERY_S)
            else:
                time.sleep(min(_MAX_SLEEP_S, 1e-5 * (spins - _SPINS)))
            now = time.monotonic()
            if now - start > timeout_s:
                raise RuntimeError(
                    f"timed out after {timeout_s:.0f} s in {self._place}: ranks "
                    f"{[self._ranks[k] for k in missing]} never arrived"
                )
            if now >= next_liveness:
                next_liveness = now + _LIVENESS_EVERY_S
                self._raise_if_exited(missing)

    def _raise_if_exited(self, missing: Sequence[int]) -> None:
        for member in missing:
            if not is_alive(self._pids[member]):
                raise RuntimeError(
                    f"rank {self._ranks[member]} (pid {self._pids[member]}) exited while the "
                    "others waited for it"
                )

    def close(self) -> None:
        self._anchor = None
        self._words.release()


def is_alive(pid: int) -> bool:
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


def create_file(path: str, size: int, *, reserve: bool = False) -> None:
    """A new zero-filled file of ``size`` bytes, readable and writable by this user only.

    ``reserve`` allocates the memory now: a mapping of a file whose pages
    /dev/shm cannot provide later fails with SIGBUS on first touch, where
    reserving fails here, with an ``OSError`` the caller can fall back on.
    """
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        if reserve:
            os.posix_fallocate(fd, 0, size)
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)


def map_file(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class Probed(Protocol):
    def write_probe(self) -> None: ...
    def probe_sees_everyone(self) -> bool: ...
    def close(self) -> None: ...


Mapped = TypeVar("Mapped", bound=Probed)


def open_for_group(
    handle: dist.ProcessGroup,
    kind: str,
    size: int,
    make: Callable[[str, list[int]], Mapped],
    gather_objects: Callable[[Any, dist.ProcessGroup], list[Any]],
    *,
    supported: bool = True,
) -> Mapped | None:
    """Map one shared file for every member of ``handle``'s group, or ``None`` everywhere.

    A collective over the group: every member calls it at the same point, and
    every member reaches the same verdict. ``make(path, pids)`` maps the file
    of ``size`` bytes as this member's view (``pids`` in group order);
    ``gather_objects(obj, handle)`` is the all_gather of picklable objects it
    talks through. A member passing ``supported=False`` (the transport does not
    work on its platform) makes every member get ``None``.
    """
    member = dist.get_rank(handle)
    usable = supported and os.path.isdir(DIRECTORY) and enabled_by_environment()
    path = ""
    if member == 0 and usable:
        path = os.path.join(DIRECTORY, f"sbpflow-{kind}-{uuid.uuid4().hex}")
        try:
            create_file(path, size, reserve=True)
        except OSError:
            path = ""
    # The first member made the file before the first gather, which hands its path to everyone.
    here = (socket.gethostname(), _boot_id(), usable, os.getpid(), path)
    hosts: list[tuple[str, str, bool, int, str]] = gather_objects(here, handle)
    shared_path = hosts[0][4]
    mapped = None
    if shared_path and all(h[:3] == hosts[0][:3] for h in hosts):
        try:
            mapped = make(shared_path, [h[3] for h in hosts])
            mapped.write_probe()
        except OSError:
            mapped = None
    dist.barrier(group=handle)
    ok = mapped is not None and mapped.probe_sees_everyone()
    verdicts: list[bool] = gather_objects(ok, handle)
    if path:
        os.unlink(path)  # every member has mapped it (or given up): nothing is left behind
    if all(verdicts):
        return mapped
    if mapped is not None:
        mapped.close()
    return None
