"""Parameter grouping by name on a fake named-parameter list that follows the model's naming contract."""

import pytest
import torch

from megaloop.optim import canonical_name, split_param_groups

D, V, KV, FF = 16, 50, 2, 64


def fake_model_params(injection="diagonal"):
    """(name, parameter, expected group) for a small Parcae/RDM-like model; meta tensors, nothing allocated."""
    spec = [("embed.weight", (V, D), "adamw"), ("value_embeds.1.weight", (V, KV * 8), "adamw"),
            ("value_embeds.3.weight", (V, KV * 8), "adamw")]
    for stack, n in (("prelude", 1), ("core", 2), ("coda", 1)):
        for i in range(n):
            prefix = f"{stack}.{i}"
            spec += [(f"{prefix}.norm_1.weight", (D,), "adamw"), (f"{prefix}.norm_2.weight", (D,), "adamw")]
            spec += [(f"{prefix}.attn.{w}.weight", (D, D), "muon") for w in ("q", "k", "v", "proj")]
            spec += [(f"{prefix}.mlp.fc.weight", (FF, D), "muon"), (f"{prefix}.mlp.proj.weight", (D, FF), "muon")]
            if i % 2 == 1:
                spec.append((f"{prefix}.attn.ve_gate.weight", (KV, 32), "muon"))
    if injection == "diagonal":
        spec += [("injection.A_log", (D,), "adamw"), ("injection.dt_bias", (D,), "adamw"),
                 ("injection.B", (D, D), "adamw"), ("C.weight", (D, D), "adamw")]
    else:
        spec += [("injection.W.weight", (D, 2 * D), "muon")]
    spec += [("prelude_norm.weight", (D,), "adamw"), ("final_norm.weight", (D,), "adamw")]
    return [(name, torch.nn.Parameter(torch.empty(shape, device="meta")), group) for name, shape, group in spec]


@pytest.mark.parametrize("injection", ["diagonal", "concat"])
def test_reference_rules(injection):
    spec = fake_model_params(injection)
    groups = split_param_groups((name, p) for name, p, _ in spec)
    assert [n for n, _ in groups.muon] == [n for n, _, g in spec if g == "muon"]
    assert [n for n, _ in groups.adamw] == [n for n, _, g in spec if g == "adamw"]
    print(groups.summary())


def test_summary_counts():
    spec = fake_model_params("diagonal")
    groups = split_param_groups((name, p) for name, p, _ in spec)
    n_muon = sum(p.numel() for _, p, g in spec if g == "muon")
    n_adamw = sum(p.numel() for _, p, g in spec if g == "adamw")
    expected = (f"optimizer groups: muon {len(groups.muon)} tensors / {n_muon:,} params; "
                f"adamw {len(groups.adamw)} tensors / {n_adamw:,} params")
    assert groups.summary() == expected and "\n" not in expected


def test_unknown_names_default_by_dimension_and_wrappers_are_ignored():
    named = [
        ("module._orig_mod.new_block.mixer.weight", torch.nn.Parameter(torch.empty(4, 8, device="meta"))),
        ("new_block.scale", torch.nn.Parameter(torch.empty(8, device="meta"))),
        ("new_block.bias", torch.nn.Parameter(torch.empty(8, device="meta"))),
        ("temperature", torch.nn.Parameter(torch.empty((), device="meta"))),
        ("_orig_mod.embed.weight", torch.nn.Parameter(torch.empty(V, D, device="meta"))),
        ("core.0._checkpoint_wrapped_module.attn.q.weight", torch.nn.Parameter(torch.empty(D, D, device="meta"))),
        ("model.injection.B", torch.nn.Parameter(torch.empty(D, D, device="meta"))),
        ("lm_head.weight", torch.nn.Parameter(torch.empty(V, D, device="meta"))),
    ]
    groups = split_param_groups(named)
    assert [n for n, _ in groups.muon] == ["module._orig_mod.new_block.mixer.weight",
                                           "core.0._checkpoint_wrapped_module.attn.q.weight"]
    assert len(groups.adamw) == 6
    assert canonical_name("module._orig_mod.core.0._fsdp_wrapped_module.mlp.fc.weight") == "core.0.mlp.fc.weight"


def test_tied_duplicates_frozen_and_adamw_mode():
    embed = torch.nn.Parameter(torch.empty(V, D, device="meta"))
    frozen = torch.nn.Parameter(torch.empty(D, D, device="meta"), requires_grad=False)
    q = torch.nn.Parameter(torch.empty(D, D, device="meta"))
    named = [("embed.weight", embed), ("core.0.attn.q.weight", q), ("lm_head.weight", embed), ("frozen.w", frozen)]
    groups = split_param_groups(named)
    assert [n for n, _ in groups.adamw] == ["embed.weight"] and [n for n, _ in groups.muon] == ["core.0.attn.q.weight"]
    everything = split_param_groups(named, optimizer="adamw")
    assert everything.muon == [] and [n for n, _ in everything.adamw] == ["embed.weight", "core.0.attn.q.weight"]


def test_tensors_above_two_dims_rejected_for_muon_only():
    conv = ("stem.conv.weight", torch.nn.Parameter(torch.empty(4, 4, 3, device="meta")))
    with pytest.raises(ValueError, match="'stem.conv.weight' has shape \\(4, 4, 3\\)"):
        split_param_groups([conv])
    assert len(split_param_groups([conv], optimizer="adamw").adamw) == 1
    with pytest.raises(ValueError, match="allowed values"):
        split_param_groups([], optimizer="sgd")
