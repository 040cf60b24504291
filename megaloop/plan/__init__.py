"""Memory planner: per-rank memory of a training job (parameters, gradients, optimizer state, activations of one
micro-batch under each activation-checkpointing setting) and the largest micro-batch that fits a GPU; under the
ring pipeline (--pp P > 1) each stage's memory and the simulated schedule of one optimizer step.
The time plan (time_model.py, comm.py, search.py): one step's predicted time from the FLOP model at a stated
efficiency of the dense peak, ring collectives over NVLink and InfiniBand, the pipeline simulator, and the exposed
part after overlap; tokens/s, days to a token budget, and the layouts that fit ranked by step time.
`python -m megaloop plan CONFIG --gpu h100 --nodes N --gpus-per-node G [--pp P] [--tokens T] [--search] [--json]`."""
from megaloop.plan.activations import ActivationTerms, activation_terms
from megaloop.plan.gpus import GPUS, Gpu
from megaloop.plan.pipeline import PipelinePlan, StagePlan, pipeline_plan
from megaloop.plan.planner import MemoryTerm, MicroBatchPlan, Plan, make_plan
from megaloop.plan.static import StaticTerms, static_terms
from megaloop.plan.time_model import Device, TimePlan, time_plan

__all__ = ["ActivationTerms", "activation_terms", "GPUS", "Gpu", "MemoryTerm", "MicroBatchPlan", "PipelinePlan",
           "Plan", "StagePlan", "make_plan", "pipeline_plan", "StaticTerms", "static_terms", "Device", "TimePlan",
           "time_plan"]
