"""What the scripts' small-multiple figures share."""

from __future__ import annotations


def shared_legend(fig, axes, reference: str, color: str, width: float, ncol: int | None = None) -> None:
    """One legend for all panels of ``fig``: each label once, in the order first drawn, and the grey
    ``reference`` line drawn behind every panel; in ``ncol`` columns (default: one row)."""
    import matplotlib.pyplot as plt

    handles, labels = [], []
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    fig.legend(handles + [plt.Line2D([], [], color=color, lw=width)], labels + [reference],
               loc="upper right", fontsize=8, ncol=ncol or len(labels) + 1)
