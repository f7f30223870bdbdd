"""The logical random state (sbpflow._rng), in one process.

Each test compares with plain torch computed in the test: a dropout on a global
tensor equals ``bernoulli_`` of the whole tensor on a generator seeded for the
state's position; a random op on a rank outside its placement advances the
state exactly as running it does.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sbpflow
from sbpflow import _rng
from sbpflow.sbp import Broadcast

KEEP = 0.75
aten = torch.ops.aten


def _draw(seed: int, offset: int) -> torch.Generator:
    return torch.Generator().manual_seed(_rng.stream_seed(seed, offset))


def _one() -> sbpflow.Placement:
    return sbpflow.placement("cpu", [0])


def test_the_logical_dropout_mask_is_a_dropout_mask() -> None:
    """The draw the dist tests compare with is a valid mask (0 or 1, about ``keep`` kept,
    another one at the next position), and dropout on a global tensor scales it by 1/keep."""
    first = torch.empty(64, 64).bernoulli_(KEEP, generator=_draw(5, 0))
    second = torch.empty(64, 64).bernoulli_(KEEP, generator=_draw(5, 64 * 64))
    assert set(first.unique().tolist()) == {0.0, 1.0}
    assert abs(first.mean().item() - KEEP) < 0.03
    assert not torch.equal(first, second)
    sbpflow.manual_seed(5)
    x = sbpflow.ones(64, 64, placement=_one(), sbp=Broadcast())
    assert torch.equal(F.dropout(x, 1 - KEEP).to_local(), first / KEEP)
    assert _rng.state() == (5, 64 * 64)
    assert torch.equal(F.dropout(x, 1 - KEEP).to_local(), second / KEEP)


def test_global_randomness_ignores_torch_generator() -> None:
    """Local code drawing from torch's generator (a rank's data augmentation) does not move
    the logical state: the dropout mask is the same with or without it."""
    x = sbpflow.ones(16, 16, placement=_one(), sbp=Broadcast())
    sbpflow.manual_seed(2)
    quiet = F.dropout(x, 0.5).to_local()
    sbpflow.manual_seed(2)
    torch.rand(100)
    assert torch.equal(F.dropout(x, 0.5).to_local(), quiet)


def test_an_explicit_generator_is_used_as_given() -> None:
    """``bernoulli_(p, generator=g)`` on a global tensor draws from ``g`` as plain torch does,
    and leaves the logical state alone."""
    sbpflow.manual_seed(9)
    x = sbpflow.zeros(5, 4, placement=_one(), sbp=Broadcast())
    got = x.bernoulli_(0.5, generator=torch.Generator().manual_seed(3)).to_local()
    want = torch.zeros(5, 4).bernoulli_(0.5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(got, want)
    assert _rng.state() == (9, 0)


def test_skipping_an_op_advances_the_state_as_running_it_does() -> None:
    """What a rank outside the placement does (``skip``) moves the offset by the numel the
    op's draw takes on the ranks that run it; ops that draw nothing leave it alone."""
    x = sbpflow.ones(6, 5, placement=_one(), sbp=Broadcast())
    cases = [
        (aten.native_dropout.default, (x, 0.5, True), {}, 30),
        (aten.native_dropout.default, (x, 0.5, False), {}, 0),
        (aten.bernoulli_.float, (x, 0.5), {}, 30),
        (aten.bernoulli_.float, (x, 0.5), {"generator": torch.Generator()}, 0),
        (aten.normal_.default, (x,), {}, 30),
        (aten.add.Tensor, (x, x), {}, 0),
    ]
    for func, args, kwargs, numel in cases:
        sbpflow.manual_seed(4)
        _rng.skip(func, args, kwargs)
        skipped = _rng.state()
        sbpflow.manual_seed(4)
        func(*args, **kwargs)
        assert skipped == _rng.state() == (4, numel), (func, args, skipped, _rng.state())


def test_manual_seed_rejects_what_is_not_an_int() -> None:
    with pytest.raises(TypeError, match="manual_seed takes an int, got float"):
        sbpflow.manual_seed(1.5)  # type: ignore[arg-type]
