"""Data parallelism with global tensors: a small CNN learns scikit-learn's handwritten digits.

    pip install torch==2.13.0 -e ".[examples]"
    python -m sbpflow.distributed.launch --nproc_per_node 2 examples/data_parallel.py

Launched with one rank (``--nproc_per_node 1``) the same script is single-process training
on the same global batches: the reference the distributed run must match.

The whole program is ordinary PyTorch plus four lines of layout:

    model.to_global(placement, broadcast)       # the parameters: rank 0's, on every rank
    sampler = DistributedSampler(train_set, placement)   # each rank reads its own share
    x, y = to_global_batch((x, y), placement)   # the ranks' batches: one logical batch, S(0)
    correct = (model(x).argmax(1) == y).sum()   # a partial sum; .item() adds up the ranks

Everything else follows from the layouts. The convolutions run on each rank's slice of the
batch; BatchNorm normalises with the statistics of the whole logical batch; the mean loss
divides by the global batch size; each parameter's gradient, a partial sum over the ranks,
is all-reduced on its way into ``.grad``; and ``torch.optim`` updates the broadcast
parameters locally. Mixed precision is plain ``torch.autocast`` (bfloat16 on CPU, float16
on CUDA) with ``torch.amp.GradScaler``, whose inf check agrees on every rank. Metrics
computed on global tensors are logical values: ``.item()`` reduces them over the ranks.

The last lines printed (on rank 0) are the final test accuracy and loss and a checksum of
the parameters and buffers; run with 1 and with 2 ranks and compare them (``--precision fp32`` makes
them agree to float32 rounding; with bfloat16 each rank rounds its share of a gradient on
its own, so the runs agree to about bfloat16's precision).

``--save-every-epoch DIR`` saves the training state (model, optimizer, GradScaler, epoch)
after each epoch to ``DIR/epoch-N`` with ``sbpflow.save``; ``--resume DIR/epoch-N`` loads it
with ``sbpflow.load`` and trains the remaining epochs, ending exactly where the run that
never stopped ends.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import sbpflow
from sbpflow.env import print0
from sbpflow.sbp import broadcast
from sbpflow.utils.data import DistributedSampler, to_global_batch

try:  # a progress bar on rank 0 when tqdm is installed; nothing changes without it
    from tqdm import tqdm
except ImportError:  # pragma: no cover - depends on the environment
    tqdm = None


def digits(device: torch.device) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's 1797 8x8 digit images (shipped with it: no download), scaled to
    [0, 1], cut into 1440 training and 357 test images by a fixed shuffle."""
    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32, device=device).unsqueeze(1) / 16.0
    labels = torch.tensor(data.target, dtype=torch.int64, device=device)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    train, test = order[:1440].to(device), order[1440:].to(device)
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])


class Net(nn.Module):
    """Two 3x3 convolutions with BatchNorm, a 2x2 max-pool and a linear classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


def progress(batches: Iterable[Any], total: int, description: str) -> Iterator[Any]:
    """``batches`` with a tqdm bar on rank 0 (when tqdm is installed)."""
    if tqdm is None or sbpflow.env.get_rank() != 0:
        return iter(batches)
    return iter(tqdm(batches, total=total, desc=description, leave=False, file=sys.stderr))


def evaluate(
    model: nn.Module, test_set: TensorDataset, placement: sbpflow.Placement
) -> tuple[float, float]:
    """(accuracy, mean loss) on the whole test set, each rank evaluating its own share.

    Each rank takes a balanced slice of the test set (no padding, so no image counts twice);
    the slices form one logical batch split along dim 0. The summed loss and the count of
    correct predictions are partial sums over the ranks, and ``.item()`` returns their
    logical value, the total, on every rank.
    """
    x_all, y_all = test_set.tensors
    rank, num_ranks = sbpflow.env.get_rank(), sbpflow.env.get_world_size()
    x, y = to_global_batch(
        (torch.tensor_split(x_all, num_ranks)[rank], torch.tensor_split(y_all, num_ranks)[rank]),
        placement,
    )
    model.eval()
    with torch.no_grad():
        logits = model(x)
        loss = F.cross_entropy(logits.float(), y, reduction="sum").item()
        correct = (logits.argmax(1) == y).sum().item()
    model.train()
    return correct / len(y_all), loss / len(y_all)


def checksum(model: nn.Module) -> float:
    """A weighted sum of every parameter and buffer (a logical value: the same on every rank)."""
    total = 0.0
    for k, t in enumerate(model.state_dict().values()):
        if t.is_floating_point():
            total += (k + 1) * t.double().abs().sum().item()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32, help="global batch per step")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--precision",
        choices=["amp", "fp32"],
        default="amp",
        help="amp: autocast (bfloat16 on cpu, float16 on cuda) with GradScaler",
    )
    parser.add_argument("--save-every-epoch", metavar="DIR", help="checkpoint to DIR/epoch-N")
    parser.add_argument("--resume", metavar="PATH", help="load this checkpoint and go on")
    args = parser.parse_args()
    if (args.save_every_epoch or args.resume) and not hasattr(sbpflow, "save"):
        parser.error(
            "--save-every-epoch and --resume need sbpflow.save and sbpflow.load "
            "(sbpflow.checkpoint), which this installation of sbpflow does not have"
        )

    num_ranks = sbpflow.env.get_world_size()
    if args.batch_size % num_ranks:
        parser.error(f"--batch-size {args.batch_size} must be a multiple of {num_ranks} ranks")
    placement = sbpflow.placement(args.device, list(range(num_ranks)))
    device = torch.device("cpu")
    if args.device == "cuda":  # rank r uses GPU LOCAL_RANK, as sbpflow does
        device = torch.device("cuda", sbpflow.env.get_local_rank() % torch.cuda.device_count())

    train_set, test_set = digits(device)
    torch.manual_seed(0)  # the same initial model on every rank, whatever the world size
    model = Net().to(device).to_global(placement, broadcast)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    amp_dtype = torch.bfloat16 if args.device == "cpu" else torch.float16
    use_amp = args.precision == "amp"
    scaler = torch.amp.GradScaler(args.device, enabled=use_amp)

    # The whole training state; sbpflow.load fills it in place (any world size or layout).
    state = {"model": model, "optimizer": optimizer, "scaler": scaler, "epoch": 0}
    if args.resume:
        sbpflow.load(args.resume, state)

    # Each rank reads batch_size / num_ranks images per step; to_global_batch joins them.
    sampler = DistributedSampler(train_set, placement, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=args.batch_size // num_ranks, sampler=sampler)
    print0(
        f"training on {num_ranks} rank(s) of {placement}, global batch {args.batch_size}, "
        f"{args.precision}"
    )
    for epoch in range(state["epoch"], args.epochs):
        sampler.set_epoch(epoch)  # reshuffle: the same permutation on every rank
        total_loss = 0.0  # becomes a global tensor: summed without communication
        for x, y in progress(loader, len(loader), f"epoch {epoch + 1}"):
            x, y = to_global_batch((x, y), placement)
            optimizer.zero_grad()
            with torch.autocast(args.device, dtype=amp_dtype, enabled=use_amp):
                loss = F.cross_entropy(model(x), y)  # the mean over the whole global batch
            scaler.scale(loss).backward()
            scaler.step(optimizer)  # skipped on every rank if any rank saw an inf
            scaler.update()
            total_loss = total_loss + loss.detach().float()
        accuracy, test_loss = evaluate(model, test_set, placement)
        print0(
            f"epoch {epoch + 1}: train loss {float(total_loss) / len(loader):.4f}, "
            f"test loss {test_loss:.4f}, test accuracy {accuracy:.4f}"
        )
        if args.save_every_epoch:
            state["epoch"] = epoch + 1
            sbpflow.save(state, f"{args.save_every_epoch}/epoch-{epoch + 1}")
    accuracy, test_loss = evaluate(model, test_set, placement)
    print0(f"final test accuracy {accuracy:.4f}")
    print0(f"final test loss {test_loss:.6f}")
    print0(f"parameter checksum {checksum(model):.6f}")


if __name__ == "__main__":
    main()
