"""The plan as text for people and as JSON for programs."""
from __future__ import annotations

from dataclasses import asdict

from megaloop.plan.gpus import GIB
from megaloop.plan.pipeline import PipelinePlan
from megaloop.plan.planner import MicroBatchPlan, Plan
from megaloop.plan.startup import startup_groups, startup_line


def gib(n: int) -> str:
    """Bytes in GiB, or in MiB below 1 GiB, 12 characters wide."""
    return f"{n / GIB:8.2f} GiB" if n >= GIB else f"{n / 2**20:8.1f} MiB"


def plan_dict(plan: Plan, world: int, nodes: int) -> dict:
    """Every figure of the plan, bytes as integers."""
    cfg, lay = plan.cfg, plan.layout
    out = {
        "model": {"parameters": plan.n_params, "seq_len": cfg.model.seq_len, "mu_rec": cfg.model.mu_rec,
                  "mu_bwd": cfg.model.backprop_depth},
        "layout": {"gpus": world, "nodes": nodes, "tp": lay.tp, "pp": lay.pp, "dp": lay.dp,
                   "sequence_parallel": lay.sp, "engine": lay.engine, "zero_stage": lay.zero_stage,
                   "precision": cfg.train.precision},
        "gpu": {"name": plan.gpu.name, "total_bytes": plan.gpu.total_bytes,
                "headroom_bytes": plan.gpu.headroom_bytes, "usable_bytes": plan.gpu.usable_bytes},
        "process_groups": asdict(startup_groups(lay.tp, lay.dp, lay.pp)),
        "micro_batch_size": cfg.data.micro_batch_size,
        "activation_checkpointing": cfg.train.activation_checkpointing,
        "settings": {},
    }
    if plan.pipeline is not None:  # the settings describe the whole model on one rank: not reported under pp > 1
        del out["settings"]
        out["pipeline"] = pipeline_dict(plan.pipeline)
        return out
    for ck in plan.settings():
        largest = plan.largest_micro_batch(ck)
        out["settings"][ck] = {
            "largest_micro_batch": largest,
            "at_largest": _mb_dict(plan.at(largest, ck)) if largest else None,
            "at_config": _mb_dict(plan.at(cfg.data.micro_batch_size, ck)),
        }
    return out


def pipeline_dict(pipe: PipelinePlan) -> dict:
    """The ring pipeline's schedule figures and per-stage bytes."""
    r = pipe.result
    return {
        "micro_batches": len(pipe.specs), "laps": [s.laps for s in pipe.specs],
        "grad_laps": [s.grad_laps for s in pipe.specs], "mean_laps": pipe.mean_laps,
        "max_in_flight": pipe.max_in_flight, "costs": asdict(pipe.costs), "makespan": r.makespan,
        "idle_fraction": r.idle_fraction, "interleaved_1f1b_idle": pipe.interleaved_idle,
        "stages": [{"rank": st.rank, "core_blocks": list(st.core_blocks), "parameters": st.n_params,
                    "params_bytes": st.static.params, "grads_bytes": st.static.grads, "muon_bytes": st.static.muon,
                    "adamw_bytes": st.static.adamw, "idle_fraction": st.idle, "peak_stored_units": st.peak_units,
                    "unit_bytes": st.unit_bytes, "activations_bytes": st.activations,
                    "stored_bytes": st.stored_bytes, "total_bytes": st.total}
                   for st in pipe.stages],
    }


def _mb_dict(mb: MicroBatchPlan) -> dict:
    return {"micro_batch": mb.micro_batch, "peak_bytes": mb.peak,
            "terms": {t.name: t.bytes for t in mb.terms()}}


def plan_text(plan: Plan, world: int, nodes: int, config_name: str) -> str:
    cfg, lay, g = plan.cfg, plan.layout, plan.gpu
    m = cfg.model
    engine = f"ZeRO-{lay.zero_stage} ({lay.engine})" if lay.dp > 1 or lay.engine == "deepspeed" else "no ZeRO"
    pp = f" x pp {lay.pp}" if lay.pp > 1 else ""
    lines = [
        f"memory plan: {config_name} ({plan.n_params / 1e6:.1f}M parameters) on {world} x {g.name} "
        f"({nodes} node{'s' if nodes > 1 else ''})",
        f"  layout: tp {lay.tp}{pp} x dp {lay.dp}, sequence parallel {'on' if lay.sp else 'off'}, {engine}, "
        f"{cfg.train.precision}; seq {m.seq_len}, mu_rec {m.mu_rec}, mu_bwd {m.backprop_depth}",
        f"  {startup_line(lay.tp, lay.dp, lay.pp)}",
        f"  GPU {gib(g.total_bytes).strip()}, headroom {gib(g.headroom_bytes).strip()} (CUDA context and "
        f"workspaces 2 GiB + 5% allocator fragmentation) -> usable {gib(g.usable_bytes).strip()} per GPU",
        "  figures are per rank (the most loaded one)" if lay.pp == 1 else
        "  figures are per GPU of each pipeline stage (the most loaded rank of its tp x dp group)",
    ]
    if plan.pipeline is not None:
        return "\n".join(lines + pipeline_lines(plan))
    for ck in plan.settings():
        largest = plan.largest_micro_batch(ck)
        mark = " (the config's setting)" if ck == cfg.train.activation_checkpointing else ""
        lines.append("")
        lines.append(f"activation_checkpointing={ck}{mark}: largest micro-batch that fits: {largest}")
        shown = [largest] if largest else []
        if cfg.data.micro_batch_size not in shown:
            shown.append(cfg.data.micro_batch_size)
        for b in shown:
            mb = plan.at(b, ck)
            verdict = "fits" if mb.peak <= g.usable_bytes else "does NOT fit"
            what = "largest" if b == largest else "data.micro_batch_size"
            lines.append(f"  micro-batch {b} ({what}): peak {gib(mb.peak).strip()}, {verdict}")
            if b == largest or not largest:
                lines += [f"    {t.name:<38}{gib(t.bytes)}" + (f"  ({t.note})" if t.note else "")
                          for t in mb.terms()]
    return "\n".join(lines)


def pipeline_lines(plan: Plan) -> list[str]:
    """The ring pipeline's schedule and a row of bytes per stage."""
    pipe, cfg, usable = plan.pipeline, plan.cfg, plan.gpu.usable_bytes
    r, c, m = pipe.result, pipe.costs, len(pipe.specs)
    lines = [
        "",
        f"ring pipeline, one optimizer step: {m} micro-batches of {cfg.data.micro_batch_size} sequences (data-parallel "
        f"rank 0, step 0), laps {' '.join(str(s.laps) for s in pipe.specs)} (mean {pipe.mean_laps:.2f}), the last "
        f"min(laps, {cfg.model.backprop_depth}) with autograd; bound {pipe.max_in_flight} micro-batches in flight",
        f"  costs in forward lap segments of the largest stage: backward {c.backward:g}, embed {c.embed:.3f} "
        f"(backward {c.embed_backward:.3f}), loss {c.loss:.3f} (backward {c.loss_backward:.3f})",
        f"  simulated makespan {r.makespan:.2f}; idle fraction {r.idle_fraction:.4f} (interleaved 1F1B's "
        f"(p-1)/(v m) with v = {pipe.mean_laps:.2f} laps: {pipe.interleaved_idle:.4f})",
        f"  activations (activation_checkpointing={cfg.train.activation_checkpointing}, micro-batch "
        f"{cfg.data.micro_batch_size}): peak stored units x one lap segment's bytes; stored: the run's peak with "
        "the embedding's and the loss's units at their own sizes (the sum counts it; not the optimizer step's "
        "working memory, nor the loss's backward transients)",
        f"  {'stage':>5} {'core':>7} {'parameters':>11} {'params':>12} {'grads':>12} {'Muon':>12} {'AdamW':>12} "
        f"{'units':>5} {'unit':>12} {'units x unit':>12} {'stored':>12} {'sum':>12} {'idle':>7}",
    ]
    for st in pipe.stages:
        s = st.static
        verdict = "" if st.total <= usable else "  does NOT fit"
        lines.append(f"  {st.rank:5d} {st.core_blocks[0]:3d}-{st.core_blocks[1] - 1:<3d} {st.n_params / 1e6:10.2f}M "
                     f"{gib(s.params)} {gib(s.grads)} {gib(s.muon)} {gib(s.adamw)} {st.peak_units:5d} "
                     f"{gib(st.unit_bytes)} {gib(st.activations)} {gib(st.stored_bytes)} {gib(st.total)} "
                     f"{st.idle:7.4f}{verdict}")
    return lines
