"""SBP rules for ATen ops, one module per op family (see NOTE [rules] in _registry.py).

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
