"""The per-cell table of issue 63 with the dense-prefill kernel (``gguf+dense``) from the runs'
summary.json files (run from the repo root:
python docs/results/gguf/dense_table.py docs/results/gguf/dense-prefill-2026-11-29)."""

import json
import sys
from pathlib import Path

ROWS = ("ar", "ar:decode_kernel=gguf", "ar:decode_kernel=gguf+dense", "auto:decode_kernel=gguf",
        "auto:decode_kernel=gguf+dense", "llamacpp-ar", "llamacpp-prompt-lookup")


def _cell(name: str) -> tuple[str, str]:
    for dataset in ("sharegpt-summarize", "humaneval", "mtbench", "gsm"):
        if name.endswith("-" + dataset):
            return name[: -len(dataset) - 1], dataset
    return name, "?"


def main(root: Path) -> None:
    print("| model | dataset | gguf `ar` / `llamacpp-ar` | `auto` gguf / `llamacpp-ar` | "
          "`auto` gguf+dense / `llamacpp-ar` | `auto` gguf+dense / `llamacpp-prompt-lookup` | "
          "parity `auto` gguf / gguf+dense | forced = ar: gguf / gguf+dense / llama.cpp | "
          "median TTFT s: gguf / gguf+dense / llama.cpp | per-prompt medians: `auto` gguf, "
          "`auto` gguf+dense / `llamacpp-ar` | pass@1: bf16 / gguf / gguf+dense / llama.cpp |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for run in sorted(root.glob("*/summary.json")):
        data = json.loads(run.read_text())
        rows = {m["method"]: m for m in data["methods"]}
        if not all(k in rows for k in ROWS):
            continue
        ar, g, gd, ag, agd, la, lp = (rows[k] for k in ROWS)

        def ratio(a, b, key="tokens_per_s"):
            return f"{a[key] / b[key]:.2f}×" if a.get(key) and b.get(key) else "–"

        def pct(v):
            return "–" if v is None else f"{100 * v:.1f}%"

        def ttft(m):
            v = m.get("median_ttft_ms")
            return "–" if v is None else f"{v / 1000:.2f}"

        model, dataset = _cell(run.parent.name)

        def acc(m):  # pass@1 where the dataset has tests (HumanEval)
            v = m.get("accuracy")
            return "–" if v is None or dataset != "humaneval" else f"{v:.2f}"

        print(f"| {model} | {dataset} | {ratio(g, la)} | {ratio(ag, la)} | {ratio(agd, la)} | "
              f"{ratio(agd, lp)} | {pct(ag['parity'])} / {pct(agd['parity'])} | "
              f"{pct(g['forced_agreement'])} / {pct(gd['forced_agreement'])} / "
              f"{pct(la['forced_agreement'])} | {ttft(g)} / {ttft(gd)} / {ttft(la)} | "
              f"{ratio(ag, la, 'median_tokens_per_s')}, {ratio(agd, la, 'median_tokens_per_s')} | "
              f"{acc(ar)} / {acc(g)} / {acc(gd)} / {acc(la)} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
