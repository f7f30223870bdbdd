"""Communication: the only layer of sbpflow that calls ``torch.distributed``."""

from ._world import ensure_initialized, get_local_rank, get_rank, get_world_size

__all__ = ["ensure_initialized", "get_local_rank", "get_rank", "get_world_size"]
