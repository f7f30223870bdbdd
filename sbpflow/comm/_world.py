"""The default process group: lazy initialisation from the environment.

# NOTE [lazy world]
# sbpflow never asks the user to call ``init_process_group``. The first time
# a collective is needed it
#   1. reuses the default group if the user (or torchrun tooling) made one,
#   2. else initialises one from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT
#      (set by ``python -m sbpflow.distributed.launch`` and by ``torchrun``),
#   3. else, with no environment at all, runs as a world of one on an
#      in-memory store.
# The backend is gloo, plus NCCL for cuda tensors when CUDA is available.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # before any group exists: NOTE [teardown]

# Long enough for a slow step (a large checkpoint write between collectives, a
# first CUDA kernel compile), short enough that a hang surfaces while the user
# still watches; SBPFLOW_TIMEOUT or set_timeout change it.
_DEFAULT_TIMEOUT_S = 120.0
_RENDEZVOUS_TIMEOUT_S = 600.0  # ranks may start minutes apart on a busy cluster
_timeout_s: float | None = None


def timeout_seconds() -> float:
    """Seconds a collective may wait before it fails (``SBPFLOW_TIMEOUT``, default 120)."""
    if _timeout_s is not None:
        return _timeout_s
    value = os.environ.get("SBPFLOW_TIMEOUT")
    if value is None:
        return _DEFAULT_TIMEOUT_S
    try:
        return float(value)
    except ValueError:
        raise ValueError(
            f"SBPFLOW_TIMEOUT must be a number of seconds, got {value!r}; e.g. SBPFLOW_TIMEOUT=120."
        ) from None


def set_timeout(seconds: float) -> None:
    """Set the collective timeout for groups created from now on."""
    global _timeout_s
    if seconds <= 0:
        raise ValueError(f"timeout must be positive seconds, got {seconds!r}.")
    _timeout_s = float(seconds)


def timeout_delta() -> datetime.timedelta:
    return datetime.timedelta(seconds=timeout_seconds())


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an int, got {value!r}.") from None


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def ensure_initialized() -> None:
    """Make sure a default process group exists (see NOTE [lazy world]).

    Collective the first time: the world-ready callbacks run then (NOTE
    [world ready]), so every rank must make its first call at the same point
    of the program, as every sbpflow collective does.
    """
    if not is_initialized():
        _init_default_group()
    if not _world_ready:
        _run_world_ready()


def _init_default_group() -> None:
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this PyTorch build.")
    backend = (
        "cpu:gloo,cuda:nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    )
    rank = _env_int("RANK")
    world_size = _env_int("WORLD_SIZE")
    if rank is None or world_size is None:
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout_delta())
        _owned.made_default()
        return
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise RuntimeError(
            f"RANK={rank} and WORLD_SIZE={world_size} are set but MASTER_ADDR/MASTER_PORT are not; "
            "start the script with `python -m sbpflow.distributed.launch` or `torchrun`, "
            "or set both variables."
        )
    if torch.cuda.is_available():
        torch.cuda.set_device(get_local_rank() % max(torch.cuda.device_count(), 1))
    dist.init_process_group(
        backend, store=_rendezvous(rank, world_size), rank=rank, world_size=world_size,
        timeout=timeout_delta(),
    )  # fmt: skip
    _owned.made_default()


def _rendezvous(rank: int, world_size: int) -> dist.Store:
    """Meet every rank through the ``env://`` store, waiting up to the rendezvous limit.

    Ranks start seconds apart (imports, a node booting late), so joining the
    world may take far longer than a collective should wait: a short
    ``SBPFLOW_TIMEOUT`` (say 10 s, to surface hangs quickly) must not make
    startup fail. The store is created with the longer rendezvous limit and
    every rank waits on it until all have arrived; then the limit drops to the
    collective timeout, so the group's connection setup starts in step and
    later waits on the store (group creation) are bounded like collectives.
    """
    limit = datetime.timedelta(seconds=max(timeout_seconds(), _RENDEZVOUS_TIMEOUT_S))
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=limit))
    store.set_timeout(limit)
    if store.add("sbpflow/arrived", 1) == world_size:
        store.set("sbpflow/all_arrived", "1")
    store.wait(["sbpflow/all_arrived"])
    store.set_timeout(timeout_delta())  # from here on, waits are bounded like collectives
    # Keys of the default group go under a prefix, as init_process_group does.
    return dist.PrefixStore("default_pg", store)


# NOTE [world ready]
# Some state must be the same on every rank before the first plan that uses it
# runs, e.g. the cost constants (NOTE [agreed constants] in boxing/cost.py).
# Layers above comm register a callback with ``on_world_ready``; the first
# ``ensure_initialized()`` of the process runs them all, on every rank, in
# registration order, whether sbpflow or the user created the default group.
# A callback may communicate over the world (the flag is set before they run,
# so its own ``ensure_initialized()`` calls return at once). comm never
# imports the layers above it: they hand it the callback.

_world_ready_callbacks: list[Callable[[], None]] = []
_world_ready = False


def on_world_ready(callback: Callable[[], None]) -> None:
    """Run ``callback`` on every rank when the world is first set up (NOTE [world ready]).

    Register it at import time on every rank. Registered after the world is
    ready, it runs at once.
    """
    _world_ready_callbacks.append(callback)
    if _world_ready:
        callback()


def is_world_ready() -> bool:
    """Whether the world-ready callbacks have run in this process."""
    return _world_ready


def _run_world_ready() -> None:
    global _world_ready
    _world_ready = True
    for callback in list(_world_ready_callbacks):
        callback()


# NOTE [teardown]
# A gloo group runs each collective on a worker thread of its own, and that
# thread lets go of the finished work a moment after the caller's ``wait()``
# has returned. When the caller's tensor is already gone by then (one of
# sbpflow's temporaries: a metadata check's pair, a boxing buffer), torch has
# handed the tensor's Python object over to the work, so letting go of the work
# means taking the GIL to free that object. If the script ends inside that
# moment, the interpreter is finalizing when the worker asks for the GIL;
# Python then ends the thread (``pthread_exit``), its unwinding runs into
# gloo's ``noexcept`` work destructor, and the process aborts after all its
# work and output ("terminate called without an active exception", SIGABRT).
# A core dump shows it: the main thread in ``Py_FinalizeEx``, a
# ``pt_gloo_runloop`` thread in ``~AsyncAllreduceWork`` -> ``decref`` ->
# ``take_gil`` -> ``PyThread_exit_thread``. The moment is longer on a busy
# machine (the worker waits for a core), so the abort comes and goes with load.
#
# The cure is to join every worker thread that may hold one of sbpflow's works
# while the interpreter still runs. A gloo group's threads stop only when the
# group object is freed (``destroy_process_group`` unregisters it but does not
# stop them), so:
#   - sbpflow tears down what it created, and only that: every group it makes
#     goes through ``owned_group`` here, which remembers it, and the default group
#     is its own only when ``ensure_initialized`` made it (NOTE [lazy world]).
#     The last exit handler (registered when ``sbpflow.comm`` is imported;
#     handlers run in reverse order, so after the user's own) destroys the
#     default group if sbpflow made it (and with it every subgroup), else each
#     of sbpflow's groups the user has not destroyed, leaving the user's default
#     group (and their own subgroups) to them; then it drops sbpflow's own
#     references (``on_teardown`` callbacks), which frees sbpflow's groups and
#     joins their threads.
#   - comm holds every group handle: layers above it ask for a group each time
#     they use one (a cached look-up), so nothing a script still holds at exit
#     (a model whose gradient sync reduces on a group) keeps a group alive.
#   - sbpflow's gloo collectives never run on the default group (comm/_groups.py
#     makes a group of its own over the world): a default group the user made
#     and keeps past the exit handlers holds none of sbpflow's works, and
#     anything may keep the default group alive, the user's own references, or
#     torch's ``torch.distributed.nn.functional``, whose functions bind the
#     default group as a default argument when first imported. That module is
#     imported here, before any group exists, so that a later import
#     (``torch._dynamo`` imports it lazily, e.g. for a meta kernel) does not
#     keep the default group of an ordinary script alive.
# This is gloo's mechanism (worker threads that free finished works); NCCL
# collectives keep using the world group, destroyed at exit with the rest when
# sbpflow made it.


class _Owned:
    """The process groups sbpflow created in this process, weakly (NOTE [teardown])."""

    def __init__(self) -> None:
        self.default: weakref.ref[dist.ProcessGroup] | None = None
        self.groups: weakref.WeakSet[dist.ProcessGroup] = weakref.WeakSet()

    def made_default(self) -> None:
        """Note that sbpflow has just made the default group."""
        world = dist.group.WORLD
        self.default = None if world is None else weakref.ref(world)

    def default_is_ours(self) -> bool:
        world = dist.group.WORLD
        return self.default is not None and world is not None and self.default() is world

    def destroy(self) -> None:
        """Destroy the default group if sbpflow made it (and every subgroup with it), else
        each of sbpflow's groups still registered, leaving the user's groups alone."""
        if not is_initialized():
            return
        if self.default_is_ours():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
            return
        for group in list(self.groups):
            with contextlib.suppress(Exception):  # destroyed already (by the user)
                dist.destroy_process_group(group)


_owned = _Owned()


def owned_group(ranks: Sequence[int], backend: str) -> dist.ProcessGroup:
    """A process group of sbpflow's own over ``ranks`` (every rank of the world must call
    it), destroyed at exit (NOTE [teardown])."""
    group = dist.new_group(list(ranks), backend=backend, timeout=timeout_delta())
    if isinstance(group, dist.ProcessGroup):  # not GroupMember.NON_GROUP_MEMBER
        _owned.groups.add(group)
    return group


_teardown: list[Callable[[], None]] = []


def on_teardown(forget: Callable[[], None]) -> None:
    """Run ``forget`` at interpreter exit, after sbpflow's groups are destroyed."""
    _teardown.append(forget)


def _teardown_at_exit() -> None:
    """Destroy the process groups sbpflow created and drop its references to them
    (NOTE [teardown])."""
    _owned.destroy()
    for forget in _teardown:
        forget()


atexit.register(_teardown_at_exit)  # at import: runs after every later-registered handler


def get_rank() -> int:
    if is_initialized():
        return dist.get_rank()
    return _env_int("RANK") or 0


def get_world_size() -> int:
    if is_initialized():
        return dist.get_world_size()
    return _env_int("WORLD_SIZE") or 1


def get_local_rank() -> int:
    local = _env_int("LOCAL_RANK")
    if local is not None:
        return local
    return get_rank()


def device_for(device_type: str) -> torch.device:
    """The device this rank uses for tensors of a placement of ``device_type``."""
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                "a cuda placement was used but CUDA is not available on this machine; "
                'use sbpflow.placement("cpu", ranks) instead.'
            )
        return torch.device("cuda", get_local_rank() % torch.cuda.device_count())
    return torch.device("cpu")
