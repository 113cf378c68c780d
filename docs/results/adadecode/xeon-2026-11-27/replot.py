"""Redraw a finished bench run's sweep plots with the current plotting code."""
import sys
from pathlib import Path
from selfspec.bench import plots
from selfspec.bench.harness import BenchRun
from selfspec.bench.metrics import summarize
from selfspec.bench.outdir import read_saved_run
from selfspec.bench.spec import parse_methods
folder, out = Path(sys.argv[1]), Path(sys.argv[2])
saved = read_saved_run(folder)
labels = list(saved.settings["methods"])
configs = parse_methods(",".join(labels))
run = BenchRun(methods=labels, lossless={c.label: True for c in configs})
run.records.extend(r for r in saved.records if r.warmup is False) if hasattr(saved.records[0], "warmup") else run.records.extend(saved.records)
summaries = summarize(run, greedy=True)
print(plots.plot_sweeps(configs, summaries, out))
