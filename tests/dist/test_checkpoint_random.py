"""Activation checkpointing with random ops on global tensors (NOTE [recomputed randomness]).

torch.utils.checkpoint restores torch's generators before it recomputes a region, not
sbpflow's logical random state: a recomputed dropout used to draw a new mask, so the
gradient was that of a mask the forward never used. Now a draw during the backward
raises on every rank, and ``sbpflow.utils.checkpoint_contexts`` replays the forward's
draws. Checked on Hugging Face GPT-2 with its default dropout, data parallel on 2 ranks,
against the same model trained without checkpointing from the same seed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import sbpflow
from sbpflow.sbp import Broadcast, Split
from sbpflow.testing import DistributedPool

transformers = pytest.importorskip("transformers")

B, S0 = Broadcast(), Split(0)
_VOCAB, _STEPS = 64, 2


def _gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=_VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2,
        bos_token_id=_VOCAB - 1, eos_token_id=_VOCAB - 1,
    )  # fmt: skip
    assert config.resid_pdrop == config.attn_pdrop == config.embd_pdrop == 0.1
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).train()


def _train(checkpointing: dict[str, Any] | None) -> dict[str, Any]:
    placement = sbpflow.placement("cpu", [0, 1])
    rank = sbpflow.env.get_rank()
    ids = torch.randint(0, _VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
    piece = torch.tensor_split(ids, 2)[rank].contiguous().to_global(placement, S0)
    model = _gpt2().to_global(placement, B)
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    sbpflow.manual_seed(3)
    losses = []
    try:
        for _ in range(_STEPS):
            loss = model(input_ids=piece, labels=piece).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    except sbpflow._rng.RandomOpInBackward as error:
        return {"error": str(error)}
    weights = [p.to_global(sbp=B).to_local().detach() for p in model.parameters()]
    return {"losses": losses, "weights": weights, "state": sbpflow._rng.state()}


def checkpointing_job() -> dict[str, Any]:
    replay = {"use_reentrant": False, "context_fn": sbpflow.utils.checkpoint_contexts}
    return {
        "plain": _train(None),
        "replayed": _train(replay),
        "reentrant": _train({"use_reentrant": True}),
        "non-reentrant": _train({"use_reentrant": False}),
    }


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_checkpointed_dropout_trains_as_without_checkpointing(dist_pool: DistributedPool) -> None:
    """With ``checkpoint_contexts`` the recomputed masks are the forward's: losses, weights
    and the random state equal training without checkpointing; without it, checkpointing a
    region with dropout raises on every rank, naming the fix, instead of a wrong gradient."""
    for rank, got in enumerate(dist_pool.run(checkpointing_job)):
        plain, replayed = got["plain"], got["replayed"]
        assert "error" not in plain and "error" not in replayed, (rank, got)
        assert replayed["losses"] == pytest.approx(plain["losses"], rel=1e-6, abs=1e-6), rank
        assert replayed["state"] == plain["state"], rank
        for want, have in zip(plain["weights"], replayed["weights"], strict=True):
            torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-6)
        for mode in ("reentrant", "non-reentrant"):
            assert "checkpoint_contexts" in got[mode].get("error", ""), (rank, mode, got[mode])
