"""The picture of a law fit (`laws fit --plot PNG`): the points and the fitted law."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(figsize=(6, 4), dpi=120)


def plot_fit(law: str, cols: dict, result: dict, path: Path) -> None:
    from megaloop.laws.forms import LAWS, TESTTIME_FORMS

    plt, fig, ax = _figure()
    if law in ("testtime", "unified"):
        x = cols["T"] / cols["mu_rec"] if law == "unified" else cols["T"]
        ax.scatter(x, cols["loss"], s=12, color="k", label="points", zorder=3)
        grid = np.linspace(max(x.min(), 1e-3), x.max(), 200)
        forms = {law: LAWS[law]} if law == "unified" else TESTTIME_FORMS
        for name, form in forms.items():
            values = {k: result[name][k]["value"] if law == "testtime" else result[k]["value"] for k in form.names}
            c = {"T": grid, "mu_rec": np.ones_like(grid)}
            style = "-" if law == "unified" or name == result["selected"] else "--"
            ax.plot(grid, form.predict(values, c), style, label=f"{name}: {form.formula}")
        ax.set_xlabel("T / mu_rec" if law == "unified" else "test-time depth T")
        ax.set_ylabel("validation loss")
    elif law == "isoflop":
        for tag, label in (("mu", "mu*"), ("D", "D*")):
            if f"gamma_{tag}" not in result:
                continue
            c = np.array([b["flops"] for b in result["budgets"]])
            opt = np.array([b[f"{tag}_opt"] for b in result["budgets"]])
            g, ref = result[f"gamma_{tag}"]["value"], result[f"{tag}_ref"]["value"]
            ax.loglog(c, opt, "o", label=f"{label} per budget")
            ax.loglog(c, ref * (c / result["C_ref"]) ** g, "-", label=f"{label} ~ C^{g:.3f}")
        ax.set_xlabel("training FLOPs C")
        ax.set_ylabel("optimum")
    else:
        form = LAWS[law]
        pred = form.predict({k: result[k]["value"] for k in form.names}, cols)
        ax.scatter(pred, cols["loss"], s=12, color="k", label=f"{len(pred)} points")
        lo, hi = min(pred.min(), cols["loss"].min()), max(pred.max(), cols["loss"].max())
        ax.plot([lo, hi], [lo, hi], "-", color="gray")
        ax.set_xlabel(f"fitted {form.formula}")
        ax.set_ylabel("measured loss")
    ax.set_title(f"{law} law")
    ax.legend(fontsize=6)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
