"""Whole Hugging Face models under ``torch.compile(model)``, written as users write it.

GPT-2, Llama and BERT (tiny random configs built in code: 2 layers, width 64, 16
tokens) keep the library's defaults: the KV cache on, the logits and the loss
returned, an attention mask with padded rows. The model is converted to global
tensors, compiled whole with Inductor, and trained 3 steps with
``model(**batch).loss.backward()``: the backward reaches the loss only, so every
other output (logits, cache) is one whose gradient nobody gives (NOTE [outputs the
backward does not reach] in sbpflow/_compiled_outputs.py).

Each job trains, on 2 ranks, against one plain process on the whole batch (the
single-process reference, in the same job): losses and parameters must agree. It
also compiles a plain copy with Dynamo alone (no Inductor: graph breaks are
Dynamo's) and asserts the global model breaks its graph exactly as often, and that
nothing compiles again after the second step.

Layouts, all under Inductor: data parallel (parameters broadcast, batch ``S(0)``) for
the three families; Llama tensor parallel with the Megatron layout (q/k/v/gate/up
``S(0)``, o/down ``S(1)``, the batch broadcast) on 2 ranks, and on a 2x2 mesh with data
parallelism on the first axis (one layer there: four ranks compile on two cores); Llama
``fully_shard`` (each decoder layer, then the root), compiled whole or per layer.

GPT-2 with its default dropout is compared with eager sbpflow instead: its masks follow
sbpflow's random state, not torch's, also inside the compiled graph.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import sbpflow
from sbpflow.nn.parallel import fully_shard
from sbpflow.sbp import Broadcast, Split
from sbpflow.testing import get_pool

from .test_tensor_parallel import _megatron_llama
from .test_transformers_models import _OPTIMIZERS  # SGD for BERT and GPT-2, as there

transformers = pytest.importorskip(
    "transformers",
    reason="needs Hugging Face transformers (pip install -e '.[test]' installs it)",
)

S0, S1, B = Split(0), Split(1), Broadcast()
_STEPS = 3
_TOL = 1e-5
_VOCAB, _WIDTH, _SEQ, _BATCH = 64, 64, 16, 4
_COMPILE_TIMEOUT_S = 600.0


# -- models: tiny sizes, the library's defaults otherwise (dropout off to compare) -----------


def _gpt2(layers: int = 2, dropout: float = 0.0) -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=_VOCAB,
        n_positions=32,
        n_embd=_WIDTH,
        n_layer=layers,
        n_head=4,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=_VOCAB - 1,
        eos_token_id=_VOCAB - 1,
    )
    return transformers.GPT2LMHeadModel(config)


def _llama(layers: int = 2) -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=_VOCAB,
        hidden_size=_WIDTH,
        intermediate_size=2 * _WIDTH,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(config)


def _bert(layers: int = 2) -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=_VOCAB,
        hidden_size=_WIDTH,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=2 * _WIDTH,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForMaskedLM(config)


_FAMILIES: dict[str, Callable[[int], nn.Module]] = {"gpt2": _gpt2, "llama": _llama, "bert": _bert}


def _batch(family: str) -> dict[str, torch.Tensor]:
    """The whole batch: ids, labels and an attention mask with padded rows on both ranks."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, _VOCAB, (_BATCH, _SEQ), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0
    mask[2, 6:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    if family == "bert":  # a masked LM is scored on some positions only
        scored = torch.rand(_BATCH, _SEQ, generator=gen) < 0.3
        scored[:, 0] = True
        labels = labels.masked_fill(~scored, -100)
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


# -- counting compiles -------------------------------------------------------------------------


class _Counting:
    """A torch.compile backend that counts the graphs it is given (first compiles and
    recompiles alike) and hands them to ``backend``."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        from torch._dynamo.backends.registry import lookup_backend

        self.graphs += 1
        return lookup_backend(self.backend)(gm, example_inputs)


def _graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def _compile(model: nn.Module, counting: _Counting, per_block: bool) -> nn.Module:
    """The model compiled whole, or (``per_block``) each decoder layer compiled in place."""
    if not per_block:
        return torch.compile(model, backend=counting)
    for layer in model.model.layers:
        layer.compile(backend=counting)
    return model


def _plain_compile_counts(
    family: str, layers: int, layout: str, per_block: bool, batch: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """Plain torch on the same model and batch (for ``fully_shard``: torch's own, applied
    the same way), compiled as the global one by Dynamo alone: its graphs after each step
    and its graph breaks."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = _FAMILIES[family](layers).train()
    if layout == "fully_shard":
        mesh = init_device_mesh("cpu", (sbpflow.env.get_world_size(),))
        for layer in model.model.layers:
            torch_fully_shard(layer, mesh=mesh)
        torch_fully_shard(model, mesh=mesh)
    counting = _Counting("eager")
    compiled = _compile(model, counting, per_block)
    graphs = []
    for _ in range(_STEPS):
        compiled(**batch).loss.backward()
        graphs.append(counting.graphs)
    result = {"graphs": graphs, "graph_breaks": _graph_breaks()}
    torch._dynamo.reset()
    return result


# -- one training run ----------------------------------------------------------------------------


def _shard(t: torch.Tensor, placement: sbpflow.Placement) -> torch.Tensor:
    """This rank's rows of the whole batch, given as its ``S(0)`` piece."""
    index = placement.flat_ranks.index(sbpflow.env.get_rank())
    return torch.tensor_split(t, placement.num_ranks)[index].contiguous().to_global(placement, S0)


def _logical(t: torch.Tensor) -> torch.Tensor:
    """The logical value of a global tensor, on every rank (a collective)."""
    return t.to_global(sbp=(B,) * len(t.sbp), check_meta=False).to_local().detach()


def _make_global(layout: str, model: nn.Module, placement: sbpflow.Placement) -> nn.Module:
    full = (B,) * placement.ndim
    model = model.to_global(placement, full)
    if layout == "tensor parallel":  # on a 2-D mesh: data parallel on axis 0, Megatron on 1

        def megatron(name: str, t: torch.Tensor) -> Any:
            return (*full[1:], _megatron_llama(name, t))

        model = model.to_global(placement, megatron)
    elif layout == "fully_shard":
        for layer in model.model.layers:
            fully_shard(layer, placement)
        fully_shard(model, placement)
    return model


def _global_batch(
    layout: str, batch: dict[str, torch.Tensor], placement: sbpflow.Placement
) -> dict[str, torch.Tensor]:
    """The batch as the layout takes it: tensor parallel broadcasts it on the tensor axis
    (and splits it on the data axis of a 2-D mesh); the others split it."""
    if layout != "tensor parallel":
        return {n: _shard(t, placement) for n, t in batch.items()}
    if placement.ndim == 1:
        return {n: t.to_global(placement, B) for n, t in batch.items()}
    return {n: t.to_global(placement, (B, B)).to_global(sbp=(S0, B)) for n, t in batch.items()}


def train_job(
    family: str, layers: int, layout: str, backend: str, mesh: list[Any], per_block: bool
) -> dict[str, Any]:
    """Worker: ``family`` with ``layers`` layers laid out as ``layout`` on ``mesh``, compiled
    with ``backend`` whole (or each decoder layer, ``per_block``), 3 steps against one plain
    process on the whole batch."""
    placement = sbpflow.placement("cpu", mesh)
    batch = _batch(family)
    plain = _plain_compile_counts(family, layers, layout, per_block, batch)

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    reference = _FAMILIES[family](layers).train()
    model = _make_global(layout, copy.deepcopy(reference), placement)
    g_batch = _global_batch(layout, batch, placement)
    counting = _Counting(backend)
    compiled = _compile(model, counting, per_block)
    opt_ref = _OPTIMIZERS[family](reference.parameters())
    opt = _OPTIMIZERS[family](model.parameters())
    losses, graphs = [], []
    for _ in range(_STEPS):
        want = reference(**batch).loss
        want.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        got = compiled(**g_batch).loss
        got.backward()
        opt.step()
        opt.zero_grad()
        graphs.append(counting.graphs)
        losses.append((got.item(), want.item()))
    errors = {}
    for (name, got_p), want_p in zip(model.named_parameters(), reference.parameters(), strict=True):
        error = (_logical(got_p).double() - want_p.detach().double()).abs().max().item()
        if error > _TOL:
            errors[name] = error
    result = {
        "losses": losses,
        "errors": errors,
        "graphs": graphs,
        "graph_breaks": _graph_breaks(),
        "plain": plain,
    }
    torch._dynamo.reset()
    return result


# -- the mechanism on a small function ------------------------------------------------------


def _outputs(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A loss and outputs beside it: a view of an intermediate, a partial matmul (a row-
    parallel product on split weights), an output the loss itself is made from, and outputs
    no gradient can flow through (a bool mask, integer indices)."""
    h = torch.tanh(x @ w1)
    partial = h @ w2  # P when w1 is split(1) and w2 split(0)
    scores = partial.relu()
    return scores.pow(2).mean(), h.view(-1), partial, scores, scores > 0, h.argmax(-1)


def unreached_outputs_job() -> dict[str, Any]:
    """Gradients of a compiled function whose backward starts at some of its outputs, against
    the same function run eagerly on global tensors and on plain ones (one process): the loss
    alone; the loss and one more output; two forwards before their two backwards."""
    torch._dynamo.reset()
    placement = sbpflow.placement("cpu", list(range(sbpflow.env.get_world_size())))
    gen = torch.Generator().manual_seed(3)
    x, w1 = torch.randn(4, 6, generator=gen), torch.randn(6, 8, generator=gen)
    w2 = torch.randn(8, 5, generator=gen)
    compiled = torch.compile(_outputs, backend="aot_eager")

    def run(fn: Any, plain: bool) -> list[torch.Tensor]:
        """Weight gradients after: the loss alone; the loss plus the partial output's sum;
        two forwards, then each one's loss backward."""
        if plain:
            args = [x, w1.clone().requires_grad_(), w2.clone().requires_grad_()]
        else:
            args = [
                x.to_global(placement, B).to_global(sbp=S0),
                w1.to_global(placement, B).to_global(sbp=S1).requires_grad_(),
                w2.to_global(placement, B).to_global(sbp=S0).requires_grad_(),
            ]
        grads = []
        loss, *_ = fn(*args)
        loss.backward()
        grads += [args[1].grad, args[2].grad]
        args[1].grad = args[2].grad = None
        loss, _, partial, *_ = fn(*args)
        (loss + partial.sum()).backward()
        grads += [args[1].grad, args[2].grad]
        args[1].grad = args[2].grad = None
        first, second = fn(*args)[0], fn(*args)[0]
        first.backward()
        second.backward()
        return [*grads, args[1].grad, args[2].grad]

    want = run(_outputs, plain=True)
    eager = run(_outputs, plain=False)
    got = run(compiled, plain=False)
    torch._dynamo.reset()
    return {
        "layouts": [str(g.sbp) for g in got],
        "errors": [
            max(
                (_logical(g) - w).abs().max().item(), (_logical(g) - _logical(e)).abs().max().item()
            )
            for g, e, w in zip(got, eager, want, strict=True)
        ],
    }


def dropout_job() -> dict[str, Any]:
    """GPT-2 with its default dropout (0.1) on 2 ranks, data parallel, 3 steps eagerly and
    compiled whole (aot_eager) from the same ``sbpflow.manual_seed``: the masks follow
    sbpflow's logical random state in both, so losses and parameters must agree."""
    placement = sbpflow.placement("cpu", [0, 1])
    g_batch = {n: _shard(t, placement) for n, t in _batch("gpt2").items()}
    runs = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        sbpflow.manual_seed(0)
        model = _gpt2(dropout=0.1).train().to_global(placement, B)
        counting = _Counting("aot_eager")
        run = torch.compile(model, backend=counting) if compiled else model
        opt = _OPTIMIZERS["gpt2"](model.parameters())
        losses, graphs = [], []
        for _ in range(_STEPS):
            loss = run(**g_batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            graphs.append(counting.graphs)
        runs[compiled] = (losses, [_logical(p) for p in model.parameters()], graphs)
    torch._dynamo.reset()
    (eager, eager_params, _), (got, params, graphs) = runs[False], runs[True]
    counting = _Counting("eager")
    plain = torch.compile(_gpt2(dropout=0.1).train(), backend=counting)
    plain_graphs = []
    for _ in range(_STEPS):
        plain(**_batch("gpt2")).loss.backward()
        plain_graphs.append(counting.graphs)
    torch._dynamo.reset()
    return {
        "losses": list(zip(got, eager, strict=True)),
        "error": max((a - b).abs().max().item() for a, b in zip(params, eager_params, strict=True)),
        "graphs": graphs,
        "plain_graphs": plain_graphs,
    }


# -- tests ---------------------------------------------------------------------------------------


def _run(
    family: str,
    layout: str,
    backend: str,
    mesh: list[Any] | None = None,
    layers: int = 2,
    per_block: bool = False,
) -> list[dict[str, Any]]:
    """``train_job`` on ``mesh`` (default: ranks 0 and 1), given longer than a hang takes to
    be noticed: Inductor compiles C++ for the forward and the backward."""
    mesh = [0, 1] if mesh is None else mesh
    pool = get_pool(torch.tensor(mesh).numel())
    timeout, pool.timeout = pool.timeout, max(pool.timeout, _COMPILE_TIMEOUT_S)
    try:
        return pool.run(train_job, family, layers, layout, backend, mesh, per_block)
    finally:
        pool.timeout = timeout


def _check(results: list[dict[str, Any]], where: str) -> None:
    for rank, got in enumerate(results):
        here = f"{where}, rank {rank}"
        for step, (loss, want) in enumerate(got["losses"]):
            assert loss == pytest.approx(want, abs=_TOL, rel=_TOL), (
                f"{here}: step {step}, losses (compiled global, one process) {got['losses']}"
            )
        assert not got["errors"], f"{here}: parameters differ from one process: {got['errors']}"
        plain = got["plain"]
        assert got["graph_breaks"] == plain["graph_breaks"], (
            f"{here}: {got['graph_breaks']} graph breaks, plain torch {plain['graph_breaks']}"
        )
        graphs = got["graphs"]
        assert graphs[-1] == graphs[1], f"{here}: compiled again after step 2: {graphs}"
        assert graphs == plain["graphs"], (
            f"{here}: graphs compiled after each step {graphs}, plain torch {plain['graphs']}"
        )


@pytest.mark.slow
@pytest.mark.parametrize("family", list(_FAMILIES))
def test_whole_model_compile_trains_data_parallel(family: str) -> None:
    """``torch.compile(model)`` (Inductor) of a global model, parameters broadcast and batch
    S(0), with its default outputs: 3 steps train as one process does, the graph breaks only
    where plain torch's does, and nothing compiles after the second step."""
    _check(_run(family, "data parallel", "inductor"), f"{family} data parallel")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mesh", "layers"),
    [([0, 1], 2), ([[0, 1], [2, 3]], 1)],  # 1 layer on 4 ranks: they compile on 2 cores here
    ids=["2 ranks", "2x2 data by tensor"],
)
def test_whole_model_compile_trains_llama_tensor_parallel(mesh: list[Any], layers: int) -> None:
    """The same for Llama with the Megatron layout: on 2 ranks, the batch broadcast; on a 2x2
    mesh, data parallel on the first axis (the batch split there) and Megatron on the second."""
    _check(
        _run("llama", "tensor parallel", "inductor", mesh, layers), f"llama tensor parallel {mesh}"
    )


@pytest.mark.slow
@pytest.mark.parametrize("per_block", [False, True], ids=["whole model", "per block"])
def test_compile_trains_llama_fully_sharded(per_block: bool) -> None:
    """The same for Llama with each decoder layer, then the root, fully sharded on 2 ranks,
    compiled whole (the graph breaks where torch's own ``fully_shard`` breaks it: before each
    sharded module's forward, which gathers its parameters eagerly) or each decoder layer
    compiled in place, the KV cache on (one graph per layer, as with torch's)."""
    _check(
        _run("llama", "fully_shard", "inductor", per_block=per_block),
        f"llama fully_shard, compiled {'per block' if per_block else 'whole'}",
    )


def test_outputs_the_backward_does_not_reach() -> None:
    """A compiled function returning a loss, a view of an intermediate and a partial output:
    backward from the loss alone, from the loss and one more output, and from two forwards'
    losses in turn give the gradients of the same function run eagerly and in one process,
    laid out as the weights are."""
    for rank, got in enumerate(get_pool(2).run(unreached_outputs_job)):
        assert max(got["errors"]) < _TOL, f"rank {rank}: gradient errors {got['errors']}"
        assert got["layouts"] == ["(S(1),)", "(S(0),)"] * 3, f"rank {rank}: {got['layouts']}"


@pytest.mark.slow
def test_compiled_model_with_dropout_trains_as_eager() -> None:
    """GPT-2 with its default dropout compiled whole: the masks are drawn in the graph
    from sbpflow's logical random state (NOTE [compiled dropout]), so losses and parameters
    agree with eager sbpflow from the same seed, with as many graphs as plain torch compiles
    for the same model and nothing compiled after the second step."""
    for rank, got in enumerate(get_pool(2).run(dropout_job)):
        for step, (loss, want) in enumerate(got["losses"]):
            assert loss == pytest.approx(want, abs=_TOL, rel=_TOL), (rank, step, got["losses"])
        assert got["error"] < _TOL, f"rank {rank}: parameters differ from eager: {got['error']}"
        graphs = got["graphs"]
        assert graphs == got["plain_graphs"], f"rank {rank}: graphs {graphs} vs torch's"
        assert graphs[-1] == graphs[1], f"rank {rank}: graphs {graphs}"
