"""Workers of the document-masking tests under tensor and pipeline parallelism (tests/pipeline/test_doc_mask_parallel
.py): the packed batch of tests/model/doc_mask_cases.py with doc_mask on, on 2 gloo processes, for every case
(dtype, depths): the full logits, the loss and (fp64) the full gradients, saved per rank.

tp2: ParallelLM over the tensor-parallel plan, with and without sequence parallelism (the attention then sees the
whole sequence after its input's all-gather, and each rank builds the documents from the whole rows' ids); the
logits gathered along the vocabulary, the gradients gathered from their shards.
pp2: LoopedStageProgram on the ring schedule (one micro-batch; every rank builds the documents of the permuted rows
once and gives each lap its prefix); the last rank's logits caught in the loss function, each rank's gradients
(the parent sums them over the ranks)."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.model.doc_mask_cases import DEPTH_CASES, backprop, batch, model_pair

CASES = [("fp64", case) for case in DEPTH_CASES] + [("fp32", "mixed"), ("fp64", "mixed+lap")]
DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def case_inputs(dtype: str, case: str):
    """(doc_mask model, ids, labels, h0, depths) of a case ("depths" or "depths+checkpointing")."""
    depths, _, checkpointing = case.partition("+")
    model, _ = model_pair(DTYPES[dtype])
    model.set_activation_checkpointing(checkpointing or "none")
    ids, labels, h0 = batch(DTYPES[dtype], model.cfg.d_model, model.cfg.vocab_size)
    return model, ids, labels, h0, DEPTH_CASES[depths]


def tp_case(dtype: str, case: str, layout) -> dict:
    from megaloop.model.tp_plan import tensor_parallel_plan
    from pipeline.collectives import all_gather_along
    from pipeline.parallel_lm import ParallelLM
    from pipeline.tensor_parallel import gather_full, reduce_partial_grads

    model, ids, labels, h0, depths = case_inputs(dtype, case)
    lm = ParallelLM(model, layout, tensor_parallel_plan(model.cfg.mlp))
    out = lm(ids, labels, depth=torch.tensor(depths), backprop_depth=backprop(depths), h0=h0)
    out.loss.backward()
    reduce_partial_grads(model, lm.tp_info, layout.tp_group)
    grads = {n: gather_full(p.grad, lm.tp_info.shards.get(n), layout.tp_group) for n, p in model.named_parameters()}
    logits = all_gather_along(out.logits.detach(), -1, layout.tp_group)
    return {"logits": logits, "loss": out.loss.detach(), "grads": grads}


def pp_case(rank: int, dtype: str, case: str) -> dict:
    from megaloop.model.stages import LoopedStageProgram, StageMicroBatch
    from pipeline.ring import MicroBatch, ring_schedule
    from pipeline.ring.execute import RingExecutor

    model, ids, labels, h0, depths = case_inputs(dtype, case)
    caught = {}

    def loss_fn(logits, target):
        caught["logits"] = logits.detach()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100)

    mb = StageMicroBatch(ids, labels, depths, backprop(depths), None, h0)
    program = LoopedStageProgram(model, rank, 2, [mb], 1.0, loss_fn=loss_fn)
    specs = [MicroBatch(**spec) for spec in program.specs()]
    actions = ring_schedule(specs, 2, max_in_flight=2)[rank]
    result = RingExecutor(program, dtype=DTYPES[dtype], check_messages=True).run(actions, specs)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"logits": caught.get("logits"), "loss": result.losses.get(0), "grads": grads}


def tp_worker(rank: int, world: int, out: str) -> None:
    from pipeline.layout import init_layout
    from tests.model.doc_mask_cases import config
    from tests.pipeline.models import dims

    layouts = {sp: init_layout(tp=2, model=dims(config()), sequence_parallel=sp) for sp in (False, True)}
    results = {(dtype, case, sp): tp_case(dtype, case, layouts[sp]) for dtype, case in CASES for sp in (False, True)}
    if rank == 0:
        torch.save(results, out)


def pp_worker(rank: int, world: int, out: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    results = {(dtype, case): pp_case(rank, dtype, case) for dtype, case in CASES}
    torch.save(results, f"{out}.{rank}")
