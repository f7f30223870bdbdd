"""How workers and jobs reach their processes: port, environment, pickled job.

A job is pickled once in the test process, so a lambda or a nested function
fails there with advice instead of as an obscure error on every worker.
"""

from __future__ import annotations

import os
import pickle
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


def pickle_job(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """Pickle a job in the parent, so an unshippable one fails here with a clear message."""
    try:
        return pickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(
            f"cannot send {job_name(fn)!r} and its arguments to the worker ranks: {exc}. Jobs must be "
            "module-level functions in an importable module (e.g. tests.dist.test_x), not lambdas "
            "or nested functions, and their arguments must be picklable."
        ) from exc


def job_name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def format_stacks(stacks: dict[int, str]) -> str:
    return "".join(
        f"\n----- rank {r} is at -----\n{text.rstrip()}" for r, text in sorted(stacks.items())
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (another process may take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def environ(env: dict[str, str]) -> Iterator[None]:
    """Set ``env`` in this process for the duration (spawned children inherit it)."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
