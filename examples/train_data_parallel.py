"""Data-parallel training of a small MLP with global tensors.

Run it on 4 ranks (CPU, gloo):

    python -m sbpflow.distributed.launch --nproc_per_node 4 examples/train_data_parallel.py

The model is made global once, its parameters broadcast over every rank; each step's batch
is global too, split along dim 0 (the batch dim) so every rank holds a quarter of it:

    model.to_global(placement, broadcast)        # rank 0's parameters, on every rank
    x = x_local.to_global(placement, split(0))   # the ranks' slices form one logical batch
    loss = loss_fn(model(x), y)                  # the mean over the WHOLE logical batch
    loss.backward()                              # each parameter's grad arrives broadcast
    optimizer.step()                             # plain torch.optim, purely local

Nothing else changes from single-process PyTorch: the matmuls run on each rank's slice
((S(0), B) -> S(0)), the mean loss divides by the global batch size, and the gradient of
each broadcast parameter, a partial sum over the ranks, is all-reduced on its way into
``.grad``. At the end every rank trains the same model on the whole batch in one process
and checks that both runs agree.
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

import sbpflow
from sbpflow.sbp import broadcast, split


def make_dataset(num_samples: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A smooth nonlinear regression target with a little noise (same on every rank)."""
    x = torch.randn(num_samples, in_features)
    w = torch.linspace(-1.0, 1.0, in_features)
    y = torch.sin(x @ w).unsqueeze(1) + 0.1 * x[:, :1] ** 2 + 0.01 * torch.randn(num_samples, 1)
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=128, help="logical batch per step")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args()

    rank = sbpflow.env.get_rank()
    world_size = sbpflow.env.get_world_size()
    placement = sbpflow.placement("cpu", list(range(world_size)))

    torch.manual_seed(0)  # the same data set and initial model on every rank
    in_features = 8
    x_all, y_all = make_dataset(2048, in_features)
    reference = nn.Sequential(nn.Linear(in_features, 64), nn.Tanh(), nn.Linear(64, 1))
    model = copy.deepcopy(reference).to_global(placement, broadcast)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.MSELoss()
    if rank == 0:
        print(
            f"training on {world_size} rank(s), batch {args.batch_size} split over {placement}",
            flush=True,
        )

    def shard(t: torch.Tensor) -> sbpflow.GlobalTensor:
        """``t`` (the same on every rank) as a global tensor split along dim 0: each rank
        passes only its slice (torch.tensor_split cuts by sbpflow's balanced rule)."""
        return torch.tensor_split(t, world_size)[rank].to_global(placement, split(0))

    batches = torch.Generator().manual_seed(1)  # the same batch order on every rank
    indices = [
        torch.randint(0, x_all.shape[0], (args.batch_size,), generator=batches)
        for _ in range(args.steps)
    ]
    for step, index in enumerate(indices, 1):
        x, y = shard(x_all[index]), shard(y_all[index])
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        if step % args.log_every == 0 or step == 1:
            line = f"step {step:4d}  loss {loss:>7f}"  # formatting a global tensor: every rank
            if rank == 0:
                print(line, flush=True)

    # The same training in one process, on the whole batch each step.
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=args.lr, momentum=0.9)
    for index in indices:
        ref_optimizer.zero_grad()
        loss_fn(reference(x_all[index]), y_all[index]).backward()
        ref_optimizer.step()

    with torch.no_grad():
        final_loss = loss_fn(model(shard(x_all)), shard(y_all)).item()
        ref_loss = loss_fn(reference(x_all), y_all).item()
    # The parameters are broadcast: every rank's local tensor is the whole parameter.
    matches = all(
        torch.allclose(p.to_local(), r, rtol=1e-4, atol=1e-5)
        for p, r in zip(model.parameters(), reference.parameters(), strict=True)
    ) and abs(final_loss - ref_loss) <= 1e-4 * max(1.0, abs(ref_loss))
    if rank == 0:
        print(f"final loss {final_loss:.4f}", flush=True)
        print(f"matches single-process training: {matches}", flush=True)


if __name__ == "__main__":
    main()
