"""EleutherAI lm-evaluation-harness on megaloop checkpoints: the model "megaloop" (optional dependency,
`pip install -r requirements-eval.txt`).

    import megaloop.eval.lm_eval_adapter  # registers "megaloop"
    lm_eval.simple_evaluate(model="megaloop", model_args="checkpoint=RUN_DIR,depth=4,seed=0", tasks=[...])

or from the shell, with every lm_eval option: `python -m megaloop.eval.lm_eval_adapter --model megaloop
--model_args checkpoint=RUN_DIR,depth=4 --tasks ...`. Every request is scored at the fixed depth `depth` (default
mu_rec) with the fixed h_0 of megaloop.eval.scoring, batched (`batch_size`, default 16); loglikelihood_rolling
uses disjoint windows of seq_len tokens (the first conditioned on BOS); generate_until decodes greedily with the
KV cache per lap and cuts at the first stop string. A context is cut on the left to the model's seq_len.
"""
from __future__ import annotations

import sys

import lm_eval.models  # noqa: F401 - the built-in models first: lm_eval loads them only into an empty registry
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from megaloop.eval.checkpoint import load_model
from megaloop.eval.scoring import Scorer


@register_model("megaloop")
class MegaloopLM(LM):
    def __init__(self, checkpoint=None, depth=None, seed: int = 0, batch_size=16, tokenizer=None, model=None,
                 tokenizer_obj=None, max_gen_toks: int = 64, **_ignored):
        """checkpoint: a run directory / checkpoint (or give `model` and `tokenizer_obj` directly, from Python);
        tokenizer: its directory (default: the run's data.shards/tokenizer). lm_eval's device and max_batch_size
        are accepted and ignored (the model runs on the CPU or where `model` already is)."""
        super().__init__()
        from megaloop.eval.cli import load_tokenizer_for

        if model is None:
            if checkpoint is None:
                raise ValueError("the megaloop model needs model_args checkpoint=RUN_DIR|CHECKPOINT (and optionally "
                                 "depth=T, seed=S, batch_size=B, tokenizer=DIR)")
            loaded = load_model(checkpoint)
            model = loaded.model
            tokenizer_obj = tokenizer_obj or load_tokenizer_for(loaded, None, tokenizer)
        self.model, self.tok = model, tokenizer_obj
        cfg = model.cfg
        self.depth = int(depth) if depth is not None else (cfg.mu_rec if cfg.is_looped else 1)
        self.seed, self.max_gen_toks = int(seed), int(max_gen_toks)
        bs = 16 if batch_size in (None, "auto") else int(str(batch_size).split(":")[0])
        self.scorer = Scorer(model, self.depth, self.seed, bs, bos_id=self.tok.bos_id)

    def _pairs(self, requests):
        pairs = []
        for req in requests:
            context, continuation = req.args[0], req.args[1]
            stripped = context.rstrip(" ")  # "Answer: " + "x" is scored as "Answer:" + " x"
            continuation = context[len(stripped):] + continuation
            pairs.append((self.tok.encode(stripped) if stripped else [], self.tok.encode(continuation)))
        return pairs

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return [(s.logprob, s.greedy) for s in self.scorer.score(self._pairs(requests))]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        return [self.scorer.rolling(self.tok.encode(req.args[0])) for req in requests]

    def generate_until(self, requests, disable_tqdm: bool = False):
        from megaloop.eval.generate import generate

        out = []
        for req in requests:
            context, kwargs = req.args[0], dict(req.args[1] or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            limit = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            ids = ([self.tok.bos_id] + self.tok.encode(context))[-(self.model.cfg.seq_len - 1):]
            gen = generate(self.model, ids, self.depth, limit, self.seed, stop={self.tok.eos_id})
            text = self.tok.decode([t for t in gen.tokens if t != self.tok.eos_id])
            cuts = [text.index(s) for s in until if s and s in text]
            out.append(text[:min(cuts)] if cuts else text)
        return out


def main(argv=None) -> int:
    """lm_eval's command line with the "megaloop" model registered."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
