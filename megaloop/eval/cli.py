"""`python -m megaloop eval RUN_DIR|CHECKPOINT`: depth evaluation, CORE and LAMBADA of a committed checkpoint at
fixed depths, on one process or several (torchrun: data parallel over examples)."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from megaloop.eval.errors import EvalInputError
from data_prep.paths import LocalPath

HELP = ("evaluate a committed checkpoint at fixed loop depths T: loss and bits per byte on the validation split "
        "and on any text, CORE, LAMBADA and answer accuracy on a synthetic reasoning dataset")
TASK_GROUPS = ("val", "core", "lambada", "synth")


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("checkpoint", type=LocalPath(), metavar="RUN_DIR|CHECKPOINT",
                   help="a run directory, a checkpoint root or one step_XXXXXXXX directory (any saving layout)")
    p.add_argument("--depths", default=None, metavar="T,T,...",
                   help="loop depths to evaluate at, e.g. 1,2,4,8,16 (default 1, 2, 4, mu_rec, 2 mu_rec)")
    p.add_argument("--tasks", default="val", metavar="NAME,...",
                   help="val (the validation split), core (every CORE task present), lambada, synth (answer "
                        "accuracy and loss by hops on the val split of a `data_prep synth` dataset, the run's "
                        "data.shards or --shards), or CORE task names such as arc_easy,copa (default: val)")
    p.add_argument("--text", type=LocalPath(), default=None, metavar="PATH",
                   help="also evaluate loss and bits per byte on this text file or directory of text files")
    p.add_argument("--shards", default=None, metavar="DIR",
                   help="shard directory of the validation split and tokenizer (default: the run's data.shards)")
    p.add_argument("--tokenizer", type=LocalPath(), default=None,
                   metavar="DIR", help="tokenizer directory (default: SHARDS/tokenizer)")
    p.add_argument("--core-dir", type=LocalPath(), default=None, metavar="DIR",
                   help="folder with tasks_v0.3.yaml and the CORE task files (needed for core, lambada and task "
                        "names)")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="score the first N examples of each task")
    p.add_argument("--val-rows", type=int, default=None, metavar="N",
                   help="evaluate the first N validation rows (default: the run's own validation set, "
                        "data.val_batches x data.micro_batch_size rows, as the trainer validated; synth: every row)")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp64"), default=None,
                   help="compute precision (default: the run's train.precision, as the trainer validated)")
    p.add_argument("--seed", type=int, default=None,
                   help="h_0 and few-shot seed (default: the run's train.seed)")
    p.add_argument("--batch-size", type=int, default=16, metavar="B", help="rows per forward (default 16)")
    p.add_argument("--config", type=LocalPath(), default=None, metavar="YAML",
                   help="load the weights into this config's model (default: the checkpoint's own model config)")
    add_device_argument(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    return p


def add_device_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]; the model runs in fp32 there (h_0 "
                   "draws on CUDA come from CUDA generators, so numbers differ from the CPU's within float noise)")


def checked_device(name: str):
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise EvalInputError(f"--device {name!r}: not a device name; use cpu or cuda[:N]") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EvalInputError(f"--device {name}: no CUDA device is available here; use --device cpu")
    return device


def parse_depths(text: str | None, model_cfg) -> list[int]:
    """The depths asked for, checked against what the model can run (an integer T >= 1; 1 for the GPT baseline)."""
    from megaloop.train.evaluate import default_val_depths

    if text is None:
        return default_val_depths(model_cfg.mu_rec, model_cfg.is_looped)
    try:
        depths = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise EvalInputError(f"--depths {text!r}: give loop depths as integers separated by commas, e.g. 1,2,4,8")
    bad = [t for t in depths if t < 1 or (not model_cfg.is_looped and t != 1)]
    if not depths or bad:
        what = "runs its blocks once (T=1 only)" if not model_cfg.is_looped else "runs T >= 1 loop steps"
        raise EvalInputError(f"--depths {text!r}: this model cannot run T={bad[0] if bad else '(none)'}: it {what}; "
                             "give depths it can run, e.g. --depths 1" + ("" if not model_cfg.is_looped else ",2,4"))
    return sorted(set(depths))


def parse_tasks(text: str, core_dir) -> tuple[set[str], list]:
    """(groups among val/core/lambada, the CORE task specs to score). Unknown names are an error naming the valid."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    groups = {n for n in names if n in TASK_GROUPS}
    wanted = [n for n in names if n not in TASK_GROUPS]
    if not (wanted or groups & {"core", "lambada"}):
        return groups, []
    if core_dir is None:
        raise EvalInputError(f"--tasks {text}: CORE and LAMBADA need --core-dir DIR, the folder with "
                             "tasks_v0.3.yaml and the task files")
    from megaloop.eval.core import read_tasks

    present, missing, other = read_tasks(core_dir)
    known = {s.name for s in present} | set(missing) | set(other)
    unknown = [n for n in wanted if n not in known]
    if unknown:
        from megaloop.config.errors import suggest

        raise EvalInputError(f"--tasks: unknown task {unknown[0]!r}{suggest(unknown[0], sorted(known))}; use "
                             f"{', '.join(TASK_GROUPS)} or one of the CORE tasks: "
                             f"{', '.join(s.name for s in present)}")
    chosen = present if "core" in groups else [s for s in present if s.name in wanted]
    return groups, chosen


def run_eval(args) -> int:
    try:
        return _run(args)
    except EvalInputError as err:
        print(f"megaloop eval: {err}", file=sys.stderr)
        return 2


def _load(args):
    from megaloop.eval.checkpoint import load_model

    model_cfg = None
    if args.config is not None:
        from megaloop.config import ConfigError, load_config

        try:
            model_cfg = load_config(args.config, validate=False).model
        except (ConfigError, FileNotFoundError) as err:
            raise EvalInputError(f"--config: {err}") from None
    import torch

    from megaloop.eval.checkpoint import run_precision

    args.precision = args.precision or run_precision(args.checkpoint)
    dtype = torch.float64 if args.precision == "fp64" else torch.float32  # bf16: fp32 weights under autocast
    return load_model(args.checkpoint, model_cfg, device=checked_device(args.device), dtype=dtype)


def load_tokenizer_for(loaded, shards, tokenizer_dir):
    from data_prep.tokenizer import load_tokenizer

    path = Path(tokenizer_dir) if tokenizer_dir else Path(shards or loaded.config.get("data", {}).get("shards", "")) / \
        "tokenizer"
    try:
        return load_tokenizer(path, verify=False)
    except Exception as err:  # noqa: BLE001 - the tokenizer package's errors, whatever they are
        raise EvalInputError(f"tokenizer {path}: {err}; pass --tokenizer DIR (the data_prep tokenizer directory)"
                             ) from None


def _check_counts(args) -> None:
    for flag, value in (("--batch-size", args.batch_size), ("--limit", args.limit), ("--val-rows", args.val_rows)):
        if value is not None and value < 1:
            raise EvalInputError(f"{flag} {value}: give a positive count")


def _run(args) -> int:
    from megaloop.eval.world import close_world, init_world

    _check_counts(args)
    loaded = _load(args)
    cfg = loaded.model_config
    depths = parse_depths(args.depths, cfg)
    groups, specs = parse_tasks(args.tasks, args.core_dir)
    seed = args.seed if args.seed is not None else int(loaded.config.get("train", {}).get("seed", 0))
    shards = args.shards or loaded.config.get("data", {}).get("shards")
    world = init_world()
    try:
        out = {"checkpoint": str(loaded.path), "step": loaded.step, "seed": seed, "mu_rec": cfg.mu_rec}
        out.update(_evaluate(args, loaded, depths, groups, specs, seed, shards, world))
    finally:
        close_world(world)
    if world.is_main:
        print(json.dumps(out, indent=1) if args.json else format_report(out))
    return 0


def _evaluate(args, loaded, depths, groups, specs, seed, shards, world) -> dict:
    from megaloop.eval import depth_eval

    model, out = loaded.model, {}
    tokenizer = None
    autocast = _autocast(args.precision, next(model.parameters()).device)
    out["precision"] = args.precision
    if "val" in groups:
        limit = args.val_rows if args.val_rows is not None else _run_val_rows(loaded.config)
        rows, _ = depth_eval.validation_rows(shards, limit)
        out["val_rows"] = len(rows.tokens)
        out["depths"] = depth_eval.evaluate_depths(model, rows, depths, seed, args.batch_size, world,
                                                   _bar(world, len(depths), "val depths"), autocast)
    if args.text:
        tokenizer = load_tokenizer_for(loaded, shards, args.tokenizer)
        docs = depth_eval.text_documents(args.text)
        rows = depth_eval.text_rows(docs, tokenizer, model.cfg.seq_len)
        out["text"] = {"path": str(args.text), "documents": len(docs), "bytes": int(rows.bytes),
                       "depths": depth_eval.evaluate_depths(model, rows, depths, seed, args.batch_size, world,
                                                            _bar(world, len(depths), "text depths"), autocast)}
    if specs or "lambada" in groups:
        tokenizer = tokenizer or load_tokenizer_for(loaded, shards, args.tokenizer)
        out.update(_tasks(args, model, tokenizer, depths, groups, specs, seed, world))
    if "synth" in groups:
        from megaloop.eval.synth import evaluate_synth

        out["synth"] = evaluate_synth(model, shards, depths, seed, args.batch_size, world, args.val_rows, autocast,
                                      _bar(world, None, "synth batches"))
    return out


def _tasks(args, model, tokenizer, depths, groups, specs, seed, world) -> dict:
    from megaloop.eval import core
    from megaloop.eval.scoring import Scorer

    present, missing, other = core.read_tasks(args.core_dir)
    tokenizer = _Memo(tokenizer)  # every depth scores the same prompts: encode each once
    out: dict = {}
    for depth in depths:
        scorer = Scorer(model, depth, seed, args.batch_size, world, tokenizer.bos_id)
        if specs:
            results = []
            for spec in specs:
                examples = core.read_examples(args.core_dir, spec, args.limit)
                pool = core.read_examples(args.core_dir, spec) if args.limit else None
                n = sum(len(core.prompts(spec, examples, i, seed, pool)) for i in range(len(examples)))
                results.append(core.score_task(scorer, tokenizer, spec, examples, seed,
                                               _bar(world, n, f"T={depth} {spec.name}"), pool))
            out.setdefault("core", {})[depth] = {
                "tasks": {r.name: r.to_dict() for r in results}, "aggregate": core.aggregate(results),
                "scored": [r.name for r in results], "missing": missing, "other_formats": other}
        if "lambada" in groups:
            spec = next((s for s in present if s.label == "lambada_openai"), None)
            if spec is None:
                raise EvalInputError(f"--tasks lambada: {args.core_dir} holds no lambada_openai.jsonl")
            examples = core.read_examples(args.core_dir, spec, args.limit)
            out.setdefault("lambada", {})[depth] = core.lambada(scorer, tokenizer, examples,
                                                                _bar(world, len(examples), f"T={depth} lambada"))
    return out


class _Memo:
    """A tokenizer whose encode remembers its results (the prompts repeat across depths and choices)."""

    def __init__(self, tokenizer):
        self.tokenizer, self._seen = tokenizer, {}
        self.bos_id, self.eos_id = tokenizer.bos_id, tokenizer.eos_id

    def encode(self, text: str) -> list[int]:
        if text not in self._seen:
            self._seen[text] = self.tokenizer.encode(text)
        return self._seen[text]


def _bar(world, total: int, desc: str):
    if not world.is_main:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, disable=None)


def _f(x: float, digits: int = 4) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _autocast(precision: str, device):
    """The forward's autocast as the trainer's (bf16 autocast for bf16, nothing otherwise), as a factory."""
    import functools

    from megaloop.train.precision import autocast_for

    return functools.partial(autocast_for, precision, device)


def _run_val_rows(config: dict) -> int | None:
    """The run's validation set size, data.val_batches x data.micro_batch_size (None: unknown, every row)."""
    data = config.get("data", {})
    batches, micro = data.get("val_batches"), data.get("micro_batch_size")
    return batches * micro if isinstance(batches, int) and isinstance(micro, int) and batches > 0 else None


def format_report(out: dict) -> str:
    lines = [f"checkpoint {out['checkpoint']} (step {out['step']}, h_0 seed {out['seed']}, mu_rec {out['mu_rec']}, "
             f"precision {out.get('precision', 'fp32')})"]
    for title, table in (("validation split", out.get("depths")), ("text " + out.get("text", {}).get("path", ""),
                                                                   out.get("text", {}).get("depths"))):
        if table:
            rows = f" ({out['val_rows']} rows)" if title == "validation split" and "val_rows" in out else ""
            lines.append(f"{title}{rows}:  T  loss [95% CI]  bpb [95% CI]  tokens")
            for t, r in table.items():
                lines.append(f"  {t:>3}  {_f(r['loss'])} [{_f(r['ci_low'])}, {_f(r['ci_high'])}]  {_f(r['bpb'])} "
                             f"[{_f(r['bpb_ci_low'])}, {_f(r['bpb_ci_high'])}]  {r['tokens']}")
    for t, block in out.get("core", {}).items():
        lines.append(f"CORE at T={t}:  task  format  shots  n  accuracy [95% CI]  chance  centered [95% CI]")
        for name, r in block["tasks"].items():
            lines.append(f"  {name:<32} {r['format']:<17} {r['shots']:>2} {r['examples']:>5}  {_f(r['accuracy'])} "
                         f"[{_f(r['ci_low'])}, {_f(r['ci_high'])}]  {_f(r['chance'])}  {_f(r['centered'])} "
                         f"[{_f(r['centered_ci_low'])}, {_f(r['centered_ci_high'])}]")
        a = block["aggregate"]
        lines.append(f"  CORE (mean centered accuracy over {a['tasks']} tasks) {_f(a['core'])} "
                     f"[{_f(a['ci_low'])}, {_f(a['ci_high'])}]")
        lines.append(f"  scored: {', '.join(block['scored'])}")
        lines.append(f"  missing (listed in tasks_v0.3.yaml, no file): {', '.join(block['missing']) or 'none'}")
    for t, r in out.get("lambada", {}).items():
        lines.append(f"LAMBADA at T={t}: last-word accuracy {_f(r['accuracy'])} [{_f(r['ci_low'])}, "
                     f"{_f(r['ci_high'])}] over {r['examples']}, perplexity {_f(r['perplexity'], 2)}")
    if "synth" in out:
        from megaloop.eval.synth import format_synth

        lines += format_synth(out["synth"])
    return "\n".join(lines)
