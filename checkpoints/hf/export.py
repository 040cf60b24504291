"""Write a committed checkpoint as a Hugging Face folder: config, modeling code, safetensors weights, tokenizer.

The folder loads with ``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`` and
``AutoTokenizer.from_pretrained(DIR)`` on a machine with torch and transformers only. It holds

* ``config.json``: MegaloopConfig's fields (sizes, the loop's mu_rec, injection, prelude/core/coda layer counts,
  num_steps = mu_rec by default) and ``auto_map`` naming the two code files; ``megaloop`` keeps the training-only
  fields (arch, mu_bwd, depth_sampler) and the step, so that ``import-hf`` rebuilds the same megaloop config;
* ``configuration_megaloop.py`` and ``modeling_megaloop.py``, copied from this package unchanged;
* ``model.safetensors`` (or ``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json`` above the
  shard size), every parameter as ``model.<megaloop name>``; the head is tied to ``model.embed.weight``;
* ``tokenizer.json`` (megaloop's tokenizer as it is: encoding adds no special token, as megaloop's scoring and
  lm-eval adapter encode; ``megaloop generate`` puts ``<|bos|>`` in front of a prompt, so write
  ``tok("<|bos|>" + prompt)`` for the same ids), ``tokenizer_config.json``, ``special_tokens_map.json`` and
  ``generation_config.json``.

The folder is written under a temporary name beside OUT_DIR and renamed into place, so a failure leaves nothing
half-written.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..load import CheckpointReader
from ..official import MODEL_PREFIX, model_array_names

HERE = Path(__file__).resolve().parent
CODE_FILES = ("configuration_megaloop.py", "modeling_megaloop.py")
WEIGHT_PREFIX = "model."
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
SPECIALS = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}
# megaloop model field -> MegaloopConfig field
FIELDS = {"vocab_size": "vocab_size", "d_model": "hidden_size", "n_heads": "num_attention_heads",
          "n_kv_heads": "num_key_value_heads", "mlp_hidden": "intermediate_size", "n_prelude": "n_prelude",
          "n_core": "n_core", "n_coda": "n_coda", "injection": "injection", "block": "block", "mlp": "mlp",
          "prelude_norm": "prelude_norm", "use_C": "use_C", "value_embeds": "value_embeds",
          "ve_gate_channels": "ve_gate_channels", "seq_len": "max_position_embeddings", "rope_base": "rope_theta",
          "norm_eps": "rms_norm_eps", "init_std": "init_std", "mu_rec": "mu_rec"}
# kept in config.json's "megaloop" entry and restored by import-hf (doc_mask: the HF model computes one document
# per row as megaloop does; packed rows of several documents it attends across)
TRAINING_FIELDS = ("arch", "mu_bwd", "depth_sampler", "attention", "doc_mask", "bos_id", "doc_attention_share")


def hf_config(model: dict, dtype: torch.dtype, special_ids: dict, step: int | None = None) -> dict:
    """config.json for a megaloop model section (a dict of ModelConfig fields; missing ones keep their defaults)."""
    unknown = sorted(set(model) - set(FIELDS) - set(TRAINING_FIELDS))
    if unknown:
        raise CheckpointError(f"the checkpoint's model config has fields this export does not know ({unknown}); "
                              "export it with the megaloop version that wrote it")
    out = {"architectures": ["MegaloopForCausalLM"], "model_type": "megaloop",
           "auto_map": {"AutoConfig": "configuration_megaloop.MegaloopConfig",
                        "AutoModelForCausalLM": "modeling_megaloop.MegaloopForCausalLM"}}
    out.update({hf: model[ours] for ours, hf in FIELDS.items() if ours in model})
    looped = model.get("injection", "diagonal") != "none"
    out["num_steps"] = int(model.get("mu_rec", 8)) if looped else 1
    out.update({"h0_seed": 0, "tie_word_embeddings": True, "use_cache": True,
                "dtype": str(dtype).removeprefix("torch."), **special_ids})
    out["megaloop"] = {"model": {k: model[k] for k in TRAINING_FIELDS if k in model}, "step": step}
    return out


def generation_config(special_ids: dict, num_steps: int) -> dict:
    return {"bos_token_id": special_ids["bos_token_id"], "eos_token_id": special_ids["eos_token_id"],
            "pad_token_id": special_ids["pad_token_id"], "do_sample": False, "num_steps": num_steps}


def tokenizer_files(tokenizer_dir: Path, seq_len: int) -> tuple[dict[str, str], dict]:
    """(file name -> text, special token ids) for the exported tokenizer, from a data_prep tokenizer directory."""
    source = tokenizer_dir / "tokenizer.json"
    if not source.is_file():
        raise CheckpointError(f"no tokenizer at {tokenizer_dir} (no tokenizer.json); pass --tokenizer DIR, the "
                              "directory `python -m data_prep tokenizer` wrote (the run's data.shards/tokenizer)")
    spec = json.loads(source.read_text(encoding="utf-8"))
    vocab = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    missing = [t for t in SPECIALS.values() if t not in vocab]
    if missing:
        raise CheckpointError(f"{source}: lacks the special tokens {missing}; give a tokenizer written by "
                              "`python -m data_prep tokenizer`")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": seq_len, "clean_up_tokenization_spaces":
              False, **SPECIALS}
    ids = {f"{name}_id": vocab[token] for name, token in SPECIALS.items()}
    files = {"tokenizer.json": source.read_text(encoding="utf-8"), "tokenizer_config.json": _dumps(config),
             "special_tokens_map.json": _dumps(SPECIALS)}
    return files, ids


def write_hf_folder(out_dir, weights: dict[str, torch.Tensor], model: dict, tokenizer_dir, dtype: str = "fp32",
                    step: int | None = None, max_shard_size: int | str = "5GB") -> Path:
    """Write the folder for megaloop parameters `weights` (megaloop names) of the model section `model` into
    `out_dir` (which must not exist), atomically. Returns out_dir."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype}: use one of {', '.join(DTYPES)}")
    out_dir = Path(out_dir)
    files, ids = tokenizer_files(Path(tokenizer_dir), int(model.get("seq_len", 2048)))
    config = hf_config(model, DTYPES[dtype], ids, step)
    tensors = {WEIGHT_PREFIX + n: (t.to(DTYPES[dtype]) if t.is_floating_point() else t).contiguous()
               for n, t in weights.items()}
    split = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_size)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
    tmp.mkdir(parents=True)
    try:
        for name in CODE_FILES:
            shutil.copyfile(HERE / name, tmp / name)
        for filename, names in split.filename_to_tensors.items():
            save_file({n: tensors[n] for n in names}, str(tmp / filename), metadata={"format": "pt"})
        if split.is_sharded:
            index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                     "weight_map": split.tensor_to_filename}
            (tmp / "model.safetensors.index.json").write_text(_dumps(index))
        (tmp / "config.json").write_text(_dumps(config))
        (tmp / "generation_config.json").write_text(_dumps(generation_config(ids, config["num_steps"])))
        for filename, text in files.items():
            (tmp / filename).write_text(text, encoding="utf-8")
        mode = (tmp / "config.json").stat().st_mode & 0o777  # what the umask gives a new file
        for filename in split.filename_to_tensors:  # safetensors writes its files private (0600)
            os.chmod(tmp / filename, mode)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def export_hf(checkpoint_dir, out_dir, dtype: str = "fp32", tokenizer_dir=None, overwrite: bool = False,
              max_shard_size: int | str = "5GB") -> Path:
    """Export the committed checkpoint `checkpoint_dir` (a step directory) to the folder `out_dir`; see the
    module docstring. The arrays are verified against the manifest first; an existing out_dir is replaced only
    with `overwrite` (after the new folder is complete)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise CheckpointError(f"{out_dir} already exists; give a new OUT_DIR, or pass --overwrite to replace it")
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"{out_dir} is a file; give a directory path for the Hugging Face folder")
    reader = CheckpointReader(checkpoint_dir)
    config = reader.metadata.get("config")
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise CheckpointError(f"{reader.path}: metadata.json holds no model config; export checkpoints written by "
                              "megaloop training or by `python -m checkpoints convert`")
    tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir else _run_tokenizer(config, reader.path)
    names = model_array_names(reader)
    reader.verify(names)
    weights = {n[len(MODEL_PREFIX):]: reader.read(n) for n in names}
    if not out_dir.exists():
        return write_hf_folder(out_dir, weights, config["model"], tokenizer_dir, dtype, reader.step, max_shard_size)
    staged = write_hf_folder(out_dir.with_name(f".{out_dir.name}.new-{os.getpid()}"), weights, config["model"],
                             tokenizer_dir, dtype, reader.step, max_shard_size)
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    os.replace(out_dir, old)
    os.replace(staged, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def _run_tokenizer(config: dict, where: Path) -> Path:
    shards = (config.get("data") or {}).get("shards")
    if not shards:
        raise CheckpointError(f"{where}: its config names no data.shards, so its tokenizer is unknown; pass "
                              "--tokenizer DIR (the directory `python -m data_prep tokenizer` wrote)")
    path = Path(shards) / "tokenizer"
    if not (path / "tokenizer.json").is_file():
        raise CheckpointError(f"the run's tokenizer {path} is not there (data.shards={shards}); pass --tokenizer DIR "
                              "(the directory `python -m data_prep tokenizer` wrote)")
    return path


def _dumps(obj) -> str:
    return json.dumps(obj, indent=2) + "\n"
