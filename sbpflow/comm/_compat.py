"""Names of ``torch.distributed`` that differ between the torch versions sbpflow supports."""

from __future__ import annotations

import torch.distributed as dist

# torch 2.13 renamed the tensor-in/tensor-out collectives (the old names warn);
# 2.11 has only the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
