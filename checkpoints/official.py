"""The official Parcae implementation's state_dict key names, and conversion between its weights and checkpoints.

Official keys (the reference's ``Parcae.state_dict()``) and the parameter names megaloop uses (``model/<name>``
inside a checkpoint)::

    transformer.wte.weight                              embed.weight
    transformer.{prelude|core_block|coda}.{i}.PART      {prelude|core|coda}.{i}.PART'   (see _BLOCK_PARTS)
    transformer.adapter.{A_log, dt_bias, B}             injection.{A_log, dt_bias, B}    (diagonal injection)
    transformer.adapter.adapter.weight                  injection.W.weight               (additive / concat)
    transformer.C.weight, transformer.ln_f.weight       C.weight, final_norm.weight
    transformer.ln_prelude.weight                       prelude_norm.weight
    value_embeds.{k}.weight                             value_embeds.{k}.weight
    lm_head.weight                                      (none: the same tensor as the embedding, tied)
    freqs_cis                                           (none: a buffer regenerated from the config)

The official GPT baseline keeps its blocks in one stack, ``transformer.h.{j}.PART``; megaloop's GPT (arch gpt) runs
its prelude, core and coda once each, so block j is the j-th of them in that order (``core.{j}`` when, as in a
converted release, n_prelude = n_coda = 0). Its other keys are those of Parcae's embedding, final norm, value
embeddings and tied head; it has no adapter, C or prelude norm. The name functions take the model section of
megaloop's config to tell the two apart (without one: Parcae).

Keys may carry the wrappers ``_orig_mod.`` (torch.compile) and ``module.`` (DistributedDataParallel); they are
stripped. This module knows names only; the model-aware check of every shape is
``megaloop.model.convert.from_reference_state_dict``. The checks here use only the config's sizes, so that this
package never needs megaloop: unknown keys, blocks beyond the configured layer counts, a missing block part,
an embedding of the wrong size and an untied head are refused by name; megaloop refuses any other mis-shaped
parameter when it loads the checkpoint.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch

from .errors import CheckpointError
from .load import CheckpointReader
from .pieces import Piece, dtype_name
from .save import Checkpointer

MODEL_PREFIX = "model/"
TIED_HEAD_KEY = "lm_head.weight"
EMBEDDING_KEY = "transformer.wte.weight"
IGNORED_KEYS = ("freqs_cis",)
WRAPPER_PREFIXES = ("_orig_mod.", "module.")

_STACKS = {"prelude": "prelude", "core_block": "core", "coda": "coda"}
_BLOCK_PARTS = {
    "norm_1.weight": "norm_1.weight", "norm_2.weight": "norm_2.weight",
    "norm_3.weight": "norm_3.weight", "norm_4.weight": "norm_4.weight",
    "attn.c_q.weight": "attn.q.weight", "attn.c_k.weight": "attn.k.weight", "attn.c_v.weight": "attn.v.weight",
    "attn.c_proj.weight": "attn.proj.weight", "attn.ve_gate.weight": "attn.ve_gate.weight",
    "mlp.fc.weight": "mlp.fc.weight", "mlp.proj.weight": "mlp.proj.weight",
}
# every block has these, whatever the block type, MLP or value-embedding settings
_REQUIRED_PARTS = ("norm_1.weight", "attn.c_q.weight", "attn.c_k.weight", "attn.c_v.weight", "attn.c_proj.weight",
                   "norm_2.weight", "mlp.fc.weight", "mlp.proj.weight")
_FIXED = {
    "transformer.wte.weight": "embed.weight",
    "transformer.adapter.A_log": "injection.A_log",
    "transformer.adapter.dt_bias": "injection.dt_bias",
    "transformer.adapter.B": "injection.B",
    "transformer.adapter.adapter.weight": "injection.W.weight",
    "transformer.C.weight": "C.weight",
    "transformer.ln_f.weight": "final_norm.weight",
    "transformer.ln_prelude.weight": "prelude_norm.weight",
}
_FIXED_INVERSE = {v: k for k, v in _FIXED.items()}
_STACKS_INVERSE = {v: k for k, v in _STACKS.items()}
_PARTS_INVERSE = {v: k for k, v in _BLOCK_PARTS.items()}
_OFFICIAL_BLOCK = re.compile(r"transformer\.(prelude|core_block|coda)\.(\d+)\.(.+)")
_GPT_BLOCK = re.compile(r"transformer\.h\.(\d+)\.(.+)")
_OUR_BLOCK = re.compile(r"(prelude|core|coda)\.(\d+)\.(.+)")
_VALUE_EMBED = re.compile(r"value_embeds\.(\d+)\.weight")
_LAYER_COUNTS = {"prelude": "n_prelude", "core_block": "n_core", "coda": "n_coda"}
_OUR_STACKS = ("prelude", "core", "coda")  # megaloop's block stacks, in the order a GPT runs them
_GPT_FIXED = {k: _FIXED[k] for k in ("transformer.wte.weight", "transformer.ln_f.weight")}
_GPT_FIXED_INVERSE = {v: k for k, v in _GPT_FIXED.items()}


class ConversionError(CheckpointError, KeyError):
    """A key or array that has no counterpart on the other side, or weights that do not fit the config."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return str(self.args[0])


# ---- names ----------------------------------------------------------------------------------------------------
def strip_wrappers(key: str) -> str:
    """An official key without the ``_orig_mod.`` / ``module.`` wrapper prefixes (also nested ones)."""
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if key.startswith(prefix):
                key, changed = key[len(prefix):], True
    return key.replace("._orig_mod.", ".")


def is_gpt(model_cfg: dict | None) -> bool:
    """Whether megaloop's model section describes the GPT baseline (official layout ``transformer.h``)."""
    return isinstance(model_cfg, dict) and model_cfg.get("arch") == "gpt"


def official_to_megaloop_name(key: str, model_cfg: dict | None = None) -> str | None:
    """megaloop's parameter name for an official key; None for keys that carry no weights of their own (the tied
    lm_head, the freqs_cis buffer). ConversionError for a key this mapping does not know. `model_cfg`: megaloop's
    model section (arch gpt selects the GPT layout; without it, Parcae's)."""
    key = strip_wrappers(key)
    if key in IGNORED_KEYS or key == TIED_HEAD_KEY:
        return None
    if is_gpt(model_cfg):
        return _gpt_name(key, model_cfg)
    if key in _FIXED:
        return _FIXED[key]
    m = _OFFICIAL_BLOCK.fullmatch(key)
    if m and m.group(3) in _BLOCK_PARTS:
        return f"{_STACKS[m.group(1)]}.{m.group(2)}.{_BLOCK_PARTS[m.group(3)]}"
    if _VALUE_EMBED.fullmatch(key):
        return key
    raise ConversionError(f"unknown reference key {key!r}: not a Parcae parameter this converter knows")


def megaloop_to_official_key(name: str, model_cfg: dict | None = None) -> str:
    """The official key of a megaloop parameter name; ConversionError for a name with no official counterpart.
    `model_cfg` as for official_to_megaloop_name."""
    if is_gpt(model_cfg):
        return _gpt_key(name, model_cfg)
    if name in _FIXED_INVERSE:
        return _FIXED_INVERSE[name]
    m = _OUR_BLOCK.fullmatch(name)
    if m and m.group(3) in _PARTS_INVERSE:
        return f"transformer.{_STACKS_INVERSE[m.group(1)]}.{m.group(2)}.{_PARTS_INVERSE[m.group(3)]}"
    if _VALUE_EMBED.fullmatch(name):
        return name
    raise ConversionError(f"our key {name!r} has no reference counterpart")


def _stack_sizes(model_cfg: dict) -> tuple[int, int, int]:
    return tuple(_size(model_cfg, f) or 0 for f in ("n_prelude", "n_core", "n_coda"))


def _gpt_name(key: str, model_cfg: dict) -> str:
    if key in _GPT_FIXED:
        return _GPT_FIXED[key]
    m = _GPT_BLOCK.fullmatch(key)
    if m and m.group(2) in _BLOCK_PARTS:
        layer, offset = int(m.group(1)), 0
        for stack, size in zip(_OUR_STACKS, _stack_sizes(model_cfg)):
            if layer < offset + size or stack == "coda":
                return f"{stack}.{layer - offset}.{_BLOCK_PARTS[m.group(2)]}"
            offset += size
    if _VALUE_EMBED.fullmatch(key):
        return key
    raise ConversionError(f"unknown reference key {key!r}: not a GPT parameter this converter knows")


def _gpt_key(name: str, model_cfg: dict) -> str:
    if name in _GPT_FIXED_INVERSE:
        return _GPT_FIXED_INVERSE[name]
    m = _OUR_BLOCK.fullmatch(name)
    if m and m.group(3) in _PARTS_INVERSE:
        offset = sum(_stack_sizes(model_cfg)[:_OUR_STACKS.index(m.group(1))])
        return f"transformer.h.{offset + int(m.group(2))}.{_PARTS_INVERSE[m.group(3)]}"
    if _VALUE_EMBED.fullmatch(name):
        return name
    raise ConversionError(f"our key {name!r} has no counterpart in the official GPT")


# ---- official weights -> checkpoint ---------------------------------------------------------------------------
def official_to_checkpoint(state_dict, config: dict, out_root, step: int = 0, metadata: dict | None = None) -> Path:
    """Write the official `state_dict` as a megaloop checkpoint under `out_root` (a new or empty directory) and
    return its step directory. It holds model/* arrays only, bit for bit the given tensors (dtype kept); its
    metadata holds `config` (megaloop's resolved config tree as a dict), ``"source": "official"`` and the entries
    of `metadata` (e.g. the official config of a release folder).

    Train from it with ``checkpoint.resume=<out_root> checkpoint.load_optimizer=false`` (it holds no optimizer
    state). ConversionError (a CheckpointError) names every key that is unknown or does not fit the config."""
    model_cfg = _model_section(config)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step {step!r} is not a step number; give an integer >= 0")
    weights = official_weights(state_dict, model_cfg)
    out_root = Path(out_root)
    if out_root.exists() and (not out_root.is_dir() or any(out_root.iterdir())):
        raise CheckpointError(f"{out_root}: exists and is not an empty directory; give a new directory for the "
                              "converted checkpoint (nothing is written into an existing run's checkpoints)")
    metadata = {**(metadata or {}), "config": config, "source": "official", "tokens": 0}
    return write_model_checkpoint(out_root, weights, metadata, step, "convert")


def write_model_checkpoint(out_root: Path, weights: dict[str, torch.Tensor], metadata: dict, step: int,
                           command: str) -> Path:
    """Commit `weights` (megaloop name -> tensor) as the model/* arrays of a one-process checkpoint under
    `out_root`, with `metadata`; returns the step directory. A failure removes the directory if this call made it,
    and names `command` as what to run again."""
    created = not out_root.exists()
    pieces = [Piece(MODEL_PREFIX + name, tuple(t.shape), (0,) * t.dim(), t.contiguous()) for name, t in
              weights.items()]
    try:
        with Checkpointer(out_root, rank=0, world_size=1, async_save=False, keep=1) as saver:
            saver.save(step, pieces, metadata)
            result = saver.wait()
        if result is None or not result.ok:
            raise CheckpointError(f"{out_root}: the checkpoint was not committed "
                                  f"({result.error if result else 'no result'}); fix the cause and {command} again")
    except BaseException:
        if created:
            shutil.rmtree(out_root, ignore_errors=True)
        raise
    return result.path


def official_weights(state_dict, model_cfg: dict) -> dict[str, torch.Tensor]:
    """megaloop name -> tensor for an official state_dict, checked against the config's sizes (see the module
    docstring). One ConversionError lists every problem found."""
    if not isinstance(state_dict, dict) or not state_dict:
        raise ConversionError(f"the official weights are a {type(state_dict).__name__}"
                              f"{' (empty)' if isinstance(state_dict, dict) else ''}, not a state_dict; pass a "
                              "mapping of official key -> tensor (Parcae's model.state_dict())")
    out: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    unknown: list[str] = []
    head = None
    for key, tensor in state_dict.items():
        if not isinstance(key, str) or not isinstance(tensor, torch.Tensor):
            problems.append(f"entry {key!r} holds a {type(tensor).__name__}, not a tensor")
            continue
        try:
            name = official_to_megaloop_name(key, model_cfg)
        except ConversionError:
            unknown.append(key)
            continue
        plain = strip_wrappers(key)
        if plain == TIED_HEAD_KEY:
            head = tensor
        if name is None:
            continue
        if name in out:
            problems.append(f"{key!r} appears twice (with and without a wrapper prefix)")
            continue
        try:
            dtype_name(tensor.dtype)
        except ValueError:
            problems.append(f"{key!r}: dtype {tensor.dtype} cannot be stored; cast it to a floating-point dtype")
        problems += _fits_config(plain, tensor, model_cfg)
        out[name] = tensor
    if unknown:
        problems.insert(0, _unknown_keys(unknown))
    problems += _missing(out, model_cfg)
    emb = out.get("embed.weight")
    if head is not None and emb is not None and not (head.shape == emb.shape and head.dtype == emb.dtype
                                                     and torch.equal(head, emb)):
        problems.append(f"{TIED_HEAD_KEY} differs from {EMBEDDING_KEY}, but the model ties them")
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise ConversionError(f"cannot convert the official weights: {shown}; give the state_dict of a Parcae "
                              "model built with this config")
    return out


def _unknown_keys(keys: list[str]) -> str:
    text = f"unknown reference keys {_listed(keys)}: not Parcae parameters this converter knows"
    if all(_is_megaloop_name(k) for k in keys):
        text += " (they are megaloop parameter names, e.g. of an export: such weights need no conversion)"
    return text


def _is_megaloop_name(key: str) -> bool:
    try:
        megaloop_to_official_key(key)
    except ConversionError:
        return False
    return True


def _model_section(config) -> dict:
    model = config.get("model") if isinstance(config, dict) else None
    if not isinstance(model, dict):
        raise CheckpointError("the config has no 'model' section; give megaloop's resolved config tree (the "
                              "config.json a run writes in train.out_dir, or `python -m megaloop check` output)")
    return model


def _size(model_cfg: dict, field: str) -> int | None:
    value = model_cfg.get(field)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _fits_config(key: str, tensor: torch.Tensor, model_cfg: dict) -> list[str]:
    m = _OFFICIAL_BLOCK.fullmatch(key)
    if m:
        count = _size(model_cfg, _LAYER_COUNTS[m.group(1)])
        if count is not None and int(m.group(2)) >= count:
            return [f"{key!r}: block {m.group(2)} of {m.group(1)}, but model.{_LAYER_COUNTS[m.group(1)]}={count}"]
    g = _GPT_BLOCK.fullmatch(key)
    if g and int(g.group(1)) >= sum(_stack_sizes(model_cfg)):
        return [f"{key!r}: block {g.group(1)}, but the GPT has n_prelude + n_core + n_coda = "
                f"{sum(_stack_sizes(model_cfg))} blocks"]
    v = _VALUE_EMBED.fullmatch(key)
    if v:
        layers = sum(_size(model_cfg, f) or 0 for f in _LAYER_COUNTS.values())
        if int(v.group(1)) >= layers or model_cfg.get("value_embeds") is False:
            return [f"{key!r}: no value embedding of layer {v.group(1)} in this config"]
    if key == EMBEDDING_KEY:
        want = (_size(model_cfg, "vocab_size"), _size(model_cfg, "d_model"))
        if None not in want and tuple(tensor.shape) != want:
            return [f"{key!r}: shape {tuple(tensor.shape)}, but model.vocab_size x model.d_model is {want}"]
    return []


def _missing(found: dict, model_cfg: dict) -> list[str]:
    need = [EMBEDDING_KEY, "transformer.ln_f.weight"]
    if is_gpt(model_cfg):
        need += [f"transformer.h.{j}.{part}" for j in range(sum(_stack_sizes(model_cfg))) for part in _REQUIRED_PARTS]
    else:
        for stack, field in _LAYER_COUNTS.items():
            need += [f"transformer.{stack}.{i}.{part}" for i in range(_size(model_cfg, field) or 0)
                     for part in _REQUIRED_PARTS]
    absent = [k for k in need if official_to_megaloop_name(k, model_cfg) not in found]
    return [f"missing keys {_listed(absent)}"] if absent else []


def _listed(keys: list[str], limit: int = 8) -> str:
    return ", ".join(map(repr, keys[:limit])) + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


# ---- checkpoint -> official weights ---------------------------------------------------------------------------
def checkpoint_to_official(checkpoint_dir) -> dict[str, torch.Tensor]:
    """Every model/* array of a committed checkpoint under its official key (dtype kept, bit for bit), plus
    ``lm_head.weight``: the very tensor of the embedding, as the official model ties them. Optimizer arrays are
    left out. The files are verified against the manifest first; CheckpointError names a corrupt file, and
    ConversionError a model array with no official name. A checkpoint whose config says arch gpt gets the
    official GPT's names (``transformer.h.{j}``)."""
    reader = CheckpointReader(checkpoint_dir)
    names = model_array_names(reader)
    model_cfg = checkpoint_model_section(reader)
    keys = {}
    unnamed = []
    for array in names:
        try:
            keys[array] = megaloop_to_official_key(array[len(MODEL_PREFIX):], model_cfg)
        except ConversionError:
            unnamed.append(array)
    if unnamed:
        kind = "GPT" if is_gpt(model_cfg) else "Parcae"
        raise ConversionError(f"{reader.path}: arrays {unnamed[:8]} have no name in the official {kind} (e.g. a "
                              "parameter of another architecture, or renamed); export them with `python -m "
                              "checkpoints export` instead")
    if "model/embed.weight" not in keys:
        raise ConversionError(f"{reader.path}: no model/embed.weight array; the official model needs its embedding "
                              "(the tied lm_head), give a checkpoint of a full model")
    reader.verify(names)
    out = {keys[a]: reader.read(a) for a in names}
    out[TIED_HEAD_KEY] = out[EMBEDDING_KEY]
    return out


def checkpoint_model_section(reader: CheckpointReader) -> dict:
    """The model section of the config in a checkpoint's metadata ({} where none is recorded)."""
    config = reader.metadata.get("config")
    model = config.get("model") if isinstance(config, dict) else None
    return model if isinstance(model, dict) else {}


def model_array_names(reader: CheckpointReader) -> list[str]:
    """The model/* arrays of a checkpoint, sorted; CheckpointError when it holds none."""
    names = sorted(n for n in reader.arrays if n.startswith(MODEL_PREFIX))
    if not names:
        raise CheckpointError(f"{reader.path}: holds no model/* arrays; give a checkpoint written by megaloop "
                              "training or by `python -m checkpoints convert`")
    return names

