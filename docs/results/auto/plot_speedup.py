"""The README's speedup plot: `auto` against selfspec's own `ar` (× `ar`, same run, prefill
included, 100% greedy parity in every row), from the reports in this folder.

    python docs/results/auto/plot_speedup.py   # writes docs/results/auto/speedup-auto-vs-ar.png

Figures copied from (one `selfspec bench` run per model and dataset, held-out prompts, bf16,
greedy, 2 threads):
- AMX Xeon: bench-2026-11-26-xeon-tpt/ (README.md, section "2026-11-26 (night, AMX Xeon)").
- AVX2 EPYC, SmolLM2: bench-2026-11-26-seven/ (section "2026-11-26 (evening)").
- AVX2 EPYC, Qwen: bench-2026-11-26-he-prefetch/qwen-*-new-default.md (section "2026-11-26
  (late)"), the only Qwen runs against today's default `ar` (selfspec's bf16 kernel); GSM
  and sharegpt-summarize were not run against it.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DATASETS = ("HumanEval", "MT-Bench", "GSM", "summarize")
NAN = float("nan")
ROWS = {  # label -> auto × ar per dataset
    "Qwen2.5-Coder-1.5B, AMX Xeon": (2.48, 2.04, 2.37, 1.72),
    "SmolLM2-135M, AMX Xeon": (2.36, 1.99, 2.28, 1.69),
    "Qwen2.5-Coder-1.5B, AVX2 EPYC": (1.34, 1.32, NAN, NAN),
    "SmolLM2-135M, AVX2 EPYC": (1.86, 1.35, 1.53, 1.32),
}


def main(out: Path = Path(__file__).with_name("speedup-auto-vs-ar.png")) -> None:
    fig, ax = plt.subplots(figsize=(8, 3.6), dpi=110)
    width = 0.8 / len(ROWS)
    for i, (label, values) in enumerate(ROWS.items()):
        xs = [d + (i - (len(ROWS) - 1) / 2) * width for d in range(len(DATASETS))]
        bars = ax.bar(xs, values, width, label=label)
        ax.bar_label(bars, labels=["" if v != v else f"{v:.2f}" for v in values], fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(DATASETS)), DATASETS)
    ax.set_ylabel("auto tokens/s ÷ ar tokens/s")
    ax.set_ylim(0, 3.2)
    ax.set_title("selfspec auto vs plain decoding (2-core CPUs, bf16, greedy, lossless)", fontsize=10)
    ax.legend(fontsize=7, loc="upper center", ncols=2)
    fig.tight_layout()
    fig.savefig(out)
    print(out)


if __name__ == "__main__":
    main()
