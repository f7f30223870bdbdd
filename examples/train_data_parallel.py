"""Data-parallel training of a small MLP, with sbpflow averaging the gradients.

Run it on 4 ranks (CPU, gloo):

    python -m sbpflow.distributed.launch --nproc_per_node 4 examples/train_data_parallel.py

Every rank seeds identically and so builds the same model and the same synthetic data set,
then trains on its own shard of the data. Loss and gradients are computed locally with plain
PyTorch; sbpflow turns each rank's gradient into one logical, averaged gradient:

    g.to_global(placement, partial_sum)   # the logical gradient is the sum of the ranks' grads
     .to_global(sbp=broadcast)            # P -> B: one all_reduce
     .to_local() / world_size             # every rank now holds the same average

Because every rank applies the same averaged gradient, the replicas never drift apart; the
script checks that at the end by gathering a checksum of the parameters from every rank
(S(0) -> B: one all_gather).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import sbpflow
from sbpflow.sbp import broadcast, partial_sum, split


def make_dataset(num_samples: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A smooth nonlinear regression target with a little noise (same on every rank)."""
    x = torch.randn(num_samples, in_features)
    w = torch.linspace(-1.0, 1.0, in_features)
    y = torch.sin(x @ w).unsqueeze(1) + 0.1 * x[:, :1] ** 2 + 0.01 * torch.randn(num_samples, 1)
    return x, y


def average_gradients(model: nn.Module, placement: sbpflow.Placement, world_size: int) -> None:
    """Replace each parameter's local gradient with the mean over all ranks."""
    for param in model.parameters():
        if param.grad is None:
            continue
        summed = param.grad.to_global(placement, partial_sum).to_global(sbp=broadcast)
        param.grad = summed.to_local() / world_size


def parameter_checksums(model: nn.Module, placement: sbpflow.Placement) -> torch.Tensor:
    """Every rank's parameter checksum, gathered on every rank (one entry per rank)."""
    with torch.no_grad():
        local = torch.stack([p.double().sum() for p in model.parameters()]).sum().reshape(1)
    return local.to_global(placement, split(0)).to_global(sbp=broadcast).to_local()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args()

    rank = sbpflow.env.get_rank()
    world_size = sbpflow.env.get_world_size()
    placement = sbpflow.placement("cpu", list(range(world_size)))

    torch.manual_seed(0)  # the same model and data on every rank
    in_features = 8
    x, y = make_dataset(2048, in_features)
    model = nn.Sequential(nn.Linear(in_features, 64), nn.Tanh(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.MSELoss()

    # This rank's shard, by sbpflow's balanced rule (tensor_split uses the same one).
    x_local = torch.tensor_split(x, world_size)[rank]
    y_local = torch.tensor_split(y, world_size)[rank]
    if rank == 0:
        print(
            f"training on {world_size} rank(s), {x_local.shape[0]} samples per rank, "
            f"placement {placement}",
            flush=True,
        )

    generator = torch.Generator().manual_seed(1 + rank)  # each rank draws its own batches
    for step in range(1, args.steps + 1):
        index = torch.randint(0, x_local.shape[0], (args.batch_size,), generator=generator)
        optimizer.zero_grad()
        loss = loss_fn(model(x_local[index]), y_local[index])
        loss.backward()
        average_gradients(model, placement, world_size)
        optimizer.step()
        if rank == 0 and (step % args.log_every == 0 or step == 1):
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)

    checksums = parameter_checksums(model, placement)
    assert torch.all(checksums == checksums[0]), f"replicas diverged: {checksums.tolist()}"
    with torch.no_grad():
        final_loss = loss_fn(model(x), y).item()
    if rank == 0:
        print(f"parameters identical on all {world_size} ranks", flush=True)
        print(f"final loss {final_loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
