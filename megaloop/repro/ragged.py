"""`python -m megaloop.repro.ragged CONFIG [--set ...] --steps N --out FILE`: the ragged loop against the masked one
(every row runs the batch's deepest depth), side by side in one process on the same weights, depths and tokens.

Per micro-batch of CONFIG's shape, per-sequence depths from the config's sampler: forward + backward once with each
loop, alternating which goes first, the faster of two timings kept. Time is this process's CPU time (on a shared
machine wall time measures the other processes' load). Writes JSON: useful core rows (sum of depths), the rows each
loop ran, and tokens per CPU-second of each."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def _fwd_bwd(model, ids, depth) -> tuple[float, dict]:
    t0 = time.process_time()
    out = model(ids, labels=ids, depth=depth.T.numpy(), backprop_depth=depth.k.numpy())
    out.loss.backward()
    model.zero_grad(set_to_none=True)
    return time.process_time() - t0, out.telemetry


def measure(cfg, steps: int, repeats: int = 2) -> dict:
    import numpy as np
    import torch

    from megaloop.depth import make_sampler
    from megaloop.model import build_model

    torch.manual_seed(cfg.train.seed)
    m = cfg.model
    model = build_model(m)
    sampler = make_sampler(m.depth_sampler, m.mu_rec, m.backprop_depth, seed=cfg.train.seed)
    g = torch.Generator().manual_seed(cfg.train.seed)
    batch, seq = cfg.data.micro_batch_size, m.seq_len
    cpu = {True: 0.0, False: 0.0}
    rows = {True: 0, False: 0}
    useful = 0
    warm = sampler.sample(0, np.arange(batch))
    _fwd_bwd(model, torch.randint(0, m.vocab_size, (batch, seq), generator=g), warm)
    for step in range(steps):
        depth = sampler.sample(step, np.arange(step * batch, (step + 1) * batch))
        ids = torch.randint(0, m.vocab_size, (batch, seq), generator=g)
        for ragged in ((True, False) if step % 2 == 0 else (False, True)):
            model.ragged_loop = ragged
            runs = [_fwd_bwd(model, ids, depth) for _ in range(repeats)]
            cpu[ragged] += min(dt for dt, _ in runs)
            rows[ragged] += int(runs[0][1]["core_rows"])
        useful += int(depth.T.sum())
    tokens = steps * batch * seq
    return {"steps": steps, "batch": batch, "seq_len": seq, "mu_rec": m.mu_rec, "sampler": m.depth_sampler,
            "useful_core_rows": useful, "ragged_core_rows": rows[True], "masked_core_rows": rows[False],
            "ragged_tokens_per_cpu_s": tokens / cpu[True], "masked_tokens_per_cpu_s": tokens / cpu[False],
            "speedup": cpu[False] / cpu[True]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megaloop.repro.ragged", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", help="YAML config, e.g. configs/parcae-tiny.yaml")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--steps", type=int, default=8, help="micro-batches (default 8)")
    ap.add_argument("--out", required=True, help="JSON file to write")
    args = ap.parse_args(argv)
    from megaloop.config import ConfigError, load_config

    try:
        if args.steps < 1:
            raise ConfigError("--steps", args.steps, "must be >= 1")
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"megaloop.repro.ragged: {err}", file=__import__("sys").stderr)
        return 2
    result = measure(cfg, args.steps)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
