"""What ``import sbpflow`` adds to torch.

# NOTE [what import sbpflow adds to torch]
# This is the one module that sets anything on torch's classes or module, and the
# one place outside a class's own module where a class gets a method
# (tests/unit/test_module_boundaries.py holds every other module to that):
# - ``torch.Tensor.to_global`` (a local tensor to a global one: ``sbpflow.tensor``)
#   and ``torch.Tensor.is_global`` (False; ``GlobalTensor`` says True);
# - ``torch.nn.Module.to_global`` (every parameter and buffer in place:
#   ``sbpflow.nn.module``);
# - ``GlobalTensor`` joins the tensor types torch.optim and ``clip_grad_norm_`` give
#   their foreach implementations (the two ``_foreach_supported_types`` lists, which
#   DTensor joins the same way; NOTE [foreach on the pieces] in ops/_foreach.py), so a
#   CUDA optimizer on global parameters takes foreach by default, as on plain ones.
# - data parallelism with nothing to call: one ``Discovery`` of ``sbpflow.nn.parallel``
#   becomes the handler the core's leaf gradient hooks show partial gradients to
#   (``bind_partial_gradients``, NOTE [data parallel by default] in nn/parallel/_default);
#   the core imports nothing of data parallelism, and importing ``sbpflow.nn.parallel``
#   binds nothing.
# ``GlobalTensor``'s own methods are in its class (NOTE [tensor layers] in _global),
# its pickling among them: ``torch.save`` stays torch's own function (NOTE [torch.save
# of global tensors] in ``sbpflow._saving``).
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import _foreach_supported_types as _optim_foreach_types
from torch.utils._foreach_utils import _foreach_supported_types as _utils_foreach_types

from ._global import GlobalTensor, bind_partial_gradients
from .nn.module import module_to_global_method
from .nn.parallel._default import Discovery
from .tensor import tensor_to_global

torch.Tensor.to_global = tensor_to_global  # type: ignore[attr-defined]
torch.Tensor.is_global = property(lambda self: False)  # type: ignore[attr-defined]
torch.nn.Module.to_global = module_to_global_method  # type: ignore[attr-defined]
for _supported in (_optim_foreach_types, _utils_foreach_types):
    if GlobalTensor not in _supported:
        _supported.append(GlobalTensor)
bind_partial_gradients(Discovery())
