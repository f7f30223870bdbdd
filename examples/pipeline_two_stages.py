"""A model cut into two pipeline stages: the first on rank 0, the second on rank 1.

Run it on 2 ranks (CPU, gloo):

    python -m sbpflow.distributed.launch --nproc_per_node 2 examples/pipeline_two_stages.py

Each stage's parameters live on its own placement; the activations cross from one stage
to the next by changing placement, which sbpflow plans as a point-to-point transfer:

    first, second = sbpflow.placement("cpu", [0]), sbpflow.placement("cpu", [1])
    stage0.to_global(first, broadcast)
    stage1.to_global(second, broadcast)
    h = stage0(x)                                 # runs on rank 0; rank 1 skips it
    out = stage1(h.to_global(second, broadcast))  # send_recv 0 -> 1, then runs on rank 1
    loss.backward()                               # the gradient of h goes back 1 -> 0

Every rank runs the same script. A rank outside a placement holds empty pieces of the
tensors on it and skips their ops, so rank 1 passes over stage 0 and rank 0 over stage 1;
the backward of the transfer is the reverse transfer. Each batch is cut into micro-batches
whose gradients accumulate before one ``optimizer.step()`` (run one after another here:
this shows the data flow, not an overlapping schedule). The script ends by comparing the
parameters with the same two stages trained in one process.
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

import sbpflow
from sbpflow.sbp import broadcast


def make_stages() -> tuple[nn.Module, nn.Module]:
    stage0 = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
    stage1 = nn.Sequential(nn.Linear(32, 4))
    return stage0, stage1


def make_data(num_steps: int, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Regression onto a smooth target (the same batches on every rank)."""
    w = torch.randn(16, 4) / 4
    batches = []
    for _ in range(num_steps):
        x = torch.randn(batch_size, 16)
        batches.append((x, torch.sin(x @ w)))
    return batches


def train_step(
    stage0: nn.Module,
    stage1: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    handoff: sbpflow.Placement | None,
) -> torch.Tensor:
    """One step over ``micro_batches``; ``handoff`` is stage 1's placement (None: one process)."""
    optimizer.zero_grad()
    total = torch.zeros(())
    for x, y in micro_batches:
        h = stage0(x)
        if handoff is not None:
            h = h.to_global(handoff, broadcast)  # stage 0's ranks -> stage 1's: send_recv
        loss = nn.functional.mse_loss(stage1(h), y) / len(micro_batches)
        loss.backward()
        total = total + loss.detach()
    optimizer.step()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()

    rank = sbpflow.env.get_rank()
    if sbpflow.env.get_world_size() != 2:
        raise SystemExit("run this example on 2 ranks (--nproc_per_node 2)")
    first, second = sbpflow.placement("cpu", [0]), sbpflow.placement("cpu", [1])

    torch.manual_seed(0)  # the same initial stages and data on every rank
    ref0, ref1 = make_stages()
    data = make_data(args.steps, args.batch_size)
    stage0 = copy.deepcopy(ref0).to_global(first, broadcast)
    stage1 = copy.deepcopy(ref1).to_global(second, broadcast)
    params = [*stage0.parameters(), *stage1.parameters()]
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9)

    for step, (x, y) in enumerate(data, 1):
        # Inputs enter on stage 0's rank, targets on stage 1's.
        micro_batches = [
            (xm.to_global(first, broadcast), ym.to_global(second, broadcast))
            for xm, ym in zip(x.chunk(args.micro_batches), y.chunk(args.micro_batches), strict=True)
        ]
        with sbpflow.boxing.trace() as t:
            loss = train_step(stage0, stage1, optimizer, micro_batches, second)
        if step == 1 or step % 10 == 0:
            line = f"step {step:3d}  loss {loss:>7f}"  # reading the loss: every rank
            if rank == 0:
                transfers = t.collectives()["send_recv"]
                print(f"{line}  ({transfers} send_recv on rank 0 this step)", flush=True)

    # The same training in one process.
    ref_optimizer = torch.optim.SGD(
        [*ref0.parameters(), *ref1.parameters()], lr=args.lr, momentum=0.9
    )
    for x, y in data:
        micro = list(zip(x.chunk(args.micro_batches), y.chunk(args.micro_batches), strict=True))
        ref_loss = train_step(ref0, ref1, ref_optimizer, micro, None)

    final_loss = loss.item()  # a collective, like printing it
    matches = abs(final_loss - ref_loss.item()) <= 1e-5 and all(
        torch.allclose(torch.tensor(p.tolist()), r, rtol=1e-4, atol=1e-5)
        for p, r in zip(params, [*ref0.parameters(), *ref1.parameters()], strict=True)
    )
    if rank == 0:
        print(f"final loss {final_loss:.4f}", flush=True)
        print(f"matches single-process training: {matches}", flush=True)


if __name__ == "__main__":
    main()
