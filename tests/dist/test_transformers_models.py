"""Hugging Face ``transformers`` models train data parallel with no fallback.

Three model families, each from a tiny random config built in code (no hub
download):

- Llama (``LlamaForCausalLM``): rotary embeddings, RMSNorm, grouped-query
  attention through ``F.scaled_dot_product_attention``, a SiLU-gated MLP, no
  biases; the library's causal-LM loss (labels padded and shifted).
- BERT (``BertForMaskedLM``): absolute position and token-type embeddings read
  from the model's buffers (a ``gather``), LayerNorm, GELU, a masked-LM head
  tied to the word embeddings; padded sequences with an attention mask through
  SDPA; most labels are ignored (-100).
- GPT-2 (``GPT2LMHeadModel``): ``Conv1D`` projections (``addmm``), the fused
  query/key/value projection split three ways, ``gelu_new``, a tied LM head;
  padded sequences with the library's eager attention (matmul, causal and
  padding mask, softmax).

Each model is converted with ``model.to_global(P, broadcast)`` and trained 3
steps on a token batch (ids, labels and attention mask) split on dim 0 over 2
and 4 ranks. Every rank also
trains a plain copy on the whole batch: the single-process reference computed
in the same test. Losses and parameters (and buffers) must agree within 1e-5,
and the steps (forward, backward, ``optimizer.step``, ``zero_grad``) run inside
``sbpflow.boxing.trace()`` and must not fall back to broadcasting an op's inputs.

The same training runs once more on 2 ranks with the loss function under
``torch.compile`` (the ``aot_eager`` backend: Dynamo and AOTAutograd, where global
tensors become local ones), against the same single-process reference.
``tests/dist/test_compile.py`` runs their padding-mask attention through Inductor.

Llama trains with AdamW. BERT and GPT-2 train with SGD with momentum: their
attention key bias adds the same score to every key of a query, which softmax
cancels, so its true gradient is 0 and the computed one is rounding noise whose
sign depends on the summation order; AdamW's first steps move each parameter by
about ``lr * sign(grad)``, so it would compare noise, not the layout.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import sbpflow
from sbpflow.sbp import Broadcast, Split
from sbpflow.testing import get_pool

transformers = pytest.importorskip(
    "transformers",
    reason="needs Hugging Face transformers (pip install -e '.[test]' installs it)",
)

S0, B = Split(0), Broadcast()
_STEPS = 3
_TOL = 1e-5
_VOCAB, _SEQ, _BATCH = 64, 7, 8  # 8 sequences: 2 and 4 ranks split the batch evenly


# -- models (tiny random configs, dropout off) ----------------------------------------


def _llama() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=_VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=32,
        attention_dropout=0.0,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config)


def _bert() -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=_VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="sdpa",
    )
    return transformers.BertForMaskedLM(config)


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=_VOCAB,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=_VOCAB - 1,
        eos_token_id=_VOCAB - 1,
        use_cache=False,
        attn_implementation="eager",
    )
    return transformers.GPT2LMHeadModel(config)


_FAMILIES: dict[str, Callable[[], nn.Module]] = {"llama": _llama, "bert": _bert, "gpt2": _gpt2}

_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "llama": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "bert": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "gpt2": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
}


def _batch(family: str) -> dict[str, torch.Tensor]:
    """The whole batch as model arguments. Causal LMs predict their own next tokens; the
    masked LM is scored on a few positions only. BERT and GPT-2 sequences are padded on the
    right (attention mask 0, label -100); Llama's are not (SDPA's is_causal path)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, _VOCAB, (_BATCH, _SEQ), generator=gen)  # 0 is BERT's pad id
    labels = ids.clone()
    if family == "bert":
        scored = torch.rand(_BATCH, _SEQ, generator=gen) < 0.3
        scored[:, 0] = True  # every rank scores at least one position
        labels = torch.where(scored, ids, torch.full_like(ids, -100))
    if family == "llama":
        return {"input_ids": ids, "labels": labels}
    mask = torch.ones_like(ids)
    for row, length in ((1, 5), (2, 3), (6, 6)):  # padded rows on several ranks, 2 or 4
        mask[row, length:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = labels.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


# -- one training run ---------------------------------------------------------------


def _train(family: str, placement: sbpflow.Placement, backend: str | None = None) -> dict[str, Any]:
    """Train the model data parallel and a plain copy on the whole batch, side by side;
    with a ``backend``, the data-parallel loss function under torch.compile."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = _FAMILIES[family]().train()
    if backend:  # the library logs a warning (a graph break) when no loss type is named
        reference.loss_type = "ForMaskedLM" if family == "bert" else "ForCausalLM"
    model = copy.deepcopy(reference).to_global(placement, B)

    def loss_of(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(**batch).loss

    step_loss = torch.compile(loss_of, backend=backend) if backend else loss_of
    batch = _batch(family)
    g_batch = {name: _shard(t, placement) for name, t in batch.items()}
    opt_ref = _OPTIMIZERS[family](reference.parameters())
    opt = _OPTIMIZERS[family](model.parameters())
    losses, fallbacks = [], []
    for _ in range(_STEPS):
        want = reference(**batch).loss
        want.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        with sbpflow.boxing.trace() as t:
            got = step_loss(g_batch)
            got.backward()
            opt.step()
            opt.zero_grad()
        fallbacks.extend(t.fallbacks)
        losses.append((got.item(), want.item()))
    want_state = _state(reference)
    errors = {}
    for name, got_t in _state(model).items():
        value, want_t = _logical(got_t).double(), want_state[name].double()
        if not torch.allclose(value, want_t, atol=_TOL, rtol=_TOL):
            errors[name] = (value - want_t).abs().max().item()
    torch._dynamo.reset()
    return {"losses": losses, "errors": errors, "fallbacks": sorted(set(fallbacks))}


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _logical(t: torch.Tensor) -> torch.Tensor:
    """The logical value of a global tensor, on every rank (a collective)."""
    return t.to_global(sbp=(B,) * len(t.sbp), check_meta=False).to_local().detach()


def _shard(t: torch.Tensor, placement: sbpflow.Placement) -> sbpflow.GlobalTensor:
    """This rank's rows of the whole batch, given as its S(0) piece (as a data loader would)."""
    index = placement.flat_ranks.index(sbpflow.env.get_rank())
    return torch.tensor_split(t, placement.num_ranks)[index].contiguous().to_global(placement, S0)


def train_families() -> list[tuple[str, dict[str, Any]]]:
    """Worker: every family on the whole world."""
    world = sbpflow.placement("cpu", list(range(sbpflow.env.get_world_size())))
    return [(family, _train(family, world)) for family in _FAMILIES]


def train_families_compiled() -> list[tuple[str, dict[str, Any]]]:
    """Worker: every family on the whole world, its loss function compiled."""
    world = sbpflow.placement("cpu", list(range(sbpflow.env.get_world_size())))
    return [(family, _train(family, world, "aot_eager")) for family in _FAMILIES]


# -- tests ----------------------------------------------------------------------------


def _check(results: list[Any], world_size: int) -> None:
    for rank, per_rank in enumerate(results):
        for family, got in per_rank:
            where = f"rank {rank}, {family} on {world_size} ranks"
            assert got["fallbacks"] == [], f"{where}: fell back on {got['fallbacks']}"
            for step, (loss, want) in enumerate(got["losses"]):
                assert loss == pytest.approx(want, abs=_TOL, rel=_TOL), (
                    f"{where}: step {step}, losses (global, reference) {got['losses']}"
                )
            assert not got["errors"], f"{where}: parameters/buffers differ: {got['errors']}"


@pytest.mark.parametrize("world_size", [2, 4])
def test_transformers_models_train_data_parallel(world_size: int) -> None:
    """Llama, BERT and GPT-2 with broadcast parameters and an S(0) token batch: 3 training
    steps compare with single-process training on the whole batch, with no fallback."""
    _check(get_pool(world_size).run(train_families), world_size)


def test_transformers_models_train_compiled() -> None:
    """The same on 2 ranks with the loss function under torch.compile (aot_eager: where
    global tensors become local ones): losses and parameters equal one process."""
    _check(get_pool(2).run(train_families_compiled), 2)
