"""End-to-end training on global tensors against single-process training on the whole batch.

Three tiny models (an MLP; a CNN with conv2d, batch_norm, relu, max_pool2d and
linear; a transformer block with embedding, layer_norm, attention written as
matmul + softmax, gelu and cross_entropy) train for 5 steps of SGD with
momentum and of AdamW. Each is laid out as

- data parallel: parameters broadcast, batch split on dim 0 (2 and 4 ranks);
- tensor parallel: a column-parallel then a row-parallel Linear (attention
  heads split: q/k/v column-parallel, output projection row-parallel), 2 ranks;
- DP x TP on a 2x2 mesh: parameters ``(B, S(k))``, batch ``(S(0), B)``.

Every rank also trains a plain copy of the model on the whole batch (the
single-process reference) and the losses, parameters and batch-norm running
statistics must agree within 1e-5. Each step (forward, backward,
``optimizer.step``, ``zero_grad``) runs inside ``sbpflow.boxing.trace()`` and
must not fall back to broadcasting an op's inputs; every parameter's gradient
arrives in the parameter's own layout (broadcast parameters: broadcast).
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


# -- models ---------------------------------------------------------------------------


class MLP(nn.Module):
    """``fc1`` is the column-parallel Linear, ``fc2`` the row-parallel one."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # No conv bias: batch norm cancels it, so its true gradient is 0 and AdamW would
        # turn rounding noise (which differs with the reduction order) into full-size steps.
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 3 * 3, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        return self.fc(x.flatten(1))


class Block(nn.Module):
    """A pre-norm transformer block with a language-model head (causal mask left out)."""

    def __init__(self, vocab: int = 11, dim: int = 8, num_heads: int = 2) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.embed = nn.Embedding(vocab, dim)
        self.ln1 = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        # No key bias: it adds the same score to every key of a query, which softmax cancels,
        # so its true gradient is 0 and AdamW would step on rounding noise.
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)
        self.head = nn.Linear(dim, vocab)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = t.shape
        return t.reshape(batch, seq, self.num_heads, dim // self.num_heads).transpose(1, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        h = self.ln1(x)
        q, k, v = self._heads(self.q(h)), self._heads(self.k(h)), self._heads(self.v(h))
        scores = torch.matmul(q, k.transpose(-2, -1)) / (q.shape[-1] ** 0.5)
        attn = torch.matmul(torch.softmax(scores, dim=-1), v)
        x = x + self.proj(attn.transpose(1, 2).reshape(x.shape))
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return self.head(x)


def _batch(model: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of the whole batch; 8 samples so 2 and 4 ranks split it evenly."""
    gen = torch.Generator().manual_seed(1)
    if model == "mlp":
        return torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
    if model == "cnn":
        return torch.randn(8, 3, 6, 6, generator=gen), torch.randint(0, 5, (8,), generator=gen)
    return torch.randint(0, 11, (8, 5), generator=gen), torch.randint(0, 11, (8, 5), generator=gen)


def _loss(model: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if model == "mlp":
        return F.mse_loss(out, target)
    if model == "cnn":
        return F.cross_entropy(out, target)
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


_MODELS: dict[str, Callable[[], nn.Module]] = {"mlp": MLP, "cnn": CNN, "block": Block}

_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params),
}


# -- parameter layouts (one mesh axis) ------------------------------------------------

_COLUMN = {"fc1", "q", "k", "v"}  # output features split: weight rows and bias
_ROW = {"fc2", "proj"}  # input features split: weight columns; bias broadcast


def _tensor_parallel(name: str, t: torch.Tensor) -> Any:
    module, kind = name.rsplit(".", 1)
    if module in _COLUMN:
        return S0
    if module in _ROW:
        return S1 if kind == "weight" else B
    return B


def _data_parallel(name: str, t: torch.Tensor) -> Any:
    return B


# -- one training run ---------------------------------------------------------------


def _train(
    model_name: str,
    optimizer: str,
    placement: sbpflow.Placement,
    param_sbp: Callable[[str, torch.Tensor], Any],
    batch_sbp: Any,
) -> dict[str, Any]:
    """Train a global model and a plain copy 5 steps; compare with single-process reference."""
    torch.manual_seed(0)
    reference = _MODELS[model_name]()
    # Local tensors given as split(d) are read as shards, so convert to B and then box.
    full = (B,) * placement.ndim
    model = copy.deepcopy(reference).to_global(placement, full).to_global(placement, param_sbp)
    x, y = _batch(model_name)
    gx, gy = _shard_batch(x, placement, batch_sbp), _shard_batch(y, placement, batch_sbp)
    opt_ref = _OPTIMIZERS[optimizer](reference.parameters())
    opt = _OPTIMIZERS[optimizer](model.parameters())
    losses, fallbacks, grad_sbps = [], [], {}
    for _ in range(_STEPS):
        opt_ref.zero_grad()
        want = _loss(model_name, reference(x), y)
        want.backward()
        opt_ref.step()
        with sbpflow.boxing.trace() as t:
            got = _loss(model_name, model(gx), gy)
            got.backward()
            grad_sbps = {
                n: (sbp_str(p.grad.sbp), sbp_str(p.sbp)) for n, p in model.named_parameters()
            }
            opt.step()
            opt.zero_grad()
        fallbacks.extend(t.fallbacks)
        losses.append((got.item(), want.item()))
    want_state = _state(reference)
    state_errors = {}
    for name, got_t in _state(model).items():
        value, want_t = _logical(got_t).double(), want_state[name].double()
        ok = torch.allclose(value, want_t, atol=_TOL, rtol=_TOL)
        state_errors[name] = 0.0 if ok else (value - want_t).abs().max().item()
    return {
        "losses": losses,  # (global, reference) per step
        "state_errors": state_errors,
        "fallbacks": sorted(set(fallbacks)),
        "grad_sbps": grad_sbps,
    }


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers (batch-norm running statistics) by name."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _logical(t: torch.Tensor) -> torch.Tensor:
    """The logical value of a global tensor, on every rank (a collective)."""
    full = t.to_global(sbp=(B,) * len(t.sbp), check_meta=False)
    return full.to_local().detach()


def _shard_batch(t: torch.Tensor, placement: sbpflow.Placement, sbp: Any) -> sbpflow.GlobalTensor:
    """The whole batch as a global tensor laid out as ``sbp``, the way a user would build it."""
    if sbp == S0:  # each rank passes its own slice (balanced, as tensor_split cuts)
        rank = sbpflow.env.get_rank()
        piece = torch.tensor_split(t, placement.num_ranks)[placement.flat_ranks.index(rank)]
        return piece.contiguous().to_global(placement, sbp)
    # Otherwise every rank passes the whole batch, broadcast, and boxes it (slicing locally).
    return t.to_global(placement, (B,) * placement.ndim).to_global(sbp=sbp)


# -- workers (module level, so the ranks can import them) ------------------------------


def _world() -> sbpflow.Placement:
    return sbpflow.placement("cpu", list(range(sbpflow.env.get_world_size())))


def data_parallel_job() -> list[tuple[str, dict[str, Any]]]:
    pl = _world()
    return [
        (f"data parallel {m} {o}", _train(m, o, pl, _data_parallel, S0))
        for m in _MODELS
        for o in _OPTIMIZERS
    ]


def tensor_parallel_job() -> list[tuple[str, dict[str, Any]]]:
    pl = _world()
    return [
        (f"tensor parallel {m} {o}", _train(m, o, pl, _tensor_parallel, B))
        for m in ("mlp", "block")
        for o in _OPTIMIZERS
    ]


def mesh_job() -> list[tuple[str, dict[str, Any]]]:
    pl = sbpflow.placement("cpu", [[0, 1], [2, 3]])

    def params(name: str, t: torch.Tensor) -> Any:
        return (B, _tensor_parallel(name, t))

    return [
        (f"2x2 DP x TP {m} {o}", _train(m, o, pl, params, (S0, B)))
        for m in _MODELS  # the CNN has no tensor-parallel layer: data parallel on axis 0
        for o in _OPTIMIZERS
    ]


# -- tests ----------------------------------------------------------------------------


def _check(results: list[list[tuple[str, dict[str, Any]]]]) -> None:
    for rank, per_rank in enumerate(results):
        for label, got in per_rank:
            where = f"rank {rank}, {label}"
            assert got["fallbacks"] == [], f"{where}: fell back on {got['fallbacks']}"
            for step, (loss, want) in enumerate(got["losses"]):
                assert loss == pytest.approx(want, abs=_TOL, rel=_TOL), (
                    f"{where}: step {step} {got['losses']}"
                )
            bad = {n: e for n, e in got["state_errors"].items() if e}
            assert not bad, f"{where}: parameters/buffers differ: {bad}"
            for name, (grad_sbp, param_sbp) in got["grad_sbps"].items():
                assert grad_sbp == param_sbp, (
                    f"{where}: {name}.grad is {grad_sbp}, param {param_sbp}"
                )


@pytest.mark.parametrize("world_size", [2, 4])
def test_data_parallel_training(world_size: int) -> None:
    """MLP, CNN (batch norm) and transformer block, broadcast parameters and an S(0) batch:
    5 steps of SGD-momentum and AdamW compare with single-process reference on the whole batch."""
    results = get_pool(world_size).run(data_parallel_job)
    _check(results)
    for per_rank in results:  # broadcast parameters get broadcast gradients
        for _, got in per_rank:
            assert all(g == "B" for g, _ in got["grad_sbps"].values()), got["grad_sbps"]


def test_tensor_parallel_training() -> None:
    """Column- then row-parallel Linears (MLP; attention heads split in the block) on 2 ranks
    compare with single-process reference; gradients keep the parameters' splits."""
    results = get_pool(2).run(tensor_parallel_job)
    _check(results)
    layouts = dict(results[0][0][1]["grad_sbps"])  # mlp: (grad SBP, parameter SBP) by name
    assert layouts["fc1.weight"] == layouts["fc1.bias"] == ("S(0)", "S(0)"), layouts
    assert layouts["fc2.weight"] == ("S(1)", "S(1)") and layouts["fc2.bias"] == ("B", "B"), layouts


def test_data_and_tensor_parallel_on_2x2_mesh() -> None:
    """Parameters (B, S(k)) and batch (S(0), B) on a 2x2 mesh compare with single-process
    reference on the whole batch."""
    results = get_pool(4).run(mesh_job)
    _check(results)
    layouts = dict(results[0][0][1]["grad_sbps"])  # mlp
    assert layouts["fc1.weight"] == ("(B, S(0))", "(B, S(0))"), layouts
    assert layouts["fc2.weight"] == ("(B, S(1))", "(B, S(1))"), layouts
