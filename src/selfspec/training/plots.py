"""Calibration plots (PNG, matplotlib's Agg backend): ROC curves per head and metric
(DSSD Figure 1) and the ε sweep (coverage and precision of τ_k(ε), DSSD §4.2)."""

from __future__ import annotations

import logging
from pathlib import Path

from selfspec.heads.files import ExitHeads
from selfspec.training.calibration import roc_auc, roc_curve

logger = logging.getLogger(__name__)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: never open a window
    import matplotlib.pyplot as plt

    return plt


def plot_roc(heads: ExitHeads, path: Path) -> Path:
    """One panel per head with the ROC curve of each metric (AUC in the legend)."""
    plt = _pyplot()
    layers = [layer for layer in heads.layers if layer in heads.calibration]
    fig, axes = plt.subplots(1, max(1, len(layers)), figsize=(3.6 * max(1, len(layers)), 3.6),
                             squeeze=False)
    for ax, layer in zip(axes[0], layers, strict=False):
        data = heads.calibration[layer]
        for metric, scores in data.scores.items():
            curve = roc_curve(scores, data.correct)
            auc = roc_auc(scores, data.correct)
            ax.plot(curve.fpr, curve.tpr, label=f"{metric} (AUC {auc:.3f})")
        ax.plot([0, 1], [0, 1], color="grey", linewidth=0.5, linestyle=":")
        accuracy = float(data.correct.float().mean())
        ax.set_title(f"head at layer {layer} (acc {accuracy:.2f})", fontsize=9)
        ax.set_xlabel("false-positive rate")
        ax.set_ylabel("true-positive rate")
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{heads.card.model}: confidence vs agreement with the final layer", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_epsilon_sweep(heads: ExitHeads, path: Path, metric: str = "entropy") -> Path:
    """Calibration coverage (solid) and test precision (dashed) of τ_k(ε) against ε."""
    plt = _pyplot()
    fig, (ax_cov, ax_prec) = plt.subplots(1, 2, figsize=(8, 3.6))
    for cal in heads.card.calibration:
        m = cal.metric(metric)
        if m is None:
            continue
        eps = [r.epsilon for r in m.thresholds]
        line, = ax_cov.plot(eps, [r.coverage for r in m.thresholds], marker="o", markersize=3,
                            label=f"layer {cal.layer}")
        ax_prec.plot(eps, [r.test_precision for r in m.thresholds], marker="o", markersize=3,
                     linestyle="--", color=line.get_color(), label=f"layer {cal.layer}")
    ax_cov.set_xlabel("ε")
    ax_cov.set_ylabel("fraction of tokens exiting (calibration)")
    ax_prec.plot([0.5, 1.0], [0.5, 1.0], color="grey", linewidth=0.5, linestyle=":")
    ax_prec.set_xlabel("ε")
    ax_prec.set_ylabel("agreement of exiting tokens (test)")
    for ax in (ax_cov, ax_prec):
        ax.legend(fontsize=7)
    fig.suptitle(f"{heads.card.model}: τ_k(ε) with the {metric} metric", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
