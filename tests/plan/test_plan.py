"""The planner's static terms against hand-computed sizes, the largest micro-batch against its own definition,
and the command line."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megaloop.config import ConfigError, load_config
from megaloop.model import build_model, count_parameters
from megaloop.plan.gpus import GPUS
from megaloop.plan.layout import Layout, local_params
from megaloop.plan.planner import make_plan
from megaloop.plan.static import static_terms

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs/parcae-tiny.yaml"


def _layout(tp=1, dp=1, zero_stage=1, engine="native"):
    return Layout(tp=tp, pp=1, dp=dp, sp=tp > 1, engine=engine, zero_stage=zero_stage)


def test_local_params_cover_the_model_and_split_by_tp():
    cfg = load_config(TINY)
    full = local_params(cfg, 1)
    assert sum(p.local_numel for p in full) == count_parameters(build_model(cfg.model, device="meta"))
    split = {p.name: p for p in local_params(cfg, 2)}
    d, v = cfg.model.d_model, cfg.model.vocab_size
    assert split["embed.weight"].local_shape == (v // 2, d)  # vocab-parallel rows
    assert split["core.0.attn.q.weight"].local_shape == (d // 2, d)  # column: output features
    assert split["core.0.attn.proj.weight"].local_shape == (d, d // 2)  # row: input features
    assert split["core.0.mlp.fc.weight"].local_shape == (4 * d // 2, d)
    assert split["injection.B"].local_shape == (d, d)  # replicated
    assert split["core.0.norm_1.weight"].local_shape == (d,)


def test_static_terms_single_process_by_hand():
    """One fp32 process: params + grads 4 B each; Muon momentum + one second-moment vector per matrix; AdamW
    two moments."""
    cfg = load_config(TINY)
    params = local_params(cfg, 1)
    n = sum(p.local_numel for p in params)
    muon = [p for p in params if p.optimizer == "muon"]
    n_adamw = n - sum(p.local_numel for p in muon)
    muon_state = sum(r * c + max(r, c) for r, c in (p.full_shape for p in muon))
    s = static_terms(params, _layout(), "bf16")
    assert (s.params, s.grads, s.muon, s.adamw) == (4 * n, 4 * n, 4 * muon_state, 8 * n_adamw)
    assert static_terms(params, _layout(), "fp64").params == 8 * n


def test_zero1_and_distributed_muon_shard_the_state():
    """ZeRO-1 over dp 4: each rank keeps Muon state for the matrices it owns (balanced whole matrices) and AdamW
    moments for the AdamW elements of its quarter of the gradient buffer; stage 0 keeps everything everywhere."""
    cfg = load_config(TINY)
    params = local_params(cfg, 1)
    one = static_terms(params, _layout(), "fp32")
    four = static_terms(params, _layout(dp=4), "fp32")
    n = sum(p.local_numel for p in params)
    muon_full = one.muon // 4
    largest = max(r * c + max(r, c) for r, c in (p.full_shape for p in params if p.optimizer == "muon"))
    assert four.muon // 4 <= muon_full / 4 + largest  # the reported rank: at most its share plus one matrix
    chunk = -(-n // 4)
    assert four.adamw // 4 <= 2 * chunk  # two moments for at most a chunk of AdamW elements
    assert four.muon + four.adamw < (one.muon + one.adamw) / 2
    assert static_terms(params, _layout(dp=4, zero_stage=0), "fp32").muon == one.muon  # stage 0: replicated


def test_largest_micro_batch_is_the_boundary():
    cfg = load_config(REPO / "configs/parcae-1_3b.yaml", world_size=8)
    plan = make_plan(cfg, GPUS["h100"], 8)
    usable = GPUS["h100"].usable_bytes
    for ck in ("none", "block", "lap"):
        b = plan.largest_micro_batch(ck)
        assert b >= 1
        assert plan.at(b, ck).peak <= usable < plan.at(b + 1, ck).peak
    assert plan.largest_micro_batch("lap") >= plan.largest_micro_batch("none")


def test_tp_halves_the_split_activations():
    """Under tensor + sequence parallelism the activations are split by heads, hidden, vocabulary or positions,
    except the all-gathered inputs of q/k/v and fc (whole sequence, whole d): tp 2 needs a bit more than half."""
    cfg = load_config(REPO / "configs/parcae-1_3b.yaml", world_size=8)
    one = make_plan(cfg, GPUS["h100"], 8).at(4, "none").activations
    cfg2 = load_config(REPO / "configs/parcae-1_3b.yaml", ["parallel.tp=2"], world_size=8)
    two = make_plan(cfg2, GPUS["h100"], 8).at(4, "none").activations
    assert 0.5 < (two.stored - two.weight_copies) / (one.stored - one.weight_copies) < 0.6


def _cli(capsys, *args):
    """Run `python -m megaloop plan ARGS` in this process: (exit code, stdout, stderr)."""
    from megaloop.__main__ import main

    code = main(["plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_json_and_text(capsys):
    code, out, err = _cli(capsys, str(TINY), "--gpu", "a100", "--nodes", "1", "--gpus-per-node", "2", "--set",
                          "parallel.tp=2", "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["layout"]["tp"] == 2 and plan["layout"]["dp"] == 1
    for ck in ("none", "block", "lap"):
        setting = plan["settings"][ck]
        assert setting["at_largest"]["peak_bytes"] <= plan["gpu"]["usable_bytes"]
        assert setting["largest_micro_batch"] >= 1
    code, out, err = _cli(capsys, str(TINY), "--gpu", "h200", "--nodes", "2", "--gpus-per-node", "4", "--set",
                          "data.global_batch_size=64")
    assert code == 0, err
    assert "8 x H200 141GB" in out and "largest micro-batch that fits" in out


def test_cli_refuses_bad_layouts(capsys):
    code, _, err = _cli(capsys, str(TINY), "--nodes", "1", "--gpus-per-node", "4", "--pp", "4")
    assert code == 2 and "parallel.pp=4" in err and "use parallel.pp <= 2" in err
    code, _, err = _cli(capsys, str(TINY), "--nodes", "1", "--gpus-per-node", "3", "--set", "parallel.tp=2")
    assert code == 2 and "parallel.tp" in err


def test_command_runs_as_a_module():
    out = subprocess.run([sys.executable, "-m", "megaloop", "plan", "--help"], cwd=REPO, capture_output=True,
                         text=True)
    assert out.returncode == 0 and "--gpus-per-node" in out.stdout


def test_resolve_layout_checks_tp_against_the_model():
    from megaloop.plan.layout import resolve_layout

    cfg = load_config(TINY, ["parallel.tp=8"])
    with pytest.raises(ConfigError, match="model.n_heads"):
        resolve_layout(cfg, 8)


def test_gpu_names_are_accepted_in_any_case(capsys):
    lower = _cli(capsys, str(TINY), "--gpu", "h100", "--nodes", "1", "--gpus-per-node", "1", "--json")
    upper = _cli(capsys, str(TINY), "--gpu", "H100", "--nodes", "1", "--gpus-per-node", "1", "--json")
    assert upper[0] == 0 and upper == lower
