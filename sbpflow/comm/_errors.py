"""The error every failed collective becomes: it names the operation and the ranks."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from ._world import timeout_seconds


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the operation and ranks."""


@contextlib.contextmanager
def named(op: str, ranks: Sequence[int]) -> Iterator[None]:
    try:
        yield
    except CollectiveError:
        raise
    except (RuntimeError, ValueError) as error:  # DistBackendError subclasses RuntimeError
        text = str(error)
        hint = ""
        lowered = text.lower()
        if "connection closed" in lowered or "connection reset" in lowered:
            hint = (
                " A peer rank closed its connection: it probably exited or crashed (see its "
                "output); the backend noticed the closed connection before the timeout."
            )
        elif "timed out" in lowered or "timeout" in lowered:
            hint = (
                f" It timed out after the collective timeout ({timeout_seconds():.0f} s): a rank "
                "probably stopped early, raised, or took a different code path. Set "
                "SBPFLOW_TIMEOUT to change the limit."
            )
        raise CollectiveError(
            f"sbpflow: {op} over ranks {list(ranks)} failed.{hint} Backend said: {text}"
        ) from error
