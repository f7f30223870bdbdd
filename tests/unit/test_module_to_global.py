"""``Module.to_global`` refuses to give one shared tensor two layouts (single process).

The check runs before any tensor is converted, so these cases never reach a
process group; the module is left exactly as it was.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import sbpflow
from sbpflow.sbp import broadcast, split


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight


def test_tied_weight_given_two_sbps_names_both_owners() -> None:
    model = _Tied()
    weight = model.embed.weight
    pl = sbpflow.placement("cpu", [0])

    def layout(name: str, t: torch.Tensor) -> object:
        return split(0) if name == "embed.weight" else split(1)

    with pytest.raises(ValueError, match=r"'embed\.weight' and 'head\.weight'.*S\(0\).*S\(1\)"):
        model.to_global(pl, layout)
    assert model.embed.weight is weight and model.head.weight is weight  # untouched
    assert not sbpflow.is_global(weight)


def test_shared_submodule_given_two_sbps_is_an_error() -> None:
    shared = nn.Linear(2, 2)
    model = nn.ModuleDict({"a": shared, "b": shared})
    pl = sbpflow.placement("cpu", [0])

    def layout(name: str, t: torch.Tensor) -> object:
        return split(0) if name.startswith("b.") else broadcast

    with pytest.raises(ValueError, match=r"'a\.weight' and 'b\.weight'"):
        model.to_global(pl, layout)
    assert not sbpflow.is_global(shared.weight)


def test_tensor_both_parameter_and_buffer_is_an_error() -> None:
    model = nn.Module()
    model.owner = nn.Linear(2, 2)
    model.register_buffer("alias", model.owner.weight)
    with pytest.raises(ValueError, match=r"both as a parameter.*'owner\.weight'.*'alias'"):
        model.to_global(sbpflow.placement("cpu", [0]), broadcast)
