"""Memory planner: per-rank memory of a training job (parameters, gradients, optimizer state, activations of one
micro-batch under each activation-checkpointing setting) and the largest micro-batch that fits a GPU.
`python -m megaloop plan CONFIG --gpu h100 --nodes N --gpus-per-node G [--json]`."""
from megaloop.plan.activations import ActivationTerms, activation_terms
from megaloop.plan.gpus import GPUS, Gpu
from megaloop.plan.planner import MemoryTerm, MicroBatchPlan, Plan, make_plan
from megaloop.plan.static import StaticTerms, static_terms

__all__ = ["ActivationTerms", "activation_terms", "GPUS", "Gpu", "MemoryTerm", "MicroBatchPlan", "Plan",
           "make_plan", "StaticTerms", "static_terms"]
