"""``sbpflow.env``: ``print0`` and the idiom for metrics summed over ranks.

Each job captures what its rank prints and computes an evaluation metric both ways the
docs show (a local count made global as a partial sum, and a global model's prediction
compared with a global batch), against the count computed in one process on the whole
data in the same job.
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

import pytest
import torch

import sbpflow
from sbpflow.sbp import partial_sum, split
from sbpflow.testing import DistributedPool


def printed_and_counts() -> dict[str, Any]:
    """Worker: what print0 printed here; correct-prediction counts summed over ranks."""
    rank, num_ranks = sbpflow.env.get_rank(), sbpflow.env.get_world_size()
    placement = sbpflow.placement("cpu", list(range(num_ranks)))
    out = io.StringIO()
    # A partial-sum loss of 2.5 (parts 2.0 and 0.5 on two ranks) and a split tensor: print0
    # formats them on every rank (a collective each), then prints on rank 0.
    loss = torch.tensor(2.0 if rank == 0 else 0.5).to_global(placement, partial_sum)
    pieces = torch.tensor([float(rank)]).to_global(placement, split(0))
    with contextlib.redirect_stdout(out):
        sbpflow.env.print0("hello from", rank, sep=" ", end="!\n")
        sbpflow.env.print0("loss", loss, pieces)
        sbpflow.env.print0(f"loss {loss:.3f}", sep="", flush=False)
    gen = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(13, 4, generator=gen), torch.randint(0, 4, (13,), generator=gen)
    mine = torch.tensor_split(torch.arange(13), num_ranks)[rank]  # balanced: 7 and 6
    # Local tensors (DDP style): this rank's count, read as one partial sum of the total.
    local_count = (logits[mine].argmax(1) == labels[mine]).sum()
    from_local = local_count.to_global(placement, partial_sum).item()
    # Global tensors: the comparison is S(0), its sum a partial sum; item() reduces it.
    x, y = logits[mine].to_global(placement, split(0)), labels[mine].to_global(placement, split(0))
    from_global = (x.argmax(1) == y).sum().item()
    return {
        "printed": out.getvalue(),
        "local_count": local_count.item(),
        "from_local": from_local,
        "from_global": from_global,
        "reference": (logits.argmax(1) == labels).sum().item(),
    }


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_print0_and_metrics_over_ranks(dist_pool: DistributedPool) -> None:
    """print0 prints on rank 0 only, with print's arguments, global tensors formatted on
    every rank (their values compared with plain tensors here); both ways of counting correct
    predictions over ranks give the single-process count on every rank."""
    results = dist_pool.run(printed_and_counts)
    pl = "placement('cpu', [0, 1])"
    loss = repr(torch.tensor(2.5))[:-1] + f", placement={pl}, sbp=P)"
    pieces = repr(torch.tensor([0.0, 1.0]))[:-1] + f", placement={pl}, sbp=S(0))"
    printed = f"hello from 0!\nloss {loss} {pieces}\nloss 2.500\n"
    assert [r["printed"] for r in results] == [printed, ""]
    for got in results:
        assert got["from_local"] == got["from_global"] == got["reference"], got
        assert got["local_count"] > 0, got  # a rank's share left out would change the total
