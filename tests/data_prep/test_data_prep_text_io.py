"""Reading text files: BOM, CRLF, invalid bytes (replaced and counted), binary/empty files, file order."""
from __future__ import annotations

import pytest

from data_prep.errors import EmptyCorpusError
from data_prep.text_io import (SKIP_BINARY, SKIP_EMPTY, SKIP_INVALID, decode_utf8_counting, list_source_files,
                               normalise_text, read_document)


def test_bom_and_line_ends_are_normalised():
    text, replaced = normalise_text(b"\xef\xbb\xbfone\r\ntwo\rthree\n\xef\xbb\xbfkept")
    assert text == "one\ntwo\nthree\n\ufeffkept"
    assert replaced == 0


@pytest.mark.parametrize("data, expected_text, expected_replaced", [
    (b"ok \xff end", "ok \ufffd end", 1),
    (b"\xc3(", "\ufffd(", 1),
    (b"a\xe2\x82b", "a\ufffdb", 2),                  # truncated 3-byte sequence: one U+FFFD for 2 bytes
    (b"\xff\xfe\xfd", "\ufffd\ufffd\ufffd", 3),
    (b"caf\xc3\xa9 \xf0\x9f\x99\x82", "café 🙂", 0),
    (b"end\xf0\x9f", "end\ufffd", 2),                # cut inside the last character
])
def test_invalid_bytes_are_replaced_and_counted(data, expected_text, expected_replaced):
    assert decode_utf8_counting(data) == (expected_text, expected_replaced)
    assert decode_utf8_counting(data)[0] == data.decode("utf-8", errors="replace")


def test_many_invalid_bytes_stay_linear():
    data = (b"x" * 50 + b"\xff") * 20000            # 1 MB with 20k stray bytes
    text, replaced = decode_utf8_counting(data)
    assert replaced == 20000 and text.count("\ufffd") == 20000


def test_listing_is_sorted_recursive_and_ignores_hidden(tmp_path):
    for name in ["b.txt", "a.txt", "sub/c.txt", ".hidden.txt", ".git/x.txt", "sub/d.md"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    assert [s.relpath for s in list_source_files(tmp_path)] == ["a.txt", "b.txt", "sub/c.txt", "sub/d.md"]
    assert [s.relpath for s in list_source_files(tmp_path, "*.txt")] == ["a.txt", "b.txt", "sub/c.txt"]


def test_empty_or_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(EmptyCorpusError, match="holds no file.*What to do"):
        list_source_files(tmp_path)
    with pytest.raises(EmptyCorpusError, match="does not exist"):
        list_source_files(tmp_path / "nope")


def test_binary_empty_and_garbage_files_are_skipped_with_a_reason(tmp_path):
    (tmp_path / "bin.dat").write_bytes(b"PK\x03\x04\x00\x00" + bytes(range(256)) * 4)
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "garbage.txt").write_bytes(bytes(range(128, 256)) * 10)
    (tmp_path / "good.txt").write_bytes(b"fine text \xff with one stray byte")
    docs = {s.relpath: read_document(tmp_path, s) for s in list_source_files(tmp_path)}
    assert docs["bin.dat"].skip_reason == SKIP_BINARY
    assert docs["empty.txt"].skip_reason == SKIP_EMPTY
    assert docs["garbage.txt"].skip_reason == SKIP_INVALID and docs["garbage.txt"].replaced_bytes == 1280
    assert docs["good.txt"].skip_reason is None and docs["good.txt"].replaced_bytes == 1
    assert docs["good.txt"].text == "fine text \ufffd with one stray byte"
