"""PNG plots of a benchmark run (matplotlib, Agg backend: no display needed).

- ``speedup.png``: speedup of each method (vs ``ar``, else ``hf-ar``, else raw tok/s).
- ``acceptance-vs-exit-layer.png``: acceptance rate against ``exit_layer``, one line per
  method and other options (when some method sets ``exit_layer``).
- ``sweep-<method>-<option>.png``: speedup against an option that takes two or more
  numeric values in the run (γ, ε, draft_len, exit_layer), one line per setting of the
  other options; for a drafting method, beside it the draft rate (drafts per generated
  token: AdaDecode's early-prediction rate) and the rejection rate (1 − acceptance), the
  three panels of AdaDecode's Figure 5.
- ``accuracy-vs-speedup.png``: task accuracy against speedup, one point per method, the
  Pareto frontier drawn through the points no other point beats on both (SpecEE Figure 1's
  view; when two or more methods were scored).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath

from selfspec.bench.metrics import MethodSummary
from selfspec.bench.spec import MethodConfig
from selfspec.extras import BENCH_INSTALL, require_module


@dataclass(frozen=True)
class _Measure:
    """Which metric the y axis shows."""

    attr: str
    label: str


def _speed_measure(summaries: Sequence[MethodSummary]) -> _Measure:
    for attr, label in (("speedup_vs_ar", "speedup vs ar"),
                        ("speedup_vs_hf_ar", "speedup vs hf-ar")):
        if any(getattr(s, attr) is not None for s in summaries):
            return _Measure(attr, label)
    return _Measure("tokens_per_s", "tokens / s")


_PATH_VALUE = re.compile(r"(?<==)[^,=()\s]*/[^,=()\s]*")
LABEL_WIDTH = 34  # characters per line of a method's label in a plot


def _short_path(match: re.Match) -> str:
    path = PurePath(match.group(0).rstrip("/"))
    # a head file is named by its folder (``.../lensstate/heads.safetensors`` → lensstate)
    return path.parent.name if path.suffix == ".safetensors" and path.parent.name else path.name


def plot_label(method: str, width: int = LABEL_WIDTH) -> str:
    """A method's label for a plot: file and folder values shortened to their name
    (``heads=/root/.cache/.../lensstate`` → ``heads=lensstate``), then wrapped between
    options at ``width`` characters, so that long method specs do not squeeze the axes.
    The report's tables keep the full spec."""
    text = _PATH_VALUE.sub(_short_path, method)
    lines = [""]
    for part in re.split(r"(?<=[,:])", text):  # break after an option's comma or the colon
        if lines[-1] and len(lines[-1]) + len(part) > width:
            lines.append("")
        lines[-1] += part
    return "\n".join(lines)


def require_matplotlib() -> None:
    """Check, before a run, that the plots can be drawn.

    Raises:
        MissingDependencyError: matplotlib is not installed (the message gives the pip
            command, or ``--no-plots``).
    """
    require_module("matplotlib", "selfspec bench's PNG plots",
                   f"{BENCH_INSTALL} (or pass --no-plots)")


def _pyplot():
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    return plt


def plot_speedup(summaries: Sequence[MethodSummary], path: Path) -> Path:
    """Horizontal bars, one per method; failed methods are shown as "failed"."""
    plt = _pyplot()
    measure = _speed_measure(summaries)
    names = [plot_label(s.method) for s in summaries]
    lines = sum(name.count("\n") + 1 for name in names)
    fig, ax = plt.subplots(figsize=(8, 0.3 * lines + 0.2 * len(summaries) + 1.5))
    values = [getattr(s, measure.attr) or 0.0 for s in summaries]
    bars = ax.barh(range(len(names)), values,
                   color=["tab:gray" if s.method in ("ar", "hf-ar") else "tab:blue"
                          for s in summaries])
    for bar, s, v in zip(bars, summaries, values):
        text = "failed" if s.failed else f"{v:.2f}"
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " " + text, va="center")
    ax.set_xlim(0, max(values + [1e-9]) * 1.18)  # room for the value labels
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    if measure.attr != "tokens_per_s":
        ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel(measure.label)
    ax.set_title("Decoding speed per method")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _others(config: MethodConfig, key: str) -> str:
    rest = ",".join(f"{k}={v}" for k, v in config.options.items() if k != key)
    return plot_label(config.name + (f" ({rest})" if rest else ""))


def _numeric(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _line_plot(points: dict[str, list[tuple[float, float]]], xlabel: str, ylabel: str,
               title: str, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in sorted(points.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_title(title)
    return _save_axes(plt, fig, ax, xlabel, ylabel, path)


def _save_axes(plt, fig, ax, xlabel: str, ylabel: str, path: Path) -> Path:
    """Label, grid and legend one plot's axes, write it to ``path`` and close it."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_acceptance_vs_exit_layer(configs: Sequence[MethodConfig],
                                  summaries: Sequence[MethodSummary], path: Path) -> Path | None:
    """Acceptance rate against ``exit_layer``; None (nothing written) when no method of the
    run sets ``exit_layer`` and reports an acceptance rate."""
    points: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for config, s in zip(configs, summaries):
        layer = config.options.get("exit_layer")
        if _numeric(layer) and s.acceptance_rate is not None:
            points[_others(config, "exit_layer")].append((layer, s.acceptance_rate))
    if not points:
        return None
    return _line_plot(points, "exit_layer (layers run by the draft)", "acceptance rate",
                      "Acceptance vs exit layer", path)


def plot_sweeps(configs: Sequence[MethodConfig], summaries: Sequence[MethodSummary],
                out_dir: Path) -> list[Path]:
    """One plot per (method, option) swept over two or more numeric values."""
    measure = _speed_measure(summaries)
    configs = [_with_default_sweep_values(c, configs) for c in configs]
    values: dict[tuple[str, str], set] = defaultdict(set)
    for config in configs:
        for key, value in config.options.items():
            if _numeric(value):
                values[(config.name, key)].add(value)
    paths = []
    for (name, key), seen in sorted(values.items()):
        if len(seen) < 2:
            continue
        panels = [(measure.label, lambda s: getattr(s, measure.attr))]
        swept = [s for c, s in zip(configs, summaries) if c.name == name]
        if any(s.draft_rate is not None for s in swept):
            panels += [("drafts / generated token", lambda s: s.draft_rate),
                       ("rejection rate", lambda s: (None if s.acceptance_rate is None
                                                     else 1 - s.acceptance_rate))]
        series = []
        for label, get in panels:
            points: dict[str, list[tuple[float, float]]] = defaultdict(list)
            for config, s in zip(configs, summaries):
                y = get(s)
                if config.name == name and _numeric(config.options.get(key)) and y is not None:
                    points[_others(config, key)].append((config.options[key], y))
            series.append((label, points))
        if series[0][1]:
            safe = re.sub(r"[^A-Za-z0-9_-]+", "_", f"sweep-{name}-{key}")
            paths.append(_panels_plot(series, key, f"{name}, by {key}", out_dir / f"{safe}.png"))
    return paths


def _with_default_sweep_values(config: MethodConfig, configs: Sequence[MethodConfig]
                               ) -> MethodConfig:
    """``config`` with the defaults of options that other configs of its method set
    numerically (a sweep's "default" row, e.g. AdaDecode's γ = 0.75, then lands on the curve)."""
    from dataclasses import fields, replace

    from selfspec.methods.registry import METHODS

    spec = METHODS.get(config.name)
    if spec is None:
        return config
    swept = {k for c in configs if c.name == config.name for k, v in c.options.items()
             if _numeric(v)}
    swept -= spec.unused_when(spec.parse(config.method_options))  # e.g. AdaDecode's tuned=true
    defaults = {f.name: f.default for f in fields(spec.options)}
    extra = {k: defaults[k] for k in swept - set(config.options)
             if _numeric(defaults.get(k))}
    return replace(config, options={**config.options, **extra}) if extra else config


def _panels_plot(series: list[tuple[str, dict[str, list[tuple[float, float]]]]], xlabel: str,
                 title: str, path: Path) -> Path:
    """One panel per ``(ylabel, {line: points})``, side by side, sharing the x axis."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(series), figsize=(5.5 * len(series), 4.2), squeeze=False)
    for ax, (ylabel, points) in zip(axes[0], series):
        for name, pts in sorted(points.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def pareto_front(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points ``(speed, accuracy)`` that no other point beats on both (ties kept),
    sorted by speed."""
    front = [p for p in points
             if not any(q[0] >= p[0] and q[1] >= p[1] and q != p for q in points)]
    return sorted(set(front))


def plot_accuracy_vs_speedup(summaries: Sequence[MethodSummary], path: Path) -> Path | None:
    """Accuracy against speed, one labelled point per method, and the Pareto frontier;
    ``None`` (nothing written) when fewer than two methods have both."""
    measure = _speed_measure(summaries)
    points = [(getattr(s, measure.attr), s.accuracy, s.method) for s in summaries
              if s.accuracy is not None and getattr(s, measure.attr) is not None]
    if len(points) < 2:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5))
    ax.scatter([p[0] for p in points], [100 * p[1] for p in points], zorder=3)
    for x, y, label in points:
        ax.annotate(plot_label(label), (x, 100 * y), fontsize=7, xytext=(4, 3),
                    textcoords="offset points")
    front = pareto_front([(x, y) for x, y, _ in points])
    ax.plot([p[0] for p in front], [100 * p[1] for p in front], "--", color="grey",
            label="Pareto frontier", zorder=2)
    ax.margins(x=0.2)  # room for the rightmost point's label inside the figure
    return _save_axes(plt, fig, ax, measure.label, "accuracy (%)", path)


def write_plots(configs: Sequence[MethodConfig], summaries: Sequence[MethodSummary],
                out_dir: Path) -> list[Path]:
    """Write every plot that applies to the run; returns their paths.

    Raises:
        MissingDependencyError: matplotlib is not installed.
    """
    paths = [plot_speedup(summaries, out_dir / "speedup.png")]
    acceptance = plot_acceptance_vs_exit_layer(configs, summaries,
                                               out_dir / "acceptance-vs-exit-layer.png")
    if acceptance is not None:
        paths.append(acceptance)
    pareto = plot_accuracy_vs_speedup(summaries, out_dir / "accuracy-vs-speedup.png")
    if pareto is not None:
        paths.append(pareto)
    return paths + plot_sweeps(configs, summaries, out_dir)
