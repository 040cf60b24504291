"""parcae-tiny (narrowed for the CPU) learns real text in the default precision (train.precision=auto: bf16 where
the CPU computes it natively, else fp32): on novels' chapters its training loss falls clearly, its validation loss at
T = mu_rec ends below the unigram cross-entropy of the validation split (the best a model without context can do, so
the threshold is a property of the data, not a tuned number) and below its own validation loss at T = 1 (test-time
depth helps)."""
from megaloop.config import load_config
from megaloop.eval.baselines import unigram_entropy
from megaloop.train.loop import train
from tests.train.conftest import TINY, fast_overrides

STEPS = 400


def test_loss_falls_and_depth_helps(tiny_shards, tmp_path):
    sets = fast_overrides(tiny_shards, tmp_path, steps=STEPS) + [
        "train.val_every=1000", "data.val_batches=8", "train.precision=auto", "optim.muon_momentum_warmup_steps=50"]
    cfg = load_config(TINY, sets)
    summary = train(cfg)
    first, last = sum(summary.losses[:10]) / 10, sum(summary.losses[-20:]) / 20
    unigram = unigram_entropy(tiny_shards, "val", fit_split="train")
    val = {t: v["val_loss"] for t, v in summary.val.items()}
    mu = cfg.model.mu_rec
    print(f"train loss: first 10 steps {first:.3f}, last 20 steps {last:.3f}")
    print(f"val loss by T: {', '.join(f'T={t}: {v:.4f}' for t, v in sorted(val.items()))}; "
          f"unigram cross-entropy of val {unigram:.4f}")
    assert last < first - 1.0
    assert val[mu] < unigram
    assert val[mu] < val[1]
