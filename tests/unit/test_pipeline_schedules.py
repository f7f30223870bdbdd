"""Pipeline schedules as data: built, validated, simulated, printed and drawn without a process group.

No tensors run here, so the single-process reference is arithmetic done in the
test itself: each (stage, micro-batch) counted from the action lists, the
bubble fractions from their closed forms ((p-1)/(m+p-1) for GPipe and 1F1B,
(p-1)/(v·m+p-1) for interleaved, a third of 1F1B's idle time for zero bubble),
and peak activations from the 1F1B warm-up rule (p - s).
"""

from __future__ import annotations

import dataclasses
import re
import xml.etree.ElementTree as ET
from collections import Counter

import pytest

from sbpflow.nn.pipeline import (
    SCHEDULE_NAMES,
    Action,
    ActionKind,
    Schedule,
    build_schedule,
    draw_timeline,
    validate,
)

F, B, BI, W = (
    ActionKind.FORWARD,
    ActionKind.BACKWARD,
    ActionKind.BACKWARD_INPUT,
    ActionKind.BACKWARD_WEIGHT,
)
SVG = "{http://www.w3.org/2000/svg}"

# (name, stage_ranks, num_microbatches): one stage per rank unless interleaved.
CASES = [
    *[(name, [0], 1) for name in ("gpipe", "1f1b", "zero_bubble")],
    *[(name, [0, 1], m) for name in ("gpipe", "1f1b", "zero_bubble") for m in (2, 5)],
    *[(name, [0, 1, 2, 3], m) for name in ("gpipe", "1f1b", "zero_bubble") for m in (4, 8, 11)],
    ("gpipe", [0, 1, 2, 3], 2),  # GPipe needs no more micro-batches than stages
    ("1f1b", [5, 2, 7], 6),  # ranks need not be 0..p-1 nor sorted
    ("zero_bubble", [5, 2, 7], 4),
    ("interleaved_1f1b", [0, 1, 0, 1], 2),
    ("interleaved_1f1b", [0, 1, 0, 1], 6),
    ("interleaved_1f1b", [0, 1, 2, 3] * 2, 8),
    ("interleaved_1f1b", [0, 1, 2, 3] * 3, 4),
    ("interleaved_1f1b", [3, 1, 2] * 2, 9),
]


def _build(name: str, stage_ranks: list[int], m: int) -> Schedule:
    return build_schedule(name, len(stage_ranks), stage_ranks, m)


@pytest.mark.parametrize(("name", "stage_ranks", "m"), CASES)
def test_each_stage_and_microbatch_runs_forward_and_backward_exactly_once(
    name: str, stage_ranks: list[int], m: int
) -> None:
    """Counted straight from the action lists: F once, and B once (I and W once for zero bubble)."""
    schedule = _build(name, stage_ranks, m)
    validate(schedule)  # build_schedule validated it; it stays valid when checked again
    assert set(schedule.actions) == set(stage_ranks)
    counts: Counter[tuple[ActionKind, int, int]] = Counter()
    for rank, actions in schedule.actions.items():
        for a in actions:
            assert stage_ranks[a.stage] == rank, f"{a} listed on rank {rank}"
            if a.is_compute:
                counts[(a.kind, a.stage, a.microbatch)] += 1
    backward_kinds = [BI, W] if name == "zero_bubble" else [B]
    expected = Counter(
        {
            (kind, s, k): 1
            for s in range(len(stage_ranks))
            for k in range(m)
            for kind in [F, *backward_kinds]
        }
    )
    assert counts == expected


@pytest.mark.parametrize(("name", "stage_ranks", "m"), CASES)
def test_every_transfer_pairs_with_one_on_the_peer(
    name: str, stage_ranks: list[int], m: int
) -> None:
    """Each boundary between ranks carries one activation and one grad per micro-batch, each sent and received once."""
    schedule = _build(name, stage_ranks, m)
    transfers = Counter(
        (a.kind, a.stage, a.microbatch, rank, a.peer)
        for rank, actions in schedule.actions.items()
        for a in actions
        if not a.is_compute
    )
    expected: Counter[tuple[ActionKind, int, int, int, int | None]] = Counter()
    for s in range(len(stage_ranks) - 1):
        here, there = stage_ranks[s], stage_ranks[s + 1]
        if here == there:
            continue
        for k in range(m):
            expected[(ActionKind.SEND_ACTIVATION, s, k, here, there)] += 1
            expected[(ActionKind.RECV_ACTIVATION, s + 1, k, there, here)] += 1
            expected[(ActionKind.SEND_GRAD, s + 1, k, there, here)] += 1
            expected[(ActionKind.RECV_GRAD, s, k, here, there)] += 1
    assert transfers == expected


@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 7), (4, 4), (4, 8), (5, 12), (6, 6)])
def test_bubble_fractions_match_the_closed_forms(p: int, m: int) -> None:
    """GPipe and 1F1B idle (p-1)/(m+p-1) of the time with forward_time == backward_time."""
    expected = (p - 1) / (m + p - 1)
    for name in ("gpipe", "1f1b"):
        sim = _build(name, list(range(p)), m).simulate(forward_time=1.0, backward_time=1.0)
        assert sim.bubble_fraction == pytest.approx(expected, abs=1e-12), name
        assert sim.makespan == pytest.approx(2 * (m + p - 1))


@pytest.mark.parametrize(("p", "v", "m"), [(2, 2, 2), (2, 2, 6), (4, 2, 8), (4, 3, 4), (3, 2, 9)])
def test_interleaved_bubble_is_divided_by_the_stages_per_rank(p: int, v: int, m: int) -> None:
    """Interleaved 1F1B idles (p-1)/(v·m+p-1) of the time with forward_time == backward_time."""
    sim = _build("interleaved_1f1b", list(range(p)) * v, m).simulate(1.0, 1.0)
    assert sim.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    plain = _build("1f1b", list(range(p)), m).simulate(1.0, 1.0)
    assert sim.bubble_fraction < plain.bubble_fraction or p == 1


@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 5), (3, 3), (4, 4), (4, 8), (6, 13)])
def test_zero_bubble_idles_a_third_of_1f1b(p: int, m: int) -> None:
    """The tested condition: with forward = input-grad = weight-grad = 1 (1F1B's backward = 2),
    zero bubble's idle time per rank is exactly a third of 1F1B's, (p-1) against 3(p-1), so
    its bubble fraction is (p-1)/(3m+p-1) against 1F1B's (p-1)/(m+p-1). (The fractions' ratio
    is (m+p-1)/(3m+p-1), above a third, since zero bubble's step is also shorter.)"""
    zb = _build("zero_bubble", list(range(p)), m).simulate(
        forward_time=1.0, backward_time=2.0, backward_input_time=1.0, backward_weight_time=1.0
    )
    ofob = _build("1f1b", list(range(p)), m).simulate(forward_time=1.0, backward_time=2.0)
    busy = 3 * m
    assert ofob.makespan - busy == pytest.approx(3 * (p - 1))
    assert zb.makespan - busy == pytest.approx((ofob.makespan - busy) / 3)
    assert zb.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
    assert zb.bubble_fraction < ofob.bubble_fraction


@pytest.mark.parametrize(("p", "m"), [(2, 5), (4, 4), (4, 8), (5, 11)])
def test_peak_activations(p: int, m: int) -> None:
    """1F1B holds p - s micro-batches on stage s (at most p), GPipe holds all m, zero bubble no more than 1F1B."""
    ranks = list(range(p))
    gpipe = _build("gpipe", ranks, m).simulate()
    ofob = _build("1f1b", ranks, m).simulate()
    zb = _build("zero_bubble", ranks, m).simulate()
    assert dict(gpipe.peak_activations) == dict.fromkeys(range(p), m)
    assert dict(ofob.peak_activations) == {s: p - s for s in range(p)}
    assert all(n <= p for n in ofob.peak_activations.values())
    assert all(zb.peak_activations[s] <= ofob.peak_activations[s] for s in range(p))
    # Counting activations as held until the deferred W, zero bubble still stays within p.
    for s in range(p):
        held = peak = 0
        for t in sorted(
            (t for t in zb.compute_timings if t.action.stage == s and t.action.kind in (F, W)),
            key=lambda t: (t.end, t.action.kind is F),
        ):
            held += 1 if t.action.kind is F else -1
            peak = max(peak, held)
        assert peak <= p, (s, peak)


@pytest.mark.parametrize(("p", "v", "m"), [(2, 2, 2), (2, 2, 8), (4, 2, 8), (3, 3, 6), (4, 1, 4)])
def test_interleaved_peak_per_rank_follows_the_warm_up(p: int, v: int, m: int) -> None:
    """Rank r holds its 2(p-r-1) + (v-1)p warm-up forwards plus one, over all its stages at once."""
    sim = _build("interleaved_1f1b", list(range(p)) * v, m).simulate()
    for r in range(p):
        expected = min(2 * (p - r - 1) + (v - 1) * p + 1, v * m)
        assert sim.peak_activations_per_rank[r] == expected
        own = [sim.peak_activations[s] for s in range(r, p * v, p)]
        assert max(own) <= expected <= sum(own)


def test_comm_time_delays_the_pipeline_and_bad_times_raise() -> None:
    """A transfer latency adds to every hop of the critical path; negative times are rejected."""
    schedule = _build("1f1b", [0, 1, 2, 3], 8)
    fast, slow = schedule.simulate(comm_time=0.0), schedule.simulate(comm_time=0.5)
    assert slow.makespan > fast.makespan
    with pytest.raises(ValueError, match=r"forward time must be >= 0, got -1"):
        schedule.simulate(forward_time=-1.0)


# -- the validator on hand-broken schedules ----------------------------------------------


def _edit(schedule: Schedule, rank: int, actions: list[Action]) -> Schedule:
    return dataclasses.replace(schedule, actions={**schedule.actions, rank: tuple(actions)})


def test_validator_rejects_a_missing_send() -> None:
    schedule = _build("1f1b", [0, 1], 2)
    send = Action(ActionKind.SEND_ACTIVATION, 0, 1, peer=1)
    broken = _edit(schedule, 0, [a for a in schedule.actions[0] if a != send])
    with pytest.raises(
        ValueError, match=r"RECV_F1s1<r0 on rank 1 has no matching send.*SEND_F1s0>r1"
    ):
        validate(broken)


def test_validator_rejects_a_forward_before_its_input_arrives() -> None:
    schedule = _build("gpipe", [0, 1], 2)
    todo = list(schedule.actions[1])
    recv = Action(ActionKind.RECV_ACTIVATION, 1, 0, peer=0)
    todo.remove(recv)
    todo.insert(todo.index(Action(F, 1, 0)) + 1, recv)
    with pytest.raises(
        ValueError,
        match=r"F0s1 at position 0 on rank 1 reads its input activation before it arrives",
    ):
        validate(_edit(schedule, 1, todo))


def test_validator_reports_a_deadlock_of_two_ranks_receiving_first() -> None:
    """Rank 0 waits for a grad that rank 1 only sends after the activation rank 0 never sent."""
    recv_grad = Action(ActionKind.RECV_GRAD, 0, 0, peer=1)
    recv_act = Action(ActionKind.RECV_ACTIVATION, 1, 0, peer=0)
    broken = Schedule(
        "hand-made",
        2,
        (0, 1),
        1,
        {
            0: (
                recv_grad,
                Action(F, 0, 0),
                Action(ActionKind.SEND_ACTIVATION, 0, 0, peer=1),
                Action(B, 0, 0),
            ),
            1: (
                recv_act,
                Action(F, 1, 0),
                Action(B, 1, 0),
                Action(ActionKind.SEND_GRAD, 1, 0, peer=0),
            ),
        },
    )
    with pytest.raises(ValueError, match="deadlock") as info:
        validate(broken)
    assert "rank 0 waits at RECV_B0s0<r1" in str(info.value)
    assert "rank 1 waits at RECV_F0s1<r0" in str(info.value)
    with pytest.raises(ValueError, match="deadlock"):
        broken.simulate()


def test_validator_rejects_messages_received_out_of_order() -> None:
    """Rank 1 receives micro-batch 1's activation before micro-batch 0's, which rank 0 sends
    first: with messages matched per pair in posting order, each would get the other's data."""
    schedule = _build("gpipe", [0, 1], 2)
    recv = [Action(ActionKind.RECV_ACTIVATION, 1, k, peer=0) for k in (0, 1)]
    swapped = [recv[1], Action(F, 1, 1), recv[0], Action(F, 1, 0)]
    rest = [a for a in schedule.actions[1] if a not in (*recv, Action(F, 1, 0), Action(F, 1, 1))]
    with pytest.raises(
        ValueError,
        match=r"rank 1 receives RECV_F1s1<r0 as its message number 0 from rank 0, but rank 0 "
        r"sends its messages to rank 1 in another order",
    ):
        validate(_edit(schedule, 1, swapped + rest))


def test_validator_rejects_missing_duplicated_and_misordered_compute() -> None:
    schedule = _build("zero_bubble", [0, 1], 2)
    todo = list(schedule.actions[1])
    with pytest.raises(ValueError, match=r"micro-batch 1 on stage 1 \(rank 1\) runs I without"):
        validate(_edit(schedule, 1, [a for a in todo if a != Action(W, 1, 1)]))
    with pytest.raises(ValueError, match=r"F0s1 appears 2 times on rank 1"):
        validate(_edit(schedule, 1, [*todo, Action(F, 1, 0)]))
    w, i = todo.index(Action(W, 1, 0)), todo.index(Action(BI, 1, 0))
    todo[w], todo[i] = todo[i], todo[w]
    with pytest.raises(
        ValueError, match=r"W0s1 at position \d+ on rank 1 runs before its input-grad"
    ):
        validate(_edit(schedule, 1, todo))
    with pytest.raises(ValueError, match=r"F0s1 .* belongs on rank 1"):
        validate(_edit(schedule, 0, [Action(F, 1, 0), *schedule.actions[0]]))


# -- bad arguments -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        (
            ("pipedream", 2, [0, 1], 4),
            ValueError,
            r"'pipedream'.*gpipe, 1f1b, interleaved_1f1b, zero_bubble",
        ),
        (("1f1b", 3, [0, 1], 4), ValueError, r"stage_ranks has 2 entries for num_stages=3"),
        (
            ("1f1b", 3, {0: 0, 1: 1, 3: 2}, 4),
            ValueError,
            r"none skipped, got \[0, 1, 3\] \(missing \[2\], unexpected \[3\]\)",
        ),
        (("1f1b", 2, [(0, 0), (0, 1)], 4), ValueError, r"stage id 0 is given 2 times"),
        (("1f1b", 3, [0, 1, 0], 4), ValueError, r"rank 0 holds stages \[0, 2\].*interleaved_1f1b"),
        (
            ("1f1b", 4, [0, 1, 2, 3], 3),
            ValueError,
            r"at least as many micro-batches as stages \(4\), got num_microbatches=3",
        ),
        (
            ("zero_bubble", 4, [0, 1, 2, 3], 2),
            ValueError,
            r"zero_bubble needs at least as many micro-batches",
        ),
        (
            ("interleaved_1f1b", 4, [0, 1, 0, 1], 3),
            ValueError,
            r"multiple of the number of pipeline ranks \(2\), got 3",
        ),
        (("interleaved_1f1b", 4, [0, 0, 1, 1], 4), ValueError, r"should be \[0, 1, 0, 1\]"),
        (("1f1b", 2.0, [0, 1], 4), TypeError, r"num_stages must be an int, got float"),
        (("1f1b", 2, [0, 1], 0), ValueError, r"num_microbatches must be at least 1, got 0"),
        (("1f1b", 2, [0, -1], 2), TypeError, r"non-negative ints, got -1"),
    ],
)
def test_bad_arguments_raise_naming_what_was_received(
    args: tuple, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        build_schedule(*args)


def test_stage_ranks_as_mapping_or_pairs_give_the_same_schedule() -> None:
    as_list = build_schedule("1f1b", 3, [4, 6, 5], 3)
    assert build_schedule("1f1b", 3, {2: 5, 0: 4, 1: 6}, 3) == as_list
    assert build_schedule("1f1b", 3, [(1, 6), (0, 4), (2, 5)], 3) == as_list
    assert as_list.ranks == (4, 6, 5)
    assert set(SCHEDULE_NAMES) == {
        "gpipe",
        "1f1b",
        "interleaved_1f1b",
        "zero_bubble",
        "looped_bfs",
        "interleaved_zero_bubble",
        "zbv",
        "dualpipev",
    }


# -- printing and drawing ----------------------------------------------------------------


def test_action_strings() -> None:
    assert str(Action(F, 1, 3)) == "F3s1"
    assert [str(Action(k, 2, 0)) for k in (B, BI, W)] == ["B0s2", "I0s2", "W0s2"]
    assert str(Action(ActionKind.SEND_ACTIVATION, 1, 3, peer=2)) == "SEND_F3s1>r2"
    assert str(Action(ActionKind.RECV_GRAD, 1, 3, peer=2)) == "RECV_B3s1<r2"
    with pytest.raises(ValueError, match="needs the peer rank"):
        Action(ActionKind.SEND_GRAD, 1, 0)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_str_is_a_slot_table_of_compute_actions(name: str) -> None:
    """Each rank's row holds exactly its compute actions, in list order; the footer has the bubble."""
    ranks = [0, 1, 2, 3] * (2 if name == "interleaved_1f1b" else 1)
    if name in ("zbv", "dualpipev"):  # two stages per rank, as a V
        ranks = [0, 1, 2, 3, 3, 2, 1, 0]
    schedule = _build(name, ranks, 8)
    lines = str(schedule).splitlines()
    assert lines[0].startswith(f"{name}: {len(ranks)} stages")
    assert len(lines) == 2 + 4 + 1
    for rank, line in zip(range(4), lines[2:6], strict=True):
        label, _, row = line.partition(" | ")
        assert label.strip() == f"rank {rank}"
        cells = [c for c in row.split() if c != "."]
        assert cells == [str(a) for a in schedule.actions[rank] if a.is_compute]
    unit = schedule.simulate(1.0, 1.0, 1.0, 1.0)
    assert f"bubble {unit.bubble_fraction:.1%}" in lines[-1]
    assert re.search(r"peak in-flight activations rank 0: \d+, rank 1", lines[-1])


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_html_is_well_formed_with_one_lane_per_rank(name: str) -> None:
    ranks = [0, 1, 2] * (2 if name == "interleaved_1f1b" else 1)
    if name in ("zbv", "dualpipev"):
        ranks = [0, 1, 2, 2, 1, 0]
    schedule = _build(name, ranks, 6)
    root = ET.fromstring(schedule._repr_html_())
    svg = root.find(f"{SVG}svg")
    assert svg is not None
    lanes = [g for g in svg.iter(f"{SVG}g") if g.get("class") == "lane"]
    assert [g.get("data-rank") for g in lanes] == ["0", "1", "2"]
    for rank, lane in zip(range(3), lanes, strict=True):
        boxes = [g for g in lane.iter(f"{SVG}g") if (g.get("class") or "").startswith("action")]
        assert len(boxes) == sum(a.is_compute for a in schedule.actions[rank])


def test_draw_timeline_takes_measured_rows() -> None:
    """Measured timings (any floats, any order) draw the same way as simulated ones."""
    rows = [
        (1, Action(F, 1, 0), 0.5, 1.25),
        (0, Action(F, 0, 0), 0.0, 0.5),
        (0, Action(B, 0, 0), 2.0, 3.1),
    ]
    svg = ET.fromstring(draw_timeline(rows, ranks=[0, 1]))
    lanes = [g for g in svg.iter(f"{SVG}g") if g.get("class") == "lane"]
    assert len(lanes) == 2
    assert len(list(lanes[0].iter(f"{SVG}rect"))) == 2
    with pytest.raises(ValueError, match=r"ranks \[1\] that are not in ranks=\[0\]"):
        draw_timeline(rows, ranks=[0])
