"""Matplotlib helpers shared by the studies (Agg backend; fixed sizes and no timestamps, so a figure depends on its
data only)."""
from __future__ import annotations

from pathlib import Path


def new_figure(ncols: int = 1, width: float = 5.0, height: float = 3.6):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])


def save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)
