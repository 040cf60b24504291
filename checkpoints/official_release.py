"""Official Parcae release folders (what the official ``save_pretrained`` writes and the Hub publishes) <-> megaloop.

A release folder holds ``config.json``, the official config dataclass dumped with ``dataclasses.asdict`` plus
``"_class_name"`` (``ParcaeConfig`` or ``GPTConfig``; the official loader takes a missing one for ``GPTConfig``), and
the model's ``state_dict`` as ``pytorch_model.bin`` or ``model.pt`` (the official loader tries them in that order;
``model.safetensors`` is read too). Importing one is strict both ways:

* the config must be one megaloop computes exactly: every official field that changes the forward pass is mapped to
  megaloop's model section (sizes, layer counts, injection, RoPE, norms, MLP, loop depths) or, where megaloop has no
  equivalent (biases, softcapping, untied head, q/k without RMS norm, a recurrent width of its own, ...), refused
  by name and value. Fields that only steer the official training code (its name, init flags, checkpointing
  policy) are kept in the checkpoint's metadata (``official_config``) and written back unchanged on export.
* the weights must hold exactly the keys the official model of that config has, each of its shape: a missing or
  unexpected key is an error naming it. The ``freqs_cis`` buffer, when present, must be the RoPE table of the
  config (the official loader restores it from the weights, ignoring ``rope_settings``).

Export writes ``config.json`` in the same dataclass-dump shape and ``model.pt`` (the state_dict, the tied head
sharing the embedding's tensor, ``freqs_cis`` regenerated as the official model computes it), so that a release
converted to megaloop and back is bit-exact in its weights and identical in its config.

This module knows the official layout as facts (field names, defaults, key names, the value-embedding rule); it
imports neither the official code nor megaloop.
"""
from __future__ import annotations

import copy
import json
import math
import os
import shutil
from pathlib import Path

import torch

from .errors import CheckpointError
from .official import EMBEDDING_KEY, TIED_HEAD_KEY, ConversionError, strip_wrappers

CONFIG_FILE = "config.json"
WEIGHT_FILES = ("pytorch_model.bin", "model.pt", "model.safetensors")  # the official loader's order, then ours
EXPORT_WEIGHTS = "model.pt"
CLASS_KEY = "_class_name"
ROPE_KEY = "freqs_cis"
VE_GATE_CHANNELS = 32  # the official attention gates value embeddings from this many channels (a constant there)

# The official Config dataclass: its fields in declaration order, with their defaults.
_BASE_FIELDS = {
    "name": "", "hf_config": {}, "block_size": 4096, "n_embd": 4096, "intermediate_size": None,
    "num_attention_heads": 32, "num_key_value_heads": None, "vocab_size": 50254, "padding_multiple": 512,
    "padded_vocab_size": None, "rope_settings": {"use_rope": True, "rope_condense_ratio": 1, "rope_base": 50000},
    "use_abacus": False, "randomize_positions_from": None, "block_class_name": "TransformerPreNormBlock",
    "norm_class_name": "LayerNorm", "attn_impl": "flash", "norm_eps": 1e-5, "mlp_class_name": "BaseMLP",
    "nonlin_name": "GELU", "bias": False, "qk_bias": False, "init_strategy": "scaled", "init_orthogonal": False,
    "skip_initialization": False, "mup_model_scaling_factor": 1, "use_fused_head": "pytorch",
    "debias_attention": False, "center_attention": False, "clip_qkv": None, "qk_norm": False, "logit_softcap": None,
    "activation_checkpoint_impl": "per-block", "simple_ops": False, "strategy": "single",
}
# ParcaeConfig and GPTConfig: the subclasses' own fields follow; an overridden field keeps its place, new default.
FIELDS = {
    "ParcaeConfig": {
        **_BASE_FIELDS, "qk_norm": False, "activation_checkpoint_impl": "per-iteration",
        "injection_type": "diagonal", "n_layers_in_recurrent_block": 4, "n_layers_in_prelude": 1,
        "n_layers_in_coda": 1, "state_init": "like-init", "recurrent_embedding_dimension": 1024,
        "recurrent_intermediation_embedding_dimension": 3520, "recurrent_num_attention_heads": None,
        "prelude_norm": False, "sampling_scheme": "poisson-truncated-full", "mean_recurrence": 32,
        "mean_backprop_depth": 8, "lockstep_n": False, "lockstep_k": False, "curriculum_target": "forward",
        "recurrent_iteration_method": "per-batch", "tie_embeddings": False, "model_class_name": "Parcae",
        "_is_recurrent_block_config": False,
    },
    "GPTConfig": {**_BASE_FIELDS, "n_layer": 16, "tie_embeddings": False},
}
# What the published releases set where a megaloop model has no official config of its own to carry.
_RELEASE_PROFILE = {
    "padding_multiple": 64, "norm_class_name": "RMSNorm", "qk_norm": True, "tie_embeddings": True,
    "init_strategy": "scaled-zero", "init_orthogonal": True,
}
_PARCAE_PROFILE = {"recurrent_iteration_method": "per-sequence"}

# Official init strategies with embedding and logit scale 1 whose h_0 ("like-init") std is sqrt(2 / (5 d)), megaloop's.
UNIT_SCALE_STRATEGIES = ("scaled", "scaled-zero", "scaled-geiping", "scaled-stuck", "small")
_INJECTIONS = {"diagonal": "diagonal", "add": "additive", "linear": "concat"}
_MLPS = {("BaseMLP", "ReLU2"): "relu2", ("GatedMLP", "SiLU"): "swiglu"}
_BLOCK_PARTS = ("norm_1.weight", "attn.c_q.weight", "attn.c_k.weight", "attn.c_v.weight", "attn.c_proj.weight",
                "attn.ve_gate.weight", "norm_2.weight", "mlp.fc.weight", "mlp.proj.weight")


class ReleaseError(CheckpointError):
    """A release folder or official config that megaloop cannot import or write exactly."""


# ---- the official config ---------------------------------------------------------------------------------------
def read_release_config(folder) -> dict:
    """The raw dict of ``folder/config.json`` (``_class_name`` included); ReleaseError when it is missing, not JSON,
    or names a class or fields the official loader does not know."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise ReleaseError(f"{folder}: no {CONFIG_FILE}; give a release folder as the official save_pretrained "
                           f"writes it ({CONFIG_FILE} and model.pt), or a weights file with --config")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ReleaseError(f"{path}: not JSON ({str(exc).splitlines()[0]}); give the config.json of the release "
                           "unchanged") from None
    if not isinstance(raw, dict):
        raise ReleaseError(f"{path}: holds a JSON {type(raw).__name__}, not an object; give the config.json of "
                           "the release unchanged")
    resolve_official_config(raw)  # refuse an unknown class or field now
    return raw


def class_name(raw: dict) -> str:
    """The config class of a raw official config (the official loader's default: GPTConfig)."""
    return raw.get(CLASS_KEY, "GPTConfig")


def resolve_official_config(raw: dict) -> dict:
    """Every field of the official config class, as the official dataclass holds them after construction: the
    defaults where `raw` has none, then intermediate_size, num_key_value_heads and padded_vocab_size filled in as
    its __post_init__ does. ``_class_name`` is kept."""
    cls = class_name(raw)
    if cls not in FIELDS:
        raise ReleaseError(f"config.json: {CLASS_KEY}={cls!r} is not an official model class; the official "
                           f"releases are {' or '.join(FIELDS)}")
    fields = FIELDS[cls]
    unknown = sorted(k for k in raw if k not in fields and k != CLASS_KEY)
    if unknown:
        raise ReleaseError(f"config.json: fields {unknown} are not fields of the official {cls} (its loader would "
                           "refuse them too); give the config.json the official save_pretrained wrote")
    cfg = copy.deepcopy({**fields, **raw, CLASS_KEY: cls})
    rope = cfg["rope_settings"]
    if not isinstance(rope, dict) or set(rope) - set(_BASE_FIELDS["rope_settings"]):
        raise ReleaseError(f"config.json: rope_settings={rope!r} is not the official RoPESettings (use_rope, "
                           "rope_condense_ratio, rope_base); give the config.json the official save_pretrained wrote")
    cfg["rope_settings"] = {**_BASE_FIELDS["rope_settings"], **rope}
    for name in ("n_embd", "num_attention_heads", "vocab_size", "padding_multiple"):
        _integer(cfg, name, 1)
    if cfg["intermediate_size"] is None:
        cfg["intermediate_size"] = 4 * cfg["n_embd"]
    if cfg["num_key_value_heads"] is None:
        cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    if cfg["padded_vocab_size"] is None:
        cfg["padded_vocab_size"] = -(-cfg["vocab_size"] // cfg["padding_multiple"]) * cfg["padding_multiple"]
    else:
        cfg["vocab_size"] = min(cfg["vocab_size"], _integer(cfg, "padded_vocab_size", 1))
    return cfg


def _integer(cfg: dict, name: str, minimum: int, where: str = "") -> int:
    value = cfg[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ReleaseError(f"config.json: {where}{name}={value!r} is not an integer >= {minimum}; give the "
                           "config.json the official save_pretrained wrote")
    return value


def _number(cfg: dict, name: str, where: str = "") -> float:
    value = cfg[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ReleaseError(f"config.json: {where}{name}={value!r} is not a number > 0; give the config.json the "
                           "official save_pretrained wrote")
    return float(value)


def _json_value(value) -> str:
    return json.dumps(value)


# ---- official config -> megaloop's model section ----------------------------------------------------------------
def megaloop_model_section(cfg: dict) -> dict:
    """megaloop's model section for a resolved official config (resolve_official_config), with every field the
    official config fixes. ReleaseError names each setting megaloop cannot compute exactly (field=value)."""
    gpt = cfg[CLASS_KEY] == "GPTConfig"
    for name in ("block_size", "intermediate_size", "num_key_value_heads") + (("n_layer",) if gpt else (
            "n_layers_in_prelude", "n_layers_in_recurrent_block", "n_layers_in_coda", "mean_recurrence",
            "mean_backprop_depth", "recurrent_embedding_dimension", "recurrent_intermediation_embedding_dimension")):
        _integer(cfg, name, 0 if name in ("n_layers_in_prelude", "n_layers_in_coda") else 1)
    rope_base = _number(cfg["rope_settings"], "rope_base", "rope_settings.")
    norm_eps = _number(cfg, "norm_eps")
    problems = _unsupported(cfg, gpt)
    if problems:
        raise ReleaseError(f"config.json: megaloop cannot compute this official model exactly: {'; '.join(problems)}"
                           "; only releases without these settings can be imported")
    section = {
        "vocab_size": cfg["padded_vocab_size"], "d_model": cfg["n_embd"], "n_heads": cfg["num_attention_heads"],
        "n_kv_heads": cfg["num_key_value_heads"], "mlp": _MLPS[cfg["mlp_class_name"], cfg["nonlin_name"]],
        "mlp_hidden": cfg["intermediate_size"], "block": "prenorm", "value_embeds": True,
        "ve_gate_channels": VE_GATE_CHANNELS, "seq_len": cfg["block_size"], "rope_base": rope_base,
        "norm_eps": norm_eps, "init_std": None,
    }
    if gpt:
        section.update(arch="gpt", injection="none", n_prelude=0, n_core=cfg["n_layer"], n_coda=0,
                       prelude_norm=False, use_C=False, mu_rec=1, mu_bwd=1, depth_sampler="fixed")
    else:
        injection = _INJECTIONS[cfg["injection_type"]]
        section.update(arch="rdm" if injection == "concat" else "parcae", injection=injection,
                       n_prelude=cfg["n_layers_in_prelude"], n_core=cfg["n_layers_in_recurrent_block"],
                       n_coda=cfg["n_layers_in_coda"], prelude_norm=cfg["prelude_norm"], use_C=True,
                       mu_rec=cfg["mean_recurrence"], mu_bwd=cfg["mean_backprop_depth"],
                       depth_sampler=_depth_sampler(cfg))
    return section


def _unsupported(cfg: dict, gpt: bool) -> list[str]:
    """'field=value (why)' for every setting of a resolved official config that megaloop cannot compute."""
    rope = cfg["rope_settings"]
    checks = [
        ("tie_embeddings", cfg["tie_embeddings"] is True, "megaloop's head is the embedding, tied"),
        ("bias", cfg["bias"] is False, "megaloop's linear layers have no biases"),
        ("qk_bias", cfg["qk_bias"] is False, "megaloop has no q/k biases"),
        ("qk_norm", cfg["qk_norm"] is True, "megaloop always RMS-normalises q and k"),
        ("logit_softcap", cfg["logit_softcap"] is None, "megaloop does not softcap logits"),
        ("clip_qkv", cfg["clip_qkv"] is None, "megaloop does not clip q/k/v"),
        ("use_abacus", cfg["use_abacus"] is False, "megaloop has no abacus embedding"),
        ("randomize_positions_from", cfg["randomize_positions_from"] is None, "megaloop has no random positions"),
        ("rope_settings.use_rope", rope["use_rope"] is True, "megaloop always applies RoPE"),
        ("rope_settings.rope_condense_ratio", rope["rope_condense_ratio"] == 1, "megaloop has no condensed RoPE"),
        ("mup_model_scaling_factor", cfg["mup_model_scaling_factor"] == 1, "megaloop has no muP width scaling"),
        ("norm_class_name", cfg["norm_class_name"] == "RMSNorm", "megaloop's norms are RMSNorm"),
        ("block_class_name", cfg["block_class_name"] == "TransformerPreNormBlock",
         "the official pre-norm block is the one megaloop computes"),
        ("mlp_class_name", (cfg["mlp_class_name"], cfg["nonlin_name"]) in _MLPS,
         "megaloop's MLPs are BaseMLP with ReLU2 and GatedMLP with SiLU"),
        ("init_strategy", cfg["init_strategy"] in UNIT_SCALE_STRATEGIES,
         f"megaloop has no embedding or logit scale and draws h_0 with std sqrt(2/(5 d)): one of "
         f"{', '.join(UNIT_SCALE_STRATEGIES)}"),
        ("n_embd", cfg["n_embd"] >= VE_GATE_CHANNELS, f"the value-embedding gate reads {VE_GATE_CHANNELS} channels"),
        ("num_attention_heads", cfg["n_embd"] % cfg["num_attention_heads"] == 0
         and cfg["n_embd"] // cfg["num_attention_heads"] % 2 == 0, "heads must split n_embd into even head sizes"),
        ("num_key_value_heads", cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0,
         "must divide num_attention_heads"),
    ]
    if not gpt:
        checks += _parcae_checks(cfg)
    problems = [f"{name}={_json_value(_field(cfg, name))} ({why})" for name, ok, why in checks if not ok]
    if not problems and not gpt:
        problems += _value_embedding_mismatch(cfg)
    return problems


def _field(cfg: dict, name: str):
    head, _, rest = name.partition(".")
    return cfg[head][rest] if rest else cfg[head]


def _parcae_checks(cfg: dict) -> list[tuple[str, bool, str]]:
    mu_rec, mu_bwd = cfg["mean_recurrence"], cfg["mean_backprop_depth"]
    return [
        ("model_class_name", cfg["model_class_name"] == "Parcae", "the official Parcae class"),
        ("injection_type", cfg["injection_type"] in _INJECTIONS, f"one of {', '.join(_INJECTIONS)}"),
        ("state_init", cfg["state_init"] == "like-init", "megaloop draws h_0 like the official 'like-init'"),
        ("recurrent_embedding_dimension", cfg["recurrent_embedding_dimension"] == cfg["n_embd"],
         f"megaloop's loop state has the model width, n_embd={cfg['n_embd']}"),
        ("recurrent_intermediation_embedding_dimension",
         cfg["recurrent_intermediation_embedding_dimension"] == cfg["intermediate_size"],
         f"megaloop's core MLP has the model's intermediate_size={cfg['intermediate_size']}"),
        ("recurrent_num_attention_heads", cfg["recurrent_num_attention_heads"] in (None, cfg["num_attention_heads"]),
         f"megaloop's core has the model's num_attention_heads={cfg['num_attention_heads']}"),
        ("num_key_value_heads", cfg["num_key_value_heads"] == cfg["num_attention_heads"],
         "the official core blocks run without grouped KV heads, and megaloop has one KV head count for all blocks"),
        ("mean_backprop_depth", 1 <= mu_bwd <= mu_rec, f"must be in [1, mean_recurrence={mu_rec}]"),
        ("prelude_norm", isinstance(cfg["prelude_norm"], bool), "true or false"),
        ("sampling_scheme", _depth_sampler(cfg) is not None,
         f"with recurrent_iteration_method={_json_value(cfg['recurrent_iteration_method'])}; megaloop has the "
         "official 'fixed' and per-sequence 'poisson-truncated-full' depth samplers"),
    ]


def _depth_sampler(cfg: dict) -> str | None:
    if cfg["sampling_scheme"] == "fixed":
        return "fixed"
    if (cfg["sampling_scheme"], cfg["recurrent_iteration_method"]) == ("poisson-truncated-full", "per-sequence"):
        return "poisson-truncated-full"
    return None


def _has_ve(layer: int, n_layers: int) -> bool:
    """The official rule: alternate layers, the last one always."""
    return layer % 2 == (n_layers - 1) % 2


def value_embedding_layers(cfg: dict) -> tuple[list[bool], list[bool]]:
    """(gated, tabled) per effective layer of a resolved official config: which blocks have a value-embedding gate
    and which layers a value-embedding table. A Parcae block decides its gate by its layer id (prelude i; core
    n_prelude + i; coda n_prelude + n_recurrent * mean_recurrence + i) against n_recurrent * mean_backprop_depth,
    its table by its effective index against the effective layer count; a GPT both by its index."""
    if cfg[CLASS_KEY] == "GPTConfig":
        flags = [_has_ve(i, cfg["n_layer"]) for i in range(cfg["n_layer"])]
        return flags, list(flags)
    p, r, c = cfg["n_layers_in_prelude"], cfg["n_layers_in_recurrent_block"], cfg["n_layers_in_coda"]
    gate_layers = r * cfg["mean_backprop_depth"]
    ids = list(range(p + r)) + [p + r * cfg["mean_recurrence"] + i for i in range(c)]
    return [_has_ve(i, gate_layers) for i in ids], [_has_ve(k, p + r + c) for k in range(p + r + c)]


def _value_embedding_mismatch(cfg: dict) -> list[str]:
    gated, tabled = value_embedding_layers(cfg)
    odd = [k for k, (g, t) in enumerate(zip(gated, tabled)) if g != t]
    if not odd:
        return []
    return [f"n_layers_in_recurrent_block * mean_backprop_depth={cfg['n_layers_in_recurrent_block']} * "
            f"{cfg['mean_backprop_depth']} (the official model then gives effective layers {odd} a value-embedding "
            "gate without a table or a table without a gate; megaloop pairs them)"]


# ---- the official state_dict ------------------------------------------------------------------------------------
def official_key_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every key of the official model's state_dict for a resolved, importable official config, with its shape, in
    the order the official model lists them (the lm_head is the embedding's tensor; freqs_cis the RoPE buffer)."""
    d, heads, kv = cfg["n_embd"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, hidden, vocab = d // heads, cfg["intermediate_size"], cfg["padded_vocab_size"]
    fc = 2 * hidden if cfg["mlp_class_name"] == "GatedMLP" else hidden
    part_shapes = {"norm_1.weight": (d,), "attn.c_q.weight": (heads * hd, d), "attn.c_k.weight": (kv * hd, d),
                   "attn.c_v.weight": (kv * hd, d), "attn.c_proj.weight": (d, d),
                   "attn.ve_gate.weight": (kv, VE_GATE_CHANNELS), "norm_2.weight": (d,), "mlp.fc.weight": (fc, d),
                   "mlp.proj.weight": (d, hidden)}
    gated, tabled = value_embedding_layers(cfg)

    def blocks(prefix: str, first: int, count: int) -> dict:
        return {f"{prefix}.{i}.{part}": part_shapes[part] for i in range(count) for part in _BLOCK_PARTS
                if part != "attn.ve_gate.weight" or gated[first + i]}

    out = {ROPE_KEY: (1, cfg["block_size"], 1, hd // 2, 2), EMBEDDING_KEY: (vocab, d)}
    if cfg[CLASS_KEY] == "GPTConfig":
        out.update(blocks("transformer.h", 0, cfg["n_layer"]))
    else:
        p, r, c = cfg["n_layers_in_prelude"], cfg["n_layers_in_recurrent_block"], cfg["n_layers_in_coda"]
        out.update(blocks("transformer.prelude", 0, p))
        out.update({"diagonal": {"transformer.adapter.A_log": (d,), "transformer.adapter.dt_bias": (d,),
                                 "transformer.adapter.B": (d, d)},
                    "linear": {"transformer.adapter.adapter.weight": (d, 2 * d)}}.get(cfg["injection_type"], {}))
        out.update(blocks("transformer.core_block", p, r))
        out["transformer.C.weight"] = (d, d)
        out.update(blocks("transformer.coda", p + r, c))
    out["transformer.ln_f.weight"] = (d,)
    if cfg.get("prelude_norm") is True:
        out["transformer.ln_prelude.weight"] = (d,)
    out.update({f"value_embeds.{k}.weight": (vocab, kv * hd) for k, t in enumerate(tabled) if t})
    out[TIED_HEAD_KEY] = (vocab, d)
    return out


def check_release_weights(state_dict: dict, cfg: dict, source) -> None:
    """Refuse (ConversionError naming them) keys the official model of `cfg` lacks or has, shapes that differ, and
    a freqs_cis buffer that is not the config's RoPE table. freqs_cis may be absent (the model regenerates it)."""
    expected = official_key_shapes(cfg)
    held = {strip_wrappers(k): v for k, v in state_dict.items() if isinstance(k, str)}
    missing = [k for k in expected if k not in held and k != ROPE_KEY]
    unexpected = sorted(k for k in held if k not in expected)
    wrong = [f"{k!r} has shape {tuple(v.shape)}, the official model's is {expected[k]}" for k, v in held.items()
             if k in expected and isinstance(v, torch.Tensor) and tuple(v.shape) != expected[k]]
    problems = ([f"missing keys {_listed(missing)}"] if missing else []) + (
        [f"unexpected keys {_listed(unexpected)}"] if unexpected else []) + wrong[:4]
    if not problems and ROPE_KEY in held:
        problems += _rope_problem(held[ROPE_KEY], cfg)
    if problems:
        raise ConversionError(f"{source}: not the weights of the official {cfg[CLASS_KEY][:-6]} its config.json "
                              f"describes: {'; '.join(problems)}; give the release's own weights file unchanged")


def _listed(keys: list[str], limit: int = 8) -> str:
    return ", ".join(map(repr, keys[:limit])) + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def rope_table(cfg: dict, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """freqs_cis as the official model registers it for a resolved config: [1, block_size, 1, head_dim / 2, 2],
    (cos, sin) of position * rope_base^(-2j / head_dim), computed in fp32, then cast to `dtype`."""
    hd = cfg["n_embd"] // cfg["num_attention_heads"]
    base = cfg["rope_settings"]["rope_base"]
    inv_freq = 1.0 / (base ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    angles = torch.outer(torch.arange(cfg["block_size"], dtype=torch.float32), inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)[None, :, None].to(dtype)


def _rope_problem(table, cfg: dict) -> list[str]:
    if not isinstance(table, torch.Tensor) or not table.is_floating_point():
        return [f"{ROPE_KEY} is not a floating-point tensor"]
    # against the table computed as the official model does (fp32 angles); the tolerance covers another build's
    # cos/sin, and bf16/fp16's 3 significant digits
    tolerance = 1e-2 if table.element_size() < 4 else 1e-5
    gap = float((table.double() - rope_table(cfg).double()).abs().max())
    if gap > tolerance:
        return [f"{ROPE_KEY} differs from the RoPE table of rope_settings.rope_base="
                f"{cfg['rope_settings']['rope_base']} by up to {gap:.3g} (the official loader would use the weights' "
                "table, ignoring the config)"]
    return []


# ---- megaloop's model section -> official config ---------------------------------------------------------------
def _megaloop_value(model: dict, name: str):
    """A model field of a checkpoint's config, its documented null replaced by the value megaloop computes with."""
    if name not in model:
        raise ReleaseError(f"the checkpoint's config has no model.{name}; give a checkpoint written by megaloop "
                           "training or `python -m checkpoints convert` (their configs hold every model field)")
    value = model[name]
    if value is not None:
        return value
    defaults = {"n_kv_heads": lambda: model["n_heads"], "mlp_hidden": lambda: 4 * model["d_model"],
                "mu_bwd": lambda: math.ceil(model["mu_rec"] / 2),
                "init_std": lambda: math.sqrt(2.0 / (5.0 * model["d_model"]))}
    return defaults[name]() if name in defaults else None


def official_config_for(model: dict, stored: dict | None = None) -> dict:
    """The official config (resolved, ``_class_name`` included) of a megaloop model section. `stored`: the
    official config a converted release carried (checkpoint metadata ``official_config``): its fields that megaloop
    does not determine are kept, the others come from `model`. ReleaseError for a model the official code cannot
    build exactly."""
    get = lambda name: _megaloop_value(model, name)  # noqa: E731
    arch = get("arch")
    cls = "GPTConfig" if arch == "gpt" else "ParcaeConfig"
    stored_cfg = resolve_official_config(stored) if isinstance(stored, dict) and class_name(stored) == cls else None
    problems = _unexportable(get)
    if problems:
        raise ReleaseError(f"the official {cls[:-6]} cannot hold this model: {'; '.join(problems)}; export it with "
                           "`python -m checkpoints export` instead")
    profile = {**_RELEASE_PROFILE, **(_PARCAE_PROFILE if cls == "ParcaeConfig" else {})}
    base = stored_cfg or {**copy.deepcopy(FIELDS[cls]), **copy.deepcopy(profile), CLASS_KEY: cls}
    out = copy.deepcopy(base)
    for name, value in _determined_fields(get, cls, base).items():
        if name == "rope_settings":  # keep a stored value where it is the same number (50000 stays 50000)
            out[name] = {k: (old if _same(old, value[k]) else value[k]) for k, old in out[name].items()}
        elif not _same(out.get(name), value):
            out[name] = value
    if stored_cfg is None:
        out["vocab_size"] = out["padded_vocab_size"]
    resolved = resolve_official_config(out)
    problems = _unsupported(resolved, cls == "GPTConfig")
    if problems:
        raise ReleaseError(f"the official {cls[:-6]} cannot hold this model exactly: {'; '.join(problems)}; export it "
                           "with `python -m checkpoints export` instead")
    _check_round_trip(megaloop_model_section(resolved), get)
    return resolved


def _same(a, b) -> bool:
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def _check_round_trip(back: dict, get) -> None:
    """Refuse to write an official config that would import as another model than `get`'s."""
    if back["arch"] == "gpt":  # one stack of blocks; the loop settings mean nothing without a loop
        skip = ("n_prelude", "n_core", "n_coda", "mu_bwd", "depth_sampler", "init_std")
        layers = get("n_prelude") + get("n_core") + get("n_coda")
        differ = ["n_prelude + n_core + n_coda"] if back["n_core"] != layers else []
    else:
        skip, differ = ("init_std",), []
    differ += [f"{k}={_json_value(get(k))} (it gives {_json_value(v)})" for k, v in back.items()
               if k not in skip and not _same(v, get(k))]
    if differ:
        raise ReleaseError(f"the official config would not give back model.{differ[0]}; export it with `python -m "
                           "checkpoints export` instead")


def _unexportable(get) -> list[str]:
    arch, d = get("arch"), get("d_model")
    checks = [
        ("block", get("block") == "prenorm", "the official block is pre-norm"),
        ("mlp", get("mlp") in ("relu2", "swiglu"), "relu2 or swiglu"),
        ("value_embeds", get("value_embeds") is True, "the official model always has value embeddings"),
        ("ve_gate_channels", get("ve_gate_channels") == VE_GATE_CHANNELS,
         f"the official gate reads {VE_GATE_CHANNELS} channels"),
        ("arch", arch in ("parcae", "rdm", "gpt"), "parcae, rdm or gpt"),
    ]
    if arch != "gpt":
        std = get("init_std")
        checks += [
            ("n_kv_heads", get("n_kv_heads") == get("n_heads"), "the official core blocks have no grouped KV heads"),
            ("init_std", math.isclose(std, math.sqrt(2.0 / (5.0 * d)), rel_tol=1e-9),
             "the official h_0 has std sqrt(2/(5 d))"),
            ("depth_sampler", get("depth_sampler") in ("fixed", "poisson-truncated-full"),
             "the official samplers megaloop matches are fixed and per-sequence poisson-truncated-full"),
            ("use_C", get("use_C") is True, "the official Parcae always has C"),
        ]
    return [f"model.{name}={_json_value(get(name))} ({why})" for name, ok, why in checks if not ok]


def _determined_fields(get, cls: str, base: dict) -> dict:
    """The official fields that megaloop's model section determines."""
    rope_base = get("rope_base")
    mlp_class, nonlin = next(k for k, v in _MLPS.items() if v == get("mlp"))
    out = {
        "block_size": get("seq_len"), "n_embd": get("d_model"), "intermediate_size": get("mlp_hidden"),
        "num_attention_heads": get("n_heads"), "num_key_value_heads": get("n_kv_heads"),
        "padded_vocab_size": get("vocab_size"),
        "rope_settings": {"use_rope": True, "rope_condense_ratio": 1,
                          "rope_base": int(rope_base) if float(rope_base).is_integer() else rope_base},
        "norm_eps": get("norm_eps"), "mlp_class_name": mlp_class, "nonlin_name": nonlin,
        "block_class_name": "TransformerPreNormBlock", "norm_class_name": "RMSNorm", "tie_embeddings": True,
        "qk_norm": True, "bias": False, "qk_bias": False, "clip_qkv": None, "logit_softcap": None,
        "use_abacus": False, "randomize_positions_from": None, "mup_model_scaling_factor": 1,
    }
    if base.get("init_strategy") not in UNIT_SCALE_STRATEGIES:
        out["init_strategy"] = _RELEASE_PROFILE["init_strategy"]
    if cls == "GPTConfig":
        out["n_layer"] = get("n_prelude") + get("n_core") + get("n_coda")
        return out
    injection = {v: k for k, v in _INJECTIONS.items()}[get("injection")]
    out.update({
        "injection_type": injection, "n_layers_in_prelude": get("n_prelude"),
        "n_layers_in_recurrent_block": get("n_core"), "n_layers_in_coda": get("n_coda"),
        "recurrent_embedding_dimension": get("d_model"), "recurrent_intermediation_embedding_dimension":
        get("mlp_hidden"), "prelude_norm": get("prelude_norm"), "mean_recurrence": get("mu_rec"),
        "mean_backprop_depth": get("mu_bwd"), "state_init": "like-init", "model_class_name": "Parcae",
        "sampling_scheme": get("depth_sampler"),
    })
    if base.get("recurrent_num_attention_heads") not in (None, get("n_heads")):
        out["recurrent_num_attention_heads"] = None
    if get("depth_sampler") != "fixed":
        out["recurrent_iteration_method"] = "per-sequence"
    return out


# ---- writing a release folder -----------------------------------------------------------------------------------
def release_state_dict(weights: dict, cfg: dict) -> dict:
    """The official state_dict of a resolved config from checkpoint_to_official's weights: freqs_cis added (in the
    embedding's dtype: a model cast as a whole casts its buffer too), keys in the official order. ConversionError
    when the keys differ from the official model's."""
    emb = weights[EMBEDDING_KEY]
    full = {ROPE_KEY: rope_table(cfg, emb.dtype if emb.is_floating_point() else torch.float32), **weights}
    expected = official_key_shapes(cfg)
    check_release_weights(full, cfg, "the checkpoint")
    return {k: full[k] for k in expected}


def output_folder_problem(out: Path) -> str | None:
    """Why `out` cannot receive a release folder (None: it is new, or an empty directory)."""
    if out.is_dir():
        return None if not any(out.iterdir()) else f"{out}: exists and is not empty; give a new directory"
    if out.exists():
        return f"{out}: exists and is not a directory; give a new directory for the release folder"
    return None


def write_release(out, cfg: dict, state_dict: dict) -> Path:
    """Write config.json (json.dump of `cfg`, indented like the official save_pretrained) and model.pt
    (torch.save of `state_dict`) into the new or empty directory `out`: both are written into a temporary
    directory beside it, flushed, then renamed to `out`, so a failure leaves nothing behind."""
    out = Path(out)
    problem = output_folder_problem(out)
    if problem:
        raise ReleaseError(problem + " (nothing is written into an existing folder)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
    tmp.mkdir()
    try:
        (tmp / CONFIG_FILE).write_text(json.dumps(cfg, indent=2), encoding="utf-8")
        torch.save(state_dict, tmp / EXPORT_WEIGHTS)
        for name in (CONFIG_FILE, EXPORT_WEIGHTS):
            fd = os.open(tmp / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, out)  # onto a new path, or over an empty directory
    except RuntimeError as exc:  # torch's zip writer reports a full disk this way
        raise ReleaseError(f"{out}: writing failed ({str(exc).splitlines()[0]}); check free space and the "
                           "path") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def release_weights_file(folder) -> Path:
    """The weights file of a release folder, in the official loader's order (pytorch_model.bin, model.pt), then
    model.safetensors."""
    for name in WEIGHT_FILES:
        path = Path(folder) / name
        if path.is_file():
            return path
    raise ReleaseError(f"{folder}: no weights file; a release folder holds one of {', '.join(WEIGHT_FILES)} beside "
                       f"{CONFIG_FILE}")
