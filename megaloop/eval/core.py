"""CORE (DCLM's in-context-learning suite) on the task files of a local folder, at one fixed depth T.

Tasks, few-shot counts and delimiters come from the folder's tasks_v0.3.yaml; a task with several few-shot counts
gives one task per count, named `<label>_<k>shot`. Three formats are scored:

- multiple choice {"query", "choices", "gold"}: context = few-shot examples + query + continuation delimiter, one
  continuation per choice; the prediction is the choice with the highest MEAN log-probability per token;
- schema {"context_options", "continuation", "gold"}: one context per option, the same continuation; the prediction
  is the option under which the continuation is most likely (mean log-probability per token);
- language modelling {"context", "continuation"}: correct when greedy decoding reproduces the continuation exactly
  (every continuation token is the argmax).

A few-shot example is rendered as the scored example with its gold answer, examples joined by the example
delimiter ("\\n"), the default continuation delimiter is " ". Trailing spaces of a context move to the front of the
continuation ("Answer: " + "Paris" is scored as "Answer:" + " Paris"), as BPE tokenizers attach a space to the word
after it. The k few-shot examples of example i are drawn without replacement from the task's other examples by a
generator seeded with (seed, i): the same prompts every run and on any number of processes.

Centered accuracy rescales accuracy so that chance is 0 and perfect is 1:

    centered = (accuracy - chance) / (1 - chance)

Task files in the folder that tasks_v0.3.yaml does not list (bigbench_language_identification and
bigbench_repeat_copy_logic here, both in DCLM's CORE) are scored too: their format is read from their fields,
with the default delimiters and UNLISTED_SHOTS few-shot examples (DCLM's CORE count for both).

with chance computed from the data: the mean over examples of 1 / (number of choices) for multiple choice, of
1 / (number of context options) for schema, and 0 for language modelling. Accuracy has a 95% Wilson score interval,
mapped through the same formula. CORE is the mean centered accuracy over the tasks scored; its interval is
+-1.96 sqrt(sum se_i^2) / n from the per-task standard errors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megaloop.eval.checkpoint import EvalInputError
from megaloop.eval.scoring import Scorer

FORMATS = {"multiple_choice": "multiple_choice", "schema": "schema", "language_modeling": "language_modeling"}
TASKS_FILE = "tasks_v0.3.yaml"
URI_PREFIX = "eval/local_data/"
Z95 = 1.959963984540054
UNLISTED_SHOTS = 10


@dataclass(frozen=True)
class TaskSpec:
    name: str
    label: str
    file: str  # relative to the CORE folder
    kind: str  # multiple_choice | schema | language_modeling
    shots: int
    continuation_delimiter: str = " "
    example_delimiter: str = "\n"


@dataclass
class TaskResult:
    name: str
    kind: str
    shots: int
    examples: int
    correct: int
    chance: float
    extra: dict = field(default_factory=dict)

    @property
    def accuracy(self) -> float:
        return self.correct / self.examples

    def interval(self) -> tuple[float, float]:
        return wilson(self.correct, self.examples)

    def to_dict(self) -> dict:
        low, high = self.interval()
        c_low, c_high = centered(low, self.chance), centered(high, self.chance)
        return {"format": self.kind, "shots": self.shots, "examples": self.examples, "accuracy": self.accuracy,
                "ci_low": low, "ci_high": high, "chance": self.chance,
                "centered": centered(self.accuracy, self.chance), "centered_ci_low": c_low,
                "centered_ci_high": c_high, **self.extra}


def centered(accuracy: float, chance: float) -> float:
    """(accuracy - chance) / (1 - chance): 0 at chance, 1 when every answer is right."""
    return (accuracy - chance) / (1.0 - chance)


def wilson(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95% by default)."""
    if n == 0:
        return float("nan"), float("nan")
    p = correct / n
    denom = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (0.0 if correct == 0 else max(0.0, mid - half)), (1.0 if correct == n else min(1.0, mid + half))


def read_tasks(core_dir) -> tuple[list[TaskSpec], list[str], list[str]]:
    """(the scorable tasks whose file is present, the names listed but absent, the names of other formats)."""
    import yaml

    core_dir = Path(core_dir)
    try:
        listed = yaml.safe_load((core_dir / TASKS_FILE).read_text())["icl_tasks"]
    except (OSError, KeyError, TypeError, yaml.YAMLError) as err:
        raise EvalInputError(f"{core_dir / TASKS_FILE}: cannot read the CORE task list ({err}); give --core-dir, "
                             "a folder holding tasks_v0.3.yaml and the task files") from None
    present, missing, other = [], [], []
    for entry in listed:
        shots = list(entry.get("num_fewshot", [0]))
        for k in shots:
            name = entry["label"] if len(shots) == 1 else f"{entry['label']}_{k}shot"
            kind = entry.get("icl_task_type")
            if kind not in FORMATS:
                other.append(name)
                continue
            rel = entry["dataset_uri"].removeprefix(URI_PREFIX)
            if not (core_dir / rel).is_file():
                missing.append(name)
                continue
            present.append(TaskSpec(name, entry["label"], rel, kind, int(k),
                                    entry.get("continuation_delimiter", " "), entry.get("example_delimiter", "\n")))
    listed_files = {e["dataset_uri"].removeprefix(URI_PREFIX) for e in listed}
    for path in sorted(core_dir.rglob("*.jsonl")):
        rel = path.relative_to(core_dir).as_posix()
        kind = None if rel in listed_files else _format_of(path)
        if kind is not None:
            present.append(TaskSpec(path.stem, path.stem, rel, kind, UNLISTED_SHOTS))
    return present, missing, other


def _format_of(path: Path) -> str | None:
    """The format of an unlisted task file from its first record's fields (None: not one of the three)."""
    import json

    with open(path, encoding="utf-8") as f:
        first = json.loads(f.readline() or "{}")
    if {"query", "choices", "gold"} <= first.keys():
        return "multiple_choice"
    if {"context_options", "continuation", "gold"} <= first.keys():
        return "schema"
    if {"context", "continuation"} <= first.keys():
        return "language_modeling"
    return None


def read_examples(core_dir, spec: TaskSpec, limit: int | None = None) -> list[dict]:
    import json

    with open(Path(core_dir) / spec.file, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows if limit is None else rows[:limit]


def fewshot_indices(n: int, i: int, k: int, seed: int) -> list[int]:
    """k distinct indices of the task's other examples for example i, from a generator seeded with (seed, i)."""
    if k == 0 or n < 2:
        return []
    rng = np.random.default_rng([seed, i])
    picks = rng.choice(n - 1, size=min(k, n - 1), replace=False)
    return [int(j) + (j >= i) for j in picks]


def _shot(spec: TaskSpec, ex: dict) -> str:
    cd = spec.continuation_delimiter
    if spec.kind == "multiple_choice":
        return f"{ex['query']}{cd}{ex['choices'][ex['gold']]}"
    if spec.kind == "schema":
        return f"{ex['context_options'][ex['gold']]}{cd}{ex['continuation']}"
    return f"{ex['context']}{cd}{ex['continuation']}"


def _split_space(context: str, continuation: str) -> tuple[str, str]:
    stripped = context.rstrip(" ")
    return stripped, context[len(stripped):] + continuation


def prompts(spec: TaskSpec, examples: list[dict], i: int, seed: int, pool: list[dict] | None = None
            ) -> list[tuple[str, str]]:
    """The (context, continuation) strings example i is scored on: one per choice / context option, or one for a
    language-modelling example. Few-shot examples come from `pool` (default: `examples`)."""
    pool = examples if pool is None else pool
    ex = examples[i]
    prefix = "".join(_shot(spec, pool[j]) + spec.example_delimiter
                     for j in fewshot_indices(len(pool), i, spec.shots, seed))
    cd = spec.continuation_delimiter
    if spec.kind == "multiple_choice":
        return [_split_space(prefix + ex["query"] + cd, c) for c in ex["choices"]]
    if spec.kind == "schema":
        return [_split_space(prefix + option + cd, ex["continuation"]) for option in ex["context_options"]]
    return [_split_space(prefix + ex["context"] + cd, ex["continuation"])]


def chance(spec: TaskSpec, examples: list[dict]) -> float:
    if spec.kind == "multiple_choice":
        return float(np.mean([1.0 / len(ex["choices"]) for ex in examples]))
    if spec.kind == "schema":
        return float(np.mean([1.0 / len(ex["context_options"]) for ex in examples]))
    return 0.0


def judge(spec: TaskSpec, example: dict, scores) -> bool:
    """Whether the scores of one example's prompts (scoring.Score, in prompt order) make it correct."""
    if spec.kind == "language_modeling":
        return scores[0].greedy
    means = [s.mean_logprob for s in scores]
    return int(np.argmax(means)) == int(example["gold"])


def score_task(scorer: Scorer, tokenizer, spec: TaskSpec, examples: list[dict], seed: int, progress=None,
               pool: list[dict] | None = None) -> TaskResult:
    per_example = [prompts(spec, examples, i, seed, pool) for i in range(len(examples))]
    requests = [(tokenizer.encode(c), tokenizer.encode(x)) for ps in per_example for c, x in ps]
    scores = scorer.score(requests, progress)
    correct, at = 0, 0
    for ex, ps in zip(examples, per_example):
        correct += judge(spec, ex, scores[at:at + len(ps)])
        at += len(ps)
    return TaskResult(spec.name, spec.kind, spec.shots, len(examples), correct, chance(spec, examples))


def aggregate(results: list[TaskResult]) -> dict:
    """CORE: the mean centered accuracy over the scored tasks, with its interval."""
    if not results:
        return {"core": float("nan"), "ci_low": float("nan"), "ci_high": float("nan"), "tasks": 0}
    values = [centered(r.accuracy, r.chance) for r in results]
    ses = [(centered(r.interval()[1], r.chance) - centered(r.interval()[0], r.chance)) / (2 * Z95) for r in results]
    mean = float(np.mean(values))
    half = Z95 * math.sqrt(sum(s * s for s in ses)) / len(results)
    return {"core": mean, "ci_low": mean - half, "ci_high": mean + half, "tasks": len(results)}


def lambada(scorer: Scorer, tokenizer, examples: list[dict], progress=None) -> dict:
    """LAMBADA: last-word accuracy (greedy exact match of the continuation) and perplexity exp(-mean log p of the
    continuation), with the accuracy's Wilson interval."""
    requests = [tuple(tokenizer.encode(s) for s in _split_space(ex["context"] + " ", ex["continuation"]))
                for ex in examples]
    scores = scorer.score(requests, progress)
    correct = sum(s.greedy for s in scores)
    low, high = wilson(correct, len(scores))
    return {"examples": len(scores), "accuracy": correct / len(scores), "ci_low": low, "ci_high": high,
            "perplexity": math.exp(-float(np.mean([s.logprob for s in scores])))}
