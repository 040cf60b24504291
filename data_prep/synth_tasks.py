"""Synthetic reasoning tasks whose answer needs k sequential steps, for measuring what loop depth buys.

A task has a fixed vocabulary (the same whatever hops, rows or seed a dataset is made with, so that every dataset of
one task shares one tokenizer and a model trained on one can be evaluated on another) and makes rows from a numpy
Generator. A row is

    <|bos|> [context] query query ... [<|eos|> <|pad|> ...]

filled with as many queries as fit in row_len tokens (each query's difficulty drawn uniformly from the hops range,
so difficulties mix within a row); a query's last token is its answer, one token. Most of a row's tokens are not
answers: the context and the question parts of the queries.

- khop: the context is a random single cycle through n symbols (letters), written as its pairs in random order,
  "c > h a > f ... |"; a query "x k = y" asks for the symbol k pointer steps from x. A single cycle has no fixed
  point and no short cycle, so y != x for every k < n and no answer can be read off without following the chain.
- modarith: no context; a query "x op op ... = y" applies k operations (+a, -a, *m with m != 0) modulo the prime
  modulus p to the start value x. Mixing multiplication with addition makes the steps non-commutative, so the answer
  is not a sum that could be gathered in one step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|unk|>")  # ids 0, 1, 2, 3
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2


@dataclass
class Row:
    """One row: tokens [row_len], answer positions and the hops of each query (in row order), and the key of its
    context (bytes; None for a task without one)."""

    tokens: np.ndarray
    positions: np.ndarray
    hops: np.ndarray
    key: bytes | None


class Task:
    """What every task shares: token ids looked up by name in its vocabulary."""

    name = ""

    def vocabulary(self) -> list[str]:
        raise NotImplementedError

    def ids(self, *tokens: str) -> list[int]:
        """The ids of `tokens` (the position of each in the vocabulary)."""
        index = {t: i for i, t in enumerate(self.vocabulary())}
        return [index[t] for t in tokens]


class KHop(Task):
    """Pointer chasing over a random single cycle through the first `symbols` letters (see the module docstring).
    Hop counts run to symbols - 1, so that no query wraps round the cycle back to its start. There are
    (symbols - 1)! distinct tables (8 letters: 5040), which bounds how many train rows leave unseen tables for val."""

    QUERY_TOKENS = 4       # x k = y

    def __init__(self, name: str = "khop", symbols: int = 8):
        if not 3 <= symbols <= 26:
            raise ValueError(f"a khop table has 3 to 26 symbols (letters), not {symbols}")
        self.name, self.n_symbols, self.max_hops = name, symbols, symbols - 1
        self.letters = tuple("abcdefghijklmnopqrstuvwxyz"[:symbols])

    def vocabulary(self) -> list[str]:
        """Every token of the task, in id order: specials, > | =, the letters, hop counts 1..max_hops."""
        return [*SPECIAL_TOKENS, ">", "|", "=", *self.letters, *(str(k) for k in range(1, self.max_hops + 1))]

    def parameters(self) -> dict:
        """The task's fixed sizes, as recorded in the manifest."""
        return {"symbols": self.n_symbols, "max_hops": self.max_hops, "table": "single cycle through the symbols",
                "distinct_tables": self.distinct_tables()}

    def distinct_tables(self) -> int:
        """How many different tables rows can hold."""
        return math.factorial(self.n_symbols - 1)

    def context_tokens(self) -> int:
        """Tokens of the context after BOS: three per pair and the separator."""
        return 3 * self.n_symbols + 1

    def max_query_tokens(self, hops: int) -> int:
        """Tokens of the longest query of `hops` steps (the same for every k here)."""
        return self.QUERY_TOKENS

    def row(self, rng: np.random.Generator, hops: tuple[int, int], row_len: int) -> Row:
        """A table and as many queries as fit."""
        n = self.n_symbols
        arrow, bar, equals, letter, hop1 = self.ids(">", "|", "=", "a", "1")   # letter i: id letter + i
        cycle = rng.permutation(n)                                         # the letters in cycle order
        successor = np.empty(n, dtype=np.int64)
        successor[cycle] = np.roll(cycle, -1)
        order = rng.permutation(cycle)                                     # the pairs' order in the table
        table = np.stack([letter + order, np.full(n, arrow), letter + successor[order]], axis=1).ravel()
        start = 1 + self.context_tokens()
        count = (row_len - start) // self.QUERY_TOKENS
        k = rng.integers(hops[0], hops[1] + 1, size=count)
        place = rng.integers(0, n, size=count)                             # each query's start: a place on the cycle
        x, y = cycle[place], cycle[(place + k) % n]
        queries = np.stack([letter + x, hop1 - 1 + k, np.full(count, equals), letter + y], axis=1).ravel()
        body = np.concatenate([[BOS_ID], table, [bar], queries])
        positions = start + self.QUERY_TOKENS * np.arange(count) + 3
        return Row(finish_row(body, row_len), positions, k, successor.astype(np.uint8).tobytes())


class ModArith(Task):
    """k operations modulo the prime `modulus` applied to a start value (see the module docstring); at most
    `max_hops` operations."""

    def __init__(self, name: str = "modarith", modulus: int = 7, max_hops: int = 16):
        self.name, self.modulus, self.max_hops = name, modulus, max_hops

    def vocabulary(self) -> list[str]:
        """Every token of the task, in id order: specials, "=", the values, then +a, -a and *m."""
        p = self.modulus
        return [*SPECIAL_TOKENS, "=", *(str(v) for v in range(p)), *(f"+{a}" for a in range(p)),
                *(f"-{a}" for a in range(p)), *(f"*{m}" for m in range(1, p))]

    def parameters(self) -> dict:
        """The task's fixed sizes, as recorded in the manifest."""
        return {"modulus": self.modulus, "max_hops": self.max_hops, "operations": ["+a", "-a", "*m (m != 0)"]}

    def context_tokens(self) -> int:
        """No context: queries follow BOS."""
        return 0

    def max_query_tokens(self, hops: int) -> int:
        """x, k operations, =, y."""
        return hops + 3

    def row(self, rng: np.random.Generator, hops: tuple[int, int], row_len: int) -> Row:
        """As many queries as fit after BOS."""
        k, x, kinds, operands = self._draw(rng, hops, row_len)
        y = self._apply(x, k, kinds, operands)
        equals, zero = self.ids("=", "0")                                   # value v: zero + v
        pieces, positions, at = [[BOS_ID]], [], 1
        for q, first in enumerate(_starts(k)):
            ops = self._op_ids(kinds[first:first + k[q]], operands[first:first + k[q]])
            pieces.append(np.concatenate([[zero + x[q]], ops, [equals, zero + y[q]]]))
            at += len(pieces[-1])
            positions.append(at - 1)
        return Row(finish_row(np.concatenate(pieces), row_len), np.array(positions, dtype=np.int64), k, None)

    def _draw(self, rng: np.random.Generator, hops: tuple[int, int], row_len: int):
        """(operations per query, start values, each operation's kind and operand) of the queries that fit."""
        k = rng.integers(hops[0], hops[1] + 1, size=row_len // 4)          # more than can fit
        k = k[:int(np.searchsorted(np.cumsum(k + 3), row_len - 1, side="right"))]
        x = rng.integers(0, self.modulus, size=len(k))
        kinds = rng.integers(0, 3, size=int(k.sum()))
        operands = rng.integers(0, self.modulus, size=int(k.sum()))
        operands[kinds == 2] = rng.integers(1, self.modulus, size=int((kinds == 2).sum()))
        return k, x, kinds, operands

    def _op_ids(self, kinds: np.ndarray, operands: np.ndarray) -> np.ndarray:
        """Token ids of operations (kind 0: +a, 1: -a, 2: *m; each kind's tokens are consecutive in the vocabulary)."""
        plus, minus, times = self.ids("+0", "-0", "*1")
        return np.choose(kinds, [plus + operands, minus + operands, times + operands - 1])

    def _apply(self, x: np.ndarray, k: np.ndarray, kinds: np.ndarray, operands: np.ndarray) -> np.ndarray:
        """Each query's value after its operations, one step at a time over all queries."""
        p, value, first = self.modulus, x.copy(), _starts(k)
        for step in range(int(k.max(initial=0))):
            live = k > step
            kind, operand = kinds[first[live] + step], operands[first[live] + step]
            v = value[live]
            value[live] = np.where(kind == 0, v + operand, np.where(kind == 1, v - operand, v * operand)) % p
        return value


def _starts(k: np.ndarray) -> np.ndarray:
    """Where each query's operations start in the flat arrays of all operations."""
    return np.concatenate([[0], np.cumsum(k)[:-1]]).astype(int)


def finish_row(body: np.ndarray, row_len: int) -> np.ndarray:
    """`body` followed by EOS (when there is room) and PAD up to row_len tokens, as uint16."""
    row = np.full(row_len, PAD_ID, dtype=np.uint16)
    row[:len(body)] = body
    if len(body) < row_len:
        row[len(body)] = EOS_ID
    return row


# khop: 8 symbols, the size a CPU-scale model (parcae-tiny) learns 1 and 2 hops of in a few hundred steps;
# khop10 and khop16: longer tables (lower chance, far more distinct tables), harder
TASKS = {task.name: task for task in (KHop("khop", 8), KHop("khop10", 10), KHop("khop16", 16), ModArith())}
