"""`megaloop laws fit` and `megaloop plot` as a user runs them: the JSON shape, points read from run directories,
and bad input as one line with exit status 2."""
import json

import numpy as np
import pytest

from megaloop.__main__ import main
from megaloop.config import load_config
from megaloop.laws import synthetic
from megaloop.laws.forms import TESTTIME_FORMS
from megaloop.model import build_model, count_parameters
from tests.train.conftest import TINY

TRUTH = synthetic.TRUTH["exp"]


def _run_dir(path, depths=range(1, 9), drop=None):
    """A finished run as the trainer leaves it: config.json, summary.json and metrics.jsonl with a final
    validation at `depths` following the exp law (noiseless)."""
    cfg = load_config(TINY, validate=False)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg.to_dict()))
    losses = TESTTIME_FORMS["exp"].predict(TRUTH, {"T": np.array(list(depths), dtype=float)})
    summary = {"n_params": count_parameters(build_model(cfg.model, device="meta")), "tokens": 614400,
               "useful_flops": 3.2e15, "steps_done": 300,
               "val": {str(t): {"val_loss": float(v)} for t, v in zip(depths, losses)}}
    if drop:
        summary.pop(drop)
    (path / "summary.json").write_text(json.dumps(summary))
    with (path / "metrics.jsonl").open("w") as f:
        f.write(json.dumps({"kind": "train", "step": 0, "loss": 8.0, "rho_A": 0.5, "state_norm": 1.2}) + "\n")
        f.write(json.dumps({"kind": "val", "step": 100, "T": 4, "val_loss": 9.0, "val_bpb": 1.0, "tokens": 1}) + "\n")
        for t, v in zip(depths, losses):
            f.write(json.dumps({"kind": "val", "step": 300, "T": t, "val_loss": float(v), "val_bpb": 1.0,
                                "tokens": 1}) + "\n")
    return path


def _one_line_error(capsys, argv, *expected):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    for text in expected:
        assert text in err[0], err[0]


def test_testtime_json_from_a_run_dir_has_one_object_per_form(tmp_path, capsys):
    run = _run_dir(tmp_path / "run")
    assert main(["laws", "fit", str(run), "--law", "testtime", "--json", "--boot", "4", "--restarts", "4",
                 "--plot", str(tmp_path / "tt.png")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(TESTTIME_FORMS) <= set(out) and out["selected"] == "exp" and out["split"] == 4  # the run's mu_rec
    for form, law in TESTTIME_FORMS.items():
        for name in law.names:
            assert set(out[form][name]) == {"value", "ci_low", "ci_high"}
    for name, value in TRUTH.items():
        p = out["exp"][name]
        # noiseless points: the value and both ends of its interval sit at the truth
        assert [p["value"], p["ci_low"], p["ci_high"]] == pytest.approx([value] * 3, rel=1e-4), p
    assert (tmp_path / "tt.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_dir_points_name_the_loop_parameters(tmp_path):
    from megaloop.laws.points import read_run_dirs

    cols = read_run_dirs([_run_dir(tmp_path / "run")])
    cfg = load_config(TINY, validate=False)
    model = build_model(cfg.model, device="meta")
    core = sum(p.numel() for block in model.core for p in block.parameters())
    assert list(cols["T"]) == list(range(1, 9))  # the final validation only (not step 100's)
    assert np.all(cols["n_rec"] == core) and np.all(cols["n_once"] + cols["n_rec"] == cols["params"])
    assert np.all(cols["mu_rec"] == cfg.model.mu_rec) and np.all(cols["r"] == cfg.model.mu_rec)


def test_parametric_json_from_csv(tmp_path, capsys):
    cols = synthetic.parametric(np.random.default_rng(0), noise=0.0, n=6)
    csv = tmp_path / "p.csv"
    csv.write_text("params,tokens,loss\n" + "".join(f"{a},{b},{c}\n" for a, b, c in zip(
        cols["params"], cols["tokens"], cols["loss"])))
    assert main(["laws", "fit", "--points", str(csv), "--law", "parametric", "--json", "--boot", "5",
                 "--restarts", "8"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["delta"] == 1e-3 and out["formula"] == "E + X N(mu_rec)^-x + Y D^-y"
    for name, value in synthetic.TRUTH["parametric"].items():
        assert out[name]["value"] == pytest.approx(value, rel=1e-3)


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    run = _run_dir(tmp_path / "nosum", drop="tokens")
    _one_line_error(capsys, ["laws", "fit", str(run), "--law", "parametric"], "field 'tokens' is missing")
    _one_line_error(capsys, ["laws", "fit", str(tmp_path / "absent"), "--law", "testtime"],
                    "not a finished run directory: config.json is missing")
    few = _run_dir(tmp_path / "few", depths=[1, 2, 3])
    _one_line_error(capsys, ["laws", "fit", str(few), "--law", "testtime"], "too few points for the testtime law")
    _one_line_error(capsys, ["laws", "fit", str(few), "--law", "parametric"], "too few points for the parametric law")
    csv = tmp_path / "bad.csv"
    csv.write_text("T,loss,depth\n1,3,1\n")
    _one_line_error(capsys, ["laws", "fit", "--points", str(csv), "--law", "testtime"], "unknown column(s) ['depth']")
    csv.write_text("T,loss\n1,3\n2,x\n")
    _one_line_error(capsys, ["laws", "fit", "--points", str(csv), "--law", "testtime"], "bad.csv:3", "'x'")
    csv.write_text("T,loss\n1,3\n")
    _one_line_error(capsys, ["laws", "fit", "--points", str(csv), "--law", "isoflop"], "needs column(s) flops")
    _one_line_error(capsys, ["laws", "fit", "--law", "testtime"], "either run directories or --points")


def test_plot_draws_the_run_and_rejects_a_non_run(tmp_path, capsys):
    run = _run_dir(tmp_path / "run")
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"kind": "train", "step": 1, "loss": 7.0, "rho_A": 0.6, "state_norm": 1.1}) + "\n")
    assert main(["plot", str(run)]) == 0
    names = sorted(p.name for p in (run / "plots").iterdir())
    assert names == ["loss.png", "rho_A.png", "state_norm.png", "testtime.png"]
    assert capsys.readouterr().out.split() == [str(run / "plots" / n) for n in
                                               ("loss.png", "rho_A.png", "state_norm.png", "testtime.png")]
    _one_line_error(capsys, ["plot", str(tmp_path)], "no metrics.jsonl")
