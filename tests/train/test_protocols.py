"""The trainer's interfaces (megaloop.train.protocols) against the classes that implement them.

Each implementation is checked member by member from the Protocol's own declarations: present on the class (or
annotated there, for an instance attribute set in __init__), a method where the Protocol declares a method (taking
its parameters, by name, with its defaults) and no method where it declares a value. isinstance against a
runtime_checkable Protocol would only look for the names, on an instance (which a parallel runtime cannot be made
without process groups). The Protocols must also list exactly what megaloop/train uses, read from its source.
"""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch
from typing_extensions import get_protocol_members

from megaloop.train.data import ShardData
from megaloop.train.protocols import DataSource, TrainerRuntime
from megaloop.train.runtime import SingleProcessRuntime

TRAIN = Path(__file__).resolve().parents[2] / "megaloop" / "train"
EMPTY = inspect.Parameter.empty


def protocol_members(proto) -> dict:
    """name -> the Protocol's declaration (a function, or a property for a value)."""
    return {name: value for name, value in vars(proto).items() if not name.startswith("_")}


def provides(cls, name: str) -> bool:
    """A class attribute (method, property, constant) or an instance attribute the class annotates."""
    return hasattr(cls, name) or any(name in vars(k).get("__annotations__", {}) for k in cls.__mro__)


def signature_problem(declared, implemented) -> str | None:
    """Why calls made as the Protocol declares them may not bind to `implemented` (None: they all do)."""
    want = list(inspect.signature(declared).parameters.values())[1:]
    have = list(inspect.signature(implemented).parameters.values())[1:]
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in have):
        return None
    if [p.name for p in have[:len(want)]] != [p.name for p in want]:
        return f"takes ({', '.join(p.name for p in have)}), declared ({', '.join(p.name for p in want)})"
    no_default = [w.name for w, h in zip(want, have) if w.default is not EMPTY and h.default is EMPTY]
    required = [h.name for h in have[len(want):] if h.default is EMPTY]
    if no_default or required:
        return f"requires {', '.join(no_default + required)}"
    return None


def problems(cls, proto) -> list[str]:
    """What `cls` lacks of `proto`, one line per member."""
    out = []
    for name, declared in protocol_members(proto).items():
        if not provides(cls, name):
            out.append(f"{name}: missing")
            continue
        static = inspect.getattr_static(cls, name, None)
        if inspect.isfunction(declared):
            if not inspect.isfunction(static):
                out.append(f"{name}: not a method")
            elif (why := signature_problem(declared, static)) is not None:
                out.append(f"{name}: {why}")
        elif inspect.isfunction(static):
            out.append(f"{name}: a method, declared a value")
    return out


def reference_runtime():
    from tests.pipeline.workers_train import ReferenceRuntime

    return ReferenceRuntime


def parallel_runtime():
    from pipeline.runtime import ParallelRuntime

    return ParallelRuntime


def pipeline_runtime():
    from pipeline.pipeline_runtime import PipelineRuntime

    return PipelineRuntime


def deepspeed_runtime():
    return pytest.importorskip("pipeline.deepspeed_engine").DeepSpeedRuntime  # deepspeed itself is imported lazily


RUNTIMES = {"single": lambda: SingleProcessRuntime, "parallel": parallel_runtime, "pipeline": pipeline_runtime,
            "deepspeed": deepspeed_runtime, "reference": reference_runtime}


@pytest.mark.parametrize("which", RUNTIMES)
def test_runtime_provides_the_protocol(which):
    assert problems(RUNTIMES[which](), TrainerRuntime) == []


def test_shard_data_provides_the_protocol():
    assert problems(ShardData, DataSource) == []


def test_members_are_read_as_typing_reads_them():
    for proto in (TrainerRuntime, DataSource):
        assert set(protocol_members(proto)) == set(get_protocol_members(proto))


def test_a_missing_or_different_member_is_reported():
    members = protocol_members(TrainerRuntime)
    body = {name: inspect.getattr_static(SingleProcessRuntime, name) for name in members
            if hasattr(SingleProcessRuntime, name)}
    body["__annotations__"] = {"device": torch.device}
    assert problems(type("Whole", (), body), TrainerRuntime) == []
    for name in members:
        if name == "device":
            partial = type("Partial", (), {k: v for k, v in body.items() if k != "__annotations__"})
        else:
            partial = type("Partial", (), {k: v for k, v in body.items() if k != name})
        assert problems(partial, TrainerRuntime) == [f"{name}: missing"]
    changed = {"prepare_model": lambda self, model: model,  # no materialize
               "gather_object": lambda self, obj, dst: [obj],  # dst without its default
               "barrier": lambda self, group: None,  # an extra required parameter
               "sum_stats": lambda self, stats: stats,  # another name
               "close": None,  # a value for a method
               "plans_ahead": lambda self: False}  # a method for a value
    for name, value in changed.items():
        found = problems(type("Changed", (), {**body, name: value}), TrainerRuntime)
        assert len(found) == 1 and found[0].startswith(f"{name}: "), found


def used_members(variable: str, sources: list[str]) -> set[str]:
    """Attributes read on `variable` (or self.`variable`) in the sources' code (strings and comments excluded)."""
    names = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.Attribute):
                continue
            v = node.value
            if (isinstance(v, ast.Name) and v.id == variable) or (
                    isinstance(v, ast.Attribute) and v.attr == variable and isinstance(v.value, ast.Name)
                    and v.value.id == "self"):
                names.add(node.attr)
    return names


def test_protocols_list_exactly_what_the_trainer_uses():
    sources = [path.read_text() for path in sorted(TRAIN.rglob("*.py"))]  # its packages too (checkpointing/)
    for variable, proto in (("runtime", TrainerRuntime), ("data", DataSource)):
        used, listed = used_members(variable, sources), set(protocol_members(proto))
        assert used == listed, (f"megaloop/train uses {sorted(used - listed)} of a {proto.__name__} without "
                                f"declaring them; declared but unused: {sorted(listed - used)}")


def test_use_is_read_from_code_only():
    sample = ('"""runtime.in_docstring"""\n'
              "def f(runtime, data, cfg):\n"
              "    runtime.a(); x = runtime.b.c; self.runtime.d; cfg.data.e; data.f  # runtime.comment\n")
    assert used_members("runtime", [sample]) == {"a", "b", "d"}
    assert used_members("data", [sample]) == {"f"}


def test_only_a_runtime_that_plans_ahead_gets_a_prefetch_planner():
    """schedule_ahead reads plans_ahead: the loader's prefetch thread plans for a pipeline runtime only, handing it
    each step's micro-batches on the host; the others' plan_ahead (a no-op) is never called."""
    from megaloop.config import load_config
    from megaloop.train.step import schedule_ahead
    from tests.train.conftest import TINY

    class Planning(SingleProcessRuntime):
        plans_ahead = True

        def plan_ahead(self, model, micro_batches):
            self.planned.append((model, micro_batches))

    cfg = load_config(str(TINY), ["model.seq_len=8", "data.micro_batch_size=2", "data.global_batch_size=4"])
    assert schedule_ahead(cfg, SingleProcessRuntime(torch.device("cpu")), model="m") is None
    runtime = Planning(torch.device("cpu"))
    runtime.planned = []
    prepare = schedule_ahead(cfg, runtime, model="m")
    prepare(3, {"tokens": torch.arange(36).reshape(4, 9), "sample_index": torch.arange(4)})
    [(model, micro_batches)] = runtime.planned
    assert model == "m" and sum(len(mb.input_ids) for mb in micro_batches) == 4
    assert all(mb.input_ids.device.type == "cpu" for mb in micro_batches)
