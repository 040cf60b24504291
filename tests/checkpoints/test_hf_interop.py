"""Hugging Face interop: the folder `export-hf` writes loads in transformers (trust_remote_code, offline) and computes
what megaloop computes.

- logits equal megaloop's evaluation forward (fixed h_0) for every model kind at T = 1, mu_rec and 2 mu_rec:
  bit for bit in fp64, within 1e-5 relative in fp32;
- greedy generate() equals `megaloop generate`'s tokens with and without the cache, follows num_steps from the
  call, the generation config and the load arguments, and a left-padded batch equals its rows alone;
- megaloop -> HF -> megaloop is bit-exact (one file and sharded);
- lm_eval --model hf on the folder scores a CORE task as megaloop's own lm-eval adapter does;
- bad input is one line on stderr, exit 2, and leaves nothing behind.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from ckpt_helpers import bits

from checkpoints import Checkpointer, CheckpointReader, Piece
from checkpoints.cli import main
from checkpoints.hf import write_hf_folder
from megaloop.config import ModelConfig
from megaloop.eval.generate import generate
from megaloop.eval.scoring import Scorer

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=512, d_model=32, n_heads=2, n_kv_heads=1, n_prelude=1, n_core=2, n_coda=1, seq_len=64,
            mu_rec=3, mu_bwd=2, ve_gate_channels=8)
KINDS = {
    "parcae": dict(arch="parcae", injection="diagonal"),
    "additive": dict(arch="parcae", injection="additive"),
    "rdm": dict(arch="rdm", injection="concat", block="sandwich", mlp="swiglu", use_C=False),
    "gpt": dict(arch="gpt", injection="none", n_prelude=0, n_core=4, n_coda=0, prelude_norm=False, use_C=False,
                mu_rec=1, mu_bwd=None, depth_sampler="fixed"),
}


def model_of(kind: str, seed: int = 1):
    """A small model of `kind` with every weight non-trivial (the reference init zeroes the output projections)."""
    from tests.eval.eval_helpers import small_model

    model = small_model(seed, **{**BASE, **KINDS[kind]})
    model.cfg.validate()
    return model


@pytest.fixture(scope="module")
def tokenizer_dir(tiny_shards) -> Path:
    return tiny_shards / "tokenizer"


def export(model, tokenizer_dir, out: Path) -> Path:
    return write_hf_folder(out, dict(model.state_dict()), dataclasses.asdict(model.cfg), tokenizer_dir)


def load_hf(folder: Path, dtype=torch.float32, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=dtype, **kwargs).eval()


def save_checkpoint(model, root: Path, shards: Path, step: int = 7) -> Path:
    """`model` committed as training commits it, with a config whose data.shards names the tokenizer's shards."""
    config = {"model": dataclasses.asdict(model.cfg), "train": {"seed": 0}, "data": {"shards": str(shards)}}
    pieces = [Piece("model/" + n, tuple(p.shape), (0,) * p.dim(), p.detach().clone())
              for n, p in model.named_parameters()]
    with Checkpointer(root, async_save=False, keep=1) as saver:
        saver.save(step, pieces, {"config": config, "tokens": 0})
        result = saver.wait()
    assert result is not None and result.ok
    return result.path


@pytest.mark.parametrize("kind", list(KINDS))
def test_logits_equal_megaloop_at_every_depth(kind, tokenizer_dir, tmp_path):
    model = model_of(kind)
    folder = export(model, tokenizer_dir, tmp_path / "hf")
    ids = torch.randint(0, 512, (3, 40), generator=torch.Generator().manual_seed(2))
    depths = [1] if kind == "gpt" else [1, model.cfg.mu_rec, 2 * model.cfg.mu_rec]
    for dtype in (torch.float32, torch.float64):
        ours, hf = model.to(dtype), load_hf(folder, dtype)
        assert hf.model.embed.weight.dtype == dtype
        for depth in depths:
            h0 = Scorer(ours, depth, seed=0).h0(*ids.shape)  # megaloop's evaluation h_0
            with torch.no_grad():
                want = ours(ids, depth=depth, h0=h0).logits
                got = hf(ids, num_steps=depth).logits
            assert got.dtype == dtype and got.shape == want.shape
            if dtype == torch.float64:
                assert torch.equal(got, want), (kind, depth)
            else:
                rel = float((got - want).abs().max() / want.abs().max())
                assert rel <= 1e-5, (kind, depth, rel)
        if kind != "gpt":  # the depth changes the logits: a forward that ignored num_steps would pass nothing
            with torch.no_grad():
                assert not torch.equal(hf(ids, num_steps=1).logits, hf(ids, num_steps=2).logits)
    model.float()


def test_the_h0_seed_is_megaloops_draw(tokenizer_dir, tmp_path):
    """A seed other than 0 (a load argument) gives the logits of megaloop's scorer at that seed, not at seed 0."""
    model = model_of("parcae")
    folder = export(model, tokenizer_dir, tmp_path / "hf")
    ids = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = load_hf(folder, h0_seed=5)(ids).logits
    assert torch.equal(got, Scorer(model, 3, seed=5).logits(ids))
    assert not torch.equal(got, Scorer(model, 3, seed=0).logits(ids))


@pytest.mark.parametrize("kind", ["parcae", "gpt"])
def test_greedy_generate_equals_megaloop_generate(kind, tokenizer_dir, tmp_path):
    model = model_of(kind, seed=4)
    folder = export(model, tokenizer_dir, tmp_path / "hf")
    hf = load_hf(folder)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    enc = tok("<|bos|>It was a dark night", return_tensors="pt")
    prompt = enc.input_ids[0].tolist()
    assert prompt[0] == tok.bos_token_id == 0 and len(prompt) > 3
    depth = model.cfg.mu_rec if kind == "parcae" else 1
    want = generate(model, prompt, depth, 32).tokens
    assert len(want) == 32
    for use_cache in (True, False):
        out = hf.generate(**enc, max_new_tokens=32, do_sample=False, use_cache=use_cache)
        assert out[0, len(prompt):].tolist() == want, use_cache
    if kind == "gpt":
        return
    at_one = generate(model, prompt, 1, 32).tokens
    assert at_one != want  # the depth changes what is generated here, so the checks below can fail
    assert hf.generate(**enc, max_new_tokens=32, do_sample=False, num_steps=1)[0, len(prompt):].tolist() == at_one
    hf.generation_config.num_steps = 1
    assert hf.generate(**enc, max_new_tokens=32, do_sample=False)[0, len(prompt):].tolist() == at_one
    loaded_at_one = load_hf(folder, num_steps=1)
    assert loaded_at_one.generate(**enc, max_new_tokens=32, do_sample=False)[0, len(prompt):].tolist() == at_one


def test_a_left_padded_batch_generates_what_each_row_does_alone(tokenizer_dir, tmp_path):
    model = model_of("parcae", seed=4)
    hf = load_hf(export(model, tokenizer_dir, tmp_path / "hf"))
    short, long = [0, 40, 41], [0, 50, 51, 52, 53, 54]
    alone = [generate(model, p, 3, 12).tokens for p in (short, long)]
    ids = torch.tensor([[2] * 3 + short, long])
    mask = torch.tensor([[0] * 3 + [1] * 3, [1] * 6])
    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=2)
    assert [out[0, 6:].tolist(), out[1, 6:].tolist()] == alone
    with torch.no_grad():  # the padded forward's logits at every real position are each row's own
        batch = hf(ids, attention_mask=mask).logits
        for row, prompt in enumerate((short, long)):
            own = hf(torch.tensor([prompt])).logits[0]
            rel = float((batch[row, -len(prompt):] - own).abs().max() / own.abs().max())
            assert rel <= 1e-5, (row, rel)


def test_megaloop_hf_megaloop_is_bit_exact(tiny_shards, tmp_path, capsys):
    model = model_of("rdm")
    step_dir = save_checkpoint(model, tmp_path / "run" / "checkpoints", tiny_shards)
    for name, extra in (("one", []), ("sharded", ["--max-shard-size", "20000"])):
        folder, back = tmp_path / f"hf-{name}", tmp_path / f"back-{name}"
        assert main(["export-hf", str(tmp_path / "run"), str(folder), *extra]) == 0  # a run directory
        shards = sorted(p.name for p in folder.glob("*.safetensors"))
        assert (len(shards) > 1) == (name == "sharded"), shards
        assert main(["import-hf", str(folder), str(back)]) == 0
        reader, original = CheckpointReader(back / "step_00000007"), CheckpointReader(step_dir)
        assert sorted(reader.arrays) == sorted(original.arrays)
        for array in original.arrays:
            a, b = original.read(array), reader.read(array)
            assert a.dtype == b.dtype and torch.equal(bits(a), bits(b)), array
        got = ModelConfig(**reader.metadata["config"]["model"])
        assert got == model.cfg  # the same megaloop config, field for field
    assert "trust_remote_code=True" in capsys.readouterr().out


def test_lm_eval_hf_scores_a_core_task_as_the_megaloop_adapter(tiny_shards, shared_dir, tmp_path):
    """arc_easy from the bundled CORE files, 6 questions, through `--model hf` on the exported folder and through
    megaloop's own adapter on the checkpoint: the same log-likelihood per choice (1e-5 relative), so the same
    accuracy."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from megaloop.eval.lm_eval_adapter import MegaloopLM

    model = model_of("parcae", seed=6)
    save_checkpoint(model, tmp_path / "run" / "checkpoints", tiny_shards)
    folder = tmp_path / "hf"
    assert main(["export-hf", str(tmp_path / "run"), str(folder)]) == 0
    data = shared_dir / "data" / "eval" / "core" / "world_knowledge" / "arc_easy.jsonl"
    (tmp_path / "task.yaml").write_text(
        f"task: core_arc_easy_local\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{query}}\\nAnswer:\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{gold}}\"\nmetric_list:\n  - metric: acc\n")
    tasks = TaskManager(include_path=str(tmp_path), include_defaults=False)
    results = {}
    for name, lm in (("hf", "hf"), ("megaloop", MegaloopLM(checkpoint=str(tmp_path / "run"), depth=2, batch_size=4))):
        args = f"pretrained={folder},trust_remote_code=True,num_steps=2,dtype=float32,device=cpu" if lm == "hf" \
            else None
        results[name] = lm_eval.simple_evaluate(model=lm, model_args=args, tasks=["core_arc_easy_local"], limit=6,
                                                task_manager=tasks, log_samples=True, bootstrap_iters=0, batch_size=2)
    samples = {name: {s["doc_id"]: s for s in r["samples"]["core_arc_easy_local"]} for name, r in results.items()}
    assert len(samples["hf"]) == 6 and samples["hf"].keys() == samples["megaloop"].keys()
    for doc, s in samples["hf"].items():
        for ours, theirs in zip(samples["megaloop"][doc]["resps"], s["resps"]):
            a, b = float(ours[0][0]), float(theirs[0][0])
            assert abs(a - b) <= 1e-5 * abs(a), (doc, a, b)
    acc = {name: r["results"]["core_arc_easy_local"]["acc,none"] for name, r in results.items()}
    assert acc["hf"] == acc["megaloop"]


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("checkpoints: ") and "\n" not in err and "Traceback" not in err, err
    return err


def test_bad_input_is_one_line_exit_2_and_leaves_nothing(tiny_shards, tmp_path, capsys):
    model = model_of("parcae")
    save_checkpoint(model, tmp_path / "run" / "checkpoints", tiny_shards)
    (tmp_path / "empty").mkdir()
    out = tmp_path / "out"
    assert "no committed checkpoint" in _one_line_error(capsys, ["export-hf", str(tmp_path / "empty"), str(out)])
    blind = tmp_path / "blind"
    save_checkpoint(model, blind, tmp_path / "no-such-shards")
    assert "--tokenizer DIR" in _one_line_error(capsys, ["export-hf", str(blind), str(out)])
    assert "--tokenizer DIR" in _one_line_error(capsys, ["export-hf", str(tmp_path / "run"), str(out), "--tokenizer",
                                                         str(tmp_path / "empty")])
    assert not out.exists() and not list(tmp_path.glob(".out*")), "a failed export left files behind"

    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert "--overwrite" in _one_line_error(capsys, ["export-hf", str(tmp_path / "run"), str(out)])
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert main(["export-hf", str(tmp_path / "run"), str(out), "--overwrite"]) == 0
    assert (out / "config.json").is_file() and not (out / "keep.txt").exists()

    from safetensors.torch import load_file, save_file

    weights = load_file(str(out / "model.safetensors"))
    del weights["model.core.1.attn.q.weight"]
    save_file(weights, str(out / "model.safetensors"))
    back = tmp_path / "back"
    err = _one_line_error(capsys, ["import-hf", str(out), str(back)])
    assert "missing tensors: model.core.1.attn.q.weight" in err
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    assert "not 'megaloop'" in _one_line_error(capsys, ["import-hf", str(out), str(back)])
    assert not back.exists()
    (back / "x").mkdir(parents=True)
    assert "not an empty directory" in _one_line_error(capsys, ["import-hf", str(out), str(back)])
