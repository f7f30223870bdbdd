"""Run torch's OpInfo database on global tensors and list every result that differs from torch.

Every op in ``torch.testing._internal.common_methods_invocations.op_db`` that supports
float32 on CPU runs on its first sample inputs, with the sample's input laid out as B, S(0),
S(-1) and (with ``--partial``) P over two ranks and its other tensor arguments broadcast. The
logical result is compared with the same op on plain tensors in the same process. Float
inputs are rounded to multiples of 2**-8 first, so a partial-sum input's parts add up to it
exactly and only the layout differs between the two computations. (One difference remains
by construction: where the value is -0.0, parts summing to it give +0.0, so ``signbit`` of
such a P input differs.)

A result that differs from torch without an error is a silent wrong result: the worst bug
sbpflow can have. An op that raises is listed apart (an error is acceptable, a wrong value
is not). Random ops and ops returning uninitialised memory are skipped: their values cannot
be compared.

Usage (needs ``pip install expecttest``, which torch's test database imports)::

    python -m sbpflow.distributed.launch --nproc_per_node 2 tools/opinfo_sweep.py --partial
    python -m sbpflow.distributed.launch --nproc_per_node 2 tools/opinfo_sweep.py --inplace
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.testing._internal.common_methods_invocations import op_db

import sbpflow
from sbpflow.sbp import broadcast, partial_sum, split

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.dist._ops_support import grid, logical, make, mismatch

PLACEMENT = sbpflow.placement("cpu", [0, 1])
RANDOM = {
    "bernoulli", "cauchy", "exponential", "geometric", "log_normal", "multinomial", "normal",
    "rand_like", "randint", "randint_like", "randn_like", "uniform",
}  # fmt: skip


def _skipped(name: str) -> bool:
    """Random ops and ops returning uninitialised memory: their values cannot be compared."""
    words = ("dropout", "empty", "rrelu", "multi_head_attention")  # the last samples dropout 0.5
    return name in RANDOM or any(word in name for word in words)


def _broadcast_args(x: Any) -> Any:
    """Dense float tensors in ``x`` as broadcast globals; index tensors and the rest stay plain."""
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.layout == torch.strided:
        return sbpflow.to_global(x.clone(), PLACEMENT, broadcast, check_meta=False)
    if isinstance(x, (list, tuple)):
        return type(x)(_broadcast_args(v) for v in x)
    if isinstance(x, dict):
        return {k: _broadcast_args(v) for k, v in x.items()}
    return x


def _layouts(x: Any, partial: bool) -> dict[str, Any]:
    layouts: dict[str, Any] = {"B": broadcast}
    if not isinstance(x, torch.Tensor) or x.layout != torch.strided or not x.is_floating_point():
        return layouts
    if x.dim() >= 1 and x.shape[0] >= 2:
        layouts["S(0)"] = split(0)
    if x.dim() >= 2 and x.shape[-1] >= 2:
        layouts["S(-1)"] = split(x.dim() - 1)
    if partial:
        layouts["P"] = partial_sum
    return layouts


def _variant(op: Any, inplace: bool) -> Any:
    """The op's function, or its in-place variant returning the input it wrote."""
    if not inplace:
        return op.op
    write = op.inplace_variant

    def run(x: Any, *args: Any, **kwargs: Any) -> Any:
        write(x, *args, **kwargs)
        return x

    return run


def sweep(max_samples: int, partial: bool, inplace: bool) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {"wrong": [], "raised": [], "ok": []}
    for op in op_db:
        if _skipped(op.name) or (inplace and op.inplace_variant is None):
            continue
        if torch.float32 not in op.supported_dtypes("cpu"):
            continue
        fn = _variant(op, inplace)
        torch.manual_seed(0)
        samples = list(op.sample_inputs("cpu", torch.float32))[:max_samples]
        for i, sample in enumerate(samples):
            x = sample.input
            if not isinstance(x, torch.Tensor):
                continue
            if x.is_floating_point() and x.layout == torch.strided:
                x = grid(x)  # P's parts then sum to it exactly (NOTE in tests/dist/_ops_support)
            try:  # on a fresh copy: a view's storage offset is not part of its global value
                want = fn(x.clone(), *sample.args, **sample.kwargs)
            except Exception:
                continue  # torch itself rejects the sample
            for name, sbp in _layouts(x, partial).items():
                tag = f"{op.name}.{op.variant_test_name}[{i}] {name}"
                try:
                    g = make(x.detach().clone(), PLACEMENT, sbp, 3)
                    got = logical(
                        fn(g, *_broadcast_args(sample.args), **_broadcast_args(sample.kwargs))
                    )
                except Exception as error:
                    found["raised"].append(f"{tag}: {type(error).__name__}: {error}"[:300])
                    continue
                why = mismatch(got, want, atol=1e-4, rtol=1e-4)
                found["wrong" if why else "ok"].append(f"{tag}: {why}" if why else tag)
                if why and sbpflow.env.get_rank() == 0:
                    print(f"WRONG {tag}: {why}", flush=True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=2, help="sample inputs per op (default 2)")
    parser.add_argument("--partial", action="store_true", help="also a partial-sum input")
    parser.add_argument("--inplace", action="store_true", help="the ops' in-place variants")
    parser.add_argument("--out", type=Path, help="write the findings as JSON (rank 0)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    found = sweep(args.samples, args.partial, args.inplace)
    if sbpflow.env.get_rank() == 0:
        print(f"{len(found['ok'])} equal torch, {len(found['wrong'])} differ, "
              f"{len(found['raised'])} raised")  # fmt: skip
        for line in found["raised"]:
            print("raised:", line.replace("\n", " ")[:200])
        if args.out:
            args.out.write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
