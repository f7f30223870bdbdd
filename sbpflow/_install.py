"""What ``import sbpflow`` adds to torch.

# NOTE [what import sbpflow adds to torch]
# This is the one module that sets anything on torch's classes or module, and the
# one place outside a class's own module where a class gets a method
# (tests/unit/test_module_boundaries.py holds every other module to that):
# - ``torch.Tensor.to_global`` (a local tensor to a global one: ``sbpflow.tensor``)
#   and ``torch.Tensor.is_global`` (False; ``GlobalTensor`` says True);
# - ``torch.nn.Module.to_global`` (every parameter and buffer in place:
#   ``sbpflow.nn.module``).
# ``GlobalTensor``'s own methods are in its class (NOTE [tensor layers] in _global),
# its pickling among them: ``torch.save`` stays torch's own function (NOTE [torch.save
# of global tensors] in ``sbpflow._saving``).
"""

from __future__ import annotations

import torch

from .nn.module import module_to_global_method
from .tensor import tensor_to_global

torch.Tensor.to_global = tensor_to_global  # type: ignore[attr-defined]
torch.Tensor.is_global = property(lambda self: False)  # type: ignore[attr-defined]
torch.nn.Module.to_global = module_to_global_method  # type: ignore[attr-defined]
