"""Tensor-parallel training of an MLP: a column-parallel then a row-parallel Linear.

Run it on 2 ranks (tensor parallel), or on 4 to also train the same model data- and
tensor-parallel on a 2 x 2 mesh:

    python -m sbpflow.distributed.launch --nproc_per_node 2 examples/train_tensor_parallel.py
    python -m sbpflow.distributed.launch --nproc_per_node 4 examples/train_tensor_parallel.py

The layout of each parameter is given by a callable passed to ``Module.to_global``:

    fc1.weight [hidden, in]   S(0)  column parallel: each rank owns some hidden units
    fc1.bias   [hidden]       S(0)
    fc2.weight [out, hidden]  S(1)  row parallel: each rank reads only its hidden units
    fc2.bias   [out]          B

With a broadcast input, ``fc1`` gives hidden activations split along the feature dim
((B, S(1)) -> S(1), no communication), GELU keeps that split, and ``fc2`` contracts over
the split dim ((S(1), S(0)) -> P): each rank holds a partial sum of the output, reduced
once where the loss needs it. That is the Megatron-style MLP, written as a plain
``nn.Sequential``; the backward pass and ``optimizer.step()`` follow from the same rules.

On a 2 x 2 mesh ``[[0, 1], [2, 3]]`` axis 0 is data parallel and axis 1 tensor parallel:
each parameter is ``(B, <its layout above>)`` and the batch is ``(S(0), B)``.

Each variant ends by comparing its parameters with the same model trained in one process.
"""

from __future__ import annotations

import argparse
import copy
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import sbpflow
from sbpflow.sbp import broadcast, sbp_str, split

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def megatron_layout(name: str, tensor: torch.Tensor) -> Any:
    """The SBP of each parameter on the tensor-parallel axis (see the module docstring)."""
    if name in ("fc1.weight", "fc1.bias"):
        return split(0)  # column parallel: output features split
    if name == "fc2.weight":
        return split(1)  # row parallel: input features split
    return broadcast  # fc2.bias is added once, to the reduced output


def make_model(in_features: int, hidden: int, out_features: int) -> nn.Sequential:
    layers = [
        ("fc1", nn.Linear(in_features, hidden)),
        ("act", nn.GELU()),
        ("fc2", nn.Linear(hidden, out_features)),
    ]
    return nn.Sequential(OrderedDict(layers))


def make_batches(num_steps: int, batch_size: int) -> Batches:
    """Regression onto a fixed random teacher network (the same on every rank)."""
    teacher = make_model(16, 8, 4)
    batches = []
    for _ in range(num_steps):
        x = torch.randn(batch_size, 16)
        with torch.no_grad():
            batches.append((x, teacher(x)))
    return batches


def train(model: nn.Module, batches: list[tuple[Any, Any]], lr: float) -> torch.Tensor:
    """SGD with momentum over ``batches``; returns the last loss (global or plain)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss = torch.zeros(())
    for x, y in batches:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
    return loss


def run_variant(
    title: str,
    placement: sbpflow.Placement,
    param_sbp: Callable[[str, torch.Tensor], Any],
    batch_sbp: Any,
    reference: nn.Module,
    trained_reference: nn.Module,
    batches: Batches,
    lr: float,
) -> tuple[float, bool]:
    """Train a copy of ``reference`` laid out as ``param_sbp``; (last loss, matches)."""
    replicated = (broadcast,) * placement.ndim
    # The model is built whole on every rank, so it is made broadcast first (rank 0's
    # values), then boxed to its layout: B -> S(d) is a local slice, no communication.
    # (Converting a local module straight to split(d) would read each rank's tensor as
    # one shard, as for any local tensor.)
    model = copy.deepcopy(reference).to_global(placement, replicated)
    model.to_global(placement, param_sbp)
    global_batches = [
        (x.to_global(placement, replicated).to_global(sbp=batch_sbp),
         y.to_global(placement, replicated).to_global(sbp=batch_sbp))
        for x, y in batches
    ]  # fmt: skip
    loss = train(model, global_batches, lr)

    # Everything below reads logical values, a collective: every rank runs it.
    x = global_batches[0][0]
    hidden = model.act(model.fc1(x))
    matches = all(
        torch.allclose(torch.tensor(p.tolist()), r, rtol=1e-4, atol=1e-5)
        for p, r in zip(model.parameters(), trained_reference.parameters(), strict=True)
    )
    line = (
        f"{title} on {placement}: fc1.weight {sbp_str(model.fc1.weight.sbp)}, "
        f"hidden {sbp_str(hidden.sbp)}, fc2 output {sbp_str(model.fc2(hidden).sbp)}, "
        f"loss {loss:.6f}"
    )
    if sbpflow.env.get_rank() == 0:
        print(line, flush=True)
    return loss.item(), matches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()

    world_size = sbpflow.env.get_world_size()
    if world_size not in (2, 4):
        raise SystemExit(f"run this example on 2 or 4 ranks, not {world_size}")

    torch.manual_seed(0)  # the same initial model and data on every rank
    reference = make_model(16, 32, 4)
    batches = make_batches(args.steps, args.batch_size)
    trained_reference = copy.deepcopy(reference)
    ref_loss = train(trained_reference, batches, args.lr).item()

    # Tensor parallel on ranks 0 and 1 (with 4 ranks, ranks 2 and 3 sit this one out: a
    # rank outside a placement holds empty pieces and skips the ops).
    final_loss, matches = run_variant(
        "tensor parallel",
        sbpflow.placement("cpu", [0, 1]),
        megatron_layout,
        broadcast,
        reference,
        trained_reference,
        batches,
        args.lr,
    )
    results = [matches]
    if world_size == 4:
        final_loss, matches = run_variant(
            "data x tensor parallel",
            sbpflow.placement("cpu", [[0, 1], [2, 3]]),
            lambda name, t: (broadcast, megatron_layout(name, t)),
            (split(0), broadcast),
            reference,
            trained_reference,
            batches,
            args.lr,
        )
        results.append(matches)

    if sbpflow.env.get_rank() == 0:
        print(f"single process: loss {ref_loss:.6f}", flush=True)
        print(f"final loss {final_loss:.4f}", flush=True)
        print(f"matches single-process training: {all(results)}", flush=True)


if __name__ == "__main__":
    main()
