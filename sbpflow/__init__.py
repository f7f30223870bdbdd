"""sbpflow: global tensors with SBP layouts for PyTorch.

``tensor.to_global(placement, sbp)`` spreads a tensor over ranks; a boxing
engine turns one layout into another with collectives. See ``docs/``.
"""

from . import boxing, env, nn, sbp, utils
from ._factories import arange, empty, full, manual_seed, ones, rand, randn, zeros
from ._visualize import visualize
from .nn import module as _module  # noqa: F401  (adds torch.nn.Module.to_global)
from .placement import Placement, placement
from .tensor import GlobalTensor, is_global, to_global

__version__ = "0.1.0"

__all__ = [
    "GlobalTensor",
    "Placement",
    "arange",
    "boxing",
    "empty",
    "env",
    "full",
    "is_global",
    "manual_seed",
    "nn",
    "ones",
    "placement",
    "rand",
    "randn",
    "sbp",
    "to_global",
    "utils",
    "visualize",
    "zeros",
]
