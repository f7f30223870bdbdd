"""Tensor parallelism from layouts alone: the collectives of a step, by kind, and its values.

Models get a Megatron layout with ``Module.to_global`` (column-parallel weights
``split(0)``, row-parallel weights ``split(1)``, everything else broadcast) and
no plan; layout propagation (NOTE [choosing a strategy], NOTE [gradient plan] in
sbpflow/_propagation.py) must find Megatron's communication:

- residual MLP blocks ``x + down(GELU(up(LayerNorm(x))))``: one all_reduce per
  block forward and one backward; with sequence parallelism (the input given
  ``split(0)``), one all_gather and one reduce_scatter per block forward;
- Hugging Face Llama (tiny random config, ``transformers``): two all_reduces per
  decoder layer forward and two backward, on 2 ranks and on a 2x2 data x tensor
  parallel mesh (there, every other collective is on the data axis: the mean
  loss's sum and the gradients' all_reduces, one per parameter in the first
  backward, then one per default gradient bucket).

Forward, backward and the optimizer step are traced separately, every step. Each
run also trains a plain copy on the whole batch in the same process, the
single-process reference: losses and parameters must agree within 1e-5.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import sbpflow
from sbpflow.nn.parallel._params import data_axes
from sbpflow.nn.parallel._reducer import GradientSync
from sbpflow.sbp import Broadcast, Split
from sbpflow.testing import get_pool

S0, S1, B = Split(0), Split(1), Broadcast()
_STEPS = 3
_TOL = 1e-5
_BLOCKS = 3


class Block(nn.Module):
    def __init__(self, dim: int = 8, inner: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, inner)
        self.down = nn.Linear(inner, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def _megatron_mlp(name: str, t: torch.Tensor) -> Any:
    if name.endswith(("up.weight", "up.bias")):
        return S0
    return S1 if name.endswith("down.weight") else B


def _megatron_llama(name: str, t: torch.Tensor) -> Any:
    module = name.split(".")[-2]
    if module in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        return S0
    return S1 if module in ("o_proj", "down_proj") else B


def _counts(trace: Any, axes: bool = False) -> dict[Any, int]:
    """Collectives that ran, by kind (and by the mesh axes they ran on, with ``axes``)."""
    return dict(trace.collectives_by_axes() if axes else trace.collectives())


def _errors(model: nn.Module, reference: nn.Module) -> dict[str, float]:
    out = {}
    for (name, got), want in zip(model.named_parameters(), reference.parameters(), strict=True):
        value = got.to_global(sbp=(B,) * len(got.sbp), check_meta=False).to_local().detach()
        error = (value.double() - want.detach().double()).abs().max().item()
        if error > _TOL:
            out[name] = error
    return out


def _train(
    model: nn.Module,
    reference: nn.Module,
    inputs: dict[str, torch.Tensor],
    global_inputs: dict[str, torch.Tensor],
    loss_of: Any,
    axes: bool = False,
) -> dict[str, Any]:
    """``_STEPS`` SGD steps of ``model`` (global) and ``reference`` (plain, whole batch)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    steps = []
    for _ in range(_STEPS):
        want = loss_of(reference, inputs)
        want.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        with sbpflow.boxing.trace() as forward:
            loss = loss_of(model, global_inputs)
        with sbpflow.boxing.trace() as backward:
            loss.backward()
        with sbpflow.boxing.trace() as update:
            opt.step()
            opt.zero_grad()
        steps.append(
            {
                "forward": _counts(forward, axes),
                "backward": _counts(backward, axes),
                "step": _counts(update, axes),
                "fallbacks": forward.fallbacks + backward.fallbacks + update.fallbacks,
                "losses": (loss.item(), want.item()),
            }
        )
    return {"steps": steps, "errors": _errors(model, reference)}


def _mlp_loss(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(inputs["x"]).pow(2).mean()


def megatron_mlp_job(sequence_parallel: bool) -> dict[str, Any]:
    """Residual MLP blocks, the input broadcast (or split on tokens), against one process."""
    placement = sbpflow.placement("cpu", list(range(sbpflow.env.get_world_size())))
    torch.manual_seed(0)
    reference = nn.Sequential(*[Block() for _ in range(_BLOCKS)])
    model = copy.deepcopy(reference).to_global(placement, B).to_global(placement, _megatron_mlp)
    x = torch.randn(12, 8, generator=torch.Generator().manual_seed(1))
    gx = x.to_global(placement, B)
    if sequence_parallel:
        gx = gx.to_global(sbp=S0)
    return _train(model, reference, {"x": x}, {"x": gx}, _mlp_loss)


def _through_views(w: torch.Tensor) -> torch.Tensor:
    """``w`` itself, seen through ten transposes and a select: views deeper than 8 and of an
    op (``select``) that no list of view ops named."""
    for _ in range(5):
        w = w.t().t()
    return w[None][0]


class RMSNorm(nn.Module):
    """Llama's RMS norm, in pointwise ops: a partial-sum gradient can pass through them."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class ViewedBlock(Block):
    """``Block`` with an RMS norm, whose column-parallel weight reaches its matmul through
    ``_through_views`` (the bias added apart: the matmul's one split input is that weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNorm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = nn.functional.linear(self.norm(x), _through_views(self.up.weight)) + self.up.bias
        return x + self.down(nn.functional.gelu(up))


def viewed_weights_job() -> dict[str, Any]:
    """``megatron_mlp_job`` with ``ViewedBlock``s, against one process."""
    placement = sbpflow.placement("cpu", list(range(sbpflow.env.get_world_size())))
    torch.manual_seed(0)
    reference = nn.Sequential(*[ViewedBlock() for _ in range(_BLOCKS)])
    model = copy.deepcopy(reference).to_global(placement, B).to_global(placement, _megatron_mlp)
    x = torch.randn(12, 8, generator=torch.Generator().manual_seed(1))
    return _train(model, reference, {"x": x}, {"x": x.to_global(placement, B)}, _mlp_loss)


def _llama(layers: int) -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention: every rank holds whole groups
        max_position_embeddings=32,
        attention_dropout=0.0,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config)


def _llama_loss(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**inputs).loss


def llama_job(mesh: list[Any], layers: int) -> dict[str, Any]:
    """Llama with the Megatron layout on ``mesh`` (2-D: data x tensor), tokens broadcast on the
    tensor axis (split on the data axis), against one process on the whole batch."""
    placement = sbpflow.placement("cpu", mesh)
    torch.manual_seed(0)
    reference = _llama(layers).train()
    data_parallel = placement.ndim == 2

    def layout(name: str, t: torch.Tensor) -> Any:
        tensor_axis = _megatron_llama(name, t)
        return (B, tensor_axis) if data_parallel else tensor_axis

    full = (B,) * placement.ndim
    model = copy.deepcopy(reference).to_global(placement, full).to_global(placement, layout)
    ids = torch.randint(1, 64, (8, 7), generator=torch.Generator().manual_seed(1))
    g_ids = ids.to_global(placement, full).to_global(sbp=(S0, B) if data_parallel else B)
    inputs = {"input_ids": ids, "labels": ids}
    result = _train(
        model,
        reference,
        inputs,
        {"input_ids": g_ids, "labels": g_ids},
        _llama_loss,
        axes=data_parallel,
    )
    params = list(model.parameters())
    result["num_parameters"] = len(params)
    # The default gradient buckets (NOTE [data parallel by default]): one kind per set of
    # data axes (the parameter's broadcast axes), and how many buckets they made.
    result["data_axes_kinds"] = len({data_axes(p._layout) for p in params})
    syncs = {id(s): s for p in params if (s := GradientSync.of(p)) is not None}
    result["num_buckets"] = sum(len(s.buckets) for s in syncs.values())
    return result


def _check_values(where: str, got: dict[str, Any]) -> None:
    for step, record in enumerate(got["steps"]):
        loss, want = record["losses"]
        assert loss == pytest.approx(want, abs=_TOL, rel=_TOL), (where, step, loss, want)
        assert record["fallbacks"] == [], (where, step, record["fallbacks"])
        assert record["step"] == {}, (where, step, "the optimizer step communicated", record)
    assert not got["errors"], f"{where}: parameters differ from one process: {got['errors']}"


def test_megatron_mlp_blocks_run_one_all_reduce_each_way() -> None:
    """Megatron MLP blocks on 2 ranks: per block one all_reduce forward (the row-parallel
    output's sum) and one backward (the column-parallel input's gradient), nothing else;
    training equals one process."""
    for rank, got in enumerate(get_pool(2).run(megatron_mlp_job, False)):
        where = f"rank {rank}"
        _check_values(where, got)
        for step, record in enumerate(got["steps"]):
            assert record["forward"] == {"all_reduce": _BLOCKS}, (where, step, record)
            assert record["backward"] == {"all_reduce": _BLOCKS}, (where, step, record)


def test_weights_seen_through_views_at_any_depth() -> None:
    """The Megatron blocks with each column-parallel weight reaching its matmul through ten
    transposes and a select: the same one all_reduce per block each way (the input's gradient
    is reduced where the input is, not left partial for the layer norm's backward), and
    training equals one process."""
    for rank, got in enumerate(get_pool(2).run(viewed_weights_job)):
        where = f"rank {rank}"
        _check_values(where, got)
        for step, record in enumerate(got["steps"]):
            assert record["forward"] == {"all_reduce": _BLOCKS}, (where, step, record)
            assert record["backward"] == {"all_reduce": _BLOCKS}, (where, step, record)


def test_sequence_parallel_mlp_blocks_gather_and_reduce_scatter() -> None:
    """The same blocks with the tokens split between blocks (the input given split(0)): per
    block forward one all_gather (into the column-parallel matmul) and one reduce_scatter
    (of the row-parallel output); backward the reverse pair, the all_gather of the layer norm
    output again for the up weight's gradient, and the all_reduces of the layer norm weight
    and bias, whose gradients are sums over the ranks' tokens (one bucket for all, from the
    first backward on); training equals one process."""
    for rank, got in enumerate(get_pool(2).run(megatron_mlp_job, True)):
        where = f"rank {rank}"
        _check_values(where, got)
        for step, record in enumerate(got["steps"]):
            forward = {"all_gather": _BLOCKS, "reduce_scatter": _BLOCKS}
            backward = {
                "all_gather": 2 * _BLOCKS,
                "reduce_scatter": _BLOCKS,
                # One default bucket (NOTE [data parallel by default]), the first backward's
                # too: all broadcast on the one axis, far below the first bucket's 1 MiB.
                "all_reduce": 1,
            }
            assert record["forward"] == forward, (where, step, record)
            assert record["backward"] == backward, (where, step, record)


def test_llama_tensor_parallel_two_all_reduces_per_layer_each_way() -> None:
    """Hugging Face Llama, q/k/v/gate/up split(0) and o/down split(1), on 2 ranks: per decoder
    layer two all_reduces forward (after attention and after the MLP) and two backward (the
    gradients of the two normed inputs), nothing else; training equals one process."""
    pytest.importorskip("transformers", reason="needs Hugging Face transformers")
    layers = 2
    for rank, got in enumerate(get_pool(2).run(llama_job, [0, 1], layers)):
        where = f"rank {rank}"
        _check_values(where, got)
        for step, record in enumerate(got["steps"]):
            assert record["forward"] == {"all_reduce": 2 * layers}, (where, step, record)
            assert record["backward"] == {"all_reduce": 2 * layers}, (where, step, record)


def test_llama_on_a_data_by_tensor_parallel_mesh() -> None:
    """The same on a 2x2 mesh, tokens split on the data axis (0): on the tensor axis (1) two
    all_reduces per layer forward and two backward; the only other collectives are on the
    data axis: the loss's all_reduce and the parameters' gradient all_reduces, one per
    bucket, the first backward included; training equals one process on the whole batch."""
    pytest.importorskip("transformers", reason="needs Hugging Face transformers")
    layers = 2
    for rank, got in enumerate(get_pool(4).run(llama_job, [[0, 1], [2, 3]], layers)):
        where = f"rank {rank}"
        _check_values(where, got)
        for step, record in enumerate(got["steps"]):
            tensor_axis, data_axis = ("all_reduce", (1,)), ("all_reduce", (0,))
            # On the data axis forward: the mean loss's one all_reduce of the scalar sum
            # over the ranks' tokens.
            forward = {tensor_axis: 2 * layers, data_axis: 1}
            assert record["forward"] == forward, (where, step, record)
            # On the data axis backward: the parameters join the default buckets in the first
            # backward (NOTE [data parallel by default]), one all_reduce per bucket: one
            # bucket per kind of parameter, (B, S) or (B, B), since the model is far below
            # the first bucket's 1 MiB. Every gradient arrives reduced on the tensor axis.
            assert got["num_buckets"] == got["data_axes_kinds"] == 2, (where, got)
            backward = {tensor_axis: 2 * layers, data_axis: got["num_buckets"]}
            assert record["backward"] == backward, (where, step, record)
