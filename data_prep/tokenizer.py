"""Byte-level BPE tokenizer: training with HF `tokenizers`, saving with a content hash, loading with a fast encoder.

A tokenizer directory holds:
- tokenizer.json          the HF tokenizer (pre-tokenizer, vocabulary, merges, special tokens);
- tokenizer_config.json   how it was made (vocab size, split pattern, specials and their ids, training corpus
                          summary) and `hash`, the sha256 of tokenizer.json in canonical JSON form (sorted keys,
                          no whitespace), i.e. of everything that decides how text becomes ids;
- verify_sample.txt       a slice of the training corpus on which the fast encoder is checked at load time.

Documents are encoded as plain text: a literal "<|eos|>" inside a document is tokenized as characters, never as the
special token. Every byte has a token (256-byte initial alphabet), so there is no unknown token.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

from . import __version__
from .errors import EmptyCorpusError, TokenizerError, TokenizerMismatchError
from .fast_encoder import EDGE_CASE_SAMPLE, build_tiktoken_encoding, first_disagreement
from .text_io import DEFAULT_MAX_INVALID_FRACTION, iter_documents, list_source_files

# GPT-4's split pattern with numbers in groups of at most two digits.
SPLIT_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*"""
                 r"""|\s*[\r\n]|\s+(?!\S)|\s+""")
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, PAD)
DEFAULT_VOCAB_SIZE = 32768
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
MAX_VOCAB_SIZE = 1 << 24  # far above any model here; the trainer's ids are 32-bit
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SAMPLE_FILE = "verify_sample.txt"
SAMPLE_DOCS = 32
SAMPLE_CHARS_PER_DOC = 2048
ENCODERS = ("auto", "tiktoken", "hf")


def canonical_json_bytes(obj) -> bytes:
    """JSON with sorted keys and no insignificant whitespace: the same object always gives the same bytes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def tokenizer_hash(tokenizer_json: str) -> str:
    """sha256 of a tokenizer.json's canonical form."""
    return hashlib.sha256(canonical_json_bytes(json.loads(tokenizer_json))).hexdigest()


def new_byte_level_bpe():
    """An untrained HF tokenizer: GPT-4-style split, then byte-level mapping without prefix space."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


class TrainedTokenizer:
    """A loaded tokenizer directory: HF tokenizer (parsed on first use), optional tiktoken encoder, special ids and
    content hash."""

    def __init__(self, directory: Path, tokenizer_json: str, vocab: dict[str, int], config: dict):
        self.directory = directory
        self.config = config
        self.vocab = vocab
        self.fast = None
        self.fast_problem: str | None = None
        self.hash: str = config["hash"]
        self.vocab_size: int = max(vocab.values()) + 1   # ids are 0..vocab_size-1
        self.bos_id, self.eos_id, self.pad_id = (vocab[t] for t in SPECIAL_TOKENS)
        self._tokenizer_json = tokenizer_json
        self._hf = None

    @property
    def hf(self):
        """The HF tokenizer (specials inside text are encoded as plain text)."""
        if self._hf is None:
            from tokenizers import Tokenizer

            self._hf = Tokenizer.from_str(self._tokenizer_json)
            self._hf.encode_special_tokens = True
        return self._hf

    @property
    def encoder_name(self) -> str:
        """"tiktoken" when the fast encoder is in use, "hf" otherwise."""
        return "tiktoken" if self.fast is not None else "hf"

    @property
    def token_dtype(self):
        """The smallest unsigned dtype that holds every id."""
        return np.uint16 if self.vocab_size <= 65536 else np.uint32

    def encode_hf(self, text: str) -> list[int]:
        """Ids from HF tokenizers (specials in the text are plain text)."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode(self, text: str) -> list[int]:
        """Ids of a document's text, without BOS/EOS, from the fast encoder when verified."""
        if self.fast is not None:
            return self.fast.encode_ordinary(text)
        return self.encode_hf(text)

    def encode_to_array(self, text: str) -> np.ndarray:
        """encode() as a numpy array of `token_dtype`."""
        return np.asarray(self.encode(text), dtype=self.token_dtype)

    def decode(self, ids) -> str:
        """Text of a list of ids; special tokens are shown as their text, broken UTF-8 as U+FFFD."""
        ids = [int(i) for i in ids]
        if self.fast is not None:
            return self.fast.decode(ids, errors="replace")
        return self.hf.decode(ids, skip_special_tokens=False)

    def verify_fast_encoder(self, texts) -> str | None:
        """None when the fast encoder gives HF's ids on every text, else the first difference."""
        if self.fast is None:
            return "no fast encoder"
        return first_disagreement(self.encode_hf, self.fast.encode_ordinary, texts)


def _training_sample(texts: list[str]) -> str:
    """Up to SAMPLE_DOCS evenly spaced slices of the training documents (for verifying the fast encoder)."""
    if not texts:
        return ""
    step = max(1, len(texts) // SAMPLE_DOCS)
    return "\n".join(t[:SAMPLE_CHARS_PER_DOC] for t in texts[::step][:SAMPLE_DOCS])


def _read_training_texts(input_dir, glob: str, max_bytes: int | None, progress: bool):
    """Documents for training plus a summary of what was read and skipped."""
    from tqdm import tqdm

    sources = list_source_files(input_dir, glob)
    texts, summary = [], {"files": 0, "text_bytes": 0, "skipped": {}, "replaced_bytes": 0}
    bar = tqdm(total=sum(s.size for s in sources), unit="B", unit_scale=True, desc="reading", disable=not progress)
    for doc in iter_documents(input_dir, sources, DEFAULT_MAX_INVALID_FRACTION):
        bar.update(doc.size)
        if doc.skip_reason:
            summary["skipped"][doc.skip_reason] = summary["skipped"].get(doc.skip_reason, 0) + 1
            continue
        summary["replaced_bytes"] += doc.replaced_bytes  # only text that is trained on
        texts.append(doc.text)
        summary["files"] += 1
        summary["text_bytes"] += doc.size
        if max_bytes is not None and summary["text_bytes"] >= max_bytes:
            break
    bar.close()
    return texts, summary


def _check_output_dir(output_dir: Path, overwrite: bool) -> None:
    """Refuse to replace an existing tokenizer unless asked to (checked before any work; files are replaced when
    the new tokenizer is written)."""
    if output_dir.exists() and not output_dir.is_dir():
        raise TokenizerError(f"--output {output_dir} is a file, not a directory",
                             "pass a directory for --output (it is created when missing)")
    if ((output_dir / TOKENIZER_FILE).exists() or (output_dir / CONFIG_FILE).exists()) and not overwrite:
        raise TokenizerError(f"{output_dir} already holds a tokenizer", "choose another --output or pass --overwrite")


def train_tokenizer(input_dir, output_dir, vocab_size: int = DEFAULT_VOCAB_SIZE, glob: str = "*",
                    max_bytes: int | None = None, min_frequency: int = 0, overwrite: bool = False,
                    progress: bool = True) -> TrainedTokenizer:
    """Train a byte-level BPE on the documents of `input_dir`, save it to `output_dir` and load it back."""
    check_training_options(vocab_size, min_frequency, output_dir, overwrite)
    if max_bytes is not None and max_bytes < 1:
        raise TokenizerError(f"--max-bytes must be at least 1, got {max_bytes}",
                             "pass a positive number of bytes, or leave --max-bytes out to read everything")
    texts, summary = _read_training_texts(input_dir, glob, max_bytes, progress)
    if not texts:
        raise EmptyCorpusError(f"no usable text in {input_dir} (skipped: {summary['skipped']})",
                               "point --input at a directory of UTF-8 text files")
    return train_on_texts(texts, summary, output_dir, vocab_size, min_frequency, progress)


def check_training_options(vocab_size: int, min_frequency: int, output_dir, overwrite: bool) -> None:
    """The checks every training does before reading anything."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise TokenizerError(f"vocab size {vocab_size} is below {MIN_VOCAB_SIZE} (256 bytes + 3 specials)",
                             f"pass --vocab-size {MIN_VOCAB_SIZE} or more")
    if vocab_size > MAX_VOCAB_SIZE:
        raise TokenizerError(f"vocab size {vocab_size} is above {MAX_VOCAB_SIZE}",
                             "pass a --vocab-size such as 32768 (the reference models) or 4096 (parcae-tiny)")
    if min_frequency < 0:
        raise TokenizerError(f"--min-frequency must be >= 0, got {min_frequency}", "pass 0 (the default) or more")
    _check_output_dir(Path(output_dir), overwrite)


def train_on_texts(texts: list[str], summary: dict, output_dir, vocab_size: int, min_frequency: int,
                   progress: bool) -> TrainedTokenizer:
    """Train on `texts`, save with `summary` as the training corpus record, and load it back."""
    from tokenizers import pre_tokenizers, trainers

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    hf = new_byte_level_bpe()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS), show_progress=_terminal_bars(progress),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tokenizer_json = hf.to_str()
    config = {
        "format": "megaloop-data_prep-tokenizer", "format_version": 1, "data_prep_version": __version__,
        "kind": "byte-level BPE", "requested_vocab_size": vocab_size, "vocab_size": hf.get_vocab_size(),
        "split_pattern": SPLIT_PATTERN, "add_prefix_space": False,
        "special_tokens": {tok: hf.token_to_id(tok) for tok in SPECIAL_TOKENS},
        "min_frequency": min_frequency, "training_corpus": summary, "hash": tokenizer_hash(tokenizer_json),
    }
    (output_dir / TOKENIZER_FILE).write_text(tokenizer_json, encoding="utf-8")
    (output_dir / SAMPLE_FILE).write_text(_training_sample(texts), encoding="utf-8")
    (output_dir / CONFIG_FILE).write_text(json.dumps(config, indent=1, sort_keys=True, ensure_ascii=False) + "\n",
                                          encoding="utf-8")
    return load_tokenizer(output_dir)


def _terminal_bars(progress: bool) -> bool:
    """The trainer's own bars only on a terminal: elsewhere (a pipe, a log file) they are blank lines on stdout."""
    import sys

    return progress and sys.stdout.isatty() and sys.stderr.isatty()


def _read_tokenizer_files(directory: Path) -> tuple[str, dict, dict]:
    """tokenizer.json text and parsed content, and the config, after checking the hash still matches."""
    tok_path, cfg_path = directory / TOKENIZER_FILE, directory / CONFIG_FILE
    for path in (tok_path, cfg_path):
        if not path.is_file():
            raise TokenizerError(f"tokenizer directory {directory} has no {path.name}",
                                 "pass the directory written by `python -m data_prep tokenizer`")
    tokenizer_json = tok_path.read_text(encoding="utf-8")
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
        content = json.loads(tokenizer_json)
    except json.JSONDecodeError as err:
        raise TokenizerError(f"{directory}: a tokenizer file is not valid JSON ({err})",
                             "re-train the tokenizer or restore its files") from err
    actual = hashlib.sha256(canonical_json_bytes(content)).hexdigest()
    if config.get("hash") != actual:
        raise TokenizerMismatchError(
            f"{tok_path} changed after training: its hash is {actual[:16]}..., {CONFIG_FILE} records "
            f"{str(config.get('hash'))[:16]}...", "restore the original tokenizer files or re-train the tokenizer")
    return tokenizer_json, content, config


def _vocabulary(content: dict, directory: Path) -> dict[str, int]:
    """token -> id from a parsed tokenizer.json (model vocabulary plus added tokens); checks the specials."""
    try:
        vocab = dict(content["model"]["vocab"])
        vocab.update({t["content"]: t["id"] for t in content.get("added_tokens", [])})
    except (KeyError, TypeError) as err:
        raise TokenizerError(f"{directory / TOKENIZER_FILE} is not a BPE tokenizer ({err})",
                             "train one with `python -m data_prep tokenizer`") from err
    missing = [t for t in SPECIAL_TOKENS if t not in vocab]
    if missing:
        raise TokenizerError(f"{directory} lacks the special tokens {missing}",
                             "train the tokenizer with `python -m data_prep tokenizer`")
    return vocab


def load_tokenizer(directory, encoder: str = "auto", verify: bool = True) -> TrainedTokenizer:
    """Load a tokenizer directory. encoder: "auto" (tiktoken when it matches HF on the verification sample, HF
    otherwise), "tiktoken" (error unless it matches) or "hf". verify=False skips that check (for worker processes
    whose parent already made it)."""
    if encoder not in ENCODERS:
        raise TokenizerError(f"unknown encoder {encoder!r}", f"use one of {ENCODERS}")
    directory = Path(directory)
    tokenizer_json, content, config = _read_tokenizer_files(directory)
    tok = TrainedTokenizer(directory, tokenizer_json, _vocabulary(content, directory), config)
    if encoder == "hf":
        return tok
    specials = {t: tok.vocab[t] for t in SPECIAL_TOKENS}
    if content["model"].get("type") != "BPE":  # e.g. data_prep synth's word-level vocabulary: HF encodes it
        tok.fast_problem = f"no fast encoder for a {content['model'].get('type')} tokenizer"
    else:
        try:
            tok.fast = build_tiktoken_encoding(f"data_prep-{tok.hash[:12]}", tok.vocab, specials, SPLIT_PATTERN)
        except (ValueError, KeyError) as err:
            tok.fast_problem = f"cannot build the fast encoder: {err}"
    if tok.fast is not None and verify:
        sample_path = directory / SAMPLE_FILE
        samples = [EDGE_CASE_SAMPLE] + ([sample_path.read_text(encoding="utf-8")] if sample_path.is_file() else [])
        tok.fast_problem = tok.verify_fast_encoder(samples)
        if tok.fast_problem:
            tok.fast = None
    if encoder == "tiktoken" and tok.fast is None:
        raise TokenizerError(f"the fast encoder does not match HF for {directory}: {tok.fast_problem}",
                             "use encoder 'auto' or 'hf'")
    return tok


def copy_tokenizer_files(tok: TrainedTokenizer, destination) -> None:
    """Copy the tokenizer's files into `destination` (so a shard directory is self-describing)."""
    destination = Path(destination)
    destination.mkdir(parents=True, exist_ok=True)
    for name in (TOKENIZER_FILE, CONFIG_FILE, SAMPLE_FILE):
        source = tok.directory / name
        if source.is_file():
            shutil.copyfile(source, destination / name)
            os.chmod(destination / name, 0o644)
