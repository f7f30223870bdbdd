"""sbpflow: global tensors with SBP layouts for PyTorch.

``tensor.to_global(placement, sbp)`` spreads a tensor over ranks; a boxing
engine turns one layout into another with collectives. See ``docs/``.
"""

# ``_global`` first: it is the class module the layers below import back (NOTE [tensor
# layers] in _global); ``_install`` adds ``to_global`` to torch's classes.
from . import _global, _install, boxing, checkpoint, env, nn, sbp, utils  # noqa: F401
from ._factories import (
    arange,
    empty,
    empty_like,
    full,
    full_like,
    manual_seed,
    ones,
    ones_like,
    rand,
    rand_like,
    randn,
    randn_like,
    zeros,
    zeros_like,
)
from ._visualize import visualize

# the function; its types: from sbpflow.auto_parallel import Plan
from .auto_parallel import auto_parallel
from .checkpoint import export_safetensors, load, save
from .placement import Placement, placement
from .tensor import GlobalTensor, is_global, to_global

__version__ = "0.1.0"

__all__ = [
    "GlobalTensor",
    "Placement",
    "arange",
    "auto_parallel",
    "boxing",
    "checkpoint",
    "empty",
    "empty_like",
    "env",
    "export_safetensors",
    "full",
    "full_like",
    "is_global",
    "load",
    "manual_seed",
    "nn",
    "ones",
    "ones_like",
    "placement",
    "rand",
    "rand_like",
    "randn",
    "randn_like",
    "save",
    "sbp",
    "to_global",
    "utils",
    "visualize",
    "zeros",
    "zeros_like",
]
