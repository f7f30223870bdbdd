"""Whether code runs inside a ``torch.compile`` trace (docs/compile.md).

# NOTE [compiled global tensors]
# ``GlobalTensor`` is a traceable wrapper subclass: ``__tensor_flatten__``
# gives its local piece and, as static context, its (layout, logical shape,
# dtype), which Dynamo's guards compare by value. Under ``torch.compile``
# the ATen ops on global tensors are dispatched once, while Dynamo and
# AOTAutograd trace them, on fake or functional local tensors; the compiled
# graph then runs with no Python dispatch at all. What the dispatch does while
# tracing must therefore be something the graph can hold (functional
# collectives, NOTE [traced collectives] in comm/_functional.py) or something
# that need not happen at run time (the metadata check, publishing the user's
# line for timeout errors, recording ``boxing.trace``). What cannot be either
# refuses to be traced: random ops other than dropout (the logical random state
# advances in Python; Dynamo then breaks the graph and runs them eagerly;
# dropout draws through an opaque op instead, NOTE [compiled dropout] in
# ops/nn_random.py), making a global
# tensor from local ones and explicit ``to_global`` boxing (graph breaks), boxing
# between placements (an error).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch._guards import TracingContext
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

__all__ = ["compiling", "graph_break", "never_a_compiled_frame", "traced"]

F = TypeVar("F", bound=Callable[..., Any])


def compiling() -> bool:
    """Whether a ``torch.compile`` trace (Dynamo or AOTAutograd) is under way."""
    return torch.compiler.is_compiling() or TracingContext.try_get() is not None


def traced(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor of a trace (fake or functional) or a trace is under way."""
    return isinstance(t, (FakeTensor, FunctionalTensor)) or compiling()


def never_a_compiled_frame(code: Any) -> None:
    """Keep torch.compile from compiling ``code``'s frame and every frame it calls.

    For sbpflow's own code that runs eagerly inside a compiled function (after
    a graph break): it must run as plain Python, not be traced as user code.
    (Ops Dynamo does trace reach the dispatcher from Dynamo's and AOTAutograd's
    own code, which this does not touch.) A flag on the code object, read by
    torch's frame evaluation in C: nothing is added to eager calls.
    """
    try:
        from torch._C._dynamo.eval_frame import (
            _FrameAction,
            _FrameExecStrategy,
            set_code_exec_strategy,
        )
    except ImportError:  # a torch built without Dynamo
        return
    skip = _FrameAction.SKIP
    set_code_exec_strategy(code, _FrameExecStrategy(skip, skip))


def graph_break(why: str) -> Callable[[F], F]:
    """Mark a function that torch.compile must call eagerly, between two graphs.

    What ``torch.compiler.disable`` does, without importing Dynamo (seconds) at
    ``import sbpflow`` and without its wrapper's cost on every eager call: Dynamo
    reads the marks when it meets a call to the function and breaks the graph.
    """

    def mark(fn: F) -> F:
        fn._torchdynamo_disable = True  # type: ignore[attr-defined]
        fn._torchdynamo_disable_msg = why  # type: ignore[attr-defined]
        never_a_compiled_frame(fn.__code__)
        return fn

    return mark
