"""A language model whose input embedding and output projection share one weight, trained on
global tensors against single-process training of the same model on the whole batch.

``Module.to_global`` must convert the tied weight once: both owners keep one
Parameter, ``named_parameters()`` and an optimizer see the same set (same count,
same names) as before, and the gradients of its two uses accumulate into one
``.grad``. If the weight broke into two parameters, the embedding and the
projection would each take only their half of the gradient and drift apart.

Layouts: data parallel (parameters B, batch S(0)) on 2 and 4 ranks; tensor
parallel on 2 ranks with the tied weight split by vocabulary rows (S(0)) or by
hidden features (S(1)), the rest broadcast. Each trains 5 steps of SGD with
momentum and of AdamW in fp32; losses and parameters must equal the plain
model's (computed in the same process) within 1e-5.
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
from sbpflow.sbp import Broadcast, Split, sbp_str
from sbpflow.testing import get_pool

S0, S1, B = Split(0), Split(1), Broadcast()
_STEPS = 5
_TOL = 1e-5
_VOCAB, _DIM = 13, 8


class TinyLM(nn.Module):
    """Embedding -> residual MLP block -> output projection tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(_VOCAB, _DIM)
        self.norm = nn.LayerNorm(_DIM)
        self.fc = nn.Linear(_DIM, _DIM)
        self.head = nn.Linear(_DIM, _VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + F.gelu(self.fc(self.norm(x)))
        return self.head(x)


_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01),
}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, next tokens) of the whole batch: 8 sequences of 6, split evenly by 2 and 4."""
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, _VOCAB, (8, 7), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _logical(t: torch.Tensor) -> torch.Tensor:
    """The logical value of a global tensor, on every rank (a collective)."""
    return t.to_global(sbp=(B,) * len(t.sbp), check_meta=False).to_local().detach()


def _train(optimizer: str, tied_sbp: Any, batch_sbp: Any) -> dict[str, Any]:
    """Train a global TinyLM and a plain copy 5 steps; report what the test compares."""
    pl = sbpflow.placement("cpu", list(range(sbpflow.env.get_world_size())))
    torch.manual_seed(0)
    reference = TinyLM()
    names_before = [n for n, _ in reference.named_parameters()]

    def layout(name: str, t: torch.Tensor) -> Any:
        return tied_sbp if name in ("embed.weight", "head.weight") else B

    # Every rank holds the whole model: convert as broadcast, then box to the layout.
    model = copy.deepcopy(reference).to_global(pl, B).to_global(pl, layout)
    opt_ref = _OPTIMIZERS[optimizer](reference.parameters())
    opt = _OPTIMIZERS[optimizer](model.parameters())
    x, y = _batch()
    if batch_sbp == S0:
        rank = sbpflow.env.get_rank()
        gx = torch.tensor_split(x, pl.num_ranks)[rank].contiguous().to_global(pl, S0)
        gy = torch.tensor_split(y, pl.num_ranks)[rank].contiguous().to_global(pl, S0)
    else:
        gx, gy = x.to_global(pl, B), y.to_global(pl, B)
    losses, fallbacks = [], []
    for _ in range(_STEPS):
        opt_ref.zero_grad()
        want = _loss(reference(x), y)
        want.backward()
        opt_ref.step()
        with sbpflow.boxing.trace() as t:
            got = _loss(model(gx), gy)
            got.backward()
            opt.step()
            opt.zero_grad()
        fallbacks.extend(t.fallbacks)
        losses.append((got.item(), want.item()))
    errors = {}
    want_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        diff = (_logical(p).double() - want_params[name].detach().double()).abs().max().item()
        errors[name] = diff
    return {
        "names": (names_before, [n for n, _ in model.named_parameters()]),
        "num_optimized": sum(len(g["params"]) for g in opt.param_groups),
        "tied": model.embed.weight is model.head.weight,
        "tied_sbp": sbp_str(model.embed.weight.sbp),
        "losses": losses,
        "errors": errors,
        "fallbacks": sorted(set(fallbacks)),
    }


def data_parallel_job() -> list[tuple[str, dict[str, Any]]]:
    return [(f"data parallel {o}", _train(o, B, S0)) for o in _OPTIMIZERS]


def tensor_parallel_job() -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"tensor parallel tied {sbp} {o}", _train(o, sbp, B))
        for sbp in (S0, S1)
        for o in _OPTIMIZERS
    ]


def _check(results: list[list[tuple[str, dict[str, Any]]]], tied_sbps: set[str]) -> None:
    for rank, per_rank in enumerate(results):
        for label, got in per_rank:
            where = f"rank {rank}, {label}"
            before, after = got["names"]
            # torch's dedup: the tied weight is listed once, under its first name.
            assert before == after and len(after) == 5, f"{where}: names {before} -> {after}"
            assert got["num_optimized"] == len(before), f"{where}: {got['num_optimized']} params"
            assert got["tied"], f"{where}: the tied weight broke into two parameters"
            assert got["tied_sbp"] in tied_sbps, f"{where}: tied weight is {got['tied_sbp']}"
            assert got["fallbacks"] == [], f"{where}: fell back on {got['fallbacks']}"
            for step, (loss, want) in enumerate(got["losses"]):
                assert loss == pytest.approx(want, abs=_TOL, rel=_TOL), (
                    f"{where}: step {step} {got['losses']}"
                )
            bad = {n: e for n, e in got["errors"].items() if e > _TOL}
            assert not bad, f"{where}: parameters differ from the reference by {bad}"


@pytest.mark.parametrize("world_size", [2, 4])
def test_tied_lm_data_parallel(world_size: int) -> None:
    """Parameters B, batch S(0): 5 steps of SGD-momentum and AdamW equal single-process
    training on the whole batch; the tied weight stays one Parameter."""
    _check(get_pool(world_size).run(data_parallel_job), {"B"})


def test_tied_lm_tensor_parallel() -> None:
    """Tied weight S(0) (vocabulary rows) and S(1) (hidden features) on 2 ranks: 5 steps of
    SGD-momentum and AdamW equal single-process training; the tied weight stays one Parameter."""
    _check(get_pool(2).run(tensor_parallel_job), {"S(0)", "S(1)"})
