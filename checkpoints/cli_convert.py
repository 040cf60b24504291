"""``python -m checkpoints convert`` (official Parcae weights <-> checkpoint) and ``export`` (safetensors + JSON).

Registered by :mod:`checkpoints.cli`; errors follow its conventions: one line ``checkpoints: <what was wrong>; <what
to do>`` on stderr and exit code 2 for bad input, never a traceback. Weight files given to ``convert`` are read
with ``torch.load(..., weights_only=True)``, which refuses pickled objects other than tensors and plain
containers without running them, or with safetensors, which holds no code at all.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import warnings
from pathlib import Path

import torch

from .cli import resolve
from .errors import CheckpointError
from .export import DTYPES, export_safetensors, replace_atomically
from .load import CheckpointReader
from .official import TIED_HEAD_KEY, checkpoint_model_section, checkpoint_to_official, official_to_checkpoint
from .official_release import (
    CLASS_KEY,
    CONFIG_FILE,
    EXPORT_WEIGHTS,
    ROPE_KEY,
    check_release_weights,
    megaloop_model_section,
    official_config_for,
    output_folder_problem,
    read_release_config,
    release_state_dict,
    release_weights_file,
    resolve_official_config,
    write_release,
)
from data_prep.paths import LocalPath

TORCH_SUFFIXES = (".pt", ".pth", ".bin")
# `python -m megaloop check CONFIG` prints the config as JSON, then its summary: the model's size, and (since the run's
# length and rates were added) the run and optimizer lines
_CHECK_TRAILER = re.compile(r"model: [0-9.]+M parameters(\nrun: [^\n]*)?(\noptimizer: [^\n]*)?")

CONVERT_EXAMPLES = """\
examples:
  # an official release folder (config.json + model.pt, as its save_pretrained writes and the Hub publishes)
  # -> a megaloop checkpoint whose config is derived from config.json; and back to a release folder
  python -m checkpoints convert --from-official parcae-140m/ --out ckpt/parcae-140m
  python -m checkpoints inspect ckpt/parcae-140m
  python -m checkpoints convert --to-official ckpt/parcae-140m --out parcae-140m-again/

  # official Parcae weights -> a megaloop checkpoint (model arrays only), then train from it
  python -m megaloop check configs/parcae-140m.yaml > parcae-140m.json
  python -m checkpoints convert --from-official parcae.pt --config parcae-140m.json --out ckpt/official
  python -m megaloop train configs/parcae-140m.yaml --set checkpoint.resume=ckpt/official \\
      --set checkpoint.load_optimizer=false

  # a megaloop checkpoint -> official key names (torch.save dict, or safetensors by extension)
  python -m checkpoints convert --to-official runs/parcae/checkpoints --out parcae.safetensors

CONFIG_JSON is megaloop's resolved config tree as JSON: the config.json a run writes in train.out_dir, or the
output of `python -m megaloop check CONFIG` (its closing summary lines, 'model: ... parameters', 'run: ...',
'optimizer: ...', are skipped). A YAML config is not accepted: resolve it with `python -m megaloop check` first. A release folder needs no --config: official
settings megaloop cannot compute exactly (untied head, biases, logit softcap, ...) are refused by name.
"""

EXPORT_EXAMPLES = """\
example:
  python -m checkpoints export runs/parcae/checkpoints --out export/parcae.safetensors --dtype bf16
  # writes export/parcae.safetensors (parameters under megaloop names) and export/parcae.json (config, step);
  # load with safetensors.torch.load_file("export/parcae.safetensors") and json.load(open("export/parcae.json"))
"""


def add_parsers(sub) -> None:
    """Add the ``convert`` and ``export`` subcommands to :func:`checkpoints.cli.build_parser`'s subparsers."""
    p = sub.add_parser("convert", help="convert between official Parcae weights and a megaloop checkpoint",
                       description="Convert official Parcae weights (a torch state_dict file or safetensors) "
                                   "into a megaloop checkpoint\nholding model/* arrays only, or a checkpoint's "
                                   "weights back to the official key names.\nBit-exact both ways (dtypes kept).",
                       epilog=CONVERT_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    way = p.add_mutually_exclusive_group(required=True)
    way.add_argument("--from-official", metavar="SRC", help="an official release folder (config.json + "
                     "pytorch_model.bin, model.pt or model.safetensors), or official weights: .pt/.pth/.bin (a "
                     "state_dict saved with torch.save; loaded with weights_only=True) or .safetensors")
    way.add_argument("--to-official", metavar="CKPT_DIR", help="a checkpoint directory (step_XXXXXXXX) or a root "
                     "holding 'latest'")
    p.add_argument("--config", type=LocalPath(),
                   metavar="CONFIG_JSON", help="with --from-official FILE: megaloop's resolved config as "
                   "JSON (see below); stored in the checkpoint's metadata")
    p.add_argument("--out", type=LocalPath(), required=True,
                   metavar="PATH", help="with --from-official: a new (or empty) checkpoint "
                   "root; with --to-official: a release folder (a path ending in '/' or without extension, or an "
                   "empty directory) or the output file, .pt/.pth (torch.save of a dict of tensors) or "
                   ".safetensors")
    p.add_argument("--step", type=int, default=None, metavar="N", help="with --from-official: the step number "
                   "of the checkpoint (default 0)")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("export", help="write a checkpoint's weights as one safetensors file plus a JSON config",
                       description="Write every model parameter of a checkpoint (no optimizer state) under its "
                                   "megaloop name to one\nsafetensors file, and the run's config and step to the "
                                   ".json of the same name beside it.",
                       epilog=EXPORT_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=LocalPath(),
                   metavar="CKPT_DIR", help="a checkpoint directory (step_XXXXXXXX) or a root holding "
                   "'latest'")
    p.add_argument("--out", type=LocalPath(), required=True,
                   metavar="FILE.safetensors", help="the safetensors file to write "
                   "(FILE.json is written beside it)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast floating-point parameters "
                   "(default: keep the stored dtypes)")
    p.add_argument("--overwrite", action="store_true", help="replace FILE.safetensors and FILE.json when they exist "
                   "(default: refuse)")
    p.set_defaults(func=cmd_export)


# ---- commands -------------------------------------------------------------------------------------------------
def cmd_convert(args) -> int:
    if args.from_official is not None:
        return _from_official(args)
    if args.config is not None or args.step is not None:
        raise CheckpointError("--config and --step belong to --from-official (a checkpoint records its own); "
                              "drop them with --to-official")
    src = resolve(args.to_official)
    out = Path(args.out)
    file_types = TORCH_SUFFIXES + (".safetensors",)
    if args.out.endswith(("/", os.sep)) or not out.suffix or (out.is_dir() and out.suffix not in file_types):
        return _to_release(src, out)
    if out.suffix not in file_types:
        raise CheckpointError(f"{out}: unknown output type {out.suffix!r}; name the file .pt/.pth (torch.save) or "
                              ".safetensors, or end the path with '/' for a release folder")
    if out.is_dir():
        raise CheckpointError(f"{out}: is a directory; give the path of the file to write (or end the path with '/' "
                              "to write a release folder into it)")
    weights = checkpoint_to_official(src)
    _save_weights(weights, out)
    print(f"wrote {out}: {len(weights)} official keys ({TIED_HEAD_KEY} tied to the embedding) from {src}")
    return 0


def _to_release(src: Path, out: Path) -> int:
    problem = output_folder_problem(out)
    if problem:
        raise CheckpointError(f"{problem} (nothing is written into an existing folder)")
    reader = CheckpointReader(src)
    config = official_config_for(checkpoint_model_section(reader), reader.metadata.get("official_config"))
    state = release_state_dict(checkpoint_to_official(src), config)
    write_release(out, config, state)
    print(f"wrote {out}: {CONFIG_FILE} ({config[CLASS_KEY]}) and {EXPORT_WEIGHTS} ({len(state)} official keys, "
          f"{TIED_HEAD_KEY} tied to the embedding, {ROPE_KEY} regenerated) from {src}")
    return 0


def _from_release(args, folder: Path) -> int:
    if args.config is not None:
        raise CheckpointError(f"{folder}: a release folder carries its own {CONFIG_FILE}; drop --config")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out}: exists and is not an empty directory; give a new directory for the converted "
                              "checkpoint")
    raw = read_release_config(folder)
    official = resolve_official_config(raw)
    config = {"model": megaloop_model_section(official)}
    source = release_weights_file(folder)
    weights = load_official_weights(source)
    check_release_weights(weights, official, source)
    path = official_to_checkpoint(weights, config, out, 0 if args.step is None else args.step,
                                  metadata={"official_config": raw})
    print(f"wrote {path}: {official[CLASS_KEY]} from {folder} ({source.name}, {len(weights)} official keys); its "
          f"model config: {json.dumps(config['model'])}; train from it with --set checkpoint.resume={args.out} "
          "--set checkpoint.load_optimizer=false and that model section")
    return 0


def _from_official(args) -> int:
    if Path(args.from_official).is_dir():
        return _from_release(args, Path(args.from_official))
    if args.config is None:
        raise CheckpointError("--from-official FILE needs --config CONFIG_JSON, megaloop's resolved config of the "
                              "model (e.g. `python -m megaloop check CONFIG > config.json`), or give a release "
                              "folder (config.json + weights) instead of the file")
    config = load_config_json(Path(args.config))
    weights = load_official_weights(Path(args.from_official))
    path = official_to_checkpoint(weights, config, Path(args.out), 0 if args.step is None else args.step)
    print(f"wrote {path}: {len(weights)} official keys from {args.from_official}; train from it with "
          f"--set checkpoint.resume={args.out} --set checkpoint.load_optimizer=false")
    return 0


def cmd_export(args) -> int:
    src = resolve(args.dir)
    target = Path(args.out)
    existing = [p for p in (target, target.with_suffix(".json")) if p.is_file()]
    if existing and not args.overwrite:
        raise CheckpointError(f"{existing[0]} already exists; give another --out, or pass --overwrite to replace it")
    out = export_safetensors(src, target, args.dtype)
    print(f"wrote {out} and {out.with_suffix('.json')} from {src}")
    return 0


# ---- reading and writing files --------------------------------------------------------------------------------
def load_config_json(path: Path) -> dict:
    """megaloop's resolved config tree from a JSON file (optionally followed by `megaloop check`'s size line)."""
    if not path.is_file():
        raise CheckpointError(f"{path}: no such config file; give megaloop's resolved config as JSON (the "
                              "config.json in a run's train.out_dir, or `python -m megaloop check CONFIG` output)")
    if path.suffix in (".yaml", ".yml"):
        raise CheckpointError(f"{path}: a YAML config; convert needs the resolved config as JSON: run `python -m "
                              f"megaloop check {path} > config.json` and pass config.json")
    try:
        text = path.read_text(encoding="utf-8")
        config, end = json.JSONDecoder().raw_decode(text.lstrip())
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{path}: not JSON ({_one_line(exc)}); give megaloop's resolved config as JSON, e.g. "
                              "`python -m megaloop check CONFIG > config.json`") from None
    rest = text.lstrip()[end:].strip()
    if rest and not _CHECK_TRAILER.fullmatch(rest):
        raise CheckpointError(f"{path}: extra text after the JSON config ({rest[:40]!r}); keep the JSON object "
                              "alone in the file")
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise CheckpointError(f"{path}: not a megaloop config (a JSON object with a 'model' section expected); "
                              "give the output of `python -m megaloop check CONFIG`")
    return config


def load_official_weights(path: Path) -> dict:
    """The state_dict in a .pt/.pth/.bin file (torch.load with weights_only=True: no code runs) or .safetensors.
    A dict holding the state_dict under "model" or "state_dict" (a training checkpoint) is unwrapped."""
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file; give the official weights as .pt/.pth/.bin or .safetensors")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path), device="cpu")
        except Exception as exc:  # safetensors raises its own error types for malformed files
            raise CheckpointError(f"{path}: not a readable safetensors file ({_one_line(exc)}); give the official "
                                  "weights file unchanged") from None
    if path.suffix not in TORCH_SUFFIXES:
        raise CheckpointError(f"{path}: unknown weights type {path.suffix or '(no extension)'!r}; give a "
                              f"{'/'.join(TORCH_SUFFIXES)} file written by torch.save, or .safetensors")
    try:
        with warnings.catch_warnings():  # e.g. about the pickle protocol: the outcome is reported below
            warnings.simplefilter("ignore")
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # the weights-only unpickler refuses anything but tensors and plain containers
        raise CheckpointError(f"{path}: refused by torch.load(weights_only=True), which loads only tensors and "
                              f"plain containers ({_refusal(exc)}); save the "
                              "weights with torch.save(model.state_dict(), FILE)") from None
    if isinstance(obj, dict) and not any(isinstance(v, torch.Tensor) for v in obj.values()):
        for wrapper in ("model", "state_dict"):
            if isinstance(obj.get(wrapper), dict):
                return obj[wrapper]
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: holds a {type(obj).__name__}, not a state_dict; save the weights with "
                              "torch.save(model.state_dict(), FILE)")
    return obj


def _save_weights(weights: dict, out: Path) -> None:
    if out.suffix == ".safetensors":
        from safetensors.torch import save_file

        # safetensors stores no aliasing: the tied head becomes its own copy of the embedding
        plain = {k: (v.clone() if k == TIED_HEAD_KEY else v) for k, v in weights.items()}
        write = lambda tmp: save_file(plain, str(tmp), metadata={"format": "pt"})  # noqa: E731
    else:
        write = lambda tmp: torch.save(dict(weights), tmp)  # noqa: E731
    try:
        replace_atomically(out, write)
    except RuntimeError as exc:  # torch's zip writer reports a full disk this way
        raise CheckpointError(f"{out}: writing failed ({_one_line(exc)}); check free space and the path") from None


def _refusal(exc: BaseException) -> str:
    """What torch's weights-only unpickler refused (e.g. "Unsupported global: GLOBAL io.open was not an allowed
    global by default"), without its advice to allow the global or to load with weights_only=False."""
    text = str(exc)
    marker = "WeightsUnpickler error:"
    if marker not in text:
        return _one_line(exc)
    detail = next((ln.strip() for ln in text.split(marker, 1)[1].splitlines() if ln.strip()), "")
    return detail.split(". Please")[0].rstrip(".") or _one_line(exc)


def _one_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of an error's message, shortened to `limit` characters."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = lines[0] if lines else type(exc).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."
