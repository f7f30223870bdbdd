"""Conversions keep each parameter the same object: an optimizer made before trains the model.

The optimizer (SGD with momentum, AdamW), a ``named_parameters()`` dict, a reference to a tied
weight and gradient hooks are all made on the plain model, *before* it is converted; then the
model trains 3 steps. Every rank also trains a plain copy of the model on the whole batch with
its own optimizer (the single-process reference); losses and parameters (logical values) must
agree within 1e-5, every parameter must still be the object the optimizer holds, and the hooks
must have run once per step. Conversions, on 2 ranks:

- ``dp``: ``model.to_global(P, broadcast)``, the batch split on dim 0;
- ``tp``: ``model.to_global(P, megatron)`` straight from the plain model: a plain parameter
  given ``split(d)`` is the whole logical tensor (each rank keeps its slice), so ``fc1``'s
  weight stays [16, 8] and the model computes what the plain one does;
- ``dp_then_tp``: ``to_global(P, broadcast)``, one data-parallel step, then boxed to the
  Megatron layout for the other steps (the optimizer state made in the first step stays
  keyed by the same parameters);
- ``fsdp``: ``fully_shard`` on the block, then on the root;
- ``plain_then_tp``: one step on the plain model (the optimizer makes its state), then
  ``model.to_global(P, megatron)``: the state, plain, is the whole logical state, as a plain
  parameter is.

``local_pieces=True`` is the explicit way to say each rank's plain tensor is its own piece:
the ranks' ``Linear(8, 16)`` weights then stack into a [32, 8] logical weight.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sbpflow
from sbpflow.nn.parallel import fully_shard
from sbpflow.sbp import Broadcast, Split
from sbpflow.testing import get_pool

S0, S1, B = Split(0), Split(1), Broadcast()
_STEPS = 3
_TOL = 1e-5
_VOCAB, _DIM = 11, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(_DIM, 2 * _DIM)
        self.fc2 = nn.Linear(2 * _DIM, _DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.relu(self.fc1(x)))


class TiedNet(nn.Module):
    """Embedding -> residual block -> output projection tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(_VOCAB, _DIM)
        self.block = Block()
        self.head = nn.Linear(_DIM, _VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(tokens)))


_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
}


def _megatron(name: str, t: torch.Tensor) -> Any:
    """fc1 column-parallel, fc2's weight row-parallel; the rest broadcast."""
    if name.startswith("block.fc1."):
        return S0
    return S1 if name == "block.fc2.weight" else B


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10 + step)
    return torch.randint(0, _VOCAB, (8, 5), generator=gen), torch.randint(
        0, _VOCAB, (8, 5), generator=gen
    )


def _loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def _logical(t: torch.Tensor) -> torch.Tensor:
    if not sbpflow.is_global(t):
        return t.detach()
    return t.to_global(sbp=(B,) * len(t.sbp), check_meta=False).to_local().detach()


def _convert(model: TiedNet, route: str, placement: sbpflow.Placement) -> None:
    if route in ("dp", "dp_then_tp"):
        model.to_global(placement, B)
    elif route == "tp":
        model.to_global(placement, _megatron)
    else:
        assert route == "fsdp"
        fully_shard(model.block, placement)
        fully_shard(model, placement)


def train_job(route: str, optimizer: str) -> dict[str, Any]:
    placement = sbpflow.placement("cpu", list(range(sbpflow.env.get_world_size())))
    torch.manual_seed(0)
    reference = TiedNet()
    model = copy.deepcopy(reference)
    # everything a torch user makes before wrapping the model
    opt = _OPTIMIZERS[optimizer](model.parameters())
    opt_ref = _OPTIMIZERS[optimizer](reference.parameters())
    held = dict(model.named_parameters())
    tied = model.head.weight
    calls = {"pre": 0, "post": 0}

    def count_pre(grad: torch.Tensor) -> None:
        calls["pre"] += 1

    def count_post(param: torch.Tensor) -> None:
        calls["post"] += 1

    model.block.fc1.weight.register_hook(count_pre)
    model.block.fc1.weight.register_post_accumulate_grad_hook(count_post)

    if route != "plain_then_tp":
        _convert(model, route, placement)
    losses = []
    for step in range(_STEPS):
        if route in ("dp_then_tp", "plain_then_tp") and step == 1:
            model.to_global(placement, _megatron)
        tokens, targets = _batch(step)
        want = _loss(reference, tokens, targets)
        want.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        split_batch = route in ("dp", "fsdp") or (route == "dp_then_tp" and step == 0)
        sbp = S0 if split_batch else B
        if route == "plain_then_tp" and step == 0:
            gt, gy = tokens, targets
        else:
            gt, gy = (t.to_global(placement, B).to_global(sbp=sbp) for t in (tokens, targets))
        got = _loss(model, gt, gy)
        got.backward()
        opt.step()
        opt.zero_grad()
        losses.append((got.item(), want.item()))
    want_params = dict(reference.named_parameters())
    errors = {
        name: (_logical(p).double() - want_params[name].detach().double()).abs().max().item()
        for name, p in model.named_parameters()
    }
    return {
        "losses": losses,
        "errors": errors,
        "names": sorted(n for n, _ in model.named_parameters()),
        "same_objects": all(p is held[n] for n, p in model.named_parameters()),
        "optimizer_holds_them": [
            p is q for p, q in zip(opt.param_groups[0]["params"], model.parameters(), strict=True)
        ],
        "first_is_embed": opt.param_groups[0]["params"][0] is model.embed.weight,
        "tied": tied is model.embed.weight and tied is model.head.weight,
        "all_global": all(sbpflow.is_global(p) for p in model.parameters()),
        "fc1_shape": tuple(model.block.fc1.weight.shape),
        "calls": calls,
    }


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("route", ["dp", "tp", "dp_then_tp", "fsdp", "plain_then_tp"])
def test_optimizer_made_before_conversion_trains_as_one_process(route: str, optimizer: str) -> None:
    """Against the plain model trained in the same process with its own optimizer."""
    for rank, got in enumerate(get_pool(2).run(train_job, route, optimizer)):
        for step, (loss, want) in enumerate(got["losses"]):
            assert abs(loss - want) <= _TOL, f"rank {rank} step {step}: loss {loss} != {want}"
        bad = {n: e for n, e in got["errors"].items() if e > _TOL}
        assert not bad, f"rank {rank}: parameters differ from one process: {bad}"
        assert got["names"] == ["block.fc1.bias", "block.fc1.weight", "block.fc2.bias",
                                "block.fc2.weight", "embed.weight"]  # fmt: skip
        assert got["same_objects"], f"rank {rank}: named_parameters() holds new objects"
        assert all(got["optimizer_holds_them"]), f"rank {rank}: {got['optimizer_holds_them']}"
        assert got["first_is_embed"] and got["tied"] and got["all_global"], got
        assert got["fc1_shape"] == (2 * _DIM, _DIM), got["fc1_shape"]
        assert got["calls"] == {"pre": _STEPS, "post": _STEPS}, got["calls"]


def local_pieces_job() -> dict[str, Any]:
    """Each rank's plain Linear(8, 16), converted split(0) both ways."""
    rank = sbpflow.env.get_rank()
    placement = sbpflow.placement("cpu", list(range(sbpflow.env.get_world_size())))
    torch.manual_seed(rank)  # different values on each rank
    whole, pieces = nn.Linear(_DIM, 2 * _DIM), nn.Linear(_DIM, 2 * _DIM)
    mine = copy.deepcopy(whole)
    mine_pieces = pieces.weight.detach().clone()
    whole.to_global(placement, S0)
    pieces.to_global(placement, S0, local_pieces=True)
    x = torch.randn(3, _DIM, generator=torch.Generator().manual_seed(5))
    return {
        "mine": mine,
        "mine_pieces": mine_pieces,
        "whole": (tuple(whole.weight.shape), _logical(whole.weight)),
        "whole_out": _logical(whole(x.to_global(placement, B))),
        "x": x,
        "pieces": (tuple(pieces.weight.shape), _logical(pieces.weight)),
    }


def test_plain_parameters_given_split_are_whole_unless_local_pieces() -> None:
    """Against rank 0's plain Linear applied in one process (the whole reading) and the ranks'
    weights stacked (``local_pieces=True``)."""
    results = get_pool(2).run(local_pieces_job)
    first: nn.Linear = results[0]["mine"]
    stacked = torch.cat([r["mine_pieces"] for r in results])
    for rank, got in enumerate(results):
        shape, value = got["whole"]
        assert shape == (2 * _DIM, _DIM), f"rank {rank}: split(0) read the plain weight as {shape}"
        assert torch.equal(value, first.weight.detach()), f"rank {rank}: not rank 0's weight"
        want = first(got["x"]).detach()
        assert torch.allclose(got["whole_out"], want, atol=_TOL, rtol=0), f"rank {rank}"
        shape, value = got["pieces"]
        assert shape == (4 * _DIM, _DIM) and torch.equal(value, stacked), f"rank {rank}"
