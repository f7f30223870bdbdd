"""SBP rules for ATen ops, one module per op family (see NOTE [rules] in _registry.py).

Importing this package registers every family.
"""

from . import pointwise  # noqa: F401
