"""Redraw a bench folder's speedup and accuracy-vs-speedup plots from its summary.json with
the current plot code (short, wrapped method labels; the runs here were drawn before it).
Usage: python replot.py BENCH_DIR PREFIX  → PREFIX-speedup.png, PREFIX-accuracy-vs-speedup.png"""
import dataclasses
import json
import sys
from pathlib import Path

from selfspec.bench.metrics import MethodSummary
from selfspec.bench.plots import plot_accuracy_vs_speedup, plot_speedup

folder, prefix = Path(sys.argv[1]), sys.argv[2]
names = {f.name for f in dataclasses.fields(MethodSummary)}
rows = json.loads((folder / "summary.json").read_text())["methods"]
summaries = [MethodSummary(**{k: v for k, v in row.items() if k in names}) for row in rows]
print(plot_speedup(summaries, Path(f"{prefix}-speedup.png")))
print(plot_accuracy_vs_speedup(summaries, Path(f"{prefix}-accuracy-vs-speedup.png")))
