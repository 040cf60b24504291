"""A model with random logits on every CORE task present: its accuracy must contain chance in its 95% interval.

    python benchmarks/core_chance.py --core-dir DIR [--limit 300]

Prints one row per task (format, examples, accuracy and interval, chance, inside?) and exits 1 if chance falls
outside the interval of any task. The model's logits are independent standard normals, so every prediction is a
fair draw among the choices (multiple choice, schema) and greedy exact match is (almost) never right (language
modelling, chance 0). A byte-level tokenizer stands in for a trained one (the prompts are what tasks_v0.3.yaml
gives; the tokenizer does not change what chance is).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaloop.config import ModelConfig  # noqa: E402
from megaloop.eval import core  # noqa: E402
from megaloop.eval.scoring import Scorer  # noqa: E402


class RandomLogits(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, seed: int = 0):
        super().__init__()
        self.cfg, self.anchor = cfg, torch.nn.Parameter(torch.zeros(1))
        self.g = torch.Generator().manual_seed(seed)

    def forward(self, ids, depth=None, h0=None):
        return type("Out", (), {"logits": torch.randn(*ids.shape, self.cfg.vocab_size, generator=self.g)})


class ByteTokenizer:
    bos_id, eos_id, pad_id = 0, 1, 2

    def encode(self, text):
        return [b + 3 for b in text.encode("utf-8")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--core-dir", required=True)
    ap.add_argument("--limit", type=int, default=300, help="examples per task (default 300)")
    ap.add_argument("--seq-len", type=int, default=512)
    args = ap.parse_args()
    cfg = ModelConfig(vocab_size=260, d_model=32, n_heads=2, seq_len=args.seq_len, mu_rec=1, mu_bwd=1,
                      ve_gate_channels=8)
    scorer = Scorer(RandomLogits(cfg), 1, batch_size=64)
    present, missing, _ = core.read_tasks(args.core_dir)
    bad = 0
    print(f"{'task':<34}{'format':<18}{'n':>5}  accuracy [95% CI]        chance  inside")
    for spec in present:
        examples = core.read_examples(args.core_dir, spec, args.limit)
        r = core.score_task(scorer, ByteTokenizer(), spec, examples, seed=0, pool=core.read_examples(args.core_dir,
                                                                                                    spec))
        low, high = r.interval()
        inside = low <= r.chance <= high
        bad += not inside
        print(f"{spec.name:<34}{spec.kind:<18}{r.examples:>5}  {r.accuracy:.4f} [{low:.4f}, {high:.4f}]  "
              f"{r.chance:.4f}  {'yes' if inside else 'NO'}")
    print(f"{len(present)} tasks scored, chance inside the interval on {len(present) - bad}; missing: "
          f"{', '.join(missing)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
