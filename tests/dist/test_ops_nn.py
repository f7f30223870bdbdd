"""nn ops on global tensors (embedding, convolution, norms, losses, dropout, pooling).

Each case is compared with a single-process reference computed in the same
test on plain tensors (forward, and the gradient of every floating input; see
``_grad_cases``). The tests also assert the output SBP the rule should pick
(data-parallel batch splits and tensor-parallel weight splits) and that no op
falls back to broadcasting every input. Batch norm over a split batch must use
the statistics of the whole logical batch, running statistics included.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import sbpflow
from sbpflow import _rng
from sbpflow.sbp import Broadcast, Partial, Split
from sbpflow.testing import DistributedPool

from ._grad_cases import Case, randint, randn, run_cases
from ._ops_support import logical, make, mismatch, placement

S0, S1, S2, S3, B, P = Split(0), Split(1), Split(2), Split(3), Broadcast(), Partial("sum")
aten = torch.ops.aten


def _bn(training: bool):
    def fn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        # Fresh running stats per call, so the reference and the global run start alike.
        mean, var = torch.zeros(x.shape[1]), torch.ones(x.shape[1])
        if sbpflow.is_global(x):
            pl = x.placement
            mean, var = make(mean, pl, (B,) * pl.ndim), make(var, pl, (B,) * pl.ndim)
        return F.batch_norm(x, mean, var, w, b, training=training, momentum=0.3)

    return fn


def _bn_aten(variant: str):
    """The batch-norm ATen ops export and functionalization produce, with their running stats."""

    def fn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        mean, var = torch.zeros(x.shape[1]), torch.ones(x.shape[1])
        if sbpflow.is_global(x):
            mean, var = make(mean, x.placement, B), make(var, x.placement, B)
        if variant == "legit":
            out = aten._native_batch_norm_legit(x, w, b, mean, var, True, 0.3, 1e-5)[0]
        elif variant == "functional":
            out, _, _, mean, var = aten._native_batch_norm_legit_functional(
                x, w, b, mean, var, True, 0.3, 1e-5
            )
        elif variant == "no_stats":
            out = aten._native_batch_norm_legit.no_stats(x, w, b, True, 0.3, 1e-5)[0]
        else:
            out = aten._native_batch_norm_legit_no_training(
                x, w, b, mean + 0.5, var * 2, 0.3, 1e-5
            )[0]
        # Fold the (updated) running statistics into the result so they are compared too.
        return out + (mean * 3 + var).sum()

    return fn


def _dropout(p: float, native: bool = False):
    """Dropout; the plain reference draws by hand the mask the logical program's next random
    op draws: ``bernoulli_(1 - p)`` of the whole tensor on a generator seeded for the
    logical random state's current position (NOTE [logical random state])."""

    def fn(a: torch.Tensor) -> torch.Tensor:
        if sbpflow.is_global(a):
            return aten.native_dropout(a, p, True)[0] if native else F.dropout(a, p)
        gen = torch.Generator().manual_seed(_rng.stream_seed(*_rng.state()))
        return a * torch.empty(a.shape).bernoulli_(1 - p, generator=gen) / (1 - p)

    return fn


def _one_axis_cases() -> list[Case]:
    w, ids = randn(10, 8, seed=1), randint(10, 4, 3, seed=2)
    img, odd = randn(4, 3, 6, 6, seed=3), randn(5, 3, 4, 4, seed=4)
    cw, cb = randn(4, 3, 3, 3, seed=5), randn(4, seed=6)
    tw = randn(3, 4, 3, 3, seed=7)  # transposed conv weight: (in, out, kh, kw)
    ch_w, ch_b = randn(3, seed=8), randn(3, seed=9)
    x = randn(4, 5, 6, seed=10)
    lw, lb = randn(6, seed=11), randn(6, seed=12)
    logits, target = randn(7, 5, seed=13), randint(5, 7, seed=14)
    target[2] = -100  # ignored: the mean divides by the global count of the others
    class_w = torch.rand(5, generator=torch.Generator().manual_seed(15)) + 0.5
    seg, seg_t = randn(3, 4, 4, 5, seed=16), randint(4, 3, 4, 5, seed=17)

    def emb(weight: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return F.embedding(i, weight)

    def conv(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return F.conv2d(a, b, c, padding=1)

    return [
        Case("embedding ids split", emb, [w, ids], [B, S0], (S0,)),
        Case("embedding ids split dim 1", emb, [w, ids], [B, S1], (S1,)),
        Case("embedding hidden split", emb, [w, ids], [S1, B], (S2,)),
        Case("embedding vocab split", emb, [w, ids], [S0, B], (P,)),
        Case(
            "embedding vocab split padding",
            lambda a, i: F.embedding(i, a, padding_idx=7),
            [w, ids],
            [S0, B],
            (P,),
        ),
        # A plain 0-dim index is not global: the weight's layout alone decides.
        Case("embedding 0-dim id", lambda a: F.embedding(torch.tensor(3), a), [w], [B], (B,)),
        Case(
            "embedding 0-dim id, vocab split",
            lambda a: F.embedding(torch.tensor(7), a),
            [w],
            [S0],
            (P,),
        ),
        Case(
            "embedding 0-dim id, hidden split",
            lambda a: F.embedding(torch.tensor(7), a),
            [w],
            [S1],
            (S0,),
        ),
        Case("conv batch split", conv, [img, cw, cb], [S0, B, B], (S0,)),
        Case(
            "conv odd batch, no bias",
            lambda a, b: F.conv2d(a, b, stride=2),
            [odd, cw],
            [S0, B],
            (S0,),
        ),
        Case("conv out channels", conv, [img, cw, cb], [B, S0, S0], (S1,)),
        Case("conv in channels", conv, [img, cw, cb], [S1, S1, B], (P,)),
        Case(
            "conv transpose batch", lambda a, b: F.conv_transpose2d(a, b), [img, tw], [S0, B], (S0,)
        ),
        Case(
            "conv transpose out channels",
            lambda a, b: F.conv_transpose2d(a, b),
            [img, tw],
            [B, S1],
            (S1,),
        ),
        Case("batch norm batch split", _bn(True), [odd, ch_w, ch_b], [S0, B, B], (S0,)),
        Case("batch norm spatial split", _bn(True), [img, ch_w, ch_b], [S2, B, B], (S2,)),
        Case("batch norm channel split", _bn(True), [img, ch_w, ch_b], [S1, S0, S0], (S1,)),
        Case("batch norm eval", _bn(False), [odd, ch_w, ch_b], [S0, B, B], (S0,)),
        Case("batch norm 1d", _bn(True), [randn(7, 3, seed=18), ch_w, ch_b], [S0, B, B], (S0,)),
        Case("batch norm legit", _bn_aten("legit"), [odd, ch_w, ch_b], [S0, B, B], (S0,)),
        Case(
            "batch norm functional",
            _bn_aten("functional"),
            [odd, ch_w, ch_b],
            [S0, B, B],
            (S0,),
            grad=False,
        ),
        Case("batch norm no stats", _bn_aten("no_stats"), [odd, ch_w, ch_b], [S0, B, B], (S0,)),
        Case("batch norm no training", _bn_aten("eval"), [odd, ch_w, ch_b], [S0, B, B], (S0,)),
        Case(
            "layer norm",
            lambda a, b, c: F.layer_norm(a, (6,), b, c),
            [x, lw, lb],
            [S0, B, B],
            (S0,),
        ),
        Case("layer norm 2 dims", lambda a: F.layer_norm(a, (5, 6)), [x], [S0], (S0,)),
        Case(
            "layer norm dim 1",
            lambda a, b, c: F.layer_norm(a, (6,), b, c),
            [x, lw, lb],
            [S1, B, B],
            (S1,),
        ),
        Case("softmax", lambda a: F.softmax(a, -1), [x], [S0], (S0,)),
        Case("log_softmax", lambda a: F.log_softmax(a, 1), [x], [S2], (S2,)),
        Case(
            "cross entropy mean",
            lambda a, t: F.cross_entropy(a, t),
            [logits, target],
            [S0, S0],
            (P,),
        ),
        Case(
            "cross entropy weighted",
            lambda a, t: F.cross_entropy(a, t, weight=class_w),
            [logits, target],
            [S0, S0],
            (P,),
        ),
        Case(
            "cross entropy sum",
            lambda a, t: F.cross_entropy(a, t, reduction="sum"),
            [logits, target],
            [S0, S0],
            (P,),
        ),
        Case(
            "cross entropy none",
            lambda a, t: F.cross_entropy(a, t, reduction="none"),
            [logits, target],
            [S0, S0],
            (S0,),
        ),
        Case("cross entropy 2d", lambda a, t: F.cross_entropy(a, t), [seg, seg_t], [S0, S0], (P,)),
        Case(
            "cross entropy 2d spatial",
            lambda a, t: F.cross_entropy(a, t),
            [seg, seg_t],
            [S3, S2],
            (P,),
        ),
        Case("mse mean", lambda a, b: F.mse_loss(a, b), [logits, logits.flip(0)], [S0, S0], (P,)),
        Case(
            "mse sum", lambda a, b: F.mse_loss(a, b, reduction="sum"), [x, x * 0.5], [S1, S1], (P,)
        ),
        Case("mse none", lambda a, b: F.mse_loss(a, b, reduction="none"), [x, -x], [S2, S2], (S2,)),
        Case("dropout split", _dropout(0.3), [x], [S1], (S1,)),
        Case("dropout broadcast", _dropout(0.5), [x], [B], (B,)),
        Case("dropout partial", _dropout(0.5), [x], [P], (P,)),
        Case("native_dropout split", _dropout(0.3, native=True), [x], [S0], (S0,)),
        Case("max_pool2d", lambda a: F.max_pool2d(a, 2), [img], [S0], (S0,)),
        Case(
            "max_pool2d channels",
            lambda a: F.max_pool2d(a, 3, stride=2, padding=1),
            [odd],
            [S1],
            (S1,),
        ),
        Case("avg_pool2d", lambda a: F.avg_pool2d(a, 2), [img], [S0], (S0,)),
        Case("avg_pool2d partial", lambda a: F.avg_pool2d(a, 2), [img], [P], (P,)),
        Case("adaptive_avg_pool2d", lambda a: F.adaptive_avg_pool2d(a, (2, 3)), [odd], [S1], (S1,)),
        Case("activations", lambda a: F.gelu(a) + F.relu(a) * F.silu(a), [x], [S0], (S0,)),
    ]


def _mesh_cases() -> list[Case]:
    img, cw, cb = randn(4, 3, 6, 6, seed=20), randn(4, 3, 3, 3, seed=21), randn(4, seed=22)
    ch_w, ch_b = randn(3, seed=23), randn(3, seed=24)
    w, ids = randn(10, 8, seed=25), randint(10, 4, 3, seed=26)
    logits, target = randn(7, 5, seed=27), randint(5, 7, seed=28)
    x, lw = randn(4, 5, 6, seed=29), randn(6, seed=30)
    BB = (B, B)
    return [
        Case(
            "conv batch x out channels",
            lambda a, b, c: F.conv2d(a, b, c),
            [img, cw, cb],
            [(S0, B), (B, S0), (B, S0)],
            (S0, S1),
        ),
        Case(
            "batch norm batch x spatial", _bn(True), [img, ch_w, ch_b], [(S0, S2), BB, BB], (S0, S2)
        ),
        Case(
            "batch norm nested batch",
            _bn(True),
            [randn(7, 3, 2, 2, seed=31), ch_w, ch_b],
            [(S0, S0), BB, BB],
            (S0, S0),
        ),
        Case(
            "embedding vocab x hidden",
            lambda a, i: F.embedding(i, a),
            [w, ids],
            [(S0, S1), BB],
            (P, S2),
        ),
        Case(
            "cross entropy nested batch",
            lambda a, t: F.cross_entropy(a, t),
            [logits, target],
            [(S0, S0), (S0, S0)],
            (P, P),
        ),
        Case(
            "layer norm", lambda a, b: F.layer_norm(a, (6,), b), [x, lw], [(S0, S1), BB], (S0, S1)
        ),
        Case("dropout", _dropout(0.25), [x], [(S0, S2)], (S0, S2)),
    ]


def _batch_norm_module_job() -> list[str]:
    """A BatchNorm2d module over an S(0) batch: outputs, parameter gradients and the
    running statistics after two training steps equal one process's on the whole batch."""
    pl = placement([0, 1])
    torch.manual_seed(0)
    ref = torch.nn.BatchNorm2d(3, momentum=0.2)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.uniform_(-0.5, 0.5)
    glob = copy.deepcopy(ref).to_global(pl, B)
    problems = []
    for step in range(2):
        x = randn(5, 3, 4, 4, seed=40 + step) * (step + 1) + step
        want = ref(x)
        got = glob(make(x, pl, S0))
        gout = randn(*want.shape, seed=50 + step)
        want.backward(gout)
        got.backward(make(gout, pl, B))
        problems.append(mismatch(logical(got), want.detach()))
        if tuple(got.sbp) != (S0,):
            problems.append(f"step {step}: output SBP {got.sbp}, expected S(0)")
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        problems.append(mismatch(logical(getattr(glob, name)), getattr(ref, name)))
        problems.append(
            None if tuple(getattr(glob, name).sbp) == (B,) else f"{name} is not broadcast"
        )
    for name in ("weight", "bias"):
        problems.append(mismatch(logical(getattr(glob, name).grad), getattr(ref, name).grad))
    glob.eval()
    ref.eval()
    x = randn(5, 3, 4, 4, seed=60)
    problems.append(mismatch(logical(glob(make(x, pl, S0))), ref(x).detach()))
    return [p for p in problems if p]


# -- jobs (module level, so the ranks can import them) ---------------------------------


def _one_axis_job() -> list[str]:
    return run_cases(_one_axis_cases(), placement([0, 1]))


def _mesh_job() -> list[str]:
    return run_cases(_mesh_cases(), placement([[0, 1], [2, 3]]))


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_nn_ops_on_two_ranks(dist_pool: DistributedPool) -> None:
    """Batch (S(0)) and tensor-parallel splits match the reference, forward and backward."""
    problems = dist_pool.run(_one_axis_job)
    assert problems[0] == [], "\n".join(problems[0])
    assert problems[1] == problems[0]


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_batch_norm_uses_whole_batch_statistics(dist_pool: DistributedPool) -> None:
    """Running statistics and outputs equal those of one process seeing the whole batch."""
    problems = dist_pool.run(_batch_norm_module_job)
    assert problems == [[], []], problems


@pytest.mark.parametrize("dist_pool", [4], indirect=True)
def test_nn_ops_on_2x2_mesh(dist_pool: DistributedPool) -> None:
    """Splits on both mesh axes (batch x channels, vocab x hidden, nested batch) match."""
    problems = dist_pool.run(_mesh_job)
    assert problems[0] == [], "\n".join(problems[0])
    assert all(p == problems[0] for p in problems)
