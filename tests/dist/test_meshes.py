"""A placement's process groups are made up front by its mesh, never in the middle of an op
(NOTE [meshes] in sbpflow/comm/_mesh.py).

On 2 ranks a training step mixes data parallelism (input ``S(0)``, weight ``B``), a
column-split weight, a factory, boxing onto a placement of one rank
(rank 0 sits outside it) and an SGD step. Every placement it touched got its mesh at the
entry that brought it in, and none from the dispatcher; the values equal plain
single-process PyTorch computed in the same job. A global tensor built on a new placement
without an entry point (the internal constructor) is caught: its first op makes the mesh,
and the record says so.
"""

from __future__ import annotations

from typing import Any

import torch

import sbpflow
from sbpflow._layout import Layout
from sbpflow.comm._mesh import MESHES
from sbpflow.sbp import Broadcast, broadcast, split
from sbpflow.testing import get_pool

_WORLD = 2


def _logical(t: torch.Tensor) -> torch.Tensor:
    return t.to_global(sbp=(Broadcast(),) * len(t.sbp), check_meta=False).to_local().detach()


def training_step_job() -> dict[str, Any]:
    MESHES.forget()  # the pool's processes ran other tests: start from no mesh
    world = sbpflow.placement("cpu", [0, 1])
    one = sbpflow.placement("cpu", [1])
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.GELU(), torch.nn.Linear(6, 3))
    data = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 6), torch.nn.GELU(), torch.nn.Linear(6, 3)])
    model.load_state_dict(plain.state_dict())
    model.to_global(world, broadcast)
    model[0].weight = torch.nn.Parameter(model[0].weight.to_global(sbp=split(0)).detach())
    x = data.to_global(world, broadcast).to_global(sbp=split(0))
    bias = sbpflow.zeros(3, placement=world, sbp=broadcast)
    out = model(x) + bias
    loss = out.square().mean()
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    moved = out.detach().to_global(one, broadcast)  # rank 0 is outside ``one``
    doubled = moved * 2
    plain_out = plain(data)
    plain_out.square().mean().backward()
    torch.optim.SGD(plain.parameters(), lr=0.1).step()
    entries = {str(p): entry for p, entry in MESHES.entries().items()}
    values_equal = all(
        torch.allclose(_logical(g), p.detach(), atol=1e-6)
        for g, p in zip(model.parameters(), plain.parameters(), strict=True)
    )
    doubled_equal = sbpflow.env.get_rank() != 1 or torch.allclose(
        doubled.to_local(), 2 * plain_out.detach(), atol=1e-6
    )
    # Built with the internal constructor on a placement no entry point has seen.
    fresh = sbpflow.placement("cpu", [1, 0])
    full = Layout(fresh, (Broadcast(),))
    g = sbpflow.GlobalTensor(torch.ones(2), full, (2,))
    _ = g.sum()  # the general path (a pointwise op on one layout never needs the groups)
    return {
        "entries": entries,
        "fresh": MESHES.entries()[fresh],
        "values_equal": values_equal,
        "doubled_equal": doubled_equal,
    }


def test_a_training_steps_placements_get_their_groups_at_their_entry_points() -> None:
    for got in get_pool(_WORLD).run(training_step_job):
        assert got["values_equal"] and got["doubled_equal"]
        entries = got["entries"]
        assert entries == {
            str(sbpflow.placement("cpu", [0, 1])): "to_global",
            str(sbpflow.placement("cpu", [1])): "to_global",
        }, entries
        assert got["fresh"] == "an op"  # what the check above would have caught
