"""The ring pipeline schedule as data: a looped model's core split over pp ranks in a ring, one lap per loop
iteration, many micro-batches' laps interleaved.

- `actions`: the action types and the chain of actions of one micro-batch;
- `generate`: the ring schedule (per-rank action lists for one optimizer step, bounded stored activations);
- `baselines`: GPipe, 1F1B and interleaved 1F1B as action lists over the same types;
- `simulate`: runs any of them against a `CostModel` (makespan, idle fractions, peak activations, deadlocks);
- `gantt`: a PNG chart of a simulated run.

Pure Python (no torch); an executor runs the same lists with torch.distributed point-to-point operations.
"""
from pipeline.ring.actions import (
    Backward,
    Embed,
    EmbedBackward,
    Forward,
    Loss,
    LossBackward,
    Message,
    MicroBatch,
    Recv,
    ScheduleError,
    Send,
    chain,
    rank_of,
)
from pipeline.ring.baselines import gpipe, interleaved_1f1b, one_f_one_b, uniform_specs
from pipeline.ring.costs import CostModel
from pipeline.ring.generate import lower_bound, ring_orders, ring_schedule
from pipeline.ring.p2p import with_p2p
from pipeline.ring.simulate import DeadlockError, SimResult, simulate

__all__ = [
    "Backward", "CostModel", "DeadlockError", "Embed", "EmbedBackward", "Forward", "Loss", "LossBackward",
    "Message", "MicroBatch", "Recv", "ScheduleError", "Send", "SimResult", "chain", "gpipe", "interleaved_1f1b",
    "lower_bound", "one_f_one_b", "rank_of", "ring_orders", "ring_schedule", "simulate", "uniform_specs", "with_p2p",
]
