"""Schedules at hand-computed steps, and OptimConfig validation."""

import dataclasses

import pytest

from megaloop.optim import OptimConfig, lr_multiplier, muon_momentum, muon_weight_decay, scheduled_values
from megaloop.optim.schedule import check_schedule


@pytest.mark.parametrize("step, expected", [(0, 0.85), (150, 0.90), (300, 0.95), (400, 0.95), (30, 0.86)])
def test_muon_momentum_warmup(step, expected):
    assert muon_momentum(step, 0.85, 0.95, 300) == pytest.approx(expected, abs=1e-15)


def test_muon_momentum_without_warmup_is_the_final_value():
    assert muon_momentum(0, 0.85, 0.95, 0) == 0.95


# total 1000 steps, cool-down over the last 500 (starting after step 500), to 0: 1 - (step - 500) / 500.
@pytest.mark.parametrize(
    "step, expected", [(0, 1.0), (250, 1.0), (500, 1.0), (501, 0.998), (750, 0.5), (999, 0.002), (1000, 0.0)]
)
def test_trapezoid_reference_default(step, expected):
    assert lr_multiplier(step, 1000) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    "step, expected",
    [(0, 0.1), (4, 0.5), (9, 1.0), (10, 1.0), (800, 1.0), (900, 0.1 + 0.9 * 0.5), (999, 0.1 + 0.9 * 0.005),
     (1000, 0.1), (1200, 0.1)],
)
def test_trapezoid_with_warmup_and_final_fraction(step, expected):
    got = lr_multiplier(step, 1000, warmup_steps=10, cooldown_fraction=0.2, final_lr_fraction=0.1)
    assert got == pytest.approx(expected, abs=1e-12)


def test_no_cooldown_is_constant():
    assert [lr_multiplier(s, 10, cooldown_fraction=0.0) for s in range(10)] == [1.0] * 10


@pytest.mark.parametrize("step, expected", [(0, 0.2), (250, 0.15), (500, 0.1), (999, 0.0002), (1000, 0.0), (1100, 0.0)])
def test_muon_weight_decay_linear_in_step(step, expected):
    assert muon_weight_decay(step, 1000, 0.2) == pytest.approx(expected, abs=1e-12)


def test_scheduled_values_combine_the_three():
    values = scheduled_values(OptimConfig(), 750, 1000)
    assert values.lr_multiplier == pytest.approx(0.5)
    assert values.matrix_lr == pytest.approx(4e-3) and values.adam_lr == pytest.approx(4e-3)
    assert values.muon_momentum == pytest.approx(0.95)
    assert values.muon_weight_decay == pytest.approx(0.05)


def test_schedule_rejects_overlapping_warmup_and_short_runs():
    with pytest.raises(ValueError, match="warmup_steps = 60 overlaps the cool-down"):
        check_schedule(100, 60, 0.5)
    with pytest.raises(ValueError, match="total_steps"):
        check_schedule(0, 0, 0.5)
    with pytest.raises(ValueError, match="counted from 0"):
        lr_multiplier(-1, 10)


def test_default_config_is_the_reference_and_valid():
    cfg = OptimConfig().validate()
    assert (cfg.matrix_lr, cfg.adam_lr, cfg.betas, cfg.eps, cfg.adam_weight_decay) == (8e-3, 8e-3, (0.8, 0.95), 1e-10, 0)
    assert (cfg.muon_momentum, cfg.muon_momentum_warmup_steps, cfg.muon_weight_decay) == ((0.85, 0.95), 300, 0.2)
    assert (cfg.normuon_beta2, cfg.ns_steps, cfg.grad_clip, cfg.warmup_steps) == (0.95, 5, 1.0, 0)
    assert (cfg.cooldown_fraction, cfg.final_lr_fraction, cfg.nesterov, cfg.name) == (0.5, 0.0, True, "muon")


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("name", "sgd", "one of ('muon', 'adamw')"),
        ("matrix_lr", 0.0, "> 0"),
        ("adam_lr", float("nan"), "> 0"),
        ("eps", -1e-8, "> 0"),
        ("muon_weight_decay", -0.1, ">= 0"),
        ("grad_clip", "1.0", ">= 0"),
        ("betas", (0.9,), "two numbers"),
        ("betas", (0.9, 1.0), "two numbers"),
        ("muon_momentum", (0.85, 1.5), "two numbers"),
        ("normuon_beta2", 1.0, "[0, 1)"),
        ("ns_steps", 6, "1..5"),
        ("ns_steps", 2.0, "1..5"),
        ("warmup_steps", -1, ">= 0"),
        ("muon_momentum_warmup_steps", True, ">= 0"),
        ("cooldown_fraction", 1.5, "[0, 1]"),
        ("final_lr_fraction", -0.1, "[0, 1]"),
        ("nesterov", "yes", "True or False"),
    ],
)
def test_validate_names_the_field_and_allowed_values(field, value, allowed):
    cfg = dataclasses.replace(OptimConfig(), **{field: value})
    with pytest.raises(ValueError) as info:
        cfg.validate()
    assert f"optim.{field} = " in str(info.value) and allowed in str(info.value)


def test_lists_from_yaml_are_accepted():
    OptimConfig(betas=[0.9, 0.95], muon_momentum=[0.85, 0.95]).validate()
