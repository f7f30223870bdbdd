"""``StepRecord``, the runtime's record of a pipelined step, in one process with no process group.

Records are made here from a schedule's simulation (the same rows the runtime writes, one
per rank), so every figure has a known answer: the simulation's bubble and peaks.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from sbpflow.nn.pipeline import ActionKind, ActionTiming, StepRecord, build_schedule


def _records(name: str, p: int, m: int) -> tuple[list[StepRecord], float]:
    schedule = build_schedule(name, p, list(range(p)), m)
    sim = schedule.simulate()
    per_rank = [
        StepRecord(
            schedule,
            (rank,),
            tuple(ActionTiming(*t) for t in sim.timings if t.rank == rank),
        )
        for rank in range(p)
    ]
    return per_rank, sim.bubble_fraction


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zero_bubble"])
def test_combined_record_measures_the_simulated_bubble(name: str) -> None:
    """Combining the ranks' records gives the simulation's bubble and each rank's order."""
    records, bubble = _records(name, 4, 8)
    whole = StepRecord.combine(records)
    assert whole.ranks == (0, 1, 2, 3)
    assert whole.bubble_fraction == pytest.approx(bubble)
    for rank in range(4):
        assert whole.actions_of(rank) == whole.schedule.actions[rank]


def test_peak_live_microbatches_is_m_for_gpipe_and_p_minus_stage_for_1f1b() -> None:
    gpipe = StepRecord.combine(_records("gpipe", 4, 8)[0]).peak_live_microbatches
    one_f_one_b = StepRecord.combine(_records("1f1b", 4, 8)[0]).peak_live_microbatches
    zero = StepRecord.combine(_records("zero_bubble", 4, 8)[0]).peak_live_microbatches
    assert gpipe == {0: 8, 1: 8, 2: 8, 3: 8}
    assert one_f_one_b == {0: 4, 1: 3, 2: 2, 3: 1}
    assert all(n <= 4 for n in zero.values()), zero  # held until W, within 1F1B's bound


def test_combine_rejects_mixed_steps_and_repeated_ranks() -> None:
    records, _ = _records("1f1b", 2, 2)
    other, _ = _records("gpipe", 2, 2)
    with pytest.raises(ValueError, match="records of different schedules"):
        StepRecord.combine([records[0], other[1]])
    with pytest.raises(ValueError, match=r"got ranks \[0, 0\]: a rank twice"):
        StepRecord.combine([records[0], records[0]])
    with pytest.raises(ValueError, match="needs at least one record"):
        StepRecord.combine([])


def test_record_prints_its_order_and_draws_one_lane_per_rank() -> None:
    whole = StepRecord.combine(_records("1f1b", 2, 2)[0])
    text = str(whole)
    assert "rank 0: F0s0 F1s0 B0s0 B1s0" in text
    assert "rank 1: F0s1 B0s1 F1s1 B1s1" in text
    svg = ET.fromstring(whole.svg())
    lanes = [g for g in svg.iter("{http://www.w3.org/2000/svg}g") if g.get("class") == "lane"]
    assert [lane.get("data-rank") for lane in lanes] == ["0", "1"]
    boxes = [g for g in svg.iter("{http://www.w3.org/2000/svg}g") if "action" in g.get("class", "")]
    assert len(boxes) == sum(1 for t in whole.timings if t.action.is_compute) == 8
    assert "<svg" in whole._repr_html_()
    kinds = {t.action.kind for t in whole.timings}
    assert ActionKind.SEND_ACTIVATION in kinds and ActionKind.RECV_GRAD in kinds
