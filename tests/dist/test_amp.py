"""Mixed precision on global models: ``torch.autocast`` and ``torch.amp.GradScaler``.

Every run is compared with the same model trained in one process on the whole batch,
under the same autocast and the same ``GradScaler("cpu")``, computed in the same job:

- data parallel: a small CNN with BatchNorm, parameters B, batch S(0);
- tensor parallel: a column-parallel then row-parallel MLP, batch B;
- ``DistributedDataParallel``: the MLP with local tensors, each rank a slice of the batch.

Each trains 4 SGD steps; step 1 is poisoned with an inf on ONE rank only (in that rank's
slice of the batch, or in its shard of a split weight gradient; the reference gets the inf
at the same logical position). That step must be skipped on every rank: parameters
unchanged bit for bit everywhere, and the scale halved everywhere, as in the reference.

Tolerances. With autocast off (float32) the runs differ only in summation order: 1e-5.
With bfloat16 autocast the matmuls round their outputs to 8 significant bits, and the
global runs round different partial results than the reference (each rank rounds its
half-batch weight gradient before the float32 sum over ranks, the reference rounds the
whole-batch one), so a gradient entry may differ by a few bfloat16 ulps (2**-8
relative). Over 3 taken steps at lr 0.1 that moves parameters by a few 1e-4: the
tolerance is 1e-3, and each run also checks that one taken step changes the parameters by
more than ten times that, so a step taken on one rank only, a wrong scale or a lost
shard cannot hide inside it.
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
from sbpflow.nn.parallel import DistributedDataParallel
from sbpflow.testing import DistributedPool

from ._ops_support import S0, S1, B, logical, make, placement, world

_STEPS = 4
_POISONED = 1
_INIT_SCALE = 2.0**10
_TOL = {None: 1e-5, torch.bfloat16: 1e-3}


class ConvNet(nn.Module):
    """conv -> BatchNorm -> relu -> linear on 1x8x8 images, 10 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.relu(self.bn(self.conv(x))).flatten(1))


class Mlp(nn.Module):
    """``fc1`` column-parallel (weight S(0)), ``fc2`` row-parallel (weight S(1)) under TP."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


def _tp_layout(name: str, t: torch.Tensor) -> Any:
    return {"fc1.weight": S0, "fc1.bias": S0, "fc2.weight": S1}.get(name, B)


def _batch(case: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The logical batch of ``step`` (8 samples, the same on every rank)."""
    gen = torch.Generator().manual_seed(10 + step)
    shape = (8, 1, 8, 8) if case == "data parallel" else (8, 16)
    return torch.randn(shape, generator=gen), torch.randint(0, 10, (8,), generator=gen)


def _poison_batch(x: torch.Tensor) -> None:
    """An inf in the last sample: the last rank's slice of an S(0) batch."""
    x[-1].view(-1)[0] = float("inf")


def _step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    x: torch.Tensor,
    y: torch.Tensor,
    dtype: torch.dtype | None,
    poison_grad: Callable[[], None] | None,
) -> None:
    opt.zero_grad()
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    if poison_grad is not None:
        poison_grad()
    scaler.step(opt)
    scaler.update()


def _local_params(model: nn.Module) -> list[torch.Tensor]:
    return [
        (p.to_local() if isinstance(p, sbpflow.GlobalTensor) else p).detach().clone()
        for p in model.parameters()
    ]


def _max_change(before: list[torch.Tensor], after: list[torch.Tensor]) -> float:
    """The largest change of any local parameter entry (0 where this rank holds none)."""
    return max(
        ((a - b).abs().max().item() for a, b in zip(after, before, strict=True) if a.numel()),
        default=0.0,
    )


def train_amp(case: str, dtype: torch.dtype | None) -> dict[str, Any]:
    """Worker: 4 steps of ``case`` and of the single-process reference; step 1 poisoned."""
    pl = world()
    rank, num_ranks = sbpflow.env.get_rank(), sbpflow.env.get_world_size()
    torch.manual_seed(0)
    reference = ConvNet() if case == "data parallel" else Mlp()
    if case == "data parallel":
        model: nn.Module = copy.deepcopy(reference).to_global(pl, B)
    elif case == "tensor parallel":
        model = copy.deepcopy(reference).to_global(pl, B).to_global(pl, _tp_layout)
    else:
        model = DistributedDataParallel(copy.deepcopy(reference))
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler_ref = torch.amp.GradScaler("cpu", init_scale=_INIT_SCALE)
    scaler = torch.amp.GradScaler("cpu", init_scale=_INIT_SCALE)
    errors, scales, changes = [], [], []
    for step in range(_STEPS):
        x, y = _batch(case, step)
        poison = step == _POISONED
        if poison and case != "tensor parallel":
            _poison_batch(x)
        poison_ref = poison_global = None
        if poison and case == "tensor parallel":
            # fc1.weight's gradient is S(0): its last row lives on the last rank only.
            def poison_ref() -> None:
                reference.fc1.weight.grad[-1, 0] = float("inf")

            def poison_global() -> None:
                if rank == num_ranks - 1:
                    model.fc1.weight.grad.to_local()[-1, 0] = float("inf")

        if case == "ddp":
            share = x.shape[0] // num_ranks
            gx, gy = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
        elif case == "data parallel":
            gx, gy = make(x, pl, S0), make(y, pl, S0)
        else:
            gx, gy = make(x, pl, B), make(y, pl, B)
        before = _local_params(model)
        _step(reference, opt_ref, scaler_ref, x, y, dtype, poison_ref)
        _step(model, opt, scaler, gx, gy, dtype, poison_global)
        changes.append(_max_change(before, _local_params(model)))
        got = [logical(p) for p in model.parameters()]
        errors.append(
            max(
                (g - r).abs().max().item() for g, r in zip(got, reference.parameters(), strict=True)
            )
        )
        scales.append((scaler.get_scale(), scaler_ref.get_scale()))
    return {"errors": errors, "scales": scales, "changes": changes}


_CASES = [
    (case, dtype)
    for case in ("data parallel", "tensor parallel", "ddp")
    for dtype in (None, torch.bfloat16)
]


def train_all() -> list[tuple[str, dict[str, Any]]]:
    """Worker: every case, autocast off and bfloat16."""
    return [(f"{case} autocast={dtype}", train_amp(case, dtype)) for case, dtype in _CASES]


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_amp_training_matches_single_process(dist_pool: DistributedPool) -> None:
    """Each case equals the single-process reference (same autocast and GradScaler) after
    every step; the poisoned step leaves every rank's parameters unchanged and halves the
    scale on every rank, as in the reference."""
    for rank_results in dist_pool.run(train_all):
        for label, got in rank_results:
            dtype = torch.bfloat16 if "bfloat16" in label else None
            assert max(got["errors"]) < _TOL[dtype], f"{label}: {got['errors']}"
            assert got["changes"][_POISONED] == 0.0, f"{label}: {got['changes']}"  # skipped
            assert got["changes"][0] > 10 * _TOL[dtype], f"{label}: {got['changes']}"  # taken
            expected = [_INIT_SCALE] * _POISONED + [_INIT_SCALE / 2] * (_STEPS - _POISONED)
            assert [s for s, _ in got["scales"]] == expected, f"{label}: {got['scales']}"
            assert [s for _, s in got["scales"]] == expected, f"{label}: {got['scales']}"


def train_on_stages() -> dict[str, Any]:
    """Worker (4 ranks): fc1 column-parallel on ranks [0, 1], fc2 on rank [2]; rank 3 holds
    nothing. An inf in rank 1's shard of fc1's gradient skips the step on all four ranks."""
    rank = sbpflow.env.get_rank()
    first, second = placement([0, 1]), placement([2])
    torch.manual_seed(0)
    reference = Mlp()
    model = copy.deepcopy(reference)
    model.fc1.to_global(first, B).to_global(first, S0)
    model.fc2.to_global(second, B)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=_INIT_SCALE)
    changes, scales = [], []
    for step in range(_STEPS):
        x, y = _batch("stages", step)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = F.relu(model.fc1(make(x, first, B)))
            out = model.fc2(hidden.to_global(second, B))
            loss = F.cross_entropy(out, make(y, second, B))
        scaler.scale(loss).backward()
        if step == _POISONED and rank == 1:
            model.fc1.weight.grad.to_local()[-1, 0] = float("inf")
        before = _local_params(model)
        with sbpflow.boxing.trace() as t:
            scaler.step(opt)  # unscale_ inside: the found-inf flag's all_reduce
        scaler.update()
        changes.append(_max_change(before, _local_params(model)))
        scales.append(scaler.get_scale())
    return {"changes": changes, "scales": scales, "step_collectives": dict(t.collectives())}


@pytest.mark.parametrize("dist_pool", [4], indirect=True)
def test_skip_agrees_on_ranks_outside_the_gradients(dist_pool: DistributedPool) -> None:
    """Gradients on placements [0, 1] and [2] of four ranks: the step with an inf on rank 1
    is skipped everywhere and the scale halves on all four ranks (rank 3, which holds no
    gradient, too); the flag takes one all_reduce per step and no new process group."""
    expected = [_INIT_SCALE] * _POISONED + [_INIT_SCALE / 2] * (_STEPS - _POISONED)
    for rank, got in enumerate(dist_pool.run(train_on_stages)):
        assert got["scales"] == expected, f"rank {rank}: {got['scales']}"
        assert got["changes"][_POISONED] == 0.0, f"rank {rank}: {got['changes']}"
        if rank < 3:
            assert got["changes"][0] > 0.0, f"rank {rank}: {got['changes']}"
        assert got["step_collectives"] == {"all_reduce": 1}, f"rank {rank}: {got}"


def _dtype_cases(pl: sbpflow.Placement) -> list[tuple[str, Callable[..., Any], tuple, tuple]]:
    """(name, function, global inputs, reference inputs): ops autocast casts down, keeps, or
    casts up (losses) on global inputs in several layouts."""
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(8, 6, generator=gen), torch.randn(5, 6, generator=gen)
    a, b = torch.randn(6, 4, generator=gen), torch.randn(4, 3, generator=gen)
    img, kernel = torch.randn(4, 2, 5, 5, generator=gen), torch.randn(3, 2, 3, 3, generator=gen)
    q = torch.randn(2, 4, 6, 8, generator=gen)
    y = torch.randint(0, 5, (8,), generator=gen)
    bn_weight, bn_bias = torch.rand(3, generator=gen), torch.rand(3, generator=gen)
    ln_weight = torch.rand(6, generator=gen)

    def conv_bn(i: Any, k: Any, g: Any, h: Any) -> Any:
        out = F.conv2d(i, k)
        return out, F.batch_norm(out, None, None, g, h, training=True)

    def linear_losses(i: Any, m: Any, t: Any) -> Any:
        out = F.linear(i, m)
        return out, F.cross_entropy(out, t), F.mse_loss(out, out.detach() * 0.5), out.softmax(-1)

    cases = [
        ("linear S(0) x B", linear_losses, (x, S0, w, B, y, S0)),
        ("linear B x S(0)", linear_losses, (x, B, w, S0, y, B)),
        ("matmul S(1) x S(0) -> P", torch.matmul, (a, S1, b, S0)),
        ("conv2d + batch_norm on S(0)", conv_bn, (img, S0, kernel, B, bn_weight, B, bn_bias, B)),
        ("layer_norm S(0)", lambda i, g: F.layer_norm(i, (6,), g), (x, S0, ln_weight, B)),
        ("attention S(1) heads", lambda i: F.scaled_dot_product_attention(i, i, i), (q, S1)),
        ("sum and mean", lambda i: (i.sum(0), i.mean()), (x, S0)),
    ]
    out = []
    for name, fn, spec in cases:
        values, sbps = spec[0::2], spec[1::2]
        out.append(
            (name, fn, tuple(make(v, pl, s) for v, s in zip(values, sbps, strict=True)), values)
        )
    return out


def autocast_dtypes(ranks: list[int]) -> list[str]:
    """Worker: each case under autocast(bfloat16) on placement ``ranks`` and in one process;
    every output's dtype (logical and local, on ranks outside the placement too) and value."""
    pl = placement(ranks)
    rank = sbpflow.env.get_rank()
    failures = []
    for name, fn, global_inputs, inputs in _dtype_cases(pl):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = fn(*global_inputs)
            want = fn(*inputs)
        got = got if isinstance(got, tuple) else (got,)
        want = want if isinstance(want, tuple) else (want,)
        for k, (g, r) in enumerate(zip(got, want, strict=True)):
            if g.dtype != r.dtype or g.to_local().dtype != r.dtype:
                failures.append(
                    f"{name} output {k} on rank {rank}: {g.dtype} (local {g.to_local().dtype}), "
                    f"one process gives {r.dtype}"
                )
                continue
            value = logical(g)
            if rank in pl and not torch.allclose(value.float(), r.float(), atol=3e-2, rtol=3e-2):
                error = (value.float() - r.float()).abs().max().item()
                failures.append(f"{name} output {k}: max error {error:.3g}")
    return failures


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
@pytest.mark.parametrize("ranks", [[0, 1], [0]], ids=["every rank", "rank 1 outside"])
def test_autocast_dtypes_match_single_process(dist_pool: DistributedPool, ranks: list[int]) -> None:
    """Under autocast(bfloat16) every output of a global op has the dtype the same op gives in
    one process (bfloat16 for matmuls and convolutions, float32 for losses), logically and in
    its local piece on every rank, and its value agrees within bfloat16 rounding (3e-2)."""
    for failures in dist_pool.run(autocast_dtypes, ranks):
        assert failures == []
