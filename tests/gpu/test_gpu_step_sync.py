"""A whole training step on one GPU, compiled (train.compile) with flash-attn, under CUDA's sync debug mode
(scripts/gpu_check.sh; skipped without a GPU): the micro-batch loops with the mode at "error" (a host
synchronisation there raises, naming the op), the whole step (loops, gradient reduction, clipping, optimizer, the
step's timings, the read of the step's reduced statistics) with it at "warn", each synchronisation counted: at most
STEP_SYNCS, the clip's skip decision; by the time the step returns, the clip's read has drained the stream past
the statistics' copy to the host (its event has completed), so reading them does not wait.

Without flash-attn installed the test skips, naming requirements-gpu.txt; flash-attn installed but not importable
(a build for another torch or CUDA) fails, naming the package."""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import warnings
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]
STEP_SYNCS = 1  # the gradient clip's skip decision (a non-finite norm skips the update on every rank)
ROWS = 16


def require_flash_attn() -> str:
    """The flash-attn module that will run (FA3's flash_attn_interface on Hopper, else FA2's flash_attn)."""
    present = [name for name in ("flash_attn_interface", "flash_attn") if importlib.util.find_spec(name)]
    if not present:
        pytest.skip("flash-attn is not installed (pip install -r requirements-gpu.txt)")
    for name in present:
        try:
            importlib.import_module(name)
            return name
        except (ImportError, OSError) as err:
            problem = f"{name}: {type(err).__name__}: {err}"
    pytest.fail(f"flash-attn is installed but does not import ({problem}); reinstall it for this torch and CUDA")


@contextlib.contextmanager
def sync_mode(mode: str, then: str):
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(then)


def build(tmp_path):
    """parcae-tiny in bf16 on CUDA, compiled, flash attention; its optimizer, a fixed pinned batch and its depths."""
    from megaloop.config import load_config
    from megaloop.depth import make_sampler
    from megaloop.train.flops import FlopModel
    from megaloop.train.loop import build_model_and_optimizer
    from megaloop.train.runtime import SingleProcessRuntime

    cfg = load_config(str(REPO / "configs" / "parcae-tiny.yaml"),
                      ["train.device=cuda", "train.precision=bf16", "train.compile=true", "model.attention=auto",
                       f"train.out_dir={tmp_path}", f"data.global_batch_size={ROWS}", "data.micro_batch_size=4"],
                      validate=False)
    device = torch.device(cfg.train.device)
    runtime = SingleProcessRuntime(device)
    model, optimizer = build_model_and_optimizer(cfg, runtime, device)
    g = torch.Generator().manual_seed(0)
    batch = {"tokens": torch.randint(0, cfg.model.vocab_size, (ROWS, cfg.model.seq_len + 1), generator=g).pin_memory(),
             "sample_index": torch.arange(ROWS)}
    sampler = make_sampler(cfg.model.depth_sampler, cfg.model.mu_rec, cfg.model.backprop_depth, seed=cfg.train.seed)
    return cfg, runtime, model, optimizer, batch, sampler, FlopModel.of(cfg.model)


def test_whole_compiled_step_with_flash_attn_has_no_stray_sync(tmp_path):
    from megaloop.train.step import reduce_step, train_step

    module = require_flash_attn()
    cfg, runtime, model, optimizer, batch, sampler, flops = build(tmp_path)
    step = 0
    depths = sampler.sample(step, batch["sample_index"])

    def run(loop_guard=contextlib.nullcontext):
        return train_step(model, optimizer, batch, depths, step, cfg.train.seed, cfg, runtime, flops,
                          loop_guard=loop_guard)

    for _ in range(2):  # compile every graph this batch's depths need, outside the measured step
        run()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with sync_mode("warn", then="default"):
            stats = run(loop_guard=lambda: sync_mode("error", then="warn"))
            drained = stats.summed.done.query()  # the statistics' host copy completed: the clip synced past it
            figures = reduce_step(stats, runtime)
        torch.cuda.synchronize()
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    print(f"one compiled bf16 step of parcae-tiny with {module} ({ROWS} rows, depths {depths.T.tolist()}): micro-batch "
          f"loops without a host sync (mode error); {len(syncs)} synchronisations in the whole step (mode warn): "
          f"{syncs}")
    assert torch.isfinite(torch.as_tensor(stats.record.grad_norm)).all()
    assert len(syncs) <= STEP_SYNCS, syncs
    assert drained and figures.tokens == ROWS * cfg.model.seq_len
