"""The hint of the error when only some ranks read a global tensor's value (pure text).

``to_local()`` is offered only where it is the value: a broadcast tensor. A partial tensor's
piece is a part of a sum (a mean loss of 2.5 split 2.0 + 0.5 would print 0.5), a split
tensor's a slice; both hints send the reader to reading on every rank and ``print0``.
"""

from __future__ import annotations

import pytest

from sbpflow._meta_check import _reading_hint


@pytest.mark.parametrize("sbp", ["P", "(S(0), P)", "P(max)"])
def test_a_partial_tensor_is_never_read_with_to_local(sbp: str) -> None:
    hint = _reading_hint("item()", [sbp])
    assert "reading a partial global tensor (item()) is a collective" in hint
    assert "sbpflow.env.print0" in hint
    assert "to_local() is only this rank's part of the sum, not the value" in hint
    assert "copy of the whole value" not in hint


def test_a_split_tensor_is_not_offered_to_local_as_its_value() -> None:
    hint = _reading_hint("tolist()", ["S(0)"])
    assert "call it on every rank" in hint and "to_local" not in hint


def test_a_broadcast_tensor_offers_to_local_as_its_value() -> None:
    hint = _reading_hint("item()", ["B", "(B, B)"])
    assert "t.to_local() is this rank's copy of the whole value" in hint
