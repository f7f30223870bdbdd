"""``save`` and ``async_save``: a state dict of global tensors into a DCP checkpoint directory.

# NOTE [checkpoint DCP calls]
# The checkpoint layer calls ``torch.distributed.checkpoint`` (DCP) to plan,
# write and read: DCP's ``save``/``async_save``/``load`` run their own object
# collectives. That is the one place outside sbpflow/comm where
# torch.distributed runs, and it runs on the process group sbpflow.comm hands
# out for storage (NOTE [storage group] in comm/_storage.py); every other
# agreement (the tmp directory's name, errors, the barrier before the rename)
# goes through sbpflow.comm.
"""

from __future__ import annotations

import concurrent.futures
import copy
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from .._global import GlobalTensor
from ..comm._storage import gather_from_every_rank, storage_group
from ..comm._world import get_rank
from ._atomic import commit, new_tmp_name, problem_with_target
from ._chunks import Chunk, storable_sbp, write_chunk
from ._flat import flatten, is_stateful

__all__ = ["as_path", "async_save", "save", "wait_for_pending_save"]


def as_path(path: object, what: str) -> str:
    """``path`` as a ``str``; ``TypeError`` naming what was received otherwise."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"{what} expects a checkpoint path (str or os.PathLike), got "
            f"{type(path).__name__}: {path!r}."
        )
    text = os.fspath(path)
    if not isinstance(text, str) or text == "":
        raise ValueError(f"{what} expects a non-empty directory path, got {path!r}.")
    return text


@dataclass
class Staged:
    """A state dict as DCP receives it: flat, each global tensor as its local chunk."""

    entries: dict[str, Any] = field(default_factory=dict)
    chunks: dict[str, Chunk | None] = field(default_factory=dict)
    sizes: dict[str, tuple[int, ...]] = field(default_factory=dict)


def stage(state_dict: Any, *, snapshot: bool) -> Staged:
    """Flatten ``state_dict``; box partial tensors away (a collective per partial tensor).

    ``snapshot`` copies every value, so the caller may change its tensors
    while the copy is written (async save).
    """
    resolved = flatten(
        {k: v.state_dict() if is_stateful(v) else v for k, v in _as_dict(state_dict).items()}
    )
    staged = Staged()
    rank = get_rank()
    with torch.no_grad():
        for key, (_, value) in resolved.items():
            if isinstance(value, GlobalTensor):
                stored = storable_sbp(value.sbp, value.shape)
                if stored != value.sbp:
                    value = value.to_global(sbp=stored)  # reduce_scatter / all_reduce
                local = value._local.detach()
                staged.entries[key] = local.clone() if snapshot else local
                staged.chunks[key] = write_chunk(value._layout, value.shape, rank)
                staged.sizes[key] = tuple(value.shape)
            elif isinstance(value, torch.Tensor):
                staged.entries[key] = value.detach().clone() if snapshot else value.detach()
            else:
                staged.entries[key] = copy.deepcopy(value) if snapshot else value
    return staged


def _as_dict(state_dict: Any) -> dict[Any, Any]:
    if not isinstance(state_dict, dict):
        raise TypeError(
            f"state_dict must be a dict, got {type(state_dict).__name__}; pass e.g. "
            '{"model": model, "optim": optimizer} or {"model": model.state_dict()}.'
        )
    return state_dict


def _begin(path: str) -> str:
    """Rank 0 checks ``path`` and makes the tmp directory; every rank gets its name or the error."""
    mine: tuple[str, str | None] | None = None
    if get_rank() == 0:
        tmp = new_tmp_name(path)
        problem = problem_with_target(path)
        if problem is None:
            try:
                os.makedirs(tmp)
            except OSError as error:
                problem = (
                    f"cannot create the directory {tmp!r} to write the checkpoint in: {error}."
                )
        mine = (tmp, problem)
    gathered = gather_from_every_rank(mine, "start")
    tmp, problem = gathered[0]
    if problem is not None:
        raise ValueError(problem)
    return tmp


def _finish(tmp: str, path: str) -> None:
    """Barrier, then rank 0 moves ``tmp`` to ``path`` (NOTE [atomic checkpoints]); errors everywhere."""
    gather_from_every_rank(None, "written")  # every rank's files are in tmp
    error: str | None = None
    if get_rank() == 0:
        try:
            commit(tmp, path)
        except OSError as exc:
            error = (
                f"the checkpoint was written to {tmp!r} but moving it to {path!r} failed: {exc}. "
                f"{path!r} still holds the previous checkpoint, if any."
            )
    (error, *_) = gather_from_every_rank(error, "renamed")
    if error is not None:
        raise OSError(error)


def _writer_and_planner(staged: Staged, tmp: str) -> tuple[Any, Any]:
    from torch.distributed.checkpoint import FileSystemWriter

    from ._planners import ChunkSavePlanner

    return FileSystemWriter(tmp), ChunkSavePlanner(staged.chunks, staged.sizes)


def save(state_dict: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Save ``state_dict`` to the checkpoint directory ``path``; every rank calls it.

    ``state_dict`` may nest dicts and lists of global tensors, plain tensors
    and Python values, and may hold objects with ``state_dict()`` (a module, an
    optimizer, a ``GradScaler``) at the top level. Each global tensor is
    written as chunks, each by one rank: split shards by their owners,
    broadcast copies once, partial-sum tensors reduced first. Plain tensors
    and Python values are taken to be the same on every rank and written once.

    The write is atomic: files go to ``path + ".tmp-<id>"``, which replaces
    ``path`` only when every rank has finished, so ``path`` always holds a
    whole checkpoint. Load it with :func:`sbpflow.load` on any placement, SBP
    and world size. See docs/checkpoints.md.
    """
    import torch.distributed.checkpoint as dcp

    path = as_path(path, "sbpflow.save")
    wait_for_pending_save()
    staged = stage(state_dict, snapshot=False)
    tmp = _begin(path)
    writer, planner = _writer_and_planner(staged, tmp)
    dcp.save(staged.entries, storage_writer=writer, planner=planner, process_group=storage_group())
    _finish(tmp, path)


# -- async --------------------------------------------------------------------------

_lock = threading.Lock()
_pending: concurrent.futures.Future[None] | None = None
_finisher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sbpflow-checkpoint")


def wait_for_pending_save() -> None:
    """Wait for the last ``async_save`` to finish (re-raising its error), if one is running."""
    global _pending
    with _lock:
        pending, _pending = _pending, None
    if pending is not None:
        pending.result()


def async_save(
    state_dict: dict[str, Any], path: str | os.PathLike[str]
) -> concurrent.futures.Future[None]:
    """Like :func:`save`, but the files are written in the background.

    Returns once the values are copied (so training may change them at
    once); the returned future completes when the checkpoint is at ``path``.
    Call ``.result()`` on it on every rank before reading ``path`` or exiting.
    The next ``save``, ``async_save`` or ``load`` waits for it first.
    Uses ``torch.distributed.checkpoint.async_save``.
    """
    import torch.distributed.checkpoint as dcp

    global _pending
    path = as_path(path, "sbpflow.checkpoint.async_save")
    wait_for_pending_save()
    staged = stage(state_dict, snapshot=True)
    tmp = _begin(path)
    writer, planner = _writer_and_planner(staged, tmp)
    response: Any = dcp.async_save(
        staged.entries, storage_writer=writer, planner=planner, process_group=storage_group()
    )
    written: concurrent.futures.Future[Any] = getattr(response, "upload_completion", response)

    def finish() -> None:
        written.result()
        _finish(tmp, path)

    future = _finisher.submit(finish)
    with _lock:
        _pending = future
    return future
