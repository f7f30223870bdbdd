"""Creating global tensors in a world of one: seeding, value ranges and sample statistics.

One process, no process group: 1-rank placements need no communication. The
cross-rank property (the logical value depends only on the seed, never on the
placement or SBP) is checked on real ranks in ``tests/dist/test_creation.py``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import sbpflow
from sbpflow import sbp

ONE = sbpflow.placement("cpu", [0])


def _values(t: sbpflow.GlobalTensor) -> torch.Tensor:
    return t.to_local().detach()


def test_random_tensors_are_deterministic_per_seed() -> None:
    sbpflow.manual_seed(1234)
    a1, a2 = (
        _values(sbpflow.randn(5, 7, placement=ONE, sbp=sbp.broadcast)),
        _values(sbpflow.rand(9, placement=ONE, sbp=sbp.split(0))),
    )
    sbpflow.manual_seed(1234)
    b1, b2 = (
        _values(sbpflow.randn(5, 7, placement=ONE, sbp=sbp.broadcast)),
        _values(sbpflow.rand(9, placement=ONE, sbp=sbp.split(0))),
    )
    assert torch.equal(a1, b1) and torch.equal(a2, b2)
    sbpflow.manual_seed(1235)
    c1 = _values(sbpflow.randn(5, 7, placement=ONE, sbp=sbp.broadcast))
    assert not torch.equal(a1, c1)


def test_successive_tensors_differ() -> None:
    sbpflow.manual_seed(0)
    first = _values(sbpflow.randn(64, placement=ONE, sbp=sbp.broadcast))
    second = _values(sbpflow.randn(64, placement=ONE, sbp=sbp.broadcast))
    assert not torch.equal(first, second)
    assert abs(torch.corrcoef(torch.stack([first, second]))[0, 1]) < 0.4


def test_value_is_independent_of_the_one_rank_sbp() -> None:
    got = []
    for layout in (sbp.split(0), sbp.split(1), sbp.broadcast, sbp.partial_sum):
        sbpflow.manual_seed(7)
        got.append(_values(sbpflow.randn(6, 5, placement=ONE, sbp=layout)))
    for other in got[1:]:
        assert torch.equal(got[0], other)


def test_prefix_of_a_flat_tensor_is_stable() -> None:
    """Element i depends on (seed, tensor number, i) only, not on the tensor's size."""
    sbpflow.manual_seed(3)
    small = _values(sbpflow.rand(10, placement=ONE, sbp=sbp.broadcast))
    sbpflow.manual_seed(3)
    large = _values(sbpflow.rand(1000, placement=ONE, sbp=sbp.broadcast))
    assert torch.equal(small, large[:10])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_rand_is_in_the_half_open_unit_interval(dtype: torch.dtype) -> None:
    sbpflow.manual_seed(11)
    u = _values(sbpflow.rand(200_000, placement=ONE, sbp=sbp.broadcast, dtype=dtype))
    assert u.dtype == dtype
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0


def test_rand_statistics() -> None:
    """Mean 1/2, variance 1/12, flat histogram, no correlation between neighbours."""
    sbpflow.manual_seed(2024)
    u = _values(sbpflow.rand(100_000, placement=ONE, sbp=sbp.broadcast)).double()
    n = u.numel()
    assert abs(float(u.mean()) - 0.5) < 5 / math.sqrt(12 * n)
    assert abs(float(u.var()) - 1 / 12) < 0.003
    counts = torch.histc(u, bins=20, min=0, max=1)
    chi2 = float(((counts - n / 20) ** 2 / (n / 20)).sum())
    assert chi2 < 50  # 19 degrees of freedom: P(chi2 > 50) ~ 1e-4
    lag1 = float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])
    assert abs(lag1) < 5 / math.sqrt(n)


@pytest.mark.parametrize("seed", [0, 1, 2, 12345])
def test_randn_statistics(seed: int) -> None:
    """Mean 0, std 1, normal tails and shape, for several seeds (seed 0 included)."""
    sbpflow.manual_seed(seed)
    z = _values(sbpflow.randn(100_000, placement=ONE, sbp=sbp.broadcast)).double()
    n = z.numel()
    assert abs(float(z.mean())) < 5 / math.sqrt(n)
    assert abs(float(z.std()) - 1) < 0.015
    assert abs(float((z**3).mean())) < 0.05  # skewness
    assert abs(float((z**4).mean()) - 3) < 0.15  # kurtosis
    beyond_2 = float((z.abs() > 2).double().mean())
    assert abs(beyond_2 - 0.0455) < 0.004
    assert float(z.abs().max()) < 6.0  # P(|z| > 6) ~ 2e-9 per sample
    lag1 = float(torch.corrcoef(torch.stack([z[:-1], z[1:]]))[0, 1])
    assert abs(lag1) < 5 / math.sqrt(n)


def test_first_samples_of_small_seeds_are_not_extreme() -> None:
    """Small seeds and small indices must be mixed as well as any others."""
    for seed in range(20):
        sbpflow.manual_seed(seed)
        z = _values(sbpflow.randn(16, placement=ONE, sbp=sbp.broadcast))
        assert float(z.abs().max()) < 4.5, (seed, z)


def test_deterministic_factories() -> None:
    z = sbpflow.zeros(3, 4, placement=ONE, sbp=sbp.split(1))
    assert isinstance(z, sbpflow.GlobalTensor) and z.shape == (3, 4) and z.dtype == torch.float32
    assert torch.equal(_values(z), torch.zeros(3, 4))
    assert torch.equal(
        _values(sbpflow.ones((2, 5), placement=ONE, sbp=sbp.broadcast)), torch.ones(2, 5)
    )
    full = sbpflow.full((2, 3), 7, placement=ONE, sbp=sbp.broadcast)
    assert full.dtype == torch.int64 and torch.equal(_values(full), torch.full((2, 3), 7))
    assert torch.equal(_values(sbpflow.arange(5, placement=ONE, sbp=sbp.split(0))), torch.arange(5))
    stepped = sbpflow.arange(1.0, 4.0, 0.5, placement=ONE, sbp=sbp.broadcast)
    assert torch.equal(_values(stepped), torch.arange(1.0, 4.0, 0.5))
    assert sbpflow.empty(2, 2, placement=ONE, sbp=sbp.broadcast).shape == (2, 2)
    grad = sbpflow.randn(3, placement=ONE, sbp=sbp.broadcast, requires_grad=True)
    assert grad.requires_grad and grad.is_leaf


@pytest.mark.parametrize(
    "args", [(5,), (2, 23, 3), (0.5, 3.0, 0.25), (1, 4, 0.5), (10, 0, -3), (3, 3), (-2.5, 2)]
)
def test_arange_matches_torch_length_dtype_and_values(args: tuple) -> None:
    got = _values(sbpflow.arange(*args, placement=ONE, sbp=sbp.split(0)))
    expected = torch.arange(*args)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.allclose(got.double(), expected.double(), rtol=0, atol=1e-6)


def test_factory_argument_errors() -> None:
    with pytest.raises(TypeError, match=r"needs placement=sbpflow.placement\(...\), got \[0\]"):
        sbpflow.zeros(2, placement=[0], sbp=sbp.broadcast)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs sbp="):
        sbpflow.ones(2, placement=ONE, sbp=None)
    with pytest.raises(ValueError, match=r"split\(1\) is out of range for a tensor with 1 dims"):
        sbpflow.randn(4, placement=ONE, sbp=sbp.split(1))
    with pytest.raises(ValueError, match=r"sizes must be non-negative, got \(2, -1\)"):
        sbpflow.rand(2, -1, placement=ONE, sbp=sbp.broadcast)
    with pytest.raises(TypeError, match="manual_seed takes an int, got str"):
        sbpflow.manual_seed("1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="arange step must be non-zero, got 0"):
        sbpflow.arange(1, 5, 0, placement=ONE, sbp=sbp.broadcast)
    with pytest.raises(ValueError, match=r"arange\(start=5, end=1, step=1\): the step points away"):
        sbpflow.arange(5, 1, placement=ONE, sbp=sbp.broadcast)


# torch's argument forms for each factory, with sbpflow's placement and sbp added as keywords.
_TORCH_FORMS: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
    ("zeros", (3, 4), {}),
    ("zeros", ((3, 4),), {}),
    ("zeros", ([3, 4],), {"dtype": torch.float64}),
    ("zeros", (torch.Size([2, 5]),), {}),
    ("zeros", ((),), {}),
    ("ones", (2, 3), {"requires_grad": True}),
    ("ones", ((2, 3),), {"dtype": torch.int32}),
    ("empty", (2, 2), {}),
    ("empty", ((4,),), {"dtype": torch.float16}),
    ("full", ((4, 2), 3.0), {}),
    ("full", ([4, 2], 3), {}),
    ("full", ((2,), True), {}),
    ("full", ((3,),), {"fill_value": 1.5, "dtype": torch.float64}),
    ("full", (), {"size": (2, 2), "fill_value": 7}),
    ("rand", (3, 2), {}),
    ("rand", ((3, 2),), {"dtype": torch.float64}),
    ("randn", (5,), {}),
    ("randn", ((2, 3),), {"requires_grad": True}),
    ("arange", (5,), {}),
    ("arange", (1, 7), {}),
    ("arange", (1.0, 4.0, 0.5), {}),
    ("arange", (), {"end": 4}),
    ("arange", (), {"start": 2, "end": 8, "step": 3}),
    ("arange", (6,), {"dtype": torch.float32}),
]


@pytest.mark.parametrize(("name", "args", "kwargs"), _TORCH_FORMS)
def test_factories_take_torch_argument_forms(name: str, args: tuple, kwargs: dict) -> None:
    """Each factory called exactly as torch's is (compared with torch in this process)."""
    want = getattr(torch, name)(*args, **kwargs)
    got = getattr(sbpflow, name)(*args, **kwargs, placement=ONE, sbp=_any_sbp(want.dim()))
    assert isinstance(got, sbpflow.GlobalTensor)
    assert (got.shape, got.dtype, got.requires_grad) == (want.shape, want.dtype, want.requires_grad)
    if name not in ("empty", "rand", "randn"):
        assert torch.equal(_values(got), want.detach())


def _any_sbp(ndim: int) -> Any:
    return sbp.split(0) if ndim else sbp.broadcast


_LIKE_FORMS: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
    ("zeros_like", (), {}),
    ("ones_like", (), {"dtype": torch.int64}),
    ("empty_like", (), {}),
    ("full_like", (7,), {}),
    ("full_like", (), {"fill_value": 2.5, "dtype": torch.float64}),
    ("rand_like", (), {}),
    ("randn_like", (), {"requires_grad": True}),
]


@pytest.mark.parametrize(("name", "args", "kwargs"), _LIKE_FORMS)
def test_like_factories_keep_a_global_input_layout(name: str, args: tuple, kwargs: dict) -> None:
    """``sbpflow.zeros_like(x)`` and friends take torch's forms; a global ``x`` lends its
    placement and SBP, a plain one needs them (compared with torch in this process)."""
    plain = torch.arange(6.0).reshape(2, 3)
    want = getattr(torch, name)(plain, *args, **kwargs)
    x = plain.to_global(ONE, sbp.split(1))
    got = getattr(sbpflow, name)(x, *args, **kwargs)
    assert (got.placement, got.sbp) == (ONE, (sbp.split(1),))
    assert (got.shape, got.dtype, got.requires_grad) == (want.shape, want.dtype, want.requires_grad)
    if name in ("zeros_like", "ones_like", "full_like"):
        assert torch.equal(_values(got), want)
    other = getattr(sbpflow, name)(x, *args, **kwargs, sbp=sbp.broadcast)
    assert other.sbp == (sbp.broadcast,) and other.placement == ONE
    from_plain = getattr(sbpflow, name)(plain, *args, **kwargs, placement=ONE, sbp=sbp.split(0))
    assert from_plain.sbp == (sbp.split(0),) and from_plain.shape == want.shape
    with pytest.raises(ValueError, match="needs placement= and sbp="):
        getattr(sbpflow, name)(plain, *args, **kwargs)


def test_factory_size_errors_name_torch_forms() -> None:
    with pytest.raises(TypeError, match=r"one tuple, as torch.full does, got int 4"):
        sbpflow.full(4, 2.0, placement=ONE, sbp=sbp.broadcast)
    with pytest.raises(TypeError, match=r"sbpflow.zeros takes the size as ints"):
        sbpflow.zeros(2.0, placement=ONE, sbp=sbp.broadcast)
    with pytest.raises(ValueError, match="non-negative"):
        sbpflow.ones(-1, placement=ONE, sbp=sbp.broadcast)
