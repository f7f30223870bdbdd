"""SBP rules for ATen ops, one module per op family (see NOTE [rules] in _registry.py), and
what a user needs to register a rule for an op of their own (docs/ops.md, "Adding a rule").

Importing this package registers every family.
"""

from . import (  # noqa: F401  (importing a family registers its rules)
    attention,
    factories,
    gather,
    matmul,
    nn_layers,
    nn_loss,
    nn_norm,
    nn_random,
    optim,
    padding,
    pointwise,
    reductions,
    storage,
    views,
)
from ._helpers import strategy
from ._registry import (
    LocalContext,
    OpInfo,
    Rule,
    Strategy,
    TensorMeta,
    bind,
    every_sbp,
    register,
    register_decomposition,
    registered_ops,
)

__all__ = [
    "LocalContext",
    "OpInfo",
    "Rule",
    "Strategy",
    "TensorMeta",
    "bind",
    "every_sbp",
    "register",
    "register_decomposition",
    "registered_ops",
    "strategy",
]
