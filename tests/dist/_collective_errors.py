"""Assertions shared by tests that expect a named ``CollectiveError`` from a rank."""

from __future__ import annotations

import re

from sbpflow.comm.collectives import CollectiveError
from sbpflow.testing import RemoteError


def assert_collective_error(error: BaseException, pattern: str) -> None:
    """``error`` (raised here or reported by a rank) is a CollectiveError whose text matches."""
    if isinstance(error, RemoteError):
        assert error.type_name == "CollectiveError", error
    else:
        assert isinstance(error, CollectiveError), error
    assert re.search(pattern, str(error)), str(error)
