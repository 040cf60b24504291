"""Memory planner: per-rank memory of a training job (parameters, gradients, optimizer state, activations of one
micro-batch under each activation-checkpointing setting) and the largest micro-batch that fits a GPU; under the
ring pipeline (--pp P > 1) each stage's memory and the simulated schedule of one optimizer step.
`python -m megaloop plan CONFIG --gpu h100 --nodes N --gpus-per-node G [--pp P] [--json]`."""
from megaloop.plan.activations import ActivationTerms, activation_terms
from megaloop.plan.gpus import GPUS, Gpu
from megaloop.plan.pipeline import PipelinePlan, StagePlan, pipeline_plan
from megaloop.plan.planner import MemoryTerm, MicroBatchPlan, Plan, make_plan
from megaloop.plan.static import StaticTerms, static_terms

__all__ = ["ActivationTerms", "activation_terms", "GPUS", "Gpu", "MemoryTerm", "MicroBatchPlan", "PipelinePlan",
           "Plan", "StagePlan", "make_plan", "pipeline_plan", "StaticTerms", "static_terms"]
