"""A tiktoken Encoding built from a trained byte-level BPE, and the check that it agrees with HF tokenizers.

HF's byte-level BPE stores each token as a string of "visible" characters, one per byte, using GPT-2's table that
maps the 256 byte values onto printable unicode characters. Inverting that table turns every vocabulary entry back
into its bytes; with rank = token id (ids grow in merge order) tiktoken's greedy lowest-rank merging reproduces HF's
merges. The two can still disagree in rare corner cases, so the fast encoder is only used after it has produced
identical ids on a sample.
"""
from __future__ import annotations

from functools import lru_cache

EDGE_CASE_SAMPLE = (
    "Hello, world! It's 2024; we've 1234567 items (12.5%) at $3,000.99 - don't panic.\n"
    "I'M SHOUTING, you'll SEE. They'd've gone.\n\n\n"
    "    indented\tline with\ttabs   and trailing spaces   \n"
    "naïve café, Straße, ÅNGSTRÖM, 日本語のテキスト, Ελληνικά, русский текст, עברית, العربية 🙂👍🏽\n"
    "numbers: 0 00 000 0000 3.14159 1e-10 ٣٤٥ ⅷ ², ids: a1b2c3, x_y-z.\n"
    "a literal special token <|eos|> and <|bos|><|pad|> stays text\n"
    "symbols: <<>> {[()]} ... --- ''' \"\"\" @#$%^&*~`|\\ \u00a0nbsp \u2028sep \ufeffbom \ufffd\n"
    "   \n \n\n   x\n"
)


@lru_cache(maxsize=1)
def unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode table: visible character -> byte value."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1))
                 + list(range(ord("\u00ae"), ord("\u00ff") + 1)))
    mapping = {chr(b): b for b in printable}
    shifted = 0
    for byte in range(256):
        if byte not in printable:
            mapping[chr(256 + shifted)] = byte
            shifted += 1
    return mapping


def token_bytes(visible: str) -> bytes:
    """The bytes of one byte-level BPE vocabulary entry."""
    table = unicode_to_byte()
    return bytes(table[ch] for ch in visible)


def build_tiktoken_encoding(name: str, vocab: dict[str, int], special_tokens: dict[str, int], pattern: str):
    """A tiktoken Encoding with mergeable rank = HF id for ordinary tokens and the specials kept separate."""
    import tiktoken

    ranks = {token_bytes(tok): idx for tok, idx in vocab.items() if tok not in special_tokens}
    if len(set(ranks)) != len(ranks):
        raise ValueError("two vocabulary entries map to the same bytes")
    return tiktoken.Encoding(name=name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=dict(special_tokens))


def first_disagreement(hf_encode, fast_encode, texts) -> str | None:
    """None when both encoders give identical ids on every text, else a short description of the first mismatch."""
    for number, text in enumerate(texts):
        hf_ids = list(hf_encode(text))
        fast_ids = list(fast_encode(text))
        if hf_ids != fast_ids:
            at = next((i for i, (a, b) in enumerate(zip(hf_ids, fast_ids)) if a != b), min(len(hf_ids), len(fast_ids)))
            return (f"sample text {number}: ids differ at position {at} "
                    f"(HF {hf_ids[at:at + 4]}, fast {fast_ids[at:at + 4]})")
    return None
