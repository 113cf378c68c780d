"""Peak resident memory per generation: resettable on Linux, recorded per record, the
largest per method in the table."""

from __future__ import annotations

import numpy as np
import pytest

from selfspec.bench.harness import run_bench
from selfspec.bench.memory import PeakRss
from selfspec.bench.metrics import summarize
from selfspec.bench.report import (
    TABLE_COLUMNS,
    markdown_table,
    record_from_json,
    record_json,
)
from selfspec.bench.runners import EncodedPrompt, RunSettings

from bench_helpers import ScriptedRunner
from bench_helpers import run_output as _out

needs_proc = pytest.mark.skipif(not PeakRss.probe().available,
                                reason="no resettable VmHWM (/proc/self/clear_refs) here")


@needs_proc
def test_the_peak_follows_an_allocation_and_resets():
    probe = PeakRss.probe()
    probe.reset()
    before = probe.read_mib()
    block = np.ones(64 << 20, dtype=np.uint8)  # 64 MiB, touched
    during = probe.read_mib()
    del block
    probe.reset()
    assert during - before > 50 and probe.read_mib() < during - 50


class _Allocating(ScriptedRunner):
    """Touches ``mib`` MiB while it runs."""

    def __init__(self, label, outputs, mib):
        super().__init__(label, outputs, [])
        self.mib = mib

    def run(self, prompt, settings):
        block = np.ones(self.mib << 20, dtype=np.uint8)
        del block
        return super().run(prompt, settings)


@needs_proc
def test_each_method_gets_its_own_peak_not_the_process_maximum():
    prompts = [EncodedPrompt("p0", [1, 2])]
    outputs = {"p0": _out([1, 2], 1.0)}
    big, small = _Allocating("ar", outputs, 200), _Allocating("hf-ar", outputs, 0)
    run = run_bench([big, small], prompts, RunSettings(2), warmup_prompts=0)
    peaks = {r.method: r.peak_rss_mib for r in run.records}
    assert peaks["ar"] - peaks["hf-ar"] > 150  # small ran after big: its peak was reset
    summaries = summarize(run, greedy=True)
    assert summaries[0].peak_rss_mib == peaks["ar"]
    assert "peak RSS MiB" in TABLE_COLUMNS and f"{peaks['ar']:.0f}" in markdown_table(summaries)
    back = record_from_json(record_json(run.records[0], None))
    assert back.peak_rss_mib == peaks["ar"]


def test_no_proc_means_no_number_rather_than_a_wrong_one():
    probe = PeakRss(available=False)
    probe.reset()
    assert probe.read_mib() is None
