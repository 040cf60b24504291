"""`python -m megaloop flops CONFIG [--depth T] [--convention megaloop|reference] [--attention full|causal]
[--by-component] [--json]`: training FLOPs per token from the FLOP model (megaloop.train.flops)."""
from __future__ import annotations

import argparse
import json

HELP = ("print the training FLOPs per token (paper Eq. 14 + attention) at mu_rec or at a given depth, optionally "
        "split by component (prelude, injection, each lap without and with gradient, coda, head, attention); "
        "--json prints one JSON object with gflop_per_token (used by `python -m slurm sweep`); the data directory "
        "need not exist")


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--depth", type=int, default=None, metavar="T",
                   help="loop depth T (default model.mu_rec): min(T, backprop depth) laps with gradient, the rest "
                   "without, as the truncated-backprop samplers cut a sequence of depth T")
    p.add_argument("--convention", choices=("megaloop", "reference"), default="megaloop",
                   help="megaloop (default): the head counted, lookups not, the injection's term of e once per "
                   "forward; reference: the official Parcae code's estimate (lookups counted as matmuls, no head), "
                   "which reproduces its published table")
    p.add_argument("--attention", choices=("full", "causal"), default="full",
                   help="full (default, what MFU uses; Megatron-LM's paper formula and torchtitan count it so): the "
                   "whole S x S products; causal: half of them (what a causal kernel computes)")
    p.add_argument("--by-component", action="store_true",
                   help="split by component; each lap without and with gradient on its own row")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def flops_report(cfg, depth: int | None, convention: str, attention: str) -> dict:
    """The figures `flops` prints, as a dict."""
    from megaloop.config import ConfigError
    from megaloop.train.flops import FlopModel, depth_split, reference_flops_per_token

    m = cfg.model
    m.validate()
    if depth is not None and (depth < 1 or (not m.is_looped and depth != 1)):
        raise ConfigError("--depth", depth, "must be >= 1 (and 1 for a GPT model, whose blocks run once)")
    n, k = depth_split(m, depth)
    fm = FlopModel.of(m, causal=attention == "causal")
    out = {"convention": convention, "attention": attention, "depth": n + k if m.is_looped else 1,
           "laps_nograd": n, "laps_grad": k, "mu_rec": m.mu_rec, "mu_bwd": m.backprop_depth if m.is_looped else 0,
           "tokens_per_step": cfg.data.global_batch_size * m.seq_len}
    if convention == "reference":
        if attention != "full":
            raise ConfigError("--attention", attention, "the reference convention counts full attention only")
        from megaloop.model import build_model, count_parameters

        total = count_parameters(build_model(m, device="meta"))
        flops = reference_flops_per_token(m, total, depth)
    else:
        flops = fm.per_token(n, k)
        out["components"] = [{"name": c.name, "gflop_per_token": c.total / 1e9, "matmul": c.matmul / 1e9,
                              "attention": c.attention / 1e9} for c in fm.components(n, k)]
        out["attention_gflop_per_token"] = sum(c["attention"] for c in out["components"])
    out["flops_per_token"], out["gflop_per_token"] = flops, flops / 1e9
    return out


def format_report(r: dict, by_component: bool) -> str:
    laps = (f"depth {r['depth']} ({r['laps_nograd']} laps without gradient, {r['laps_grad']} with)"
            if r["laps_grad"] else "a plain stack, once")
    lines = [f"training FLOPs per token, {r['convention']} convention, {r['attention']} attention, {laps}: "
             f"{r['gflop_per_token']:.4f} GFLOP/token; {r['tokens_per_step']:,} tokens per step"]
    if by_component and "components" in r:
        lines.append(f"{'component':<20} {'GFLOP/token':>12} {'matmul':>10} {'attention':>10} {'share':>7}")
        for c in r["components"]:
            lines.append(f"{c['name']:<20} {c['gflop_per_token']:>12.5f} {c['matmul']:>10.5f} {c['attention']:>10.5f} "
                         f"{100 * c['gflop_per_token'] / r['gflop_per_token']:>6.2f}%")
        att = r["attention_gflop_per_token"]
        lines.append(f"{'attention (all)':<20} {att:>12.5f} {'':>10} {'':>10} {100 * att / r['gflop_per_token']:>6.2f}%")
    elif by_component:
        lines.append("(the reference convention has no per-component split: it is one formula, kept to check the "
                     "published table)")
    return "\n".join(lines)


def run_flops(args, cfg) -> int:
    report = flops_report(cfg, args.depth, args.convention, args.attention)
    if not args.by_component:
        report.pop("components", None)
    print(json.dumps(report) if args.json else format_report(report, args.by_component))
    return 0
