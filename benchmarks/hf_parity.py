"""The Hugging Face export against megaloop, over the full matrix: every model kind, trained runs and the published
140m shapes, loop depths T = 1, mu_rec and 2 mu_rec, fp32 and fp64, and greedy generation with and without the cache.

For each model the script exports the folder (checkpoints.hf.write_hf_folder, as `export-hf` does), loads it with
transformers (trust_remote_code, offline) and prints, per depth, the largest logit difference from megaloop's
evaluation forward (its fixed h_0) relative to the largest logit, in fp32 and in fp64, and whether the 32 greedy
tokens of generate() with and without the cache equal `megaloop generate`'s at T = mu_rec (the prompt is <|bos|>
and the first tokens of a sentence). The tests (tests/checkpoints/test_hf_interop.py) run a small subset of this.

    python benchmarks/hf_parity.py --runs RUN_DIR [RUN_DIR ...]     # trained runs (their data.shards tokenizer)
    python benchmarks/hf_parity.py --shapes parcae-140m gpt-140m rdm-140m --tokenizer DIR   # random weights

--shapes takes the names of configs/*.yaml (and parcae-140m-additive: the 140m Parcae with the additive
injection); their weights are megaloop's initialisation with every weight perturbed (so that the zero-initialised
projections count). Exit status 1 when a check fails: fp32 above 1e-5 relative, fp64 not bit-identical, or tokens
that differ.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PROMPT = "It was the best of times, it was the worst of times"


def perturbed(model, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.1 if "norm" in name or name.endswith(("A_log", "dt_bias")) else 0.02
            p.add_(scale * torch.randn(p.shape, generator=g))
    return model.eval()


def shape_model(name: str):
    from megaloop.config import load_config
    from megaloop.model import build_model

    additive = name.endswith("-additive")
    cfg = load_config(REPO / "configs" / f"{name.removesuffix('-additive')}.yaml",
                      ["model.injection=additive"] if additive else [])
    return perturbed(build_model(cfg.model, seed=0)), name


def run_model(run: str):
    from megaloop.eval.checkpoint import load_model

    loaded = load_model(run)
    shards = loaded.config.get("data", {}).get("shards")
    return loaded.model, Path(shards) / "tokenizer", f"{Path(run).name} (step {loaded.step})"


def logit_rows(model, hf, ids, depths) -> list[tuple]:
    """(depth, fp32 relative difference, fp64 identical) per depth."""
    from megaloop.eval.scoring import Scorer

    rows = []
    for depth in depths:
        out = {}
        for dtype in (torch.float32, torch.float64):
            ours, theirs = model.to(dtype), hf.to(dtype)
            with torch.no_grad():
                want = ours(ids, depth=depth, h0=Scorer(ours, depth).h0(*ids.shape)).logits
                got = theirs(ids, num_steps=depth).logits
            out[dtype] = (float((got - want).abs().max() / want.abs().max()), bool(torch.equal(got, want)))
        rows.append((depth, out[torch.float32][0], out[torch.float64][1]))
    model.float(), hf.float()
    return rows


def generation_row(model, hf, depth: int) -> tuple[bool, bool]:
    from transformers import AutoTokenizer

    from megaloop.eval.generate import generate

    tok = AutoTokenizer.from_pretrained(hf.name_or_path, trust_remote_code=True)
    enc = tok("<|bos|>" + PROMPT, return_tensors="pt")
    prompt = enc.input_ids[0].tolist()
    want = generate(model, prompt, depth, 32).tokens
    got = [hf.generate(**enc, max_new_tokens=32, do_sample=False, use_cache=c)[0, len(prompt):].tolist()
           for c in (True, False)]
    return got[0] == want, got[1] == want


def check(model, tokenizer_dir: Path, label: str, work: Path) -> bool:
    from transformers import AutoModelForCausalLM

    from checkpoints.hf import write_hf_folder

    folder = write_hf_folder(work / label.split()[0], dict(model.state_dict()), dataclasses.asdict(model.cfg),
                             tokenizer_dir)
    hf = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    cfg = model.cfg
    depths = [1, cfg.mu_rec, 2 * cfg.mu_rec] if cfg.is_looped else [1]
    ids = torch.randint(0, cfg.vocab_size, (2, min(64, cfg.seq_len)), generator=torch.Generator().manual_seed(0))
    ok = True
    for depth, rel32, same64 in logit_rows(model, hf, ids, depths):
        good = rel32 <= 1e-5 and same64
        ok &= good
        print(f"{label:<34} {cfg.injection:<9} T={depth:<3} fp32 rel {rel32:.2e}  fp64 "
              f"{'identical' if same64 else 'DIFFERS'}{'' if good else '  FAIL'}", flush=True)
    cached, uncached = generation_row(model, hf, cfg.mu_rec if cfg.is_looped else 1)
    ok &= cached and uncached
    print(f"{label:<34} {cfg.injection:<9} generate 32 greedy tokens at T={cfg.mu_rec if cfg.is_looped else 1}: "
          f"cache {'same' if cached else 'DIFFERENT'}, no cache {'same' if uncached else 'DIFFERENT'}", flush=True)
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="*", default=[], metavar="RUN_DIR", help="trained runs to export")
    parser.add_argument("--shapes", nargs="*", default=[], metavar="NAME",
                        help="configs/NAME.yaml models with random weights (e.g. parcae-140m gpt-140m rdm-140m "
                             "parcae-140m-additive)")
    parser.add_argument("--tokenizer", type=Path, default=None, help="tokenizer directory for --shapes")
    args = parser.parse_args(argv)
    if args.shapes and args.tokenizer is None:
        parser.error("--shapes needs --tokenizer DIR (a data_prep tokenizer directory)")
    ok = True
    with tempfile.TemporaryDirectory(prefix="hf-parity-") as work:
        for run in args.runs:
            model, tokenizer_dir, label = run_model(run)
            ok &= check(model, tokenizer_dir, label, Path(work))
        for name in args.shapes:
            model, label = shape_model(name)
            ok &= check(model, args.tokenizer, f"{label} (random)", Path(work))
            del model
    print("all checks hold" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
