"""Sleeping on a 32-bit word in shared memory until another process changes it (Linux futex).

The shared-memory table (NOTE [shared-memory meta check]) uses this so that a
rank waiting for the others sleeps in the kernel and is woken the moment the
last one publishes, instead of polling with sleeps that add their own latency.
Where the futex system call is not available (not Linux, an architecture
whose call number is not listed), ``AVAILABLE`` is False and callers poll.
"""

from __future__ import annotations

import ctypes
import platform
import sys

_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_WAKE_ALL = 2**31 - 1
_SYSCALL_NUMBER = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(
    platform.machine().lower()
)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_syscall() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux") or _SYSCALL_NUMBER is None:
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).syscall  # releases the GIL while it waits
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_long
    return call


_syscall = _load_syscall()
AVAILABLE = _syscall is not None


def wait(address: int, expected: int, timeout_s: float) -> None:
    """Sleep while the int32 at ``address`` equals ``expected``, at most ``timeout_s``.

    Returns at once if the word already differs; may also return spuriously.
    """
    seconds = max(timeout_s, 0.0)
    timeout = _Timespec(int(seconds), int((seconds % 1.0) * 1e9))
    _futex(address, _FUTEX_WAIT, expected, ctypes.byref(timeout))


def wake_all(address: int) -> None:
    """Wake every process sleeping on the int32 at ``address``."""
    _futex(address, _FUTEX_WAKE, _WAKE_ALL, ctypes.c_void_p(None))


def _futex(address: int, op: int, value: int, timeout: object) -> None:
    assert _syscall is not None and _SYSCALL_NUMBER is not None
    # Every argument has its C width spelled out: syscall() is variadic and reads longs.
    _syscall(
        ctypes.c_long(_SYSCALL_NUMBER), ctypes.c_void_p(address), ctypes.c_long(op),
        ctypes.c_long(value), timeout, ctypes.c_void_p(None), ctypes.c_long(0),
    )  # fmt: skip
