"""``python -m checkpoints export-hf`` and ``import-hf`` (registered by :mod:`checkpoints.cli`; its error
conventions: one line on stderr, exit 2 for bad input)."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import CheckpointError
from .export import DTYPES, export_hf
from .importing import import_hf
from data_prep.paths import LocalPath

EXPORT_EXAMPLES = """\
examples:
  python -m checkpoints export-hf runs/parcae hf/parcae            # the run's newest checkpoint, fp32
  python -m checkpoints export-hf runs/parcae/checkpoints/step_00001000 hf/parcae-bf16 --dtype bf16

  # then, with torch and transformers only:
  python -c "from transformers import AutoModelForCausalLM, AutoTokenizer
  tok = AutoTokenizer.from_pretrained('hf/parcae', trust_remote_code=True)
  model = AutoModelForCausalLM.from_pretrained('hf/parcae', trust_remote_code=True)
  ids = tok('The old man', return_tensors='pt')
  print(tok.decode(model.generate(**ids, max_new_tokens=32, num_steps=8)[0]))"

The tokenizer is the run's (data.shards/tokenizer) unless --tokenizer names one.
"""


def add_parsers(sub) -> None:
    p = sub.add_parser("export-hf", help="write a checkpoint as a Hugging Face folder (transformers, lm-eval, Hub)",
                       description="Write a committed checkpoint as a folder that transformers loads with "
                                   "AutoModelForCausalLM.from_pretrained(DIR,\ntrust_remote_code=True): config, "
                                   "modeling code, safetensors weights, tokenizer, generation config.",
                       epilog=EXPORT_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=LocalPath(), metavar="CKPT_OR_RUN",
                   help="a run directory, a checkpoint root or a step_XXXXXXXX directory")
    p.add_argument("out", type=LocalPath(), metavar="OUT_DIR", help="the folder to write (must not exist)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="weight dtype (default fp32)")
    p.add_argument("--tokenizer", type=LocalPath(), default=None, metavar="DIR",
                   help="a data_prep tokenizer directory (default: the run's data.shards/tokenizer)")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="split the weights into files of at most SIZE, with an index (default 5GB)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR when it exists (default: refuse)")
    p.set_defaults(func=cmd_export_hf)

    p = sub.add_parser("import-hf", help="read a folder written by export-hf back into a megaloop checkpoint",
                       description="Read a folder written by export-hf into a megaloop checkpoint (model arrays "
                                   "only), checking every tensor\nagainst its config.json. Bit-exact.")
    p.add_argument("folder", type=LocalPath(), metavar="DIR", help="the Hugging Face folder")
    p.add_argument("out", type=LocalPath(), metavar="OUT", help="a new (or empty) checkpoint root")
    p.add_argument("--step", type=int, default=None, metavar="N",
                   help="the checkpoint's step (default: the step the export recorded)")
    p.set_defaults(func=cmd_import_hf)


def checkpoint_of(path: Path) -> Path:
    """The committed step directory of a run directory, checkpoint root or step directory."""
    from ..cli import resolve

    if path.is_dir() and not (path / "metadata.json").is_file() and (path / "checkpoints").is_dir():
        return resolve(str(path / "checkpoints"))
    return resolve(str(path))


def cmd_export_hf(args) -> int:
    src = checkpoint_of(Path(args.checkpoint))
    out = export_hf(src, Path(args.out), args.dtype, args.tokenizer, args.overwrite, _size(args.max_shard_size))
    print(f"wrote {out} from {src}: load it with AutoModelForCausalLM.from_pretrained({str(out)!r}, "
          "trust_remote_code=True)")
    return 0


def cmd_import_hf(args) -> int:
    if args.step is not None and args.step < 0:
        raise CheckpointError(f"--step {args.step} is negative; give a step number >= 0")
    path = import_hf(Path(args.folder), Path(args.out), args.step)
    print(f"wrote {path} from {args.folder}; train from it with --set checkpoint.resume={args.out} --set "
          "checkpoint.load_optimizer=false, or evaluate it with python -m megaloop eval")
    return 0


def _size(text: str):
    """An int of bytes or a size string huggingface_hub parses ("5GB", "500MB")."""
    import re

    if not re.fullmatch(r"\d+|\d+(\.\d+)?\s*[KMGT]i?B", text.strip(), flags=re.IGNORECASE):
        raise CheckpointError(f"--max-shard-size {text!r} is not a size; give bytes or a size such as 5GB or 500MB")
    return int(text) if text.strip().isdigit() else text.strip()
