"""`data_prep synth`: byte-identical output for one seed, val tables unseen in train, every recorded answer equal
to the one worked out here from the row's text, shards that the training loader and the tokenizer loader read,
and one-line errors (exit 2, nothing left behind) for bad input."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from data_prep.cli import main
from data_prep.synth import SynthOptions, read_queries, write_synth
from data_prep.synth_tasks import TASKS, KHop
from data_prep.tokenizer import load_tokenizer


def _make(out: Path, task: str = "khop", hops=(1, 4), rows: int = 40, val_rows: int = 12, seed: int = 0,
          seq_len: int = 96, shard_size: int = 16) -> dict:
    return write_synth(out, SynthOptions(task, hops, rows, val_rows, seed, seq_len, shard_size))


@pytest.fixture(scope="module")
def khop(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("khop") / "data"
    _make(out)
    return out


@pytest.fixture(scope="module")
def modarith(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("modarith") / "data"
    _make(out, "modarith", hops=(1, 6), seq_len=64)
    return out


def _rows(shard_dir: Path, split: str) -> np.ndarray:
    from data_prep.shard_reader import ShardDataset

    ds = ShardDataset(shard_dir, split, verify="full")
    return ds.read_rows(np.arange(len(ds), dtype=np.int64)).astype(np.int64)


def _words(shard_dir: Path, row: np.ndarray) -> list[str]:
    """The row's text split into words: one word per token (the tokenizer is word-level)."""
    tok = load_tokenizer(shard_dir / "tokenizer")
    words = tok.decode(row).split()
    assert len(words) == len(row)
    return words


def _khop_answers(words: list[str]) -> dict[int, tuple[str, int]]:
    """{answer position: (answer, hops)} worked out from a khop row's text: the pairs before "|", then queries."""
    bar = words.index("|")
    table = {words[i]: words[i + 2] for i in range(1, bar, 3)}
    assert all(words[i + 1] == ">" for i in range(1, bar, 3))
    first, x, steps = words[1], table[words[1]], 1
    while x != first:
        x, steps = table[x], steps + 1
    assert steps == len(table) == 8  # one cycle through 8 letters
    out, i = {}, bar + 1
    while i + 3 < len(words) and words[i] in table:
        x, k = words[i], int(words[i + 1])
        assert words[i + 2] == "="
        for _ in range(k):
            x = table[x]
        out[i + 3] = (x, k)
        i += 4
    return out


def _modarith_answers(words: list[str], p: int) -> dict[int, tuple[str, int]]:
    """{answer position: (answer, hops)} worked out from a modarith row's text with Python integers."""
    out, i = {}, 1
    while i < len(words) and words[i].isdigit():
        value, k, i = int(words[i]), 0, i + 1
        while words[i] != "=":
            op, operand = words[i][0], int(words[i][1:])
            value = {"+": value + operand, "-": value - operand, "*": value * operand}[op] % p
            k, i = k + 1, i + 1
        out[i + 1] = (str(value), k)
        i += 2
    return out


def _check_answers(shard_dir: Path, solve) -> int:
    checked = 0
    for split in ("train", "val"):
        rows = _rows(shard_dir, split)
        _, queries = read_queries(shard_dir, split)
        for r, row in enumerate(rows):
            words = _words(shard_dir, row)
            expected = solve(words)
            mine = queries[queries[:, 0] == r]
            assert sorted(expected) == mine[:, 1].tolist()          # every answer recorded, at its place
            for _, position, hops in mine:
                assert words[position] == expected[position][0] and hops == expected[position][1]
            checked += len(mine)
    return checked


def test_khop_answers_are_the_pointer_chains_of_the_table(khop):
    assert _check_answers(khop, _khop_answers) == 52 * 17  # 17 queries fit in 97 tokens after BOS and 25 of table


def test_modarith_answers_are_the_operations_worked_out(modarith):
    assert _check_answers(modarith, lambda w: _modarith_answers(w, TASKS["modarith"].modulus)) > 52 * 5


def test_hops_are_mixed_uniformly_within_rows(tmp_path):
    _make(tmp_path / "d", rows=400, val_rows=4, hops=(2, 5))
    _, q = read_queries(tmp_path / "d", "train")
    counts = np.bincount(q[:, 2], minlength=6)[2:]
    expected = len(q) / 4
    assert counts.min() > 0 and np.abs(counts - expected).max() < 4 * np.sqrt(expected)  # 4 sigma of a binomial
    per_row = [len(set(q[q[:, 0] == r, 2].tolist())) for r in range(400)]
    assert np.mean(per_row) > 3.5  # 17 queries over 4 difficulties: almost every row mixes all four


def test_same_options_same_bytes_other_seed_other_rows(tmp_path):
    for name in ("a", "b"):
        _make(tmp_path / name)
    _make(tmp_path / "c", seed=1)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert len(files) == 9  # 3 train + 1 val shards, 2 query files, manifest, tokenizer.json and its config
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    assert not np.array_equal(_rows(tmp_path / "a", "train"), _rows(tmp_path / "c", "train"))
    tokenizer = "tokenizer/tokenizer.json"
    assert (tmp_path / "a" / tokenizer).read_bytes() == (tmp_path / "c" / tokenizer).read_bytes()  # one per task


def _tables(shard_dir: Path, split: str) -> set[tuple]:
    return {tuple(sorted(_khop_table(_words(shard_dir, row)).items())) for row in _rows(shard_dir, split)}


def _khop_table(words: list[str]) -> dict[str, str]:
    bar = words.index("|")
    return {words[i]: words[i + 2] for i in range(1, bar, 3)}


def test_val_tables_are_unseen_in_train(khop):
    assert not _tables(khop, "val") & _tables(khop, "train")


def test_val_tables_are_redrawn_when_train_holds_them(tmp_path, monkeypatch):
    """Five symbols make 4! = 24 cycles: 30 train rows hold most of them, so independent val draws would repeat some;
    the val rows must still all be unseen. With three symbols (2 cycles) none can be, and the error says so."""
    monkeypatch.setitem(TASKS, "khop5", KHop("khop5", 5))
    _make(tmp_path / "d", "khop5", hops=(1, 2), rows=30, val_rows=20, seq_len=40)
    train = _tables(tmp_path / "d", "train")
    assert len(train) > 12 and not _tables(tmp_path / "d", "val") & train
    monkeypatch.setitem(TASKS, "khop3", KHop("khop3", 3))
    with pytest.raises(Exception, match="draws all gave a table used in train .khop3 has 2 distinct tables"):
        _make(tmp_path / "e", "khop3", hops=(1, 2), rows=30, val_rows=5, seq_len=40)
    assert not (tmp_path / "e" / "manifest.json").exists() and not (tmp_path / "e" / ".incoming").exists()


def test_shards_load_through_the_training_loader(khop):
    from data_prep.loader import ShardLoader

    rows = _rows(khop, "train")
    loader = ShardLoader(khop, global_batch_size=8, seed=3, prefetch=0)
    batch = next(iter(loader))
    assert batch["tokens"].shape == (8, 97)
    for tokens, row_id in zip(batch["tokens"].numpy(), batch["row_id"].numpy()):
        assert np.array_equal(tokens, rows[row_id])


def test_tokenizer_loads_and_round_trips(khop):
    tok = load_tokenizer(khop / "tokenizer")
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (0, 1, 2, 4 + 3 + 8 + 7)
    assert tok.fast is None and tok.encoder_name == "hf"
    row = _rows(khop, "val")[0]
    assert tok.encode(tok.decode(row)) == row.tolist()
    assert tok.encode("a > b | a 1 = b") == [7, 4, 8, 5, 7, 15, 6, 8]


def test_cli_writes_and_reports(tmp_path, capsys):
    assert main(["synth", "--task", "modarith", "--out", str(tmp_path / "d"), "--hops", "3", "--rows", "8",
                 "--val-rows", "2", "--seq-len", "32"]) == 0
    out = capsys.readouterr().out
    assert "vocabulary 32 (model.vocab_size)" in out  # 4 specials, =, 7 values, 7 + 7 + 6 operations
    _, q = read_queries(tmp_path / "d", "val")
    assert set(q[:, 2].tolist()) == {3}
    with pytest.raises(SystemExit) as done:
        main(["synth", "--help"])
    assert done.value.code == 0 and "python -m data_prep synth --task khop" in capsys.readouterr().out


@pytest.mark.parametrize("args, needle", [
    (["--task", "khopp"], "is not a synthetic task"),
    (["--task", "khop", "--hops", "0..2"], "is not a range A..B"),
    (["--task", "khop", "--hops", "3..1"], "is not a range A..B"),
    (["--task", "khop", "--hops", "1..8"], "1 <= A <= B <= 7"),
    (["--task", "khop16", "--hops", "1..16"], "1 <= A <= B <= 15"),
    (["--task", "khop", "--hops", "two"], "is not a range A..B"),
    (["--task", "khop", "--seq-len", "28"], "a khop row needs 30 tokens"),
    (["--task", "khop16", "--seq-len", "52"], "a khop16 row needs 54 tokens"),
    (["--task", "modarith", "--hops", "1..16", "--seq-len", "18"], "a modarith row needs 20 tokens"),
    (["--task", "khop", "--rows", "0"], "--rows must be at least 1"),
])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(tmp_path, capsys, args, needle):
    out = tmp_path / "d"
    assert main(["synth", "--out", str(out), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0] and "What to do" in err[0], err
    assert not out.exists()


def test_existing_dataset_needs_overwrite(khop, capsys):
    assert main(["synth", "--task", "khop", "--out", str(khop), "--rows", "4"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert len(_rows(khop, "train")) == 40  # untouched
