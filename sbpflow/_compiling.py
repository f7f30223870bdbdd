"""Whether code runs inside a ``torch.compile`` trace (docs/compile.md).

Under ``torch.compile`` the ATen ops on global tensors are dispatched once,
while Dynamo and AOTAutograd trace them, on fake or functional local tensors;
the compiled graph then runs with no Python dispatch at all. What the
dispatch does while tracing must therefore be something the graph can hold
(functional collectives, NOTE [traced collectives] in comm/_functional.py) or
something that need not happen at run time (the metadata check, publishing the
user's line for timeout errors, recording ``boxing.trace``).
"""

from __future__ import annotations

import torch
from torch._guards import TracingContext
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

__all__ = ["compiling", "traced"]


def compiling() -> bool:
    """Whether a ``torch.compile`` trace (Dynamo or AOTAutograd) is under way."""
    return torch.compiler.is_compiling() or TracingContext.try_get() is not None


def traced(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor of a trace (fake or functional) or a trace is under way."""
    return isinstance(t, (FakeTensor, FunctionalTensor)) or compiling()
