"""The plan as text for people and as JSON for programs."""
from __future__ import annotations

from megaloop.plan.gpus import GIB
from megaloop.plan.planner import MicroBatchPlan, Plan


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
        "micro_batch_size": cfg.data.micro_batch_size,
        "activation_checkpointing": cfg.train.activation_checkpointing,
        "settings": {},
    }
    for ck in plan.settings():
        largest = plan.largest_micro_batch(ck)
        out["settings"][ck] = {
            "largest_micro_batch": largest,
            "at_largest": _mb_dict(plan.at(largest, ck)) if largest else None,
            "at_config": _mb_dict(plan.at(cfg.data.micro_batch_size, ck)),
        }
    return out


def _mb_dict(mb: MicroBatchPlan) -> dict:
    return {"micro_batch": mb.micro_batch, "peak_bytes": mb.peak,
            "terms": {t.name: t.bytes for t in mb.terms()}}


def plan_text(plan: Plan, world: int, nodes: int, config_name: str) -> str:
    cfg, lay, g = plan.cfg, plan.layout, plan.gpu
    m = cfg.model
    engine = f"ZeRO-{lay.zero_stage} ({lay.engine})" if lay.dp > 1 or lay.engine == "deepspeed" else "no ZeRO"
    lines = [
        f"memory plan: {config_name} ({plan.n_params / 1e6:.1f}M parameters) on {world} x {g.name} "
        f"({nodes} node{'s' if nodes > 1 else ''})",
        f"  layout: tp {lay.tp} x dp {lay.dp}, sequence parallel {'on' if lay.sp else 'off'}, {engine}, "
        f"{cfg.train.precision}; seq {m.seq_len}, mu_rec {m.mu_rec}, mu_bwd {m.backprop_depth}",
        f"  GPU {gib(g.total_bytes).strip()}, headroom {gib(g.headroom_bytes).strip()} (CUDA context and "
        f"workspaces 2 GiB + 5% allocator fragmentation) -> usable {gib(g.usable_bytes).strip()} per GPU",
        "  figures are per rank (the most loaded one)",
    ]
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
