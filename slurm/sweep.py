"""An isoFLOP grid: every (FLOP budget, mu_rec) pair is one training run whose token count is the budget divided by
the FLOPs per token at that mu_rec (megaloop's FLOP model, slurm/flops.py), trained as
train.steps = round(tokens / (global_batch_size * seq_len)) steps, so the trained tokens are within half a step of
budget / FLOPs-per-token. Each run gets its own out_dir; all of them are one job array."""
from __future__ import annotations

import math
from pathlib import Path

from slurm.ask import Cost
from slurm.options import OptionError
from slurm.spec import Point


def parse_list(option: str, value: str, kind):
    """'2,4,8' -> [2, 4, 8]; '1e15,3e15' -> [1e15, 3e15]; duplicates refused, order kept."""
    try:
        items = [kind(v.strip()) for v in value.split(",")]
    except ValueError:
        raise OptionError(option, value, f"must be comma-separated {'integers' if kind is int else 'numbers'}, "
                                         "e.g. 2,4,8,16 or 1e18,3e18") from None
    if not items or any(not x > 0 for x in items) or len(set(items)) != len(items):
        raise OptionError(option, value, "must be distinct positive values")
    return items


def budget_tag(budget: float) -> str:
    """1e+15 -> '1e15', 3.5e+18 -> '3.5e18': short and free of characters that need quoting."""
    mantissa, _, exponent = f"{budget:.3g}".partition("e")
    return f"{mantissa}e{int(exponent)}" if exponent else mantissa


def mu_bwd_override(value: str) -> list[str]:
    """--mu-bwd: half (ceil(mu_rec / 2) at every point, the paper's recipe), config (as the config sets it) or N."""
    if value == "half":
        return ["model.mu_bwd=null"]
    if value == "config":
        return []
    if value.isdigit() and int(value) >= 1:
        return [f"model.mu_bwd={int(value)}"]
    raise OptionError("--mu-bwd", value, "must be half (ceil(mu_rec/2)), config (the config's value) or a positive "
                                         "integer")


def grid(mu_values: list[int], budgets: list[float], costs: dict[int, Cost], root: str,
         fixed: list[str] = ()) -> list[Point]:
    """Every (budget, mu_rec) pair, budgets outer; `fixed`: overrides of every point (the --mu-bwd choice)."""
    points = []
    for budget in budgets:
        for mu in mu_values:
            cost = costs[mu]
            tokens = budget / cost.flops_per_token
            steps = round(tokens / cost.tokens_per_step)
            if steps < 1:
                least = max(c.flops_per_token * c.tokens_per_step for c in costs.values())  # a step at every mu
                raise OptionError("--flops", f"{budget:g}", f"buys {tokens:.3g} tokens at mu_rec={mu}, less than one "
                                                            f"step of {cost.tokens_per_step} tokens; raise the budget "
                                                            f"to {_round_up(least)} or more")
            overrides = (f"model.mu_rec={mu}", *fixed, f"train.steps={steps}")
            points.append(Point(len(points), mu, cost.mu_bwd, budget, cost.flops_per_token, cost.tokens_per_step,
                                steps, str(Path(root) / f"mu{mu}-{budget_tag(budget)}"), overrides))
    return points


def _round_up(value: float) -> str:
    """`value` written with 3 significant digits, rounded up (so the budget it names buys what it must)."""
    exponent = math.floor(math.log10(value)) - 2
    return f"{math.ceil(value / 10 ** exponent) * 10 ** exponent:.3g}"
