"""Worker of the tensor-parallel module test: split small fp64 modules and a parcae-tiny model at tp 2, with and
without sequence parallelism, and compare each parallel module's output with the whole module's (cut the way this
rank should see it); saves rank 0's errors and facts."""
from __future__ import annotations

import torch
from torch import nn

from pipeline.layout import init_layout
from pipeline.parallel_lm import ParallelLM
from pipeline.tensor_parallel import apply_tensor_parallel, shard_tensor
from tests.pipeline.models import case_config, dims, make_model, plan_for

SEQ, D_IN, D_OUT, VOCAB = 4, 8, 6, 10


class Scale(nn.Module):
    """x * weight: a module that is neither Linear nor Embedding, for the region styles."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 2.0, D_IN, dtype=torch.float64))

    def forward(self, x):
        return x * self.weight


def _holder(module: nn.Module) -> nn.Module:
    holder = nn.Module()
    holder.m = module
    return holder


def _cut(t: torch.Tensor, dim: int, tp: int, rank: int) -> torch.Tensor:
    return t.chunk(tp, dim=dim)[rank]


def module_errors(layout) -> dict:
    """For each style: (class name, parameter names, ShardSpecs, max |parallel - reference|)."""
    tp, rank, sp = layout.tp, layout.tp_rank, layout.sequence_parallel
    torch.manual_seed(0)  # the same whole modules on every rank
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, SEQ, D_IN, generator=g, dtype=torch.float64)
    ids = torch.arange(2 * SEQ).reshape(2, SEQ) % VOCAB
    seq = (lambda t: _cut(t, 1, tp, rank)) if sp else (lambda t: t)  # this rank's positions
    linear = nn.Linear(D_IN, D_OUT, bias=False, dtype=torch.float64)
    embedding = nn.Embedding(VOCAB, D_IN, dtype=torch.float64)
    cases = {  # style: (whole module, its input on this rank, reference output)
        "column": (linear, x, linear(x)[..., _cut(torch.arange(D_OUT), 0, tp, rank)]),
        "row": (linear, _cut(x, -1, tp, rank), seq(linear(x))),
        "vocab": (embedding, ids, seq(embedding(ids))),
        "column-embedding": (embedding, ids, _cut(embedding(ids), -1, tp, rank)),
        "enter": (Scale(), seq(x), x * Scale().weight),
        "gather-output": (Scale(), seq(x), x * Scale().weight),
    }
    out = {}
    for style, (module, given, want) in cases.items():
        whole = {f"m.{n}": p.detach().clone() for n, p in module.named_parameters()}
        holder = _holder(module)
        plan_style = "column" if style == "column-embedding" else style
        info = apply_tensor_parallel(holder, (("m", plan_style), ("m", "replicate")), layout)
        with torch.no_grad():
            err = float((holder.m(given) - want).abs().max())
        held = dict(holder.named_parameters())
        shard_err = max(float((held[n].detach() - shard_tensor(w, info.shards[n], rank)).abs().max())
                        for n, w in whole.items()) if info.shards else 0.0
        shards = {n: (s.dim, s.tp, s.parts) for n, s in info.shards.items()}
        out[style] = {"cls": type(holder.m).__name__, "names": sorted(held), "shards": shards,
                      "err": err, "shard_err": shard_err, "is_base": isinstance(holder.m, type(module)),
                      "vocab_range": info.vocab_range}
    return out


def model_facts(case: str, layout) -> dict:
    """A parcae-tiny model under ParallelLM: names, classes, hooks, instance attributes, modes and the h_0 seam."""
    cfg = case_config(case)
    model = make_model(case).double()
    names = [n for n, _ in model.named_parameters()]
    lm = ParallelLM(model, layout, plan_for(cfg))
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    patched = [n for n, m in model.named_modules() if {"forward", "initial_state"} & set(vars(m))]
    lm.eval()
    eval_modes = {m.training for m in model.modules()} | {lm.training}
    lm.train()
    e = torch.zeros(2, cfg.seq_len // layout.tp if layout.sequence_parallel else cfg.seq_len, cfg.d_model,
                    dtype=torch.float64)
    h0 = model.initial_state(e, (5, 7, torch.tensor([3, 9])))
    model.set_sequence_shard(1, None)
    full = model.initial_state(e.new_zeros(2, cfg.seq_len, cfg.d_model), (5, 7, torch.tensor([3, 9])))
    want = _cut(full, 1, layout.tp, layout.tp_rank) if layout.sequence_parallel else full
    classes = {n: type(m).__name__ for n, m in model.named_modules()}
    return {"names_kept": names == [n for n, _ in lm.named_parameters()], "hooks": hooks, "patched": patched,
            "eval_modes": eval_modes, "train_mode": all(m.training for m in model.modules()),
            "h0_err": float((h0 - want).abs().max()), "h0_shape": tuple(h0.shape), "classes": classes,
            "same_params": [id(p) for p in lm.parameters()] == [id(p) for p in model.parameters()]}


def worker(rank: int, world: int, out_path: str) -> None:
    results = {}
    for sp in (False, True):
        layout = init_layout(tp=world, model=dims(case_config("parcae")), sequence_parallel=sp)
        results[("modules", sp)] = module_errors(layout)
        results[("model", sp)] = model_facts("parcae-gqa-swiglu", layout)
    layout = init_layout(tp=world)
    try:
        apply_tensor_parallel(_holder(nn.Embedding(VOCAB, D_IN)), (("m", "row"),), layout)
    except TypeError as err:
        results["refused"] = str(err)
    if rank == 0:
        torch.save(results, out_path)
