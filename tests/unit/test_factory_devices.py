"""Every factory given a cuda placement on a machine without CUDA raises ``to_global``'s error.

Single process, no process group: the error must come before the placement's process groups
are made (torch.distributed would fail first with "Distributed package doesn't have NCCL built
in"). The reference is the error ``torch.zeros(2).to_global`` raises for the same placement, in
the same process. CUDA is hidden (``torch.cuda.is_available`` returns False), so the test runs the
same on a machine with a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import sbpflow
from sbpflow import _factories
from sbpflow.sbp import broadcast, split

_CUDA = sbpflow.placement("cuda", [0])
_LIKE = torch.zeros(4, 2)

# One call per factory, each with a cuda placement.
_CALLS: dict[str, Callable[[], Any]] = {
    "randn": lambda: sbpflow.randn(4, 4, placement=_CUDA, sbp=split(0)),
    "rand": lambda: sbpflow.rand(4, 4, placement=_CUDA, sbp=broadcast),
    "zeros": lambda: sbpflow.zeros(4, 2, placement=_CUDA, sbp=broadcast),
    "ones": lambda: sbpflow.ones(4, placement=_CUDA, sbp=split(0)),
    "empty": lambda: sbpflow.empty(4, 2, placement=_CUDA, sbp=broadcast),
    "full": lambda: sbpflow.full((4, 2), 3.0, placement=_CUDA, sbp=broadcast),
    "arange": lambda: sbpflow.arange(0, 8, placement=_CUDA, sbp=split(0)),
    "zeros_like": lambda: sbpflow.zeros_like(_LIKE, placement=_CUDA, sbp=broadcast),
    "ones_like": lambda: sbpflow.ones_like(_LIKE, placement=_CUDA, sbp=broadcast),
    "full_like": lambda: sbpflow.full_like(_LIKE, 2.0, placement=_CUDA, sbp=broadcast),
    "empty_like": lambda: sbpflow.empty_like(_LIKE, placement=_CUDA, sbp=broadcast),
    "rand_like": lambda: sbpflow.rand_like(_LIKE, placement=_CUDA, sbp=broadcast),
    "randn_like": lambda: sbpflow.randn_like(_LIKE, placement=_CUDA, sbp=broadcast),
}


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _to_global_error() -> str:
    with pytest.raises(RuntimeError) as caught:
        torch.zeros(2).to_global(_CUDA, broadcast)
    return str(caught.value)


def test_every_factory_is_covered() -> None:
    factories = set(_factories.__all__) - {"manual_seed"}
    assert factories == set(_CALLS), "a factory without a device test"


@pytest.mark.usefixtures("no_cuda")
@pytest.mark.parametrize("name", sorted(_CALLS))
def test_cuda_placement_without_cuda_raises_the_to_global_error(name: str) -> None:
    expected = _to_global_error()
    assert "a cuda placement was used but CUDA is not available" in expected
    with pytest.raises(RuntimeError) as caught:
        _CALLS[name]()
    assert str(caught.value) == expected
