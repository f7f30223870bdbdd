"""``fully_shard`` trains like single-process PyTorch, holds 1/N of the state, and says no clearly.

Every run trains a plain copy of the model in the same process on the whole batch (the
single-process reference) and compares every parameter with it (the logical value of the
sharded one) after each run: within 1e-5 for SGD with momentum and for AdamW (its first
steps move a parameter by about ``lr * sign(grad)``, so a gradient off by rounding stays
within rounding). Models:

- a residual MLP stack (an input Linear, 3 blocks of Linear-ReLU-Linear, an output
  Linear), ``fully_shard`` on each block and then the root, on 2 and 4 ranks, one batch
  or 4 micro-batches per step (``no_sync`` on the first 3: one reduce_scatter per module,
  on the last micro-batch only);
- Hugging Face Llama (tiny random config), ``fully_shard`` on each decoder layer and the
  root, on 2 and 4 ranks;
- FSDP x TP on a 2x2 mesh: axis 0 shards, axis 1 holds column- then row-parallel Linears;
- a 2-stage eager pipeline (stage 0 on ranks 0-1, stage 1 on ranks 2-3), each stage fully
  sharded on its own ranks;
- the MLP stack with each block under ``torch.compile`` (aot_eager), on 2 ranks.

The collectives each step ran are counted from the boxing trace (one all_gather per module
in forward, one per block again in backward, one reduce_scatter per module). Memory is
measured from the tensors each rank holds: between steps its pieces of the parameters,
gradients and AdamW state are 1/N of the whole (+ one row of rounding) and nothing gathered
is alive; during forward, at most two blocks (besides the root) hold gathered buffers; when
a reduce_scatter starts, the unsharded gradients are freed.
A checkpoint saved on 4 ranks loads on 2 as FSDP and as DP, and in a plain process.
"""

from __future__ import annotations

import contextlib
import copy
import os
import pickle
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sbpflow
from sbpflow.comm import collectives
from sbpflow.nn.parallel import fully_shard
from sbpflow.nn.parallel.fsdp import _state_of
from sbpflow.sbp import Broadcast, Split
from sbpflow.testing import get_pool

from ._plain_process import run_in_plain_process

S0, S1, B = Split(0), Split(1), Broadcast()
_STEPS = 3
_TOL = 1e-5
_MAX_NORM = 0.5  # clip_grad_norm_ every step (the gradients' norms are about 1)


class Block(nn.Module):
    """``x + fc2(relu(fc1(x)))``: fc1 column-parallel and fc2 row-parallel under TP."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.relu(self.fc1(x)))


class Net(nn.Module):
    """Input Linear, residual blocks, output Linear (the root's own parameters)."""

    def __init__(self, num_blocks: int = 3, width: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(5, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(num_blocks))
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
}


def _micro_batches(step: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + step)
    return [
        (torch.randn(8, 5, generator=gen), torch.randn(8, 3, generator=gen)) for _ in range(count)
    ]


def _logical(t: torch.Tensor) -> torch.Tensor:
    """The logical value of a global tensor on every rank (a collective)."""
    return t.to_global(sbp=(B,) * len(t.sbp), check_meta=False).to_local().detach()


def _errors(model: nn.Module, reference: nn.Module) -> dict[str, float]:
    """Max abs difference per parameter beyond the tolerance (logical values)."""
    out = {}
    want = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        value, ref = _logical(p).double(), want[name].detach().double()
        if not torch.allclose(value, ref, atol=_TOL, rtol=_TOL):
            out[name] = (value - ref).abs().max().item()
    assert set(want) == {n for n, _ in model.named_parameters()}
    return out


def _batch(t: torch.Tensor, placement: sbpflow.Placement, sbp: Any) -> sbpflow.GlobalTensor:
    return t.to_global(placement, (B,) * placement.ndim).to_global(sbp=sbp)


def _shard_blocks(model: Net, placement: sbpflow.Placement | None, **kwargs: Any) -> Net:
    for block in model.blocks:
        fully_shard(block, placement, **kwargs)
    return fully_shard(model, placement, **kwargs)


def _train_mlp(
    placement: sbpflow.Placement, optimizer: str, num_micro: int, batch_sbp: Any
) -> dict[str, Any]:
    """Train a fully sharded copy and the plain reference side by side."""
    torch.manual_seed(0)
    reference = Net()
    model = _shard_blocks(copy.deepcopy(reference), placement)
    opt_ref = _OPTIMIZERS[optimizer](reference.parameters())
    opt = _OPTIMIZERS[optimizer](model.parameters())
    counts, grad_sbps, norms = [], set(), []
    for step in range(_STEPS):
        batches = _micro_batches(step, num_micro)
        opt_ref.zero_grad()
        for x, y in batches:
            F.mse_loss(reference(x), y).backward()
        norms.append(nn.utils.clip_grad_norm_(reference.parameters(), _MAX_NORM).item())
        opt_ref.step()
        opt.zero_grad()
        for i, (x, y) in enumerate(batches):
            last = i == num_micro - 1
            gx, gy = _batch(x, placement, batch_sbp), _batch(y, placement, batch_sbp)
            with contextlib.nullcontext() if last else model.no_sync(), sbpflow.boxing.trace() as t:
                F.mse_loss(model(gx), gy).backward()
            c = t.collectives()
            counts.append((c.get("all_gather", 0), c.get("reduce_scatter", 0)))
        grad_sbps |= {str(p.grad.sbp) for p in model.parameters()}
        norms.append(nn.utils.clip_grad_norm_(model.parameters(), _MAX_NORM).item())
        opt.step()
    return {
        "errors": _errors(model, reference),
        "counts": counts,
        "norms": norms,  # reference, sharded, per step
        "grad_sbps": sorted(grad_sbps),
        "param_sbps": sorted({str(p.sbp) for p in model.parameters()}),
    }


def mlp_job(optimizer: str, num_micro: int) -> dict[str, Any]:
    world = sbpflow.placement("cpu", list(range(sbpflow.env.get_world_size())))
    return _train_mlp(world, optimizer, num_micro, S0)


# -- Hugging Face Llama --------------------------------------------------------------------


def _llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attention_dropout=0.0,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config)


def llama_job() -> dict[str, Any]:
    """Each decoder layer, then the root; AdamW; the batch split on dim 0."""
    placement = sbpflow.placement("cpu", list(range(sbpflow.env.get_world_size())))
    torch.manual_seed(0)
    reference = _llama().train()
    model = copy.deepcopy(reference)
    for layer in model.model.layers:
        fully_shard(layer, placement)
    fully_shard(model, placement)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    losses, fallbacks = [], set()
    for _ in range(_STEPS):
        ids = torch.randint(0, 64, (8, 7), generator=gen)
        want = reference(input_ids=ids, labels=ids).loss
        want.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        gids = _batch(ids, placement, S0)
        with sbpflow.boxing.trace() as t:
            got = model(input_ids=gids, labels=gids).loss
            got.backward()
            opt.step()
            opt.zero_grad()
        fallbacks |= set(t.fallbacks)
        losses.append((got.item(), want.item()))
    return {"errors": _errors(model, reference), "losses": losses, "fallbacks": sorted(fallbacks)}


# -- FSDP x TP on a 2x2 mesh ---------------------------------------------------------------


def _megatron(name: str, t: torch.Tensor) -> Any:
    """fc1 column-parallel, fc2's weight row-parallel on axis 1; the rest broadcast."""
    if ".fc1." in name:
        return (B, S0)
    return (B, S1) if name.endswith("fc2.weight") else (B, B)


def mesh_job(optimizer: str) -> dict[str, Any]:
    """Axis 0 shards (data), axis 1 splits fc1 by columns and fc2 by rows (tensor)."""
    mesh = sbpflow.placement("cpu", [[0, 1], [2, 3]])
    torch.manual_seed(0)
    reference = Net()
    model = copy.deepcopy(reference).to_global(mesh, (B, B)).to_global(mesh, _megatron)
    _shard_blocks(model, mesh)
    opt_ref = _OPTIMIZERS[optimizer](reference.parameters())
    opt = _OPTIMIZERS[optimizer](model.parameters())
    for step in range(_STEPS):
        ((x, y),) = _micro_batches(step, 1)
        opt_ref.zero_grad()
        F.mse_loss(reference(x), y).backward()
        opt_ref.step()
        opt.zero_grad()
        F.mse_loss(model(_batch(x, mesh, (S0, B))), _batch(y, mesh, (S0, B))).backward()
        opt.step()
    return {
        "errors": _errors(model, reference),
        "sbps": {n: (str(p.sbp), str(p.grad.sbp)) for n, p in model.named_parameters()},
    }


# -- a 2-stage pipeline, each stage fully sharded on its own ranks -------------------------


def pipeline_job() -> dict[str, Any]:
    """Stage 0 (input Linear and a block) on ranks 0-1, stage 1 (a block and the output
    Linear) on ranks 2-3; two micro-batches accumulated per step; SGD-momentum."""
    rank = sbpflow.env.get_rank()
    placements = [sbpflow.placement("cpu", [0, 1]), sbpflow.placement("cpu", [2, 3])]
    torch.manual_seed(0)
    reference = nn.ModuleList(
        [nn.Sequential(nn.Linear(5, 6), Block(6)), nn.Sequential(Block(6), nn.Linear(6, 3))]
    )
    stages = copy.deepcopy(reference)
    for stage, pl in zip(stages, placements, strict=True):
        stage.to_global(pl, B)
        fully_shard(stage, pl)
    opt_ref = _OPTIMIZERS["sgd"](reference.parameters())
    opt = _OPTIMIZERS["sgd"](stages.parameters())
    counts = []
    for step in range(_STEPS):
        batches = _micro_batches(step, 2)
        opt_ref.zero_grad()
        for x, y in batches:
            (F.mse_loss(reference[1](reference[0](x)), y) / 2).backward()
        opt_ref.step()
        opt.zero_grad()
        with sbpflow.boxing.trace() as t:
            for x, y in batches:
                h = stages[0](_batch(x, placements[0], S0))
                h = stages[1](h.to_global(placements[1], S0))
                (F.mse_loss(h, _batch(y, placements[1], S0)) / 2).backward()
        c = t.collectives()
        counts.append((c.get("all_gather", 0), c.get("reduce_scatter", 0)))
        opt.step()
    errors = {}
    for i, (stage, ref) in enumerate(zip(stages, reference, strict=True)):
        mine = {n: p for n, p in stage.named_parameters()}
        for name, want in ref.named_parameters():
            got = mine[name]
            if rank in placements[i]:
                value = _logical(got)
                if not torch.allclose(value, want.detach(), atol=_TOL, rtol=_TOL):
                    errors[f"{i}.{name}"] = (value - want.detach()).abs().max().item()
            elif got.to_local().numel() != 0:
                errors[f"{i}.{name} held outside its stage"] = float(got.to_local().numel())
    return {"errors": errors, "counts": counts}


# -- compiled blocks -------------------------------------------------------------------------


def compiled_job() -> dict[str, Any]:
    """Each block compiled (aot_eager), fully sharded; SGD-momentum, 2 steps."""
    torch._dynamo.reset()
    world = sbpflow.placement("cpu", list(range(sbpflow.env.get_world_size())))
    torch.manual_seed(0)
    reference = Net(num_blocks=2)
    model = _shard_blocks(copy.deepcopy(reference), world)
    for block in model.blocks:
        block.compile(backend="aot_eager")
    opt_ref = _OPTIMIZERS["sgd"](reference.parameters())
    opt = _OPTIMIZERS["sgd"](model.parameters())
    for step in range(2):
        ((x, y),) = _micro_batches(step, 1)
        opt_ref.zero_grad()
        F.mse_loss(reference(x), y).backward()
        opt_ref.step()
        opt.zero_grad()
        F.mse_loss(model(_batch(x, world, S0)), _batch(y, world, S0)).backward()
        opt.step()
    errors = _errors(model, reference)
    torch._dynamo.reset()
    return {"errors": errors}


# -- memory ----------------------------------------------------------------------------------


def memory_job() -> dict[str, Any]:
    """Local elements this rank holds between steps, and live gathered blocks during forward."""
    world = sbpflow.env.get_world_size()
    placement = sbpflow.placement("cpu", list(range(world)))
    torch.manual_seed(0)
    model = _shard_blocks(Net(num_blocks=5, width=8), placement)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    groups = [_state_of(b).group for b in model.blocks]
    root = _state_of(model).group
    live_blocks: list[int] = []
    grads: list[weakref.ref[torch.Tensor]] = []  # the blocks' unsharded gradients
    at_reduce: list[tuple[int, int]] = []  # as a reduce_scatter starts: (grads alive, gathered)

    def gradient_refs(module: nn.Module, args: Any) -> None:  # after fully_shard's pre-hook
        for p in module.parameters():  # the gathered parameters, during the forward
            p.register_hook(lambda g: grads.append(weakref.ref(g)))  # type: ignore[misc]

    def reduce_scatter_async(*args: Any, **kwargs: Any) -> Any:
        alive = sum(ref() is not None for ref in grads)
        at_reduce.append((alive, sum(g.unsharded_bytes > 0 for g in groups)))
        return real_reduce_scatter(*args, **kwargs)

    real_reduce_scatter = collectives.reduce_scatter_async
    for block in model.blocks:
        block.register_forward_hook(  # before fully_shard's own hook frees the block
            lambda *_: live_blocks.append(sum(g.unsharded_bytes > 0 for g in groups)),
            prepend=True,
        )
        block.register_forward_pre_hook(gradient_refs)
    between = []
    for step in range(_STEPS):
        ((x, y),) = _micro_batches(step, 1)
        opt.zero_grad(set_to_none=False)
        loss = F.mse_loss(model(_batch(x, placement, S0)), _batch(y, placement, S0))
        with mock.patch.object(collectives, "reduce_scatter_async", reduce_scatter_async):
            loss.backward()
        opt.step()
        held = {"param": 0, "grad": 0, "exp_avg": 0, "exp_avg_sq": 0}
        for p in model.parameters():
            held["param"] += p.to_local().numel()
            held["grad"] += p.grad.to_local().numel()
            state = opt.state[p]
            held["exp_avg"] += state["exp_avg"].to_local().numel()
            held["exp_avg_sq"] += state["exp_avg_sq"].to_local().numel()
        gathered = sum(g.unsharded_bytes for g in [*groups, root])
        states = {s.value for s in [model.sharded_state, *(b.sharded_state for b in model.blocks)]}
        between.append({"held": held, "gathered_bytes": gathered, "states": sorted(states)})
    total = sum(p.numel() for p in model.parameters())
    # every parameter's piece is at most one row (of its dim 0) over an even share
    rounding = sum(p.numel() // p.shape[0] for p in model.parameters())
    return {
        "between": between,
        "total": total,
        "rounding": rounding,
        "live_blocks": live_blocks,
        "at_reduce": at_reduce,
    }


# -- bad input -------------------------------------------------------------------------------


def bad_input_job(case: str) -> None:
    """Raise the ValueError of one mistake (every rank makes it)."""
    world = sbpflow.placement("cpu", list(range(sbpflow.env.get_world_size())))
    torch.manual_seed(0)
    model = Net(num_blocks=1)
    if case == "already global with another layout":
        model.blocks[0].to_global(world, B)
        model.blocks[0].fc1.weight = nn.Parameter(model.blocks[0].fc1.weight.to_global(sbp=S1))
        fully_shard(model.blocks[0])
    elif case == "twice":
        fully_shard(model.blocks[0])
        fully_shard(model.blocks[0])
    elif case == "placement without this rank":
        fully_shard(model, sbpflow.placement("cpu", [0]))
    elif case == "ranks that differ":
        width = 6 if sbpflow.env.get_rank() == 0 else 7
        fully_shard(Net(width=width))


# -- checkpoints -----------------------------------------------------------------------------


def _ckpt_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Logical values of the parameters and the optimizer state, by parameter name."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for name, p in model.named_parameters():
        out[name] = _logical(p) if isinstance(p, sbpflow.GlobalTensor) else p.detach()
    for p, state in opt.state.items():
        for key, value in state.items():
            if isinstance(value, sbpflow.GlobalTensor):
                value = _logical(value)
            out[f"{names[id(p)]}.{key}"] = value.detach().clone()
    return out


def _trained_adamw(model: nn.Module, placement: sbpflow.Placement | None) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(2):
        ((x, y),) = _micro_batches(step, 1)
        if placement is not None:
            x, y = _batch(x, placement, S0), _batch(y, placement, S0)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return opt


def save_job(path: str) -> dict[str, torch.Tensor]:
    world = sbpflow.placement("cpu", list(range(sbpflow.env.get_world_size())))
    torch.manual_seed(0)
    model = _shard_blocks(Net(), world)
    opt = _trained_adamw(model, world)
    sbpflow.save({"model": model, "optim": opt}, path)
    return _ckpt_state(model, opt)


def _fresh(layout: str, placement: sbpflow.Placement | None) -> tuple[nn.Module, Any]:
    """Another model (other initial values) with an optimizer that has stepped once."""
    torch.manual_seed(1)
    model: nn.Module = Net()
    if layout == "fsdp":
        _shard_blocks(model, placement)
    elif layout == "dp":
        assert placement is not None
        model = model.to_global(placement, B)
    return model, _trained_adamw(model, None if layout == "plain" else placement)


def load_job(path: str) -> dict[str, dict[str, torch.Tensor]]:
    world = sbpflow.placement("cpu", list(range(sbpflow.env.get_world_size())))
    out = {}
    for layout in ("fsdp", "dp"):
        model, opt = _fresh(layout, world)
        sbpflow.load(path, {"model": model, "optim": opt})
        out[layout] = _ckpt_state(model, opt)
    return out


def load_in_plain_process(path: str, out: str) -> None:
    """Run in a plain process (a world of one); pickles the loaded values to ``out``."""
    assert "RANK" not in os.environ
    model, opt = _fresh("plain", None)
    sbpflow.load(path, {"model": model, "optim": opt})
    with open(out, "wb") as f:
        pickle.dump(_ckpt_state(model, opt), f)


# -- the tests -------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(("optimizer", "num_micro"), [("sgd", 1), ("adamw", 4)])
def test_mlp_stack_matches_single_process(world_size: int, optimizer: str, num_micro: int) -> None:
    """Each block then the root, SGD-momentum with one batch per step, AdamW with 4
    micro-batches per step (no_sync on the first 3), gradients clipped to norm 0.5: equal
    single-process training on the whole batch (the global norm equal too); parameters and
    gradients S(0); per backward 4 all_gathers in forward (3 blocks, root), 3 more in backward
    (the blocks freed after forward; the root stays gathered), and 4 reduce_scatters on the
    last micro-batch only."""
    for rank, got in enumerate(get_pool(world_size).run(mlp_job, optimizer, num_micro)):
        assert not got["errors"], f"rank {rank}: parameters differ from the reference: {got}"
        assert got["param_sbps"] == got["grad_sbps"] == ["(S(0),)"], (rank, got)
        ref_norms, norms = got["norms"][::2], got["norms"][1::2]
        assert norms == pytest.approx(ref_norms, rel=_TOL), (rank, got["norms"])
        per_step = [(7, 0)] * (num_micro - 1) + [(7, 4)]
        assert got["counts"] == per_step * _STEPS, (rank, got["counts"])


@pytest.mark.parametrize("world_size", [2, 4])
def test_hugging_face_llama_matches_single_process(world_size: int) -> None:
    """Llama (tiny random config) with each decoder layer and the root fully sharded, AdamW:
    losses and parameters equal single-process training; no op falls back."""
    for rank, got in enumerate(get_pool(world_size).run(llama_job)):
        assert not got["errors"], f"rank {rank}: parameters differ: {got['errors']}"
        for loss, want in got["losses"]:
            assert loss == pytest.approx(want, abs=_TOL, rel=_TOL), (rank, got["losses"])
        assert not got["fallbacks"], (rank, got["fallbacks"])


@pytest.mark.parametrize("optimizer", sorted(_OPTIMIZERS))
def test_fully_sharded_and_tensor_parallel_on_2x2_mesh(optimizer: str) -> None:
    """Axis 0 shards, axis 1 is tensor parallel: equal single-process training; weights shard
    the dim the tensor axis leaves whole; the column-parallel bias, split on its only dim by
    the tensor axis, stays broadcast on the data axis (trained data parallel)."""
    for rank, got in enumerate(get_pool(4).run(mesh_job, optimizer)):
        assert not got["errors"], f"rank {rank}: {got['errors']}"
        sbps = got["sbps"]
        assert sbps["blocks.0.fc1.weight"] == ("(S(1), S(0))",) * 2, sbps
        assert sbps["blocks.0.fc1.bias"] == ("(B, S(0))",) * 2, sbps
        assert sbps["blocks.0.fc2.weight"] == ("(S(0), S(1))",) * 2, sbps
        assert sbps["blocks.0.fc2.bias"] == ("(S(0), B)",) * 2, sbps


def test_two_stage_pipeline_with_fully_sharded_stages() -> None:
    """Each stage fully sharded on its own 2 ranks, 2 micro-batches per step: equal
    single-process training; a rank holds nothing of the other stage and moves nothing for
    it: per micro-batch, one all_gather of its own stage (the root: kept from forward to
    backward) and one reduce_scatter."""
    for rank, got in enumerate(get_pool(4).run(pipeline_job)):
        assert not got["errors"], f"rank {rank}: {got['errors']}"
        # its stage (the root of its fully sharded modules): one gather per micro-batch's
        # forward, kept for the backward, and one reduce_scatter per micro-batch
        assert got["counts"] == [(2, 2)] * _STEPS, (rank, got["counts"])


def test_compiled_blocks_match_single_process() -> None:
    """Blocks under torch.compile (aot_eager), gathered and freed between graphs: equal
    single-process training."""
    for rank, got in enumerate(get_pool(2).run(compiled_job)):
        assert not got["errors"], f"rank {rank}: {got['errors']}"


@pytest.mark.parametrize("world_size", [2, 4])
def test_memory_between_steps_and_during_forward(world_size: int) -> None:
    """Between steps: this rank's pieces of parameters, gradients and both AdamW moments are
    each at most 1/N of the model (+ one row per parameter of rounding), and no gathered
    buffer is alive. During forward: when a block's forward ends, exactly two of the 5
    blocks hold gathered buffers (itself and the next one, prefetched), never more. During
    backward: when a module's reduce_scatter starts, no unsharded gradient of a block is
    alive and at most one block (the one prefetched) holds gathered buffers."""
    for rank, got in enumerate(get_pool(world_size).run(memory_job)):
        bound = got["total"] / world_size + got["rounding"]
        for step in got["between"]:
            assert all(n <= bound for n in step["held"].values()), (rank, bound, step)
            assert step["gathered_bytes"] == 0 and step["states"] == ["sharded"], (rank, step)
        assert max(got["live_blocks"]) == 2, (rank, got["live_blocks"])
        assert len(got["at_reduce"]) == 6 * _STEPS, (rank, got["at_reduce"])  # blocks, root
        assert all(alive == 0 and gathered <= 1 for alive, gathered in got["at_reduce"]), (
            rank,
            got["at_reduce"],
        )


_BAD_INPUT = {
    "already global with another layout": r"already global with layout S\(1\)",
    "twice": "already called on this Block;",
    "placement without this rank": r"does not hold ranks \[1\]",
    "ranks that differ": "ranks passed different modules",
}


@pytest.mark.parametrize("case", sorted(_BAD_INPUT))
def test_bad_input_raises_value_error_on_every_rank(case: str) -> None:
    """Each mistake raises the same clear ValueError on every rank, within seconds."""
    outcomes = get_pool(2).run_expect_errors(bad_input_job, case, timeout=60.0)
    outcomes.assert_all_raised(ValueError, match=_BAD_INPUT[case], within=60.0)


def test_checkpoint_saved_on_4_ranks_loads_on_2_ranks_and_in_a_plain_process(
    tmp_path: Path,
) -> None:
    """A fully sharded model and its AdamW state saved on 4 ranks load on 2 ranks into a
    fully sharded and a data-parallel model, and in one plain process, with equal values."""
    path = str(tmp_path / "ckpt")
    saved = get_pool(4).run(save_job, path)[0]
    assert any(k.endswith("exp_avg_sq") for k in saved)
    for got in get_pool(2).run(load_job, path):
        for layout in ("fsdp", "dp"):
            assert got[layout].keys() == saved.keys()
            for key, want in saved.items():
                assert torch.equal(got[layout][key], want), (layout, key)
    out = str(tmp_path / "plain.pkl")
    run_in_plain_process("tests.dist.test_fsdp", "load_in_plain_process", path, out)
    with open(out, "rb") as f:
        plain = pickle.load(f)
    assert plain.keys() == saved.keys()
    for key, want in saved.items():
        assert torch.equal(plain[key], want), key
