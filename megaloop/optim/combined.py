"""Muon + AdamW behind one object: schedules, clipping, non-finite skipping and a plain state dict.

Typical use (one training iteration)::

    opt = build_optimizer(model.named_parameters(), cfg.optim, total_steps)
    loss.backward()
    record = opt.step(step)      # clip, skip if non-finite, else update with the schedules at `step`
    opt.zero_grad()

Under a parallel layout the optimizer is built with the runtime's distributed ``parts`` (see :class:`OptimizerParts`):
they make the inner Muon/AdamW, say which gradients the clip measures and scales, and bracket the update (e.g. one
all-gather of the updated shards); the schedules, clipping, skipping and step records stay here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

import torch
from torch import Tensor

from .clip import clip_grad_tensors, clip_grads
from .config import OptimConfig
from .grouping import ParamGroups, split_param_groups
from .muon import Muon
from .schedule import ScheduledValues, check_schedule, continued_values

STATE_FORMAT = "megaloop.optim.combined/1"


@dataclass(frozen=True)
class StepRecord:
    """What one :meth:`CombinedOptimizer.step` did, for logging."""

    step: int
    grad_norm: float  # global norm before clipping (nan/inf when skipped for that reason)
    skipped: bool
    lr_multiplier: float
    matrix_lr: float  # Muon base lr at this step (before the per-matrix shape factor)
    adam_lr: float
    muon_momentum: float
    muon_weight_decay: float


class OptimizerParts(Protocol):
    """What a parallel runtime gives :class:`CombinedOptimizer` to build and drive its distributed inner parts."""

    def build(self, muon_named: list, adamw_named: list, muon_hyper: dict, adamw_hyper: dict) -> tuple:
        """(muon, adamw) optimizers for the two groups of (name, parameter); None for an empty group."""

    def grads_to_clip(self) -> tuple[list[Tensor], list[Tensor]]:
        """(gradients whose squares make this rank's share of the norm, gradients the clip scales)."""

    def norm_sq_reduce(self, local: Tensor) -> Tensor:
        """The global squared norm from this rank's share."""

    def begin_update(self) -> None: ...

    def end_update(self) -> None: ...

    def zero_grad(self) -> None: ...


def _adamw_kwargs(params: list[Tensor]) -> dict[str, bool]:
    """Fused AdamW when every parameter is a contiguous floating tensor on CPU or CUDA, else the foreach path (the
    fused kernel walks memory linearly: a transposed parameter given a contiguous gradient gets mismatched
    elements)."""
    fusable = all(p.is_floating_point() and p.is_contiguous() and p.device.type in ("cpu", "cuda") for p in params)
    return {"fused": True} if fusable else {"foreach": True}


class CombinedOptimizer:
    """Muon for the matrix group and torch AdamW for the rest, stepped together on one schedule.

    The schedules (trapezoid lr for both, Muon momentum warm-up, Muon weight-decay decay) are functions of the
    training iteration: :meth:`step` takes it explicitly, or uses its own counter, which advances on every call
    (applied or skipped), as the reference's step counter does. ``parts`` (a parallel runtime's) build the inner
    optimizers instead, and the clip and update go through them.
    """

    def __init__(
        self,
        groups: ParamGroups,
        cfg: OptimConfig,
        total_steps: int,
        norm_sq_reduce: Callable[[Tensor], Tensor | None] | None = None,
        parts: OptimizerParts | None = None,
    ):
        cfg.validate()
        check_schedule(total_steps, cfg.warmup_steps, cfg.cooldown_fraction)
        self.cfg = cfg
        self.total_steps = total_steps
        self.norm_sq_reduce = norm_sq_reduce
        self.muon_names = [name for name, _ in groups.muon]
        self.adamw_names = [name for name, _ in groups.adamw]
        self.params = [p for _, p in groups.muon] + [p for _, p in groups.adamw]
        self.parts = parts
        if parts is None:
            self.muon = self._build_muon([p for _, p in groups.muon])
            self.adamw = self._build_adamw([p for _, p in groups.adamw])
        else:
            self.muon, self.adamw = parts.build(list(groups.muon), list(groups.adamw), self._muon_hyper(),
                                                self._adamw_hyper())
        self.iteration = 0
        self.num_skipped = 0

    def _muon_hyper(self) -> dict[str, Any]:
        cfg = self.cfg
        return dict(lr=cfg.matrix_lr, momentum=cfg.muon_momentum[0], weight_decay=cfg.muon_weight_decay,
                    beta2=cfg.normuon_beta2, nesterov=cfg.nesterov, ns_steps=cfg.ns_steps)

    def _adamw_hyper(self) -> dict[str, Any]:
        cfg = self.cfg
        return dict(lr=cfg.adam_lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.adam_weight_decay)

    def _build_muon(self, params: list[Tensor]) -> Muon | None:
        return Muon(params, **self._muon_hyper()) if params else None

    def _build_adamw(self, params: list[Tensor]) -> torch.optim.AdamW | None:
        return torch.optim.AdamW(params, **self._adamw_hyper(), **_adamw_kwargs(params)) if params else None

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The inner optimizers that exist (Muon first)."""
        return [opt for opt in (self.muon, self.adamw) if opt is not None]

    def schedule_at(self, step: int) -> ScheduledValues:
        """The scheduled learning rates, momentum and weight decay at ``step`` of a schedule spanning total_steps
        (steps past it, in a run extended with train.extend=continue, keep the rates of its last step)."""
        return continued_values(self.cfg, step, self.total_steps)

    def _apply_schedule(self, values: ScheduledValues) -> None:
        if self.muon is not None:
            for group in self.muon.param_groups:
                group["lr"] = values.matrix_lr
                group["momentum"] = values.muon_momentum
                group["weight_decay"] = values.muon_weight_decay
        if self.adamw is not None:
            for group in self.adamw.param_groups:
                group["lr"] = values.adam_lr

    def skip_step(self, step: int | None = None) -> StepRecord:
        """Drop this step's gradients without updating anything and count it as skipped (a loss spike under
        train.on_spike=skip); the step counter advances as in `step`."""
        step = self.iteration if step is None else step
        values = self.schedule_at(step)
        self.num_skipped += 1
        self.zero_grad(set_to_none=True)
        self.iteration = step + 1
        return StepRecord(step=step, grad_norm=float("nan"), skipped=True, lr_multiplier=values.lr_multiplier,
                          matrix_lr=values.matrix_lr, adam_lr=values.adam_lr, muon_momentum=values.muon_momentum,
                          muon_weight_decay=values.muon_weight_decay)

    @torch.no_grad()
    def step(self, step: int | None = None) -> StepRecord:
        """Clip gradients, then update every parameter with the schedules at ``step`` (default: own counter).

        If the global gradient norm is not finite nothing is updated (parameters and optimizer state stay
        bit-identical), the gradients are dropped and the skip is counted.
        """
        step = self.iteration if step is None else step
        values = self.schedule_at(step)
        if self.parts is None:
            grad_norm = clip_grads(self.params, self.cfg.grad_clip, self.norm_sq_reduce)
        else:
            grad_norm = clip_grad_tensors(*self.parts.grads_to_clip(), self.cfg.grad_clip, self.parts.norm_sq_reduce)
        skipped = not math.isfinite(grad_norm)
        if skipped:
            self.num_skipped += 1
            self.zero_grad(set_to_none=True)
        else:
            self._apply_schedule(values)
            if self.parts is not None:
                self.parts.begin_update()
            for opt in self.optimizers:
                opt.step()
            if self.parts is not None:
                self.parts.end_update()
        self.iteration = step + 1
        return StepRecord(
            step=step,
            grad_norm=grad_norm,
            skipped=skipped,
            lr_multiplier=values.lr_multiplier,
            matrix_lr=values.matrix_lr,
            adam_lr=values.adam_lr,
            muon_momentum=values.muon_momentum,
            muon_weight_decay=values.muon_weight_decay,
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every managed parameter (with ``parts``: zeroed in place in their buffer,
        whatever ``set_to_none`` says, since the .grad tensors are views that must stay attached)."""
        if self.parts is not None:
            self.parts.zero_grad()
            return
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """Counters, parameter names and the inner optimizers' state dicts (tensors, numbers, strings only)."""
        return {
            "format": STATE_FORMAT,
            "iteration": self.iteration,
            "num_skipped": self.num_skipped,
            "muon_names": list(self.muon_names),
            "adamw_names": list(self.adamw_names),
            "muon": self.muon.state_dict() if self.muon is not None else None,
            "adamw": self.adamw.state_dict() if self.adamw is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the parameter names and their grouping must match this optimizer's."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a {STATE_FORMAT} state dict (format = {state.get('format')!r})")
        for key, names in (("muon_names", self.muon_names), ("adamw_names", self.adamw_names)):
            if list(state[key]) != names:
                missing = sorted(set(names) - set(state[key]))[:5]
                extra = sorted(set(state[key]) - set(names))[:5]
                raise ValueError(
                    f"optimizer state was saved for other parameters ({key}): missing {missing}, unexpected "
                    f"{extra}, or a different order; build the optimizer from the same model and config"
                )
        if self.muon is not None:
            self.muon.load_state_dict(state["muon"])
        if self.adamw is not None:
            self.adamw.load_state_dict(state["adamw"])
        self.iteration = int(state["iteration"])
        self.num_skipped = int(state["num_skipped"])


MUON_PREFIX = "optim/muon"
ADAMW_PREFIX = "optim/adamw"
ADAMW_MOMENTS = ("exp_avg", "exp_avg_sq")


def sharded_state(opt: CombinedOptimizer, spec_of: Callable | None = None) -> tuple[list[tuple], dict[str, Any]]:
    """The optimizer's state without its layout, for checkpoints: (entries, scalars).

    entries are (array name, parameter name, tensor, sharded) tuples: Muon's momentum_buffer / second_moment under
    optim/muon/<key>/<name> (whole matrices), AdamW's exp_avg / exp_avg_sq under optim/adamw/<key>/<name> (shaped
    like this rank's parameter, i.e. its tensor-parallel shard: sharded=True). Distributed inner optimizers
    (distributed Muon, ZeRO-1 AdamW) provide their own entries (ZeRO-1's: blocks of rows of the shard, marked by a
    RowBlock in place of `sharded`; spec_of(name) gives a parameter's tensor-parallel ShardSpec). scalars: counters, this optimizer's parameter names
    and AdamW step counts (JSON); under pipeline parallelism each rank's cover its stage only: a checkpoint stores
    the job's, :func:`merge_scalars` of every rank's.
    """
    entries: list[tuple] = []
    adamw_steps: dict[str, float] = {}
    if opt.muon is not None:
        if hasattr(opt.muon, "sharded_state"):
            entries += opt.muon.sharded_state(MUON_PREFIX)
        else:
            for name, p in zip(opt.muon_names, opt.muon.param_groups[0]["params"]):
                entries += [(f"{MUON_PREFIX}/{key}/{name}", name, t, False) for key, t in opt.muon.state[p].items()]
    if opt.adamw is not None:
        if hasattr(opt.adamw, "sharded_state"):
            more, adamw_steps = opt.adamw.sharded_state(ADAMW_PREFIX, spec_of=spec_of)
            entries += more
        else:
            for name, p in zip(opt.adamw_names, opt.adamw.param_groups[0]["params"]):
                state = opt.adamw.state.get(p)
                if state:
                    entries += [(f"{ADAMW_PREFIX}/{key}/{name}", name, state[key], True) for key in ADAMW_MOMENTS]
                    adamw_steps[name] = float(state["step"])
    scalars = {"format": STATE_FORMAT, "iteration": opt.iteration, "num_skipped": opt.num_skipped,
               "muon_names": list(opt.muon_names), "adamw_names": list(opt.adamw_names), "adamw_step": adamw_steps}
    return entries, scalars


NAME_KEYS = ("muon_names", "adamw_names")


def parameter_names(opt: CombinedOptimizer) -> dict[str, list[str]]:
    """{"muon_names": [...], "adamw_names": [...]}: the parameters this optimizer updates, by group."""
    return {"muon_names": list(opt.muon_names), "adamw_names": list(opt.adamw_names)}


def join_names(per_rank: list[dict[str, Any]]) -> dict[str, list[str]]:
    """The job's parameter names by group from every rank's (a pipeline stage's names, or all of them): each name
    once, sorted, so that the result does not depend on the layout."""
    return {key: sorted({name for names in per_rank for name in names[key]}) for key in NAME_KEYS}


def merge_scalars(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The job's optimizer scalars from every rank's :func:`sharded_state` scalars (in any order): the parameter
    names joined (:func:`join_names`), the AdamW step counts merged; the counters must agree (every rank stepped
    together), and so must the step counts of a parameter several ranks hold (data-parallel or stage replicas)."""
    first, steps = per_rank[0], {}
    for rank, scalars in enumerate(per_rank):
        if (scalars["iteration"], scalars["num_skipped"]) != (first["iteration"], first["num_skipped"]):
            raise ValueError(f"rank {rank} is at optimizer iteration {scalars['iteration']} ({scalars['num_skipped']} "
                             f"skipped) but rank 0 at {first['iteration']} ({first['num_skipped']}): every rank must "
                             "save after the same step")
        for name, step in scalars["adamw_step"].items():
            if steps.setdefault(name, step) != step:
                raise ValueError(f"AdamW step counts of {name!r} differ between ranks ({steps[name]} and {step}); "
                                 "every rank must save after the same step")
    return {**first, **join_names(per_rank), "adamw_step": dict(sorted(steps.items()))}


def check_saved_names(scalars: dict[str, Any], held: dict[str, list[str]]) -> None:
    """Refuse optimizer state saved for other parameters than the job's (`held`: :func:`join_names` of every
    rank's :func:`parameter_names`), naming a few missing and unexpected ones."""
    for key in NAME_KEYS:
        saved, here = set(scalars[key]), set(held[key])
        if saved != here:
            missing, unexpected = sorted(here - saved)[:5], sorted(saved - here)[:5]
            raise ValueError(f"optimizer state was saved for other parameters ({key}: missing {missing}, unexpected "
                             f"{unexpected}); build the optimizer from the same model and config, or load the weights "
                             "only")


@torch.no_grad()
def load_sharded_state(opt: CombinedOptimizer, read: Callable, scalars: dict[str, Any],
                       held: dict[str, list[str]] | None = None) -> None:
    """Restore :func:`sharded_state` (the job's scalars, :func:`merge_scalars`) under any layout: read(array, name,
    sharded) returns the whole array (sharded=False) or this rank's shard of it (True), or None when the checkpoint
    has no such array. `held`: the names every rank of this job updates (:func:`join_names`; default this
    optimizer's, as in one process); the saved names must be the same."""
    if scalars.get("format") != STATE_FORMAT:
        raise ValueError(f"not a {STATE_FORMAT} optimizer state (format = {scalars.get('format')!r})")
    check_saved_names(scalars, held or parameter_names(opt))
    steps = {k: float(v) for k, v in scalars["adamw_step"].items()}
    if opt.muon is not None:
        if hasattr(opt.muon, "load_sharded_state"):
            opt.muon.load_sharded_state(read, MUON_PREFIX)
        else:
            _load_plain_muon(opt, read)
    if opt.adamw is not None:
        if hasattr(opt.adamw, "load_sharded_state"):
            opt.adamw.load_sharded_state(read, ADAMW_PREFIX, steps)
        else:
            _load_plain_adamw(opt, read, steps)
    opt.iteration = int(scalars["iteration"])
    opt.num_skipped = int(scalars["num_skipped"])


def _load_plain_muon(opt: CombinedOptimizer, read: Callable) -> None:
    from .muon import init_muon_state

    opt.muon.state.clear()
    for name, p in zip(opt.muon_names, opt.muon.param_groups[0]["params"]):
        fresh = init_muon_state(p)
        loaded = {key: read(f"{MUON_PREFIX}/{key}/{name}", name, False) for key in fresh}
        if all(t is not None for t in loaded.values()):
            opt.muon.state[p] = {key: loaded[key].to(dtype=t.dtype, device=t.device).reshape(t.shape)
                                 for key, t in fresh.items()}


def _load_plain_adamw(opt: CombinedOptimizer, read: Callable, steps: dict[str, float]) -> None:
    params = opt.adamw.param_groups[0]["params"]
    state = {}
    for index, (name, p) in enumerate(zip(opt.adamw_names, params)):
        if name not in steps:
            continue
        moments = {key: read(f"{ADAMW_PREFIX}/{key}/{name}", name, True) for key in ADAMW_MOMENTS}
        state[index] = {"step": torch.tensor(steps[name], dtype=torch.float32),
                        **{key: t.to(dtype=p.dtype, device=p.device).reshape(p.shape) for key, t in moments.items()}}
    saved = opt.adamw.state_dict()
    saved["state"] = state
    opt.adamw.load_state_dict(saved)


def build_optimizer(
    named_params: Iterable[tuple[str, Tensor]],
    cfg: OptimConfig,
    total_steps: int,
    norm_sq_reduce: Callable[[Tensor], Tensor | None] | None = None,
    verbose: bool = False,
    parts: OptimizerParts | None = None,
) -> CombinedOptimizer:
    """Validate ``cfg``, split the parameters by name (see grouping.py) and build the combined optimizer.

    ``total_steps`` (the run's length in optimizer steps) sets the cool-down and the weight-decay decay;
    ``norm_sq_reduce`` is passed to :func:`clip_grads`. ``verbose`` prints the one-line group summary. ``parts``:
    a parallel runtime's distributed inner optimizers (``runtime.optimizer_parts()``), None in one process.
    """
    cfg.validate()
    groups = split_param_groups(named_params, optimizer=cfg.name)
    if verbose:
        print(groups.summary())
    return CombinedOptimizer(groups, cfg, total_steps, norm_sq_reduce=norm_sq_reduce, parts=parts)
