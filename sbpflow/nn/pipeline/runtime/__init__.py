"""The pipeline runtime: one step's micro-batches through ``build``, in a schedule's order, on this rank.

Only the stages this rank holds run here (NOTE [stages held elsewhere] in
_held_elsewhere.py); the schedule (``..schedules``) says in which order.
"""

from ._carriers import Carriers
from ._compiled import compile_forwards
from ._early import EarlyReceives
from ._held_elsewhere import HeldElsewhere
from ._held_here import HeldHere
from ._microbatch import MicroBatchArgs, mean_outputs, split_microbatches
from ._scope import current_action, finish_streams, microbatch_contexts
from ._stages import Stage, box_to_stage, check_stage_ids, check_stages, stage_ranks
from ._step import run_step
from ._transfers import refuse_if_out_of_step

__all__ = [
    "Carriers",
    "EarlyReceives",
    "HeldElsewhere",
    "HeldHere",
    "MicroBatchArgs",
    "Stage",
    "box_to_stage",
    "check_stage_ids",
    "check_stages",
    "compile_forwards",
    "current_action",
    "finish_streams",
    "mean_outputs",
    "microbatch_contexts",
    "refuse_if_out_of_step",
    "run_step",
    "split_microbatches",
    "stage_ranks",
]
