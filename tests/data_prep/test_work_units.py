"""Greedy grouping of pieces into work units, and unit keys that change exactly when their inputs do."""
from __future__ import annotations

from dataclasses import replace

from data_prep.inputs import InputFile
from data_prep.units import options_fingerprint, plan_units


def _file(name, size=100, mtime=1):
    return InputFile(name, f"/x/{name}", size, mtime, "text", None)


def _layout(units):
    return [[(r.file.name, r.first, r.stop) for r in u.ranges] for u in units]


def test_pieces_are_grouped_greedily_in_order():
    a, b, c = _file("a"), _file("b"), _file("c")
    units = plan_units([(a, [40]), (b, [30, 30, 50]), (c, [200])], unit_bytes=100, fingerprint="f")
    # a+b0+b1 = 100 fits; b2 = 50 starts a new unit; c (200) is larger than the budget: a unit of its own
    assert _layout(units) == [[("a", 0, 1), ("b", 0, 2)], [("b", 2, 3)], [("c", 0, 1)]]
    assert [u.size for u in units] == [100, 50, 200]
    assert [u.index for u in units] == [0, 1, 2]


def test_keys_change_only_with_their_inputs_or_options():
    a, b = _file("a"), _file("b")
    fp = options_fingerprint({"seq_len": 8, "tokenizer": "h"})
    base = plan_units([(a, [60]), (b, [60])], 100, fp)
    assert len({u.key for u in base}) == 2
    assert [u.key for u in plan_units([(a, [60]), (b, [60])], 100, fp)] == [u.key for u in base]
    touched = plan_units([(a, [60]), (replace(b, mtime_ns=2), [60])], 100, fp)
    assert touched[0].key == base[0].key and touched[1].key != base[1].key
    other = plan_units([(a, [60]), (b, [60])], 100, options_fingerprint({"seq_len": 16, "tokenizer": "h"}))
    assert all(o.key != u.key for o, u in zip(other, base))
