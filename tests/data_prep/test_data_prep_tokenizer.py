"""Tokenizer (small scale): round trip on every document, tiktoken ids == HF ids, hash, specials."""
from __future__ import annotations

import json
import random
import shutil

import pytest

from data_prep.errors import TokenizerError, TokenizerMismatchError
from data_prep.fast_encoder import EDGE_CASE_SAMPLE
from data_prep.text_io import iter_documents, list_source_files
from data_prep.tokenizer import (CONFIG_FILE, SAMPLE_FILE, TOKENIZER_FILE, load_tokenizer, tokenizer_hash,
                                  train_tokenizer)


def _chapter_texts(chapters_dir):
    return [d.text for d in iter_documents(chapters_dir, list_source_files(chapters_dir))]


def test_round_trip_and_fast_equals_hf_on_every_chapter(chapters_tokenizer, chapters_dir):
    tok = chapters_tokenizer
    assert tok.encoder_name == "tiktoken", tok.fast_problem
    texts = _chapter_texts(chapters_dir)
    assert len(texts) == 222
    hf_ids = [e.ids for e in tok.hf.encode_batch_fast(texts, add_special_tokens=False)]
    hf_decoded = tok.hf.decode_batch(hf_ids, skip_special_tokens=False)
    for text, ids, hf_text in zip(texts, hf_ids, hf_decoded):
        assert tok.fast.encode_ordinary(text) == ids
        assert tok.decode(ids) == text
        assert hf_text == text
    total_bytes, total_tokens = sum(len(t.encode()) for t in texts), sum(map(len, hf_ids))
    print(f"chapters: {total_bytes / total_tokens:.3f} bytes per token with vocab {tok.vocab_size}")
    assert 2.5 < total_bytes / total_tokens < 6


def test_every_byte_sequence_round_trips_without_unknown_tokens(chapters_tokenizer):
    tok = chapters_tokenizer
    rng = random.Random(0)
    chars = [chr(rng.choice([rng.randrange(32, 0x250), rng.randrange(0x250, 0xD800), rng.randrange(0xE000, 0x10FFFF)]))
             for _ in range(3000)]
    for text in [EDGE_CASE_SAMPLE, "".join(chars), "\x00\x01\x7f \t\n\u200b", "<|eos|><|bos|>"]:
        ids = tok.encode(text)
        assert ids == tok.encode_hf(text)
        assert tok.decode(ids) == text
        assert all(0 <= i < tok.vocab_size for i in ids)


def test_specials_are_separate_and_never_produced_by_text(chapters_tokenizer):
    tok = chapters_tokenizer
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    ids = tok.encode("a <|eos|> b <|pad|>")
    assert not {tok.bos_id, tok.eos_id, tok.pad_id} & set(ids)
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id]) == "<|bos|>a <|eos|> b <|pad|><|eos|>"


def test_numbers_split_in_groups_of_at_most_two_digits(chapters_tokenizer):
    tok = chapters_tokenizer
    pieces = [tok.decode([i]) for i in tok.encode("year 18471925 and 7")]
    digits = [p for p in pieces if p.strip().isdigit()]
    assert "".join(digits) == "184719257" and all(len(p) <= 2 for p in digits)


def test_saved_files_config_and_hash(chapters_tokenizer):
    directory = chapters_tokenizer.directory
    config = json.loads((directory / CONFIG_FILE).read_text())
    assert config["vocab_size"] == 4096 and config["requested_vocab_size"] == 4096
    assert config["special_tokens"] == {"<|bos|>": 0, "<|eos|>": 1, "<|pad|>": 2}
    assert config["hash"] == chapters_tokenizer.hash and len(config["hash"]) == 64
    assert config["training_corpus"]["files"] == 222


def test_training_is_deterministic_and_hash_tracks_content(small_corpus, tmp_path):
    first = train_tokenizer(small_corpus, tmp_path / "a", vocab_size=600, progress=False)
    second = train_tokenizer(small_corpus, tmp_path / "b", vocab_size=600, progress=False)
    third = train_tokenizer(small_corpus, tmp_path / "c", vocab_size=700, progress=False)
    assert first.hash == second.hash != third.hash
    with pytest.raises(TokenizerError, match="already holds a tokenizer"):
        train_tokenizer(small_corpus, tmp_path / "a", vocab_size=600, progress=False)


def test_edited_tokenizer_file_is_detected(chapters_tokenizer, tmp_path):
    copy = tmp_path / "tok"
    shutil.copytree(chapters_tokenizer.directory, copy)
    data = json.loads((copy / TOKENIZER_FILE).read_text())
    data["model"]["merges"] = data["model"]["merges"][:-1]
    (copy / TOKENIZER_FILE).write_text(json.dumps(data))
    with pytest.raises(TokenizerMismatchError, match="changed after training.*What to do"):
        load_tokenizer(copy)


def test_reformatted_tokenizer_file_keeps_its_hash(chapters_tokenizer, tmp_path):
    copy = tmp_path / "tok"
    shutil.copytree(chapters_tokenizer.directory, copy)
    data = json.loads((copy / TOKENIZER_FILE).read_text())
    (copy / TOKENIZER_FILE).write_text(json.dumps(data, indent=4))
    assert load_tokenizer(copy).hash == chapters_tokenizer.hash


def test_missing_tokenizer_and_bad_vocab_size_are_clear_errors(tmp_path, small_corpus):
    with pytest.raises(TokenizerError, match="has no tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(TokenizerError, match="below 259"):
        train_tokenizer(small_corpus, tmp_path / "x", vocab_size=100, progress=False)


def test_hf_fallback_gives_the_same_ids(chapters_tokenizer):
    hf_only = load_tokenizer(chapters_tokenizer.directory, encoder="hf")
    assert hf_only.encoder_name == "hf"
    assert hf_only.encode(EDGE_CASE_SAMPLE) == chapters_tokenizer.encode(EDGE_CASE_SAMPLE)


def _tokenizer_where_tiktoken_differs(source, destination):
    """A copy whose extra merges make greedy lowest-rank merging (tiktoken) disagree with HF's merge list:
    HF merges "~^" first and has no merge ("~^", "`"); tiktoken sees "~^`" in the vocabulary and takes it."""
    shutil.copytree(source, destination)
    data = json.loads((destination / TOKENIZER_FILE).read_text())
    vocab, merges = data["model"]["vocab"], data["model"]["merges"]
    assert not {"~^", "^`", "~^`"} & set(vocab)
    for token, pair in [("~^", ["~", "^"]), ("^`", ["^", "`"]), ("~^`", ["~", "^`"])]:
        vocab[token] = len(vocab)
        merges.append(pair)
    text = json.dumps(data)
    (destination / TOKENIZER_FILE).write_text(text)
    config = json.loads((destination / CONFIG_FILE).read_text())
    config["hash"] = tokenizer_hash(text)
    (destination / CONFIG_FILE).write_text(json.dumps(config))
    return destination


def test_fast_encoder_is_only_used_when_it_agrees(chapters_tokenizer, tmp_path):
    from data_prep.prepare import ShardOptions, prepare_shards
    from data_prep.shard_reader import ShardDataset

    tok_dir = _tokenizer_where_tiktoken_differs(chapters_tokenizer.directory, tmp_path / "tok")
    odd = "Odd glyphs ~^` in a row, twice: ~^` ok."
    tok = load_tokenizer(tok_dir)
    assert tok.encoder_name == "tiktoken"                    # its own samples do not contain the odd glyphs
    assert tok.fast.encode_ordinary(odd) != tok.encode_hf(odd)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(odd * 40)
    manifest = prepare_shards(corpus, tok_dir, tmp_path / "shards",
                              ShardOptions(seq_len=32, val_fraction=0.0, progress=False))
    assert manifest["tokenizer"]["encoder"] == "hf" and "disagrees" in manifest["tokenizer"]["encoder_check"]
    rows = ShardDataset(tmp_path / "shards")
    stream = [tok.bos_id] + tok.encode_hf(odd * 40) + [tok.eos_id]
    assert rows.read_rows(list(range(len(rows)))).reshape(-1).tolist() == stream[:len(rows) * 33]
    with open(tok_dir / SAMPLE_FILE, "a", encoding="utf-8") as sample:
        sample.write(odd)
    reloaded = load_tokenizer(tok_dir)
    assert reloaded.encoder_name == "hf" and "ids differ" in reloaded.fast_problem
    assert reloaded.encode(odd) == reloaded.encode_hf(odd)
    with pytest.raises(TokenizerError, match="fast encoder does not match HF"):
        load_tokenizer(tok_dir, encoder="tiktoken")
