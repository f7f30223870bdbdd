"""SBP values: printing, equality and ``normalize`` (validation, negative dims, N-D tuples).

Pure code, one process.
"""

from __future__ import annotations

import pytest

from sbpflow import sbp
from sbpflow.sbp import Broadcast, Partial, Split, normalize, sbp_str


def test_one_printed_form_for_str_and_repr() -> None:
    """NOTE [one printed form]: str and repr are the short form, so a tuple prints alike."""
    for value, text in [
        (sbp.split(0), "S(0)"),
        (sbp.split(2), "S(2)"),
        (sbp.broadcast, "B"),
        (sbp.partial_sum, "P"),
        (sbp.partial_max, "P(max)"),
    ]:
        assert str(value) == repr(value) == f"{value}" == f"{value!r}" == text
    assert repr((sbp.split(0), sbp.broadcast)) == "(S(0), B)"
    assert str((sbp.split(0),)) == "(S(0),)"


def test_nd_signature_prints_as_tuple() -> None:
    assert sbp_str((sbp.split(0),)) == "S(0)"
    assert sbp_str((sbp.split(0), sbp.broadcast)) == "(S(0), B)"
    assert sbp_str((sbp.partial_sum, sbp.split(1), sbp.broadcast)) == "(P, S(1), B)"


def test_values_compare_and_hash() -> None:
    assert sbp.split(0) == Split(0) and hash(sbp.split(0)) == hash(Split(0))
    assert sbp.split(0) != sbp.split(1)
    assert sbp.broadcast == Broadcast()
    assert sbp.partial_sum == Partial("sum") != sbp.partial_max
    assert sbp.broadcast != sbp.partial_sum
    assert len({sbp.split(0), Split(0), sbp.broadcast, Broadcast(), sbp.partial_sum}) == 3


def test_kind_predicates() -> None:
    assert sbp.split(0).is_split and not sbp.split(0).is_broadcast
    assert sbp.broadcast.is_broadcast and not sbp.broadcast.is_partial
    assert sbp.partial_sum.is_partial and not sbp.partial_sum.is_split


def test_normalize_wraps_one_value_and_negative_dims() -> None:
    assert normalize(sbp.split(0), 1) == (Split(0),)
    assert normalize([sbp.broadcast], 1) == (Broadcast(),)
    assert normalize((sbp.split(-1), sbp.broadcast), 2, tensor_ndim=3) == (Split(2), Broadcast())
    assert normalize((sbp.split(-3),), 1, tensor_ndim=3) == (Split(0),)
    assert normalize(sbp.split(5), 1) == (Split(5),)  # no tensor: dims are not checked yet


@pytest.mark.parametrize(
    ("value", "placement_ndim", "tensor_ndim", "error", "match"),
    [
        (sbp.split(2), 1, 2, ValueError, r"split\(2\) is out of range for a tensor with 2 dims"),
        (sbp.split(-3), 1, 2, ValueError, r"split\(-3\) is out of range"),
        (sbp.split(0), 1, 0, ValueError, r"split\(0\) is out of range for a tensor with 0 dims"),
        (
            (sbp.split(0), sbp.broadcast),
            1,
            None,
            ValueError,
            r"has 2 entries but the placement has 1 axes",
        ),
        (sbp.broadcast, 2, None, ValueError, r"has 1 entry but the placement has 2 axes.*\(B, B\)"),
        ("S(0)", 1, None, TypeError, "got str 'S\\(0\\)'"),
        (None, 1, None, TypeError, "got NoneType"),
        ((sbp.split(0), 1), 2, None, TypeError, "got int 1"),
        (Broadcast, 1, None, TypeError, "got the class Broadcast"),
    ],
)
def test_normalize_errors_name_the_value(
    value: object, placement_ndim: int, tensor_ndim: int | None, error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        normalize(value, placement_ndim, tensor_ndim)


def test_bad_values() -> None:
    with pytest.raises(TypeError, match=r"split\(dim\) takes an int tensor dim, got 1.0"):
        sbp.split(1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got True"):
        sbp.split(True)
    with pytest.raises(ValueError, match="'sum' or 'max', got 'mean'"):
        Partial("mean")
