"""The loop a pool worker runs: join the world once, then run jobs until told to stop.

Workers are spawned, not forked, so each starts with a fresh torch and no
inherited process group, exactly like a rank started by a launcher. They live
for many tests, so the spawn (~3 s on a 2-core machine) and the gloo
rendezvous are paid once per pool, not once per test.

Messages to the parent are ``(kind, job_id, body)`` tuples:

=============  ============================================================
``ready``      the default process group is up; ``body`` is the pid
``init_error`` joining the world failed; ``body`` is the traceback text
``done``       the job returned; ``body`` is the pickled return value
``raised``     the job raised; ``body`` is an :class:`ErrorReport`
=============  ============================================================
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

from ._errors import report_exception


def worker_main(env: dict[str, str], stack_file: str, conn: Connection) -> None:
    """Entry point of one worker process (target of ``multiprocessing.Process``)."""
    # Ctrl-C in the terminal reaches the whole process group; let the parent
    # decide how to stop the workers instead of each dying mid-collective.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(env)
    with open(stack_file, "w") as stacks:
        if hasattr(signal, "SIGUSR1"):
            # The parent sends SIGUSR1 to a rank that stopped answering, to show
            # where it is stuck; faulthandler dumps from C even mid-collective.
            faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        try:
            import torch

            torch.set_num_threads(1)
            import sbpflow.env

            sbpflow.env.ensure_initialized()
        except BaseException:
            _send(conn, ("init_error", None, traceback.format_exc()))
            return
        _send(conn, ("ready", None, os.getpid()))
        _serve(conn)


def _serve(conn: Connection) -> None:
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        if message is None:
            return
        job_id, payload = message
        kind, body = _run_job(payload)
        sys.stdout.flush()
        sys.stderr.flush()
        if not _send(conn, (kind, job_id, body)):
            return


def _run_job(payload: bytes) -> tuple[str, Any]:
    try:
        fn, args, kwargs = pickle.loads(payload)
        result = fn(*args, **kwargs)
    except BaseException as exc:
        return "raised", report_exception(exc)
    try:
        return "done", pickle.dumps(result)
    except Exception as exc:
        try:
            raise TypeError(
                f"the return value of {getattr(fn, '__qualname__', fn)!r} could not be pickled "
                f"({type(result).__qualname__}: {exc}); return plain tensors, numbers or "
                "containers of them."
            ) from exc
        except TypeError as wrapped:
            return "raised", report_exception(wrapped)


def _send(conn: Connection, message: tuple[str, Any, Any]) -> bool:
    try:
        conn.send(message)
    except (BrokenPipeError, EOFError, OSError):
        return False
    return True
