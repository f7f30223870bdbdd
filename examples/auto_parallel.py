"""Let sbpflow choose the layout: ``sbpflow.auto_parallel`` plans, ``plan.apply`` converts.

Run it on 2 ranks:

    python -m sbpflow.distributed.launch --nproc_per_node 2 examples/auto_parallel.py

Every rank plans the same residual MLP blocks (``x + down(GELU(up(LayerNorm(x))))``) on its
own: the forward is captured on meta tensors, no data and no process group, and the layouts
of the whole step are chosen by an integer program priced by the boxing planner's costs.
With the batch pinned broadcast (``fixed={0: broadcast}``) the plan is Megatron's: ``up``
split by output features, ``down`` by input features, the rest broadcast. Rank 0 prints the
plan; then every rank applies it (the parameters laid out, and the module boundaries hooked
so that the step boxes where the plan says), trains 5 SGD steps, and compares the parameters
with the same model trained in one process.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import sbpflow
from sbpflow.sbp import broadcast, sbp_str


class Block(nn.Module):
    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, inner)
        self.down = nn.Linear(inner, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def train(model: nn.Module, x: torch.Tensor, steps: int) -> float:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loss = torch.zeros(())
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
    return loss.item()


def main() -> None:
    placement = sbpflow.placement("cpu", list(range(sbpflow.env.get_world_size())))
    torch.manual_seed(0)
    reference = nn.Sequential(Block(256, 1024), Block(256, 1024))
    x = torch.randn(512, 256)

    plan = sbpflow.auto_parallel(reference, placement, x, fixed={0: broadcast}, optimizer="sgd")
    if sbpflow.env.get_rank() == 0:
        print(plan.explain())

    model = plan.apply(copy.deepcopy(reference))  # built whole on every rank, then boxed
    gx = x.to_global(placement, broadcast).to_global(sbp=plan.input_sbp[0])
    loss = train(model, gx, steps=5)
    reference_loss = train(reference, x, steps=5)

    # reading logical values is a collective: every rank runs it
    matches = all(
        torch.allclose(torch.tensor(p.tolist()), r, rtol=1e-4, atol=1e-5)
        for p, r in zip(model.parameters(), reference.parameters(), strict=True)
    )
    if sbpflow.env.get_rank() == 0:
        layouts = ", ".join(
            f"{n} {sbp_str(s)}" for n, s in plan.param_sbp.items() if n.startswith("0.")
        )
        print(f"planned layouts (block 0): {layouts}")
        print(f"single process: final loss {reference_loss:.6f}")
        print(f"final loss {loss:.6f}")
        print(f"matches single-process training: {matches}")


if __name__ == "__main__":
    main()
