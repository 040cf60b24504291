"""Pipeline-parallel layouts (parallel.pp > 1) are checked at config load, before any process group: more stages
than core blocks, fewer micro-batches than stages, the DeepSpeed engine; a valid one loads. The micro-batch rule is checked against the ring generator and simulator themselves."""
from pathlib import Path

import pytest

from megaloop.config import ConfigError, load_config
from pipeline.ring import MicroBatch, ring_schedule, simulate

TINY = Path(__file__).resolve().parents[2] / "configs" / "parcae-tiny.yaml"  # n_core 2, batch 16 of micro 8


def _error(overrides, world_size=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(TINY, overrides, world_size=world_size)
    return str(info.value)


def test_more_stages_than_core_blocks():
    message = _error(["parallel.pp=8", "model.n_core=4"])
    assert "parallel.pp=8" in message and "the core has 4 blocks" in message and "use parallel.pp <= 4" in message


def test_deepspeed_engine_refused_with_the_fix():
    message = _error(["parallel.pp=2", "parallel.engine=deepspeed", "optim.name=adamw"])
    assert "parallel.pp=2" in message and "parallel.engine=deepspeed" in message
    assert "data parallelism only" in message and "use parallel.engine=native" in message


@pytest.mark.parametrize("overrides,world,dp,m,fixes", [
    (["parallel.pp=2", "data.micro_batch_size=16"], None, 1, 1,
     ["data.micro_batch_size=8", "data.global_batch_size=32"]),
    (["parallel.pp=2", "data.global_batch_size=32"], 8, 4, 1, ["data.micro_batch_size=4", "data.global_batch_size=64"]),
    (["parallel.pp=4", "model.n_core=4", "data.global_batch_size=8", "data.micro_batch_size=2", "parallel.dp=2"],
     None, 2, 2, ["data.micro_batch_size=1", "data.global_batch_size=16"]),
])
def test_too_few_micro_batches_names_the_count_and_the_fix(overrides, world, dp, m, fixes):
    """m = global / (micro x dp) micro-batches per rank must be >= pp: the message names m, the data values and
    which values work; each named fix then passes every check."""
    pp = int(overrides[0].split("=")[1])
    message = _error(overrides, world)
    assert f"parallel.pp={pp}" in message and f"gives {m}" in message and f"dp={dp}" in message, message
    for fix in fixes:
        assert fix in message, message
        load_config(TINY, overrides + [fix], world_size=world)


@pytest.mark.parametrize("pp", [2, 4])
def test_the_micro_batch_rule_matches_the_ring_schedule(pp):
    """The generator schedules any m >= 1 without deadlock (the simulator checks it), but with m < pp micro-batches
    at most m ranks compute at once, so the ring is at least 1 - m/pp idle; with m = pp all pp ranks do at once."""
    for m in (pp - 1, pp):
        specs = [MicroBatch(3, 2) for _ in range(m)]
        result = simulate(ring_schedule(specs, pp, 3 * pp), specs)
        starts = sorted({start for _, start, _, _ in result.intervals})
        busiest = max(sum(1 for _, a, b, _ in result.intervals if a <= t < b) for t in starts)
        assert busiest == min(m, pp)
        if m < pp:
            assert result.idle_fraction >= 1 - m / pp - 1e-12


def test_valid_layout_loads_and_bad_in_flight_is_refused():
    overrides = ["parallel.pp=2", "parallel.tp=2", "data.global_batch_size=32"]
    assert "parallel.pp_in_flight" in _error(overrides + ["parallel.pp_in_flight=0"], world_size=8)
    cfg = load_config(TINY, overrides, world_size=8)
    assert cfg.dp_size(8) == 2


def test_train_command_fails_at_config_load(capsys):
    from megaloop.__main__ import main

    code = main(["train", str(TINY), "--set", "parallel.pp=4", "--set", "model.n_core=2"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "parallel.pp=4" in err and "use parallel.pp <= 2" in err
