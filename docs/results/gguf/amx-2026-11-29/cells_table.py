"""Issue 63's Qwen cells rerun on the AMX build of the GGUF kernels, from the runs'
summary.json files (from the repo root: python docs/results/gguf/amx-2026-11-29/cells_table.py
[DIR], DIR defaulting to this folder)."""

import json
import sys
from pathlib import Path

ROWS = ("ar:decode_kernel=gguf", "auto:decode_kernel=gguf", "llamacpp-ar",
        "llamacpp-prompt-lookup")


def main(root: Path) -> None:
    print("| cell | gguf `ar` / `llamacpp-ar` | `auto` gguf / `llamacpp-ar` | `auto` gguf / "
          "`llamacpp-prompt-lookup` | per-prompt medians: `auto` gguf / `llamacpp-ar` | "
          "`auto` / gguf `ar` | parity | steps drafted | acceptance | "
          "median TTFT s: gguf / llama.cpp | tok/s: gguf `ar`, `auto`, llama.cpp `ar`, lookup |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for run in sorted(root.glob("*/summary.json")):
        data = json.loads(run.read_text())
        rows = {m["method"]: m for m in data["methods"]}
        g, ag, la, lp = (rows[k] for k in ROWS)

        def ratio(a, b, key="tokens_per_s"):
            return f"{a[key] / b[key]:.2f}×"

        steps = ag.get("drafter_steps") or {}
        total = sum(steps.values()) or 1
        drafted = 1 - steps.get("ar", 0) / total
        print(f"| {run.parent.name} | {ratio(g, la)} | {ratio(ag, la)} | {ratio(ag, lp)} | "
              f"{ratio(ag, la, 'median_tokens_per_s')} | {ratio(ag, g)} | "
              f"{100 * ag['parity']:.0f}% | {100 * drafted:.0f}% | "
              f"{100 * (ag.get('acceptance_rate') or 0):.0f}% | "
              f"{g['median_ttft_ms'] / 1000:.2f} / {la['median_ttft_ms'] / 1000:.2f} | "
              f"{g['tokens_per_s']:.1f}, {ag['tokens_per_s']:.1f}, {la['tokens_per_s']:.1f}, "
              f"{lp['tokens_per_s']:.1f} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent)
