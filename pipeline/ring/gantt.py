"""A Gantt chart (PNG, matplotlib's Agg backend) of a simulated schedule: one row per rank, one bar per compute
action, coloured by kind (forward with and without autograd, backward, embedding/loss), labelled with its
micro-batch where the bar is wide enough."""
from __future__ import annotations

from pathlib import Path

from pipeline.ring.actions import Backward, Embed, EmbedBackward, Forward, Loss, LossBackward
from pipeline.ring.simulate import SimResult

COLOURS = {"forward": "#4c72b0", "forward (no autograd)": "#a6c8e8", "backward": "#dd8452",
           "embed / loss": "#55a868", "embed / loss backward": "#2d6a3e"}


def _kind(action) -> str:
    if isinstance(action, Forward):
        return "forward" if action.grad else "forward (no autograd)"
    if isinstance(action, Backward):
        return "backward"
    if isinstance(action, (Embed, Loss)):
        return "embed / loss"
    assert isinstance(action, (EmbedBackward, LossBackward))
    return "embed / loss backward"


def gantt_chart(result: SimResult, path: str | Path, title: str = "", width: float = 14.0, dpi: int = 80) -> Path:
    """Draws `result` (from `simulate`) into the PNG file `path` and returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    pp = len(result.busy)
    fig, ax = plt.subplots(figsize=(width, 0.45 * pp + 1.4), dpi=dpi)
    min_label = result.makespan / (width * 6) if result.makespan else 0.0
    for rank, start, end, action in result.intervals:
        if end <= start:
            continue
        ax.barh(rank, end - start, left=start, height=0.8, color=COLOURS[_kind(action)], edgecolor="white",
                linewidth=0.3)
        if end - start >= min_label:
            ax.text((start + end) / 2, rank, str(action.mb), ha="center", va="center", fontsize=6)
    ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
    ax.invert_yaxis()
    ax.set_xlim(0, result.makespan)
    ax.set_xlabel("time (forward lap segment = 1)")
    ax.set_title(title or f"makespan {result.makespan:g}, idle {100 * result.idle_fraction:.1f}%", fontsize=9,
                 pad=18)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], loc="lower center", ncol=5,
              fontsize=7, bbox_to_anchor=(0.5, 1.0), frameon=False)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
