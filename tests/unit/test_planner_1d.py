"""The boxing planner on 1-D placements: it picks the DESIGN §3 table's op for every pair.

Pure code, one process: plans are built with no process group. The expected
ops are the design's one-axis table, written out here independently.
"""

from __future__ import annotations

import itertools

import networkx as nx
import pytest
import torch

import sbpflow
from sbpflow import boxing
from sbpflow._layout import Layout
from sbpflow.boxing import BoxingPlan, BoxingStep
from sbpflow.sbp import Broadcast, Partial, SbpParallel, Split

S0, S1, B, P = Split(0), Split(1), Broadcast(), Partial("sum")
SBPS = (S0, S1, B, P)
SHAPES = [(8, 12), (13, 5), (3, 7), (0, 4)]


def _table_op(src: SbpParallel, dst: SbpParallel) -> list[str]:
    """DESIGN §3: the one-axis transformation from ``src`` to ``dst``."""
    if src == dst:
        return []
    if isinstance(src, Split) and dst == B:
        return ["all_gather"]
    if src == P and dst == B:
        return ["all_reduce"]
    if src == P and isinstance(dst, Split):
        return ["reduce_scatter"]
    if isinstance(src, Split) and isinstance(dst, Split):
        return ["all_to_all"]
    if src == B and isinstance(dst, Split):
        return ["slice"]
    assert dst == P
    return ["zero"]  # B -> P keeps the first rank's data; S -> P zero-pads the shard


@pytest.mark.parametrize("num_ranks", [2, 3, 4])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_pair_picks_the_table_op(num_ranks: int, shape: tuple[int, int]) -> None:
    pl = sbpflow.placement("cpu", list(range(num_ranks)))
    wrong = []
    for src, dst in itertools.product(SBPS, SBPS):
        got = boxing.plan(shape, torch.float32, (pl, src), (pl, dst))
        ops = [step.op for step in got.steps]
        if ops != _table_op(src, dst):
            wrong.append(f"{src} -> {dst}: planned {ops}, expected {_table_op(src, dst)}")
        for step in got.steps:
            assert step.axis == 0 and step.axes == (0,)
            assert step.cost > 0
    assert not wrong, "\n".join(wrong)


def test_collective_steps_report_bytes_sent_per_rank() -> None:
    pl = sbpflow.placement("cpu", [0, 1, 2, 3])
    shape, itemsize = (8, 12), 4
    block = 8 * 12 * itemsize

    def only_step(src: SbpParallel, dst: SbpParallel) -> BoxingStep:
        (step,) = boxing.plan(shape, torch.float32, (pl, src), (pl, dst)).steps
        return step

    assert only_step(S0, B).bytes_per_rank == 3 * block // 4
    assert only_step(P, B).bytes_per_rank == 2 * 3 * block // 4
    assert only_step(P, S1).bytes_per_rank == 3 * block // 4
    assert only_step(S0, S1).bytes_per_rank == 3 * block // 16
    assert only_step(B, S0).bytes_per_rank == 0
    assert only_step(B, P).bytes_per_rank == 0


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_one_rank_placements_need_no_steps(shape: tuple[int, int]) -> None:
    pl = sbpflow.placement("cpu", [2])
    for src, dst in itertools.product(SBPS, SBPS):
        assert boxing.plan(shape, torch.float32, (pl, src), (pl, dst)).steps == ()


def test_plan_prints_steps_and_exposes_its_graph() -> None:
    pl = sbpflow.placement("cpu", [0, 1, 2, 3])
    got = boxing.plan((8, 12), torch.float32, (pl, S0), (pl, B))
    assert isinstance(got, BoxingPlan)
    text = str(got)
    lines = text.splitlines()
    assert lines[0].startswith("S(0) -> B  on placement('cpu', [0, 1, 2, 3])")
    assert "shape [8, 12] float32" in lines[0]
    assert len(lines) == 2 and "all_gather" in lines[1] and "axis 0" in lines[1]
    assert "288 B/rank" in lines[1]  # 3/4 of 8 * 12 * 4 bytes
    assert repr(got).startswith("<BoxingPlan S(0) -> B, 1 steps, ~")
    page = got._repr_html_()
    assert page.startswith("<div><b>") and "<td>all_gather</td>" in page and "<table>" in page
    graph = got.to_networkx()
    assert isinstance(graph, nx.DiGraph)
    chosen = [(a, b) for a, b, chosen in graph.edges(data="chosen") if chosen]
    assert chosen == [(Layout(pl, (S0,)), Layout(pl, (B,)))]
    assert got.collectives() == ["all_gather"]
    assert got.cost == pytest.approx(got.steps[0].cost)
    identity = boxing.plan((8, 12), torch.float32, (pl, B), (pl, B))
    assert "(no steps: the layouts already match)" in str(identity)
    assert identity.cost == 0


def test_plans_are_cached_per_shape_dtype_and_layouts() -> None:
    pl = sbpflow.placement("cpu", [0, 1])
    first = boxing.plan((8, 12), torch.float32, (pl, S0), (pl, S1))
    assert boxing.plan([8, 12], torch.float32, (pl, sbpflow.sbp.split(0)), (pl, [S1])) is first
    assert boxing.plan((8, 12), torch.float32, Layout(pl, (S0,)), Layout(pl, (S1,))) is first
    assert boxing.plan((8, 12), torch.float64, (pl, S0), (pl, S1)) is not first
    assert boxing.plan((8, 13), torch.float32, (pl, S0), (pl, S1)) is not first
    negative = boxing.plan((8, 12), torch.float32, (pl, Split(-2)), (pl, Split(-1)))
    assert negative is first  # negative dims are normalised before caching


@pytest.mark.parametrize(
    ("src_ranks", "dst_ranks"),
    [([0, 1], [2, 3]), ([0, 1, 2], [1, 2, 3]), ([0], [0, 1, 2, 3]), ([0, 1, 2, 3], [3])],
)
def test_cross_placement_plans_move_data_point_to_point(
    src_ranks: list[int], dst_ranks: list[int]
) -> None:
    """One step changes the placement: send_recv, or a local copy when no data has to move."""
    src_pl = sbpflow.placement("cpu", src_ranks)
    dst_pl = sbpflow.placement("cpu", dst_ranks)
    disjoint = not set(src_ranks) & set(dst_ranks)
    for src, dst in itertools.product(SBPS, SBPS):
        got = boxing.plan((8, 12), torch.float32, (src_pl, src), (dst_pl, dst))
        crossing = [s for s in got.steps if s.src.placement != s.dst.placement]
        assert len(crossing) == 1, (src, dst, [str(s) for s in got.steps])
        (transfer,) = crossing
        assert transfer.op in ("send_recv", "copy") and transfer.axis is None
        if disjoint:
            assert transfer.op == "send_recv", (src, dst)
        assert got.steps[0].src.placement == src_pl and got.steps[-1].dst.placement == dst_pl
        assert "between placements" in str(got)


def test_plan_rejects_bad_arguments() -> None:
    pl = sbpflow.placement("cpu", [0, 1])
    with pytest.raises(TypeError, match=r"src must be a \(placement, sbp\) pair, got 'S\(0\)'"):
        boxing.plan((4,), torch.float32, "S(0)", (pl, B))
    with pytest.raises(TypeError, match=r"dtype must be a torch\.dtype, got 'float32'"):
        boxing.plan((4,), "float32", (pl, S0), (pl, B))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"split\(1\) is out of range for a tensor with 1 dims"):
        boxing.plan((4,), torch.float32, (pl, S1), (pl, B))


def test_mixed_partial_kinds_are_a_clear_error():
    """A layout with partial_sum on one axis and partial_max on another cannot be planned."""
    import pytest

    mesh = sbpflow.placement("cpu", [[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="mixes partial_sum and partial_max"):
        sbpflow.boxing.plan(
            (4, 4),
            torch.float32,
            src=(mesh, (sbpflow.sbp.partial_sum, sbpflow.sbp.partial_sum)),
            dst=(mesh, (sbpflow.sbp.partial_max, sbpflow.sbp.partial_sum)),
        )
