"""Each check of the same-layout pointwise handler (NOTE [same-layout pointwise] in
sbpflow/_dispatch_pointwise.py), one call it must turn away, in one process.

Every call here reaches the handler first (its op is one of ``SAME_LAYOUT_OPS``) and is one
it must decline: operands of different shapes (broadcasting), a plain tensor operand, an
out-of-place op on strided operands, an integer operand, a write into a tensor whose piece is
a copy. Each result is compared with plain torch on the same
values (value, shape, dtype, strides) and the global tensor's own metadata must describe it;
had the handler taken the call, it would have wrapped the result with its first operand's
metadata or written into the copy. The 2-rank cases (partial layouts, mixed layouts, AdamW)
are in tests/dist/test_same_layout_pointwise.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import sbpflow
from sbpflow import _dispatch_pointwise, _view_writes
from sbpflow.sbp import broadcast

ONE = sbpflow.placement("cpu", [0])


def _global(t: torch.Tensor) -> sbpflow.GlobalTensor:
    return t.clone().to_global(ONE, broadcast)


def _agrees(got: Any, want: torch.Tensor) -> None:
    assert isinstance(got, sbpflow.GlobalTensor)
    meta = got._meta
    assert (tuple(got.shape), got.dtype, got.stride()) == (
        tuple(want.shape),
        want.dtype,
        want.stride(),
    )
    assert (meta.shape, meta.dtype, meta.strides) == (
        tuple(want.shape),
        want.dtype,
        want.stride(),
    )
    local = got.to_local().detach()
    assert local.dtype == want.dtype and torch.equal(local, want)


_COLUMN = torch.arange(1.0, 5.0).reshape(4, 1)
_ROW = torch.arange(1.0, 7.0).reshape(1, 6)
_FULL = torch.arange(24.0).reshape(4, 6) / 8 + 1


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.clone()


# name -> the call, given how to make an operand (``_plain`` for the reference, ``_global``);
# ``_plain`` in a case's body makes an operand that stays plain in both.
_CASES: dict[str, Callable[[Callable[[torch.Tensor], Any]], Any]] = {
    "broadcasting shapes": lambda g: g(_COLUMN) * g(_ROW),
    "broadcasting in place": lambda g: g(_FULL).add_(g(_ROW)),
    "a plain operand": lambda g: g(_COLUMN) + _plain(_ROW),
    "a plain operand in place": lambda g: g(_FULL).mul_(_plain(_ROW)),
    "strided out of place": lambda g: g(_COLUMN).expand(4, 6) * 2.0,
    "transposed and contiguous": lambda g: torch.maximum(g(_FULL).t(), g(_FULL.t().contiguous())),
    "integer operand": lambda g: g(torch.arange(6).reshape(2, 3)) * 2.5,
    "other dtypes": lambda g: g(_FULL) - g(_FULL.double()),
}


@pytest.mark.parametrize("grad_mode", [False, True])
@pytest.mark.parametrize("name", list(_CASES))
def test_declined_calls_equal_plain_torch(name: str, grad_mode: bool) -> None:
    """In no_grad (as in an optimizer's step) and with grad mode on."""
    want = _CASES[name](_plain)
    with torch.set_grad_enabled(grad_mode):
        _agrees(_CASES[name](_global), want)


def test_taken_calls_equal_plain_torch() -> None:
    """What the handler does take, for the comparison above to mean something: its results are
    plain torch's too (and the loop leaves no entry in the qualifying table of another meta)."""
    a, b = _FULL.clone(), _FULL.flip(0).clone()
    ga, gb = _global(a), _global(b)
    with torch.no_grad():
        for got, want in (
            (ga.mul_(0.5).addcmul_(gb, gb, value=0.25), a.mul_(0.5).addcmul_(b, b, value=0.25)),
            (ga.lerp_(gb, 0.1).sqrt(), a.lerp_(b, 0.1).sqrt()),
            ((gb / 3.0).add_(1e-3), (b / 3.0).add_(1e-3)),
        ):
            _agrees(got, want)
    assert _dispatch_pointwise._qualifies.get(ga._meta) == _dispatch_pointwise._ANY


def test_write_into_a_piece_holding_a_copy_is_refused() -> None:
    """A global tensor whose piece is a copy (a view whose rule re-laid its input out, NOTE
    [view writes]) refuses in-place ops on this path as on the general one."""
    target = _global(_FULL)
    _view_writes.note_copy(target._local)
    other = _global(_FULL)
    with torch.no_grad():
        for write in (lambda: target.mul_(2.0), lambda: target.addcdiv_(other, other, value=1.0)):
            with pytest.raises(ValueError, match="view of a global tensor"):
                write()
    assert torch.equal(target.to_local(), _FULL)
