"""The FLOP model against torch.utils.flop_counter.FlopCounterMode, the whole matrix: GPT and Parcae (and RDM) at
T in {1, 4, 8}, with truncated backprop (k = min(T, ceil(mu/2))) and without (k = T), per component (forward per
module, the backward whole); the backward of one lap with gradient from two runs that differ by one gradient lap;
and the reference convention against the official code's published table.

    python benchmarks/flops_counter.py [--config configs/parcae-tiny.yaml] [--seq 64]

Exits 1 when any component is off by more than 2%, or the reference table by more than 0.5%.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PUBLISHED = {"parcae-140m": 1.360, "parcae-370m": 4.174, "parcae-770m": 8.860, "parcae-1_3b": 15.834,
             "gpt-140m": 0.821, "gpt-370m": 2.416, "gpt-770m": 4.955, "gpt-1_3b": 8.607}


def _models(config: str, seq: int):
    from megaloop.config import load_config

    m = load_config(config, validate=False).model
    parcae = dataclasses.replace(m, seq_len=seq, mu_rec=8, mu_bwd=4)
    gpt = dataclasses.replace(parcae, arch="gpt", injection="none", mu_rec=1, mu_bwd=1, prelude_norm=False,
                              use_C=False)
    rdm = dataclasses.replace(parcae, arch="rdm", injection="concat", block="sandwich", use_C=False)
    return {"parcae": parcae, "rdm": rdm, "gpt": gpt}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "parcae-tiny.yaml"),
                    help="the model sizes to check (a Parcae config; GPT and RDM variants are derived from it)")
    ap.add_argument("--seq", type=int, default=64, help="sequence length of the counted runs")
    args = ap.parse_args()
    import torch
    from tqdm import tqdm

    from megaloop.config import load_config
    from megaloop.model import build_model, count_parameters
    from megaloop.train.flop_count import analytical_groups, compare, counted_groups
    from megaloop.train.flops import reference_flops_per_token

    torch.manual_seed(0)
    worst, lines = 0.0, []
    cases = [("gpt", 0, 0)] + [(arch, t - k, k) for arch in ("parcae", "rdm") for t in (1, 4, 8)
                                for k in sorted({min(t, 4), t})]
    models = _models(args.config, args.seq)
    built = {name: build_model(cfg) for name, cfg in models.items()}
    for arch, n, k in tqdm(cases, desc="counting", file=sys.stderr):
        for name, want, got, err in compare(models[arch], n, k, built[arch]):
            worst = max(worst, err)
            lines.append(f"{arch:<7} T={max(n + k, 1):<2} k={k:<2} {name:<10} {want:>14.0f} {got:>14.0f} {100 * err:>9.4f}%")
    print(f"{'model':<7} {'T':<4} {'k':<4} {'component':<10} {'analytical':>14} {'counted':>14} {'rel err':>10}"
          "   (FLOPs per token; forward per component, backward whole)")
    print("\n".join(lines))
    for arch in ("parcae", "rdm"):  # one gradient lap's backward: runs at (T=4, k=2) and (T=4, k=3)
        cfg, model = models[arch], built[arch]
        got = counted_groups(model, cfg, 1, 3)["backward"] - counted_groups(model, cfg, 2, 2)["backward"]
        want = analytical_groups(cfg, 1, 3)["backward"] - analytical_groups(cfg, 2, 2)["backward"]
        err = abs(got - want) / want
        worst = max(worst, err)
        print(f"{arch}: backward of one lap with gradient: analytical {want:.0f}, counted {got:.0f}, rel err "
              f"{100 * err:.4f}%")
    print(f"worst relative error per component: {100 * worst:.4f}% (bound 2%)")
    ref_worst = 0.0
    for name, published in PUBLISHED.items():
        m = load_config(ROOT / "configs" / f"{name}.yaml", validate=False).model
        got = reference_flops_per_token(m, count_parameters(build_model(m, device="meta"))) / 1e9
        err = abs(got - published) / published
        ref_worst = max(ref_worst, err)
        print(f"reference convention {name:<12} {got:.4f} GFLOP/token, published {published:.3f}, "
              f"rel err {100 * err:.4f}%")
    print(f"worst relative error against the published table: {100 * ref_worst:.4f}% (bound 0.5%)")
    return 0 if worst <= 0.02 and ref_worst <= 0.005 else 1


if __name__ == "__main__":
    sys.exit(main())
