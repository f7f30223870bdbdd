"""DistributedDataParallel on local tensors: OneFlow's DDP program, run on 2 ranks.

    python -m sbpflow.distributed.launch --nproc_per_node 2 examples/ddp_linear.py

Each rank holds its own two samples of the linear system ``x @ w = y`` (whose solution
is ``w = [[2], [3]]``) and a whole copy of the model. ``ddp(m)`` broadcasts rank 0's
parameters, and after every ``backward()`` the gradients are the mean over the ranks
(reduced in buckets while backward runs), so both ranks take the same SGD steps and end
with the same ``w``. Attributes of the model read through the wrapper (``m.lr``,
``m.iter_count``), as in OneFlow.
"""

from __future__ import annotations

import torch

import sbpflow
from sbpflow.nn.parallel import DistributedDataParallel as ddp

train_x = [
    torch.tensor([[1, 2], [2, 3]], dtype=torch.float32),
    torch.tensor([[4, 6], [3, 1]], dtype=torch.float32),
]
train_y = [
    torch.tensor([[8], [13]], dtype=torch.float32),
    torch.tensor([[26], [9]], dtype=torch.float32),
]


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lr = 0.01
        self.iter_count = 500
        self.w = torch.nn.Parameter(torch.zeros(2, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


def main() -> None:
    rank = sbpflow.env.get_rank()
    if sbpflow.env.get_world_size() != 2:
        raise SystemExit("run this example on 2 ranks: --nproc_per_node 2")
    m = Model()
    m = ddp(m)
    loss = torch.nn.MSELoss(reduction="sum")
    optimizer = torch.optim.SGD(m.parameters(), m.lr)

    for i in range(m.iter_count):
        x, y = train_x[rank], train_y[rank]
        y_pred = m(x)
        loss_value = loss(y_pred, y)
        if (i + 1) % 100 == 0 and rank == 0:
            print(f"{i + 1}/{m.iter_count} loss: {loss_value.item():.6f}", flush=True)
        optimizer.zero_grad()
        loss_value.backward()
        optimizer.step()

    w = m.w.detach().flatten().tolist()
    print(f"rank {rank} w: [[{w[0]:.4f}], [{w[1]:.4f}]]", flush=True)


if __name__ == "__main__":
    main()
