"""Document filters of `data_prep shards`: --min-chars and --filter 'FIELD>=VALUE' on a numeric metadata column
(e.g. FineWeb-Edu's `int_score>=3`). A filtered document is skipped and counted under its filter's reason."""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass

from .errors import DataPrepError

OPS = {">=": operator.ge, "<=": operator.le, "==": operator.eq, "!=": operator.ne, ">": operator.gt, "<": operator.lt}
_FILTER = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*(>=|<=|==|!=|>|<)\s*(-?[0-9.eE+-]+)\s*$")


@dataclass(frozen=True)
class FieldFilter:
    """Keep a document when `field op value` holds for its (numeric) metadata field."""

    field: str
    op: str
    value: float

    @property
    def text(self) -> str:
        return f"{self.field}{self.op}{self.value:g}"

    def keeps(self, meta: dict, where: str) -> bool:
        got = meta.get(self.field)
        if got is None:
            return False
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            raise DataPrepError(f"{where}: field {self.field!r} of --filter {self.text} is a {type(got).__name__}, "
                                "not a number", "filter on a numeric column (e.g. int_score>=3)")
        return OPS[self.op](got, self.value)


def parse_filter(spec: str) -> FieldFilter:
    match = _FILTER.match(spec)
    if not match:
        raise DataPrepError(f"--filter {spec!r} is not FIELD OP NUMBER",
                            f"write e.g. --filter 'int_score>=3' (operators {' '.join(OPS)})")
    try:
        value = float(match.group(3))
    except ValueError:
        raise DataPrepError(f"--filter {spec!r}: {match.group(3)!r} is not a number", "compare with a number") from None
    return FieldFilter(match.group(1), match.group(2), value)


def skip_reason(text: str | None, meta: dict, min_chars: int, filters: tuple[FieldFilter, ...],
                where: str) -> str | None:
    """Why a readable document is filtered out, or None to keep it."""
    if min_chars and text is not None and len(text) < min_chars:
        return f"fewer than {min_chars} characters (--min-chars)"
    for rule in filters:
        if not rule.keeps(meta, where):
            return f"filtered out by {rule.text}"
    return None
