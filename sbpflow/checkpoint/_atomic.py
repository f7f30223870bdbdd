"""Atomic replacement of a checkpoint directory: write beside it, then swap it into place.

# NOTE [atomic checkpoints]
# ``save(state_dict, path)`` never writes into ``path``. Every rank writes
# into ``path + ".tmp-<id>"`` (one id for the job, chosen by rank 0); when
# every rank has finished, rank 0 moves the new directory to ``path`` and
# only then deletes the previous checkpoint:
#   - no previous checkpoint: ``rename(tmp, path)``;
#   - on Linux: ``renameat2(tmp, path, RENAME_EXCHANGE)`` swaps the two
#     directories in one step, then the old one (now at ``tmp``) is deleted;
#   - elsewhere (or a file system without the exchange): ``path`` is renamed
#     to ``path + ".prev-<id>"``, ``tmp`` to ``path``, and the previous one is
#     deleted. A crash between the two renames leaves no ``path``; ``load``
#     then names the ``.prev-`` directory that still holds the previous one.
# So a process killed at any point of a save leaves ``path`` holding either
# the previous checkpoint or the new one, whole. A killed save leaves its
# ``.tmp-<id>`` directory behind; it is safe to delete.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import shutil
import sys
import uuid

__all__ = ["METADATA_FILE", "commit", "leftovers", "new_tmp_name", "problem_with_target"]

METADATA_FILE = ".metadata"  # what DCP's FileSystemWriter writes last, on the coordinator
_RENAME_EXCHANGE = 2  # linux/fs.h


def new_tmp_name(path: str) -> str:
    return f"{path}.tmp-{uuid.uuid4().hex[:12]}"


def problem_with_target(path: str) -> str | None:
    """Why ``path`` cannot receive a checkpoint, or None (checked on rank 0 before writing)."""
    if os.path.isfile(path):
        return (
            f"checkpoint path {path!r} is a file; a checkpoint is a directory. "
            "Pass a directory path (it is created if missing)."
        )
    if os.path.isdir(path) and os.listdir(path) and not is_checkpoint(path):
        return (
            f"checkpoint path {path!r} is a directory that holds files but no checkpoint "
            f"(no {METADATA_FILE}); sbpflow.save replaces the directory at the path, so it "
            "refuses to delete other files. Pass a new or empty directory, or an earlier checkpoint."
        )
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as error:
        return f"cannot create the parent directory of checkpoint path {path!r}: {error}."
    if not os.access(parent, os.W_OK):
        return f"the parent directory of checkpoint path {path!r} is not writable."
    return None


def is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METADATA_FILE))


def leftovers(path: str) -> list[str]:
    """Directories a crashed save left beside ``path`` (for error messages)."""
    return sorted(
        glob.glob(glob.escape(path) + ".prev-*") + glob.glob(glob.escape(path) + ".tmp-*")
    )


def _exchange(a: str, b: str) -> bool:
    """Swap directories ``a`` and ``b`` atomically (Linux ``renameat2``); False if unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd = -100
    result = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    if result == 0:
        return True
    errno = ctypes.get_errno()
    if errno in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: no exchange on this file system
        return False
    raise OSError(errno, os.strerror(errno), a)


def commit(tmp: str, path: str) -> None:
    """Move the finished checkpoint ``tmp`` to ``path`` (NOTE [atomic checkpoints]). Rank 0 only."""
    if not os.path.lexists(path):
        os.rename(tmp, path)
    elif _exchange(tmp, path):
        shutil.rmtree(tmp)
    else:
        previous = path + ".prev-" + tmp.rsplit(".tmp-", 1)[-1]
        os.rename(path, previous)
        os.rename(tmp, path)
        shutil.rmtree(previous)
    _sync_dir(os.path.dirname(os.path.abspath(path)))


def _sync_dir(directory: str) -> None:
    """Make the renames durable (best effort: not every platform can fsync a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
