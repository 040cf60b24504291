"""The training step neither reads back from the device nor makes a blocking host-to-device copy inside its
micro-batch loop, and talks to the other ranks once per step for its statistics.

A TorchDispatchMode, active around every step's micro-batch assembly and loop (forwards and backwards included),
counts the ops that make the host wait for a value: aten._local_scalar_dense (.item(), float(), bool() of a tensor)
and the data-dependent shapes aten.nonzero / masked_select. On the CPU these are as visible as on a GPU.

Blocking host-to-device copies are counted by emulating a CUDA device on the CPU. Every host tensor is on the CPU
here, so a `Tensor.to(<device>)` / `Tensor.cuda()` of a CPU tensor inside the loop is what would be a host-to-device
copy on a GPU (a copy between two device tensors is never written that way in the step: the device tensors it makes
are created there). Such a copy counts as blocking unless it asks for non_blocking=True AND its source is pinned,
which is what CUDA needs to queue it without stalling the host. Pinning is emulated: megaloop.model.transfer.pins
answers True (the code takes its CUDA path: the loader and to_device pin), Tensor.pin_memory returns a marked copy
and Tensor.is_pinned reads the mark. A pageable source or a missing non_blocking is counted, with its caller.
Not seen: Tensor.copy_ between a host and a device tensor (nothing in the step writes one). Expected: zero syncs and
zero blocking copies, on one process, under dp2 with depth balancing (micro-batches of different sizes on the two
ranks) and under pp2 (the ring stages' per-lap work).

Device-to-host reads over a whole step (from the start of train_step to the end of reduce_step) are counted by
`DeviceReads`, with the same CUDA emulation: a tensor is "on the device" when it is a parameter or a gradient, an
emulated host-to-device copy, or computed from one (tracked op by op); a read is `.tolist()`, `.numpy()`, `.cpu()`,
a scalar read (.item(), float(), bool(): aten._local_scalar_dense, is_nonzero), a data-dependent shape (nonzero,
masked_select), a `copy_` from the device into host memory that is not pinned+non_blocking, and a CUDA event waited
on (torch.cuda.Event emulated) before any later read drained the stream past it. Reads made inside the optimizer's
clip decision (megaloop.optim.clip.clip_grad_tensors: the global gradient norm on the host) are the step's one
allowed device sync and are counted apart. Expected: no other read per step (the packed statistics' read waits on an
event the clip has drained).

The collectives of a dp2 step (from the start of train_step to the end of its statistics reduction) are counted by
wrapping torch.distributed's functions and attributed by the caller: exactly one is the packed statistics reduction
(runtime.sum_stats); every other one is issued from train_step's backward, gradient reduction or optimizer calls
(whatever the gradient reducer and the distributed optimizer need).
"""
from __future__ import annotations

import collections
import contextlib
import functools
import traceback

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import megaloop.model.transfer as transfer
import megaloop.train.loop as loop
from megaloop.config import load_config
from megaloop.train.loop import train
from megaloop.train.runtime import make_runtime
from tests.pipeline.spawn import spawn
from tests.train.conftest import TINY, fast_overrides

SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "item"}
# the lines of megaloop/train/step.py (and of the micro-batch loop it hands to the runtime) from which gradient and
# optimizer traffic may start
STEP_FILES = ("megaloop/train/step.py", "pipeline/micro_batches.py")
GRADIENT_CALLS = ("runtime.backward(", "runtime.reduce_gradients(", "optimizer.step(", "optimizer.zero_grad(")
COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "reduce_scatter_tensor", "reduce_scatter", "reduce_scatter_single",
               "all_gather_into_tensor", "all_gather", "all_gather_single", "all_gather_coalesced", "all_gather_object",
               "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "reduce", "send", "recv", "isend",
               "irecv", "batch_isend_irecv", "all_to_all", "all_to_all_single", "scatter", "gather", "gather_object",
               "scatter_object_list", "_all_gather_base", "_reduce_scatter_base", "_broadcast_coalesced")
P2P_OPS = ("isend", "irecv")
STEPS = 3


class SyncCounter(TorchDispatchMode):
    """Counts ops that wait for the device's result on the host, and the dtype casts (aten._to_copy) of the
    parameters in `weights` (data_ptr -> name) per step (`casts`: one Counter of names per step; a cast of a view
    of a parameter is not counted: autocast casts parameters, and caches only those)."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []
        self.weights: dict[int, str] = {}
        self.casts: list[collections.Counter] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNC_OPS:
            self.seen.append(name)
        # autocast casts the parameter itself (a view's cast, e.g. of W.t(), is the model's own, not autocast's)
        if name == "_to_copy" and not args[0]._is_view() and args[0].data_ptr() in self.weights and self.casts:
            self.casts[-1][self.weights[args[0].data_ptr()]] += 1
        return func(*args, **(kwargs or {}))


class DeviceReads(TorchDispatchMode):
    """Device-to-host reads per step, and the clip decision's reads apart (see the module docstring). Tensors on the
    emulated device carry `_device_for_test`."""

    def __init__(self):
        super().__init__()
        self.steps: list[dict] = []  # per step: {"reads": [where...], "clip": n}
        self.drains = 0  # reads so far: each one waits for everything queued before it

    def begin_step(self, model) -> None:
        self.steps.append({"reads": [], "clip": 0})
        for p in model.parameters():
            mark_device(p)
            if p.grad is not None:
                mark_device(p.grad)

    def read(self, what: str) -> None:
        stack = traceback.extract_stack()[:-2]
        self.drains += 1
        if not self.steps:
            return
        if any(frame.name == "clip_grad_tensors" for frame in stack):
            self.steps[-1]["clip"] += 1
        else:
            self.steps[-1]["reads"].append(f"{what}: " + "".join(traceback.format_list(stack[-3:])))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if name == "copy_":
            dst, src = args[0], args[1]
            non_blocking = kwargs.get("non_blocking", len(args) > 2 and args[2] is True)
            out = func(*args, **kwargs)
            if on_device(src) and not on_device(dst) and not (non_blocking and dst.is_pinned()):
                self.read("blocking copy_ to the host")
            return out
        if name in SYNC_OPS and any(on_device(t) for t in inputs):
            self.read(f"aten.{name}")
        out = func(*args, **kwargs)
        if any(on_device(t) for t in inputs):
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    mark_device(t)
        return out


def mark_device(t: torch.Tensor) -> torch.Tensor:
    t._device_for_test = True
    return t


def on_device(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, "_device_for_test", False)


class EmulatedEvent:
    """torch.cuda.Event on the emulated stream: complete once a later read has drained the stream; waiting on it
    before then is a device-to-host read of its own."""

    reads: DeviceReads | None = None

    def __init__(self, enable_timing=False, **kwargs):
        self.recorded_at = None

    def record(self, stream=None):
        self.recorded_at = self.reads.drains

    def query(self) -> bool:
        return self.reads.drains > self.recorded_at

    def synchronize(self):
        if not self.query():
            self.reads.read("event.synchronize() before the stream was drained")


@contextlib.contextmanager
def emulated_device_reads(reads: DeviceReads):
    """Tensor.tolist / numpy / cpu of a device tensor counted as reads, torch.cuda.Event emulated."""
    real = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "cpu")}
    real_event = torch.cuda.Event

    def reader(name):
        def method(self, *args, **kwargs):
            if on_device(self):
                reads.read(f"Tensor.{name}()")
            out = real[name](self, *args, **kwargs)
            if name == "cpu" and out is self:  # a host copy: a new tensor, not on the device
                out = self.detach().clone()
                out.__dict__.pop("_device_for_test", None)
            return out
        return method

    for name in real:
        setattr(torch.Tensor, name, reader(name))
    EmulatedEvent.reads, torch.cuda.Event = reads, EmulatedEvent
    try:
        yield reads
    finally:
        for name, fn in real.items():
            setattr(torch.Tensor, name, fn)
        torch.cuda.Event = real_event


class CopyCounter:
    """Counts host-to-device copies that would block on a CUDA device (see the module docstring), while `active`."""

    def __init__(self):
        self.active = False
        self.reading = False  # inside a step (DeviceReads counting): copies to a device mark their result
        self.blocking: list[str] = []

    def __enter__(self):
        self.active = True
        return self

    def __exit__(self, *exc):
        self.active = False

    def check(self, tensor: torch.Tensor, args: tuple, kwargs: dict, positional_non_blocking: int) -> None:
        device = kwargs.get("device", next((a for a in args if isinstance(a, (str, torch.device))), None))
        if not self.active or tensor.device.type != "cpu" or device is None:
            return  # a dtype conversion, or outside the loop
        non_blocking = kwargs.get("non_blocking", len(args) > positional_non_blocking
                                  and args[positional_non_blocking] is True)
        if non_blocking and getattr(tensor, "_pinned_for_test", False):
            return
        why = "pageable source" if non_blocking else "non_blocking=False"
        self.blocking.append(f"{why}: " + "".join(traceback.format_list(traceback.extract_stack()[-4:-2])))


@contextlib.contextmanager
def emulated_cuda_copies(copies: CopyCounter):
    """Tensor.to / .cuda checked by `copies`; pinning answered by the CPU (marked copies)."""
    real = {name: getattr(torch.Tensor, name) for name in ("to", "cuda", "pin_memory", "is_pinned")}
    real_pins = transfer.pins

    def to(self, *args, **kwargs):
        copies.check(self, args, kwargs, 1 if args and isinstance(args[0], (str, torch.device)) else 2)
        out = real["to"](self, *args, **kwargs)
        device = kwargs.get("device", next((a for a in args if isinstance(a, (str, torch.device))), None))
        if copies.reading and device is not None and not on_device(self):  # a host-to-device copy: on the device
            out = mark_device(out.view_as(out) if out is self else out)
        return out

    def cuda(self, device=None, non_blocking=False, **kwargs):
        copies.check(self, ("cuda",), {"non_blocking": non_blocking}, 1)
        return self  # the copy itself is not made: there is no device here

    def pin_memory(self, device=None):
        pinned = self.clone()
        pinned._pinned_for_test = True
        return pinned

    def is_pinned(self, device=None):
        return getattr(self, "_pinned_for_test", False)

    for name, fn in {"to": to, "cuda": cuda, "pin_memory": pin_memory, "is_pinned": is_pinned}.items():
        setattr(torch.Tensor, name, fn)
    transfer.pins = lambda device: True
    try:
        yield copies
    finally:
        for name, fn in real.items():
            setattr(torch.Tensor, name, fn)
        transfer.pins = real_pins


def overrides(shards, out_dir, dp: int, pp: int = 1, precision: str = "fp64") -> list[str]:
    """Per-sequence depths, micro-batches of 2 out of 8 rows: several micro-batches of different depths."""
    return fast_overrides(shards, out_dir, steps=STEPS) + [
        "data.micro_batch_size=2", "data.val_batches=0", "train.val_every=1000", f"parallel.dp={dp}",
        f"parallel.pp={pp}", f"train.precision={precision}"]


def _origin(name: str, stack) -> str:
    """"stats" (runtime.sum_stats), "gradient" (a gradient or optimizer call of train_step) or "other: ..."."""
    if any(frame.name == "sum_stats" for frame in stack):
        return "stats"
    step_lines = [frame.line or "" for frame in stack if frame.filename.endswith(STEP_FILES)]
    if step_lines and any(call in step_lines[-1] for call in GRADIENT_CALLS):
        return "gradient"
    return f"other: {name}\n" + "".join(traceback.format_list(stack))


def traced_train(cfg, runtime=None) -> dict:
    """Run the trainer with the loop guard counting host syncs and blocking host-to-device copies, and the
    collectives of each step attributed."""
    counter, copies, reads = SyncCounter(), CopyCounter(), DeviceReads()
    calls, active = [], {"on": False}
    real_step, real_reduce = loop.train_step, loop.reduce_step

    @contextlib.contextmanager
    def guard():
        with counter, copies:
            yield

    def train_step(model, *args, **kwargs):
        active["on"] = True
        calls.append("step")
        counter.weights = {p.data_ptr(): name for name, p in model.named_parameters() if p.is_floating_point()}
        counter.casts.append(collections.Counter())
        reads.__enter__()  # left at the end of reduce_step: the whole step
        copies.reading = True
        reads.begin_step(model)
        return real_step(model, *args, loop_guard=guard, **kwargs)

    def reduce_step(*args, **kwargs):
        try:
            return real_reduce(*args, **kwargs)
        finally:
            active["on"] = copies.reading = False
            reads.__exit__(None, None, None)

    def wrap(name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            outermost = active["on"] and not active.get("inside")
            if outermost:  # a collective that torch implements with another one counts once
                calls.append(_origin(name, traceback.extract_stack()))
                active["inside"] = True
            try:
                return fn(*args, **kwargs)
            finally:
                if outermost:
                    active["inside"] = False
        return wrapper

    dist = torch.distributed
    # isend/irecv stay as they are: P2POp accepts only those two functions (batch_isend_irecv is counted)
    saved = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name) and name not in P2P_OPS}
    loop.train_step, loop.reduce_step = train_step, reduce_step
    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    try:
        with emulated_cuda_copies(copies), emulated_device_reads(reads):
            summary = train(cfg, runtime)
    finally:
        if copies.reading:  # a step that raised: leave its read counting
            reads.__exit__(None, None, None)
        loop.train_step, loop.reduce_step = real_step, real_reduce
        for name, fn in saved.items():
            setattr(dist, name, fn)
    per_step, current = [], None
    for c in calls:
        if c == "step":
            current = {"stats": 0, "gradient": 0, "other": []}
            per_step.append(current)
        elif c.startswith("other"):
            current["other"].append(c)
        else:
            current[c] += 1
    return {"syncs": list(counter.seen), "weight_casts": counter.casts, "blocking_copies": copies.blocking,
            "per_step": per_step, "steps": calls.count("step"), "losses": summary.losses,
            "reads": [step["reads"] for step in reads.steps], "clip_reads": [step["clip"] for step in reads.steps]}


def check_reads(got: dict, label: str) -> None:
    """Per step: no device-to-host read but the clip decision's (which does read)."""
    print(f"{label}: device-to-host reads per step outside the clip decision: "
          f"{[len(r) for r in got['reads']]}; the clip decision's reads: {got['clip_reads']}")
    assert len(got["reads"]) == STEPS and all(got["clip_reads"])
    assert all(r == [] for r in got["reads"]), next(r for r in got["reads"] if r)[0]


def test_no_host_sync_in_the_micro_batch_loop_single_process(tiny_shards, tmp_path):
    got = traced_train(load_config(TINY, overrides(tiny_shards, tmp_path, 1)))
    print(f"one process, {got['steps']} steps: host syncs in the micro-batch loops: {len(got['syncs'])}, "
          f"blocking host-to-device copies: {len(got['blocking_copies'])}")
    assert got["steps"] == STEPS and len(got["losses"]) == STEPS
    assert got["syncs"] == []
    assert got["blocking_copies"] == [], got["blocking_copies"][0]
    check_reads(got, "one process")


def test_counter_sees_a_host_sync(tiny_shards, tmp_path):
    """The counter is not blind: a float() of the loss inside the loop is seen."""
    counter = SyncCounter()
    with counter:
        loss = torch.ones(3, dtype=torch.float64).sum()
        float(loss)
        torch.nonzero(torch.ones(2))
    assert counter.seen == ["_local_scalar_dense", "nonzero"]


def test_copy_counter_sees_blocking_copies():
    """A pageable source, or a pinned one without non_blocking, is counted; a pinned non-blocking copy, a dtype
    conversion and a copy outside the loop are not. The emulation leaves torch as it was."""
    with emulated_cuda_copies(CopyCounter()) as copies:
        host = torch.arange(4)
        host.to("cpu", non_blocking=True)
        with copies:
            host.to("cpu", non_blocking=True)  # pageable
            host.pin_memory().to(torch.device("cpu"))  # pinned, blocking
            host.cuda()
            transfer.to_device(host.numpy(), "cpu")  # pinned (pins answers True) and non-blocking
            host.to(torch.float64)
    assert [b.split(":")[0] for b in copies.blocking] == ["pageable source", "non_blocking=False",
                                                          "non_blocking=False"]
    assert not transfer.pins("cpu") and not hasattr(torch.arange(2).pin_memory, "__wrapped__")


def _worker(rank: int, world: int, shards: str, out_dir: str, result: str, dp: int, pp: int) -> None:
    precision = "bf16" if pp > 1 else "fp64"  # pp2 also counts autocast's weight casts
    cfg = load_config(TINY, overrides(shards, f"{out_dir}/run", dp, pp, precision))
    runtime = make_runtime(cfg, torch.device("cpu"))
    try:
        got = traced_train(cfg, runtime)
        got["schedules_made_in_step"] = getattr(runtime, "schedules_made_in_step", None)
    finally:
        runtime.close()
    torch.save(got, f"{result}.{rank}")


@pytest.mark.multiproc
@pytest.mark.parametrize("dp,pp", [(2, 1), (1, 2)], ids=["dp2", "pp2"])
def test_no_host_sync_and_one_stats_reduction_per_step(tiny_shards, tmp_path, dp, pp):
    """dp2: no sync or blocking copy, one statistics reduction per step and the rest from gradient/optimizer calls;
    pp2 (bf16 autocast): no sync or blocking copy in the ring stages (their point-to-point messages are the ring's
    own traffic), each weight autocast casts is cast once per step, not once per lap and micro-batch, and every
    step's ring schedule was made ahead of the step (in the loader's prefetch thread)."""
    spawn(_worker, 2, str(tiny_shards), str(tmp_path), str(tmp_path / "result"), dp, pp)
    for rank in range(2):
        got = torch.load(tmp_path / f"result.{rank}")
        print(f"dp{dp} pp{pp} rank {rank}: host syncs in the micro-batch loops: {len(got['syncs'])}, blocking "
              f"host-to-device copies: {len(got['blocking_copies'])}; collectives per step: "
              + ", ".join(f"{s['stats']} statistics + {s['gradient']} gradient/optimizer" for s in got["per_step"]))
        assert got["syncs"] == []
        assert got["blocking_copies"] == [], got["blocking_copies"][0]
        check_reads(got, f"dp{dp} pp{pp} rank {rank}")
        assert len(got["per_step"]) == STEPS
        for step in got["per_step"]:
            assert step["stats"] == 1 and step["gradient"] >= 1
            if pp == 1:
                assert step["other"] == [], step["other"][0]
        if pp > 1:
            print(f"pp2 rank {rank}: weight casts per step: "
                  + ", ".join(f"{len(c)} weights, at most {max(c.values())} each" for c in got["weight_casts"]))
            assert all(c and max(c.values()) == 1 for c in got["weight_casts"]), got["weight_casts"]
            print(f"pp2 rank {rank}: ring schedules generated inside the steps: {got['schedules_made_in_step']}")
            assert got["schedules_made_in_step"] == 0  # each made ahead, in the loader's prefetch thread


def test_the_loader_pins_for_a_cuda_device_only():
    from megaloop.train.data import pin_batches

    assert pin_batches(torch.device("cuda")) and pin_batches("cuda:1")
    assert not pin_batches(torch.device("cpu")) and not pin_batches(None)


def test_cuda_step_times_are_read_one_step_later(monkeypatch):
    """On a GPU a step's times come back at the next step, read from events that have completed (the event
    class stands in for torch.cuda.Event: it counts synchronisations and which events were read)."""
    from megaloop.train.step import StepTimer

    clock, read = iter(range(100)), []

    class Event:
        def __init__(self, enable_timing=False):
            self.t, self.synced = None, False

        def record(self):
            self.t = next(clock)

        def synchronize(self):
            self.synced = True

        def elapsed_time(self, end):
            read.append(end.synced)
            return 1e3 * (end.t - self.t)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    timer = StepTimer(torch.device("cuda"))
    firsts = []
    for _ in range(3):
        start = timer.mark()
        timer.add("forward", start, timer.mark())
        firsts.append(start.t)
        times = timer.completed_totals()
        if len(firsts) == 1:
            assert all(v != v for v in times.values())  # NaN: nothing measured before the first step
        else:
            assert times["forward"] == 1.0 and read[-1]
    assert StepTimer(torch.device("cpu")).completed_totals() == {"forward": 0, "backward": 0, "communication": 0,
                                                       "optimizer": 0, "pipeline_idle": 0}


def test_read_counter_sees_device_reads():
    """DeviceReads is not blind: a blocking read of a device value is counted, a pinned non-blocking copy whose event
    a later read (here, a stand-in for the clip decision) drained is not, and an event waited on before any drain is;
    reads of host tensors are not counted. HostCopy takes its CUDA path under the emulation."""
    reads, real_tolist, real_event = DeviceReads(), torch.Tensor.tolist, torch.cuda.Event
    with emulated_cuda_copies(CopyCounter()) as copies, emulated_device_reads(reads):
        copies.reading = True
        with reads:
            reads.begin_step(torch.nn.Linear(1, 1))
            x = torch.arange(3.0).to("cpu", non_blocking=True) * 2  # an emulated host-to-device copy: device
            torch.arange(2.0).tolist(), float(torch.ones(()).sum())  # host values: not counted
            early, late = transfer.HostCopy(x), transfer.HostCopy(x + 1)
            assert early.host.is_pinned() and not on_device(early.host)
            early.tolist()  # waited on before any read drained the stream: a read
            float(x.sum())  # a blocking scalar read
            assert late.tolist() == [1.0, 3.0, 5.0]  # drained by the reads above: not counted
            x.cpu()
            torch.empty(3).copy_(x)  # pageable destination: blocking
    got = [r.split(":")[0] for r in reads.steps[0]["reads"]]
    assert got == ["event.synchronize() before the stream was drained", "aten._local_scalar_dense", "Tensor.cpu()",
                   "blocking copy_ to the host"], got
    assert torch.cuda.Event is real_event and torch.Tensor.tolist is real_tolist  # torch left as it was
