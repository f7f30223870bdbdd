"""``Module.to_global`` converts parameters in place: the same objects, their hooks and attributes
kept, or an error before anything changed (single process, a world of one).

The reference for values is the plain module in the same process: in a world of one every
layout's piece is the whole tensor, so a converted parameter must hold the plain values and its
gradient the plain gradient.
"""

from __future__ import annotations

import copy
import weakref

import pytest
import torch

import sbpflow
from sbpflow.sbp import broadcast, split

_P = sbpflow.placement("cpu", [0])


def _linear() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 4)


def test_parameters_keep_identity_hooks_attributes_and_optimizer_state_keys() -> None:
    reference = _linear()
    model = copy.deepcopy(reference)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    weight, bias = model.weight, model.bias
    weight.tag = "mine"
    seen: list[torch.Tensor] = []
    posted: list[torch.Tensor] = []
    weight.register_hook(lambda g: seen.append(g))
    weight.register_post_accumulate_grad_hook(lambda p: posted.append(p))
    model.to_global(_P, lambda name, t: split(0) if name == "weight" else broadcast)
    assert model.weight is weight and model.bias is bias
    assert isinstance(weight, torch.nn.Parameter) and sbpflow.is_global(weight)
    assert weight.sbp == (split(0),) and weight.requires_grad and weight.tag == "mine"
    assert opt.param_groups[0]["params"] == [weight, bias]
    x = torch.randn(5, 3)
    model(x.to_global(_P, broadcast)).square().sum().backward()
    reference(x).square().sum().backward()
    assert len(seen) == 1 and sbpflow.is_global(seen[0]) and posted == [weight]
    assert torch.allclose(weight.grad.to_local(), reference.weight.grad)
    opt.step()
    assert set(opt.state) == {weight, bias}  # the state is keyed by the same objects


def test_a_plain_gradient_raises_before_anything_changed() -> None:
    model = _linear()
    model.bias.grad = torch.ones(4)
    with pytest.raises(ValueError, match=r"'bias' has a gradient .*zero_grad"):
        model.to_global(_P, broadcast)
    assert not sbpflow.is_global(model.weight) and not sbpflow.is_global(model.bias)
    model.zero_grad()
    model.to_global(_P, broadcast)
    assert sbpflow.is_global(model.bias)


def test_a_held_view_raises_before_anything_changed() -> None:
    model = _linear()
    view = model.bias[1:]
    with pytest.raises(RuntimeError, match=r"'bias' is shared with another tensor"):
        model.to_global(_P, broadcast)
    assert not sbpflow.is_global(model.weight)
    del view
    model.to_global(_P, broadcast)
    assert sbpflow.is_global(model.weight) and sbpflow.is_global(model.bias)


def test_a_weakref_raises_before_anything_changed() -> None:
    model = _linear()
    ref = weakref.ref(model.bias)
    with pytest.raises(RuntimeError, match=r"'bias' is referenced by a weakref"):
        model.to_global(_P, broadcast)
    assert not sbpflow.is_global(model.weight) and ref() is model.bias


def test_a_global_gradient_is_boxed_with_its_parameter() -> None:
    reference = _linear()
    model = copy.deepcopy(reference).to_global(_P, broadcast)
    weight = model.weight
    x = torch.randn(2, 3)
    model(x.to_global(_P, broadcast)).sum().backward()
    reference(x).sum().backward()
    model.to_global(_P, lambda name, t: split(1) if name == "weight" else broadcast)
    assert model.weight is weight and weight.grad.sbp == (split(1),)
    assert torch.allclose(weight.grad.to_local(), reference.weight.grad)


def test_local_pieces_takes_a_bool() -> None:
    with pytest.raises(TypeError, match="local_pieces must be True or False"):
        _linear().to_global(_P, broadcast, local_pieces="yes")


class _SlottedParameter(torch.nn.Parameter):
    __slots__ = ("note",)


def test_a_parameter_with_slots_raises_before_anything_changed() -> None:
    model = _linear()
    model.bias = _SlottedParameter(model.bias.detach())
    with pytest.raises(TypeError, match=r"'bias' is a _SlottedParameter with __slots__"):
        model.to_global(_P, broadcast)
    assert not sbpflow.is_global(model.weight)
