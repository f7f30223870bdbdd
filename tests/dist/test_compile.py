"""Training steps of global models under ``torch.compile`` against eager and single-process runs.

An MLP and a transformer block (the models of test_training.py) train for a
few SGD steps laid out as data parallel (parameters ``B``, batch ``S(0)``),
tensor parallel (column- then row-parallel Linears) and DP x TP on a 2x2 mesh.
Each run trains three copies from the same weights on the same batches:

- the single-process reference: a plain model on the whole batch;
- sbpflow eager: the global model;
- sbpflow compiled: the global model under ``torch.compile`` (forward and
  backward compiled; the optimizer step stays eager).

Losses and final parameters of the compiled run must equal both others within
1e-5, the model must compile as one graph (no graph break), and a run that
changes the batch size part-way must compile once per batch size, not per step.
Compilation is slow on a 2-core machine, so most cases use the ``aot_eager``
backend (Dynamo and AOTAutograd, which is where global tensors are desugared);
one case runs Inductor's C++ backend end to end.
"""

from __future__ import annotations

import collections
import copy
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._inductor.compile_fx import compile_fx, compile_fx_inner

import sbpflow
from sbpflow.sbp import Broadcast, Split
from sbpflow.testing import get_pool
from tests.dist.test_training import MLP, Block, _batch, _loss, _tensor_parallel

S0, B = Split(0), Broadcast()
_STEPS = 3
_TOL = 1e-5
_LR = 0.1


# The functional collectives a compiled graph holds, by the name boxing gives them.
_FUNCTIONAL = {
    "all_gather_into_tensor": "all_gather",
    "all_reduce": "all_reduce",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
}


class _Backend:
    """``backend`` ("aot_eager" or "inductor") counting the frames it compiles and the
    collectives in the forward and backward graphs AOTAutograd gives it."""

    def __init__(self, backend: str) -> None:
        self.frames = 0
        self.collectives: collections.Counter[str] = collections.Counter()
        self.other_c10d: list[str] = []  # process-group calls that are not functional: none
        if backend == "aot_eager":
            self._compile: Any = aot_autograd(
                fw_compiler=self._count_then(lambda gm, _: make_boxed_func(gm.forward)),
                bw_compiler=self._count_then(lambda gm, _: make_boxed_func(gm.forward)),
            )
        else:
            inner = self._count_then(compile_fx_inner)
            self._compile = lambda gm, inputs: compile_fx(gm, inputs, inner_compile=inner)

    def _count_then(self, compile_graph: Any) -> Any:
        def count(gm: torch.fx.GraphModule, inputs: Any, **kwargs: Any) -> Any:
            for node in gm.graph.nodes:
                target = str(node.target)
                if node.op == "call_function" and "c10d" in target:
                    namespace, name = target.split(".")[:2]
                    if namespace == "_c10d_functional" and name in _FUNCTIONAL:
                        self.collectives[_FUNCTIONAL[name]] += 1
                    elif name != "wait_tensor":
                        self.other_c10d.append(target)
            return compile_graph(gm, inputs, **kwargs)

        return count

    def __call__(self, gm: torch.fx.GraphModule, inputs: Any) -> Any:
        self.frames += 1
        return self._compile(gm, inputs)


def _data_parallel(name: str, t: torch.Tensor) -> Any:
    return B


def _global_batch(t: torch.Tensor, placement: sbpflow.Placement, sbp: Any) -> torch.Tensor:
    """The whole batch laid out as ``sbp``: each rank passes the whole batch, boxed to ``sbp``."""
    full = (B,) * placement.ndim
    return t.to_global(placement, full).to_global(sbp=sbp)


def _sgd(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p -= _LR * p.grad
            p.grad = None


def _logical(t: torch.Tensor) -> torch.Tensor:
    """The logical value of a global tensor, on every rank (a collective)."""
    return t.to_global(sbp=(B,) * len(t.sbp), check_meta=False).to_local().detach()


def _train(
    model_name: str,
    placement: sbpflow.Placement,
    param_sbp: Any,
    batch_sbp: Any,
    backend: str,
    batch_sizes: tuple[int, ...] = (8,),
) -> dict[str, Any]:
    """Train reference, eager and compiled copies ``_STEPS`` steps per batch size."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = {"mlp": MLP, "block": Block}[model_name]()
    full = (B,) * placement.ndim
    eager = copy.deepcopy(reference).to_global(placement, full).to_global(placement, param_sbp)
    compiled = copy.deepcopy(eager)
    counting = _Backend(backend)
    step_fn = torch.compile(compiled, backend=counting)
    x_all, y_all = _batch(model_name)
    losses, fallbacks, collectives = [], [], []
    for size in batch_sizes:
        x, y = x_all[:size], y_all[:size]
        gx, gy = _global_batch(x, placement, batch_sbp), _global_batch(y, placement, batch_sbp)
        for step in range(_STEPS):
            want = _loss(model_name, reference(x), y)
            want.backward()
            with sbpflow.boxing.trace() as eager_trace:
                got_eager = _loss(model_name, eager(gx), gy)
                got_eager.backward()
            # A compiled step runs its graph's collectives (counted when it is compiled, at
            # the first step of each batch size) and those of the eager rest (the loss, the
            # gradients' boxing hooks), which boxing.trace records; tracing records nothing.
            before = counting.collectives.copy()
            with sbpflow.boxing.trace() as compiled_trace:
                got = _loss(model_name, step_fn(gx), gy)
                got.backward()
            if step == 0:
                graph = counting.collectives - before
            fallbacks += compiled_trace.fallbacks
            ran = compiled_trace.collectives() + graph
            collectives.append((dict(ran), dict(eager_trace.collectives())))
            losses.append((got.item(), got_eager.item(), want.item()))
            for m in (reference, eager, compiled):
                _sgd(m)
    explained = torch._dynamo.explain(compiled)(gx)
    errors = {}
    for (name, p_ref), p_eager, p_comp in zip(
        reference.named_parameters(), eager.parameters(), compiled.parameters(), strict=True
    ):
        value = _logical(p_comp)
        errors[name] = max(
            (value - p_ref.detach()).abs().max().item(),
            (value - _logical(p_eager)).abs().max().item(),
        )
    torch._dynamo.reset()
    return {
        "losses": losses,
        "param_errors": errors,
        "frames": counting.frames,
        "fallbacks": fallbacks,
        "other_c10d": counting.other_c10d,
        "graph_collectives": dict(counting.collectives),  # summed over compiled graphs
        "collectives": collectives,
        "graph_breaks": explained.graph_break_count,
        "graphs": explained.graph_count,
    }


def _boxing_and_dropout() -> dict[str, Any]:
    """Compiled against eager from the same seed: a Megatron-style row-parallel matmul whose
    partial output ``relu`` needs reduced (boxing the op needs: in the graph); the same with an
    explicit ``to_global`` (a graph break); then dropout (in the graph: its masks drawn from
    sbpflow's logical random state when the graph runs); and a global tensor made from local pieces
    inside the compiled function (a graph break)."""
    torch._dynamo.reset()
    pl = _world()
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(4, 6, generator=gen), torch.randn(5, 6, generator=gen)
    gx = _global_batch(x, pl, Split(1))
    gw = _global_batch(w, pl, Split(1))
    x_piece = x.tensor_split(pl.num_ranks, dim=1)[sbpflow.env.get_rank()].contiguous()

    def implicit(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ gw.t())

    def explicit(x: torch.Tensor) -> torch.Tensor:
        return torch.relu((x @ gw.t()).to_global(sbp=B))

    def dropout(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(implicit(x), 0.5, training=True) * 3

    def from_local(x: torch.Tensor) -> torch.Tensor:
        return implicit(sbpflow.to_global(x, pl, Split(1)))

    counting = _Backend("aot_eager")
    out: dict[str, Any] = {}
    cases = {
        "implicit": implicit,
        "explicit": explicit,
        "dropout": dropout,
        "from_local": from_local,
    }
    for name, fn in cases.items():
        arg = x_piece if name == "from_local" else gx
        sbpflow.manual_seed(5)
        compiled_fn = torch.compile(fn, backend=counting)
        got = [_logical(compiled_fn(arg)) for _ in range(2)]  # two draws: different masks
        sbpflow.manual_seed(5)
        want = [_logical(fn(arg)) for _ in range(2)]
        explained = torch._dynamo.explain(fn)(arg)
        out[name] = {
            "errors": [(g - w).abs().max().item() for g, w in zip(got, want, strict=True)],
            "draws_differ": not torch.equal(got[0], got[1]),
            "graph_breaks": explained.graph_break_count,
            "graphs": explained.graph_count,
        }
    with sbpflow.boxing.trace() as eager:
        implicit(gx)
    out["eager_collectives"] = dict(eager.collectives())
    out["single_process"] = (_logical(implicit(gx)) - torch.relu(x @ w.t())).abs().max().item()
    out["in_graph"] = dict(counting.collectives)
    torch._dynamo.reset()
    return out


def _padding_mask(padding: torch.Tensor) -> torch.Tensor:
    """A causal mask anded with a padding mask, the way Hugging Face ``sdpa_mask`` builds it:
    plain index tensors (made inside the function, so plain in a trace too) index the padding
    mask, and a plain causal mask joins the result."""
    batch, length = padding.shape
    rows = torch.arange(batch)[:, None, None, None]
    queries = torch.arange(length)[None, None, :, None]
    keys = torch.arange(length)[None, None, None, :]
    causal = keys <= queries  # plain (1, 1, L, L)
    return (causal & padding[rows, keys]).expand(batch, -1, length, length)


def _masked_attention(scores: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
    """Attention probabilities under that mask, as Hugging Face's eager attention adds it."""
    allowed = _padding_mask(padding)
    return torch.softmax(scores + torch.where(allowed, 0.0, torch.finfo(scores.dtype).min), -1)


def _plain_tensors_join() -> dict[str, Any]:
    """A plain tensor next to a global one joins as broadcast: under torch.compile (where it is
    a fake tensor) as in eager, and as an nn.Parameter."""
    torch._dynamo.reset()
    pl = _world()
    padding = torch.ones(8, 7, dtype=torch.bool)
    padding[1, 5:] = padding[6, 6:] = False
    g_padding = _global_batch(padding, pl, S0)
    want = _padding_mask(padding)
    eager = _padding_mask(g_padding)
    compiled = torch.compile(_padding_mask, backend="aot_eager")(g_padding)
    gen = torch.Generator().manual_seed(3)  # the same values on every rank
    scores = torch.randn(8, 4, 7, 7, generator=gen)
    # Inductor's C++ code generation once stopped here (NOTE [bool buffers]).
    attention = torch.compile(_masked_attention)(_global_batch(scores, pl, S0), g_padding)
    x = torch.randn(8, 1, 1, 7, generator=gen)
    weight = nn.Parameter(torch.randn(1, 1, 7, 7, generator=gen))
    with_parameter = _global_batch(x, pl, B) + weight
    torch._dynamo.reset()
    return {
        name: {
            "sbp": str(t.sbp),
            "local_shape": tuple(t.to_local().shape),
            "expected_local_shape": t._layout.local_shape(tuple(t.shape), sbpflow.env.get_rank()),
            "error": (_logical(t).float() - ref.float()).abs().max().item(),
        }
        for name, t, ref in (
            ("eager", eager, want),
            ("compiled", compiled, want),
            ("parameter", with_parameter, x + weight.detach()),
            ("inductor attention", attention, _masked_attention(scores, padding)),
        )
    }


def _world() -> sbpflow.Placement:
    return sbpflow.placement("cpu", list(range(sbpflow.env.get_world_size())))


def one_dim_job() -> list[tuple[str, dict[str, Any]]]:
    """Data and tensor parallel on 2 ranks; one Inductor case and one that changes batch size."""
    pl = _world()
    return [
        ("DP mlp inductor", _train("mlp", pl, _data_parallel, S0, "inductor")),
        ("DP block", _train("block", pl, _data_parallel, S0, "aot_eager", (8, 4))),
        ("TP mlp", _train("mlp", pl, _tensor_parallel, B, "aot_eager")),
        ("TP block", _train("block", pl, _tensor_parallel, B, "aot_eager")),
    ]


def mesh_job() -> list[tuple[str, dict[str, Any]]]:
    pl = sbpflow.placement("cpu", [[0, 1], [2, 3]])

    def params(name: str, t: torch.Tensor) -> Any:
        return (B, _tensor_parallel(name, t))

    return [
        (f"2x2 DP x TP {m}", _train(m, pl, params, (S0, B), "aot_eager")) for m in ("mlp", "block")
    ]


def _check(results: list[list[tuple[str, dict[str, Any]]]]) -> None:
    for rank, per_rank in enumerate(results):
        for label, got in per_rank:
            where = f"rank {rank}, {label}"
            for step, (loss, eager, want) in enumerate(got["losses"]):
                assert loss == pytest.approx(want, abs=_TOL, rel=_TOL), (where, step, got["losses"])
                assert loss == pytest.approx(eager, abs=_TOL, rel=_TOL), (
                    where,
                    step,
                    got["losses"],
                )
            bad = {n: e for n, e in got["param_errors"].items() if e > _TOL}
            assert not bad, f"{where}: parameters differ: {bad}"
            assert got["graph_breaks"] == 0 and got["graphs"] == 1, (where, got)
            assert not got["fallbacks"], (where, got["fallbacks"])
            assert not got["other_c10d"], (where, got["other_c10d"])
            # The compiled step runs no collective the eager step does not (it may run fewer:
            # its backward starts from the gradient layout it was traced with).
            for step, (ran, eager) in enumerate(got["collectives"]):
                extra = collections.Counter(ran) - collections.Counter(eager)
                assert not extra, f"{where}: step {step} ran {ran}, eager ran {eager}"
            # The same every step after the first (whose backward reduces each data-parallel
            # gradient on its own before they join buckets: NOTE [data parallel by default]).
            assert len({str(c) for c in got["collectives"][1:]}) == 1, (where, got["collectives"])


def test_compiled_training_on_one_axis() -> None:
    """DP and TP steps of an MLP and a transformer block, compiled, equal eager sbpflow and
    single-process training on the whole batch; one graph, one compile per batch size."""
    results = get_pool(2).run(one_dim_job)
    _check(results)
    for per_rank in results:
        frames = {label: got["frames"] for label, got in per_rank}
        assert frames == {"DP mlp inductor": 1, "DP block": 2, "TP mlp": 1, "TP block": 1}, frames
        in_graph = {label: got["graph_collectives"] for label, got in per_rank}
        # Data parallel: gradients are reduced by the parameters' hooks (their buckets), outside
        # the graph.
        assert in_graph["DP mlp inductor"] == in_graph["DP block"] == {}, in_graph
        assert in_graph["TP block"], in_graph  # attention heads: boxing inside the graph
        assert per_rank[2][1]["collectives"][0][0], per_rank  # TP mlp: the loss reduces P


def test_boxing_dropout_and_conversions_in_a_compiled_function() -> None:
    """The boxing an op needs inside a compiled function is an all_reduce in its graph, and
    equals eager sbpflow and a single-process matmul; an explicit ``to_global`` and a
    local -> global conversion break the graph, dropout does not (a new mask each call), and
    each gives what eager sbpflow gives."""
    for got in get_pool(2).run(_boxing_and_dropout):
        assert got["single_process"] < _TOL, got
        # implicit, dropout and from_local (after its break): what eager
        # sbpflow runs for the matmul's partial output, once each
        [(kind, count)] = got["eager_collectives"].items()
        assert count == 1 and got["in_graph"] == {kind: 3}, got
        breaks = {name: got[name]["graph_breaks"] for name in ("implicit", "explicit", "dropout")}
        assert breaks == {"implicit": 0, "explicit": 1, "dropout": 0}, got
        # The conversion opens the function: it runs first, then the one graph (explain counts
        # no break where no graph came before it).
        assert got["from_local"]["graphs"] == 1, got
        for name in ("implicit", "explicit", "dropout", "from_local"):
            assert max(got[name]["errors"]) < _TOL, got
        assert got["dropout"]["draws_differ"], got


def test_plain_tensors_join_as_broadcast_in_compiled_functions_too() -> None:
    """The causal-and-padding mask of Hugging Face's ``sdpa_mask``: compiled, a plain tensor
    joins the global ones as broadcast, as in eager, so both choose the same layout; the
    pieces match their layout and the values equal one process, also for attention under
    that mask compiled by Inductor. A plain nn.Parameter next to a global tensor joins the
    same way in eager."""
    for got in get_pool(2).run(_plain_tensors_join):
        assert got["compiled"]["sbp"] == got["eager"]["sbp"], got
        for name, case in got.items():
            assert case["local_shape"] == case["expected_local_shape"], (name, got)
            assert case["error"] < _TOL, (name, got)


def test_compiled_training_on_2x2_mesh() -> None:
    """Parameters (B, S(k)) and batch (S(0), B) on a 2x2 mesh, compiled, equal eager sbpflow and
    single-process training on the whole batch."""
    results = get_pool(4).run(mesh_job)
    _check(results)
    for per_rank in results:
        assert all(got["frames"] == 1 for _, got in per_rank), per_rank
        assert per_rank[1][1]["graph_collectives"], per_rank  # the block: boxing in the graph


def _transposed_dropout() -> dict[str, Any]:
    """Dropout of a transposed split tensor (a non-contiguous piece) compiled by Inductor:
    the masks eager sbpflow draws from the same seed, new ones on the second call."""
    torch._dynamo.reset()
    pl = _world()
    gen = torch.Generator().manual_seed(4)
    x = _global_batch(torch.randn(6, 10, generator=gen), pl, Split(1))

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x.t() * 2, 0.5, training=True) + 1

    sbpflow.manual_seed(7)
    want = [_logical(f(x)) for _ in range(2)]
    sbpflow.manual_seed(7)
    compiled = torch.compile(f)
    got = [_logical(compiled(x)) for _ in range(2)]
    torch._dynamo.reset()
    return {
        "equal": [torch.equal(g, w) for g, w in zip(got, want, strict=True)],
        "differ": not torch.equal(got[0], got[1]),
    }


def test_inductor_dropout_of_a_transposed_piece_draws_eager_masks() -> None:
    for got in get_pool(2).run(_transposed_dropout):
        assert got == {"equal": [True, True], "differ": True}, got
