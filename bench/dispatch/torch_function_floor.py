"""The other road for a Python tensor subclass: intercept ``F.linear`` above autograd.

``run.py``'s **floor** is the least a ``__torch_dispatch__`` wrapper subclass
costs. A subclass could instead catch ``F.linear`` in ``__torch_function__``
and record one ``autograd.Function`` for the whole call, skipping the
dispatcher's per-ATen-op round trips. This script times the two unavoidable
parts of that road on plain tensors of the benchmark's local size (32x64 input,
64x64 weight and bias requiring grad), single process:

- **plain**: ``F.linear(x, w, b)``;
- **Function.apply**: the same computation recorded as one ``autograd.Function``;
- **__torch_function__ + apply**: reached through a subclass's ``__torch_function__``;
- **wrapper subclass: ...**: the same from wrapper-subclass inputs, the result
  wrapped as a new wrapper (what a global tensor needs), still without layouts.

A framework on this road pays at least the last row's overhead, and every
attribute read of its tensors (``.shape``, ``.grad``, ...) becomes a Python
call too. Compare it with half of DTensor's linear overhead in
docs/benchmarks.md (same machine).

Run: ``python bench/dispatch/torch_function_floor.py``
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x, w = ctx.saved_tensors
        return grad @ w, grad.t() @ x, grad.sum(0)


class _Wrapper(torch.Tensor):
    """A wrapper subclass (the form a global tensor takes) that catches ``F.linear``."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor, requires_grad: bool = False) -> _Wrapper:
        self = torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, dtype=inner.dtype, requires_grad=requires_grad
        )
        self.inner = inner
        return self

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is F.linear:
            return _WrappedLinear.apply(*args)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise NotImplementedError(f"{func}: only F.linear is caught in this measurement")


class _WrappedLinear(torch.autograd.Function):
    """One autograd node for the whole call: unwrap, compute, wrap."""

    @staticmethod
    def forward(ctx: Any, x: _Wrapper, w: _Wrapper, b: _Wrapper) -> _Wrapper:
        return _Wrapper(F.linear(x.inner, w.inner, b.inner))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError("forward only in this measurement")


class _Intercepting(torch.Tensor):
    inner: torch.Tensor

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is F.linear:
            return _Linear.apply(*[a.inner if isinstance(a, _Intercepting) else a for a in args])
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _per_call_us(
    fn: Callable[[], Any], calls: int = 3000, samples: int = 15
) -> tuple[float, float]:
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return min(times), statistics.median(times)


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(32, 64)
    w = torch.randn(64, 64, requires_grad=True)
    b = torch.randn(64, requires_grad=True)
    wrapped = torch.Tensor._make_subclass(_Intercepting, x)
    wrapped.inner = x
    xg, wg, bg = _Wrapper(x), _Wrapper(w.detach(), True), _Wrapper(b.detach(), True)
    rows = {
        "plain": lambda: F.linear(x, w, b),
        "Function.apply": lambda: _Linear.apply(x, w, b),
        "__torch_function__ + apply": lambda: F.linear(wrapped, w, b),
        "wrapper subclass: __torch_function__ + apply + wrap": lambda: F.linear(xg, wg, bg),
    }
    plain = None
    print("| path | µs per call (min / median) | overhead over plain µs (min / median) |")
    print("|---|---|---|")
    for name, fn in rows.items():
        lo, mid = _per_call_us(fn)
        plain = plain or (lo, mid)
        print(f"| {name} | {lo:.1f} / {mid:.1f} | {lo - plain[0]:.1f} / {mid - plain[1]:.1f} |")


if __name__ == "__main__":
    main()
