"""`python -m megaloop generate CHECKPOINT --prompt TEXT`: sampling with a KV cache per lap at a fixed depth, or
with adaptive depth per token (`--exit-threshold`), which also reports the mean laps and, with `--score-text`, the
loss against fixed depths at equal compute."""
from __future__ import annotations

import argparse
import json
import sys

from megaloop.eval.errors import EvalInputError
from data_prep.paths import LocalPath

HELP = ("generate text from a committed checkpoint at a fixed loop depth T (KV cache per lap), or with adaptive "
        "depth per token")


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("checkpoint", type=LocalPath(),
                   metavar="RUN_DIR|CHECKPOINT", help="a run directory, checkpoint root or step dir")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--depth", type=int, default=None, metavar="T",
                   help="loop depth (default mu_rec); with --exit-threshold, the most laps a token may take")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; otherwise sample")
    p.add_argument("--top-k", type=int, default=None, metavar="K", help="sample among the K most likely tokens")
    p.add_argument("--seed", type=int, default=0, help="h_0 and sampling seed (default 0)")
    p.add_argument("--exit-threshold", type=float, default=None, metavar="EPS",
                   help="stop looping a token once ||h_t - h_{t-1}|| / ||h_t|| < EPS (adaptive depth)")
    p.add_argument("--score-text", type=LocalPath(), default=None, metavar="PATH",
                   help="with --exit-threshold: also measure loss and mean laps on this text against fixed T")
    p.add_argument("--score-rows", type=int, default=4, metavar="N", help="rows of --score-text to score (default 4)")
    p.add_argument("--tokenizer", type=LocalPath(), default=None,
                   metavar="DIR", help="tokenizer directory (default: the run's)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    from megaloop.eval.cli import add_device_argument

    add_device_argument(p)
    return p


def run_generate(args) -> int:
    try:
        return _run(args)
    except EvalInputError as err:
        print(f"megaloop generate: {err}", file=sys.stderr)
        return 2


def _check(args, cfg) -> int:
    depth = args.depth if args.depth is not None else (cfg.mu_rec if cfg.is_looped else 1)
    if depth < 1 or (not cfg.is_looped and depth != 1):
        what = "runs its blocks once (T=1 only)" if not cfg.is_looped else "runs T >= 1 loop steps"
        raise EvalInputError(f"--depth {depth}: this model cannot run it: it {what}")
    if args.max_new_tokens < 1:
        raise EvalInputError(f"--max-new-tokens {args.max_new_tokens}: give at least 1")
    if args.exit_threshold is not None and not args.exit_threshold > 0:
        raise EvalInputError(f"--exit-threshold {args.exit_threshold}: give a positive ratio, e.g. 0.01")
    if args.temperature < 0 or (args.top_k is not None and args.top_k < 1):
        raise EvalInputError("--temperature must be >= 0 and --top-k >= 1")
    return depth


def _run(args) -> int:
    from megaloop.eval.checkpoint import load_model
    from megaloop.eval.cli import checked_device, load_tokenizer_for
    from megaloop.eval.generate import generate

    loaded = load_model(args.checkpoint, device=checked_device(args.device))
    cfg = loaded.model_config
    depth = _check(args, cfg)
    tokenizer = load_tokenizer_for(loaded, None, args.tokenizer)
    prompt = [tokenizer.bos_id, *tokenizer.encode(args.prompt)]
    if len(prompt) >= cfg.seq_len:
        raise EvalInputError(f"--prompt is {len(prompt)} tokens; the model runs at most seq_len {cfg.seq_len}")
    gen = generate(loaded.model, prompt, depth, args.max_new_tokens, args.seed, args.temperature, args.top_k,
                   args.exit_threshold, {tokenizer.eos_id})
    laps = gen.prompt_laps + gen.laps
    out = {"prompt": args.prompt, "text": tokenizer.decode(gen.tokens), "tokens": len(gen.tokens), "depth": depth,
           "mean_laps": sum(laps) / len(laps), "stopped": _stop_reason(gen.tokens, args.max_new_tokens, len(prompt),
                                                                       cfg.seq_len, tokenizer.eos_id)}
    if args.score_text:
        if args.exit_threshold is None:
            raise EvalInputError("--score-text measures adaptive depth: give --exit-threshold EPS too")
        out["score"] = _score(loaded.model, tokenizer, args, depth)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        if not args.prompt:
            print("[the prompt is empty: generating from <|bos|> alone]", file=sys.stderr)
        print(args.prompt + out["text"])
        print(f"[{out['tokens']} tokens at T={depth}, {out['stopped']}; mean laps per position "
              f"{out['mean_laps']:.2f}]", file=sys.stderr)
        if "score" in out:
            for r in out["score"]["adaptive"]:
                print(f"[eps {r['eps']:g}: mean laps {r['mean_laps']:.2f}, loss {r['loss']:.4f}; fixed T at equal "
                      f"compute {r['fixed_loss_at_equal_compute']:.4f}]", file=sys.stderr)
    return 0


def _stop_reason(tokens: list[int], asked: int, prompt_tokens: int, seq_len: int, eos_id: int) -> str:
    """Why generation ended: the end-of-text token, the model's context, or the tokens asked for."""
    if tokens and tokens[-1] == eos_id:
        return "stopped at <|eos|>"
    if len(tokens) < asked:
        return (f"stopped at the context limit ({asked} asked: the model runs at most seq_len {seq_len} positions "
                f"and the prompt took {prompt_tokens} with <|bos|>)")
    return f"the {asked} asked for"


def _score(model, tokenizer, args, depth) -> dict:
    from megaloop.eval.depth_eval import text_documents, text_rows
    from megaloop.eval.generate import adaptive_table

    rows = text_rows(text_documents(args.score_text), tokenizer, model.cfg.seq_len)
    full = rows.labelled.all(1)
    return adaptive_table(model, rows.tokens[full][:args.score_rows], depth, args.seed, [args.exit_threshold])
