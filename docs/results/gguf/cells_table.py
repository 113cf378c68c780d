"""The per-cell table of issue 63 from the runs' summary.json files (run from the repo root:
python docs/results/gguf/cells_table.py docs/results/gguf/cells-2026-11-29)."""

import json
import sys
from pathlib import Path


def main(root: Path) -> None:
    print("| model | dataset | gguf `ar` / `llamacpp-ar` | `auto` gguf / `llamacpp-ar` | "
          "`auto` gguf / `llamacpp-prompt-lookup` | `auto` gguf parity | forced = ar: gguf / "
          "llama.cpp | bf16 `auto` / `ar` | decoding: gguf `ar` / `llamacpp-ar` | "
          "per-prompt medians: gguf `ar` / `llamacpp-ar`, `auto` gguf / `llamacpp-ar` | "
          "bandwidth GB/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for run in sorted(root.glob("*/summary.json")):
        data = json.loads(run.read_text())
        rows = {m["method"]: m for m in data["methods"]}
        need = ("ar", "ar:decode_kernel=gguf", "auto:decode_kernel=gguf", "llamacpp-ar",
                "llamacpp-prompt-lookup", "auto")
        if not all(k in rows for k in need):
            continue
        ar, g, ag, la, lp, auto = (rows[k] for k in need)

        def ratio(a, b, key="tokens_per_s"):
            return f"{a[key] / b[key]:.2f}×" if a.get(key) and b.get(key) else "–"

        def pct(v):
            return "–" if v is None else f"{100 * v:.1f}%"

        model, _, dataset = run.parent.name.partition("-")
        name = run.parent.name
        model = name.rsplit("-", 1)[0] if not name.endswith("sharegpt-summarize") else \
            name[: -len("-sharegpt-summarize")]
        dataset = name[len(model) + 1:]
        bw = (data.get("roofline") or {}).get("bandwidth_gb_per_s")
        print(f"| {model} | {dataset} | {ratio(g, la)} | {ratio(ag, la)} | {ratio(ag, lp)} | "
              f"{pct(ag['parity'])} | {pct(g['forced_agreement'])} / {pct(la['forced_agreement'])} | "
              f"{ratio(auto, ar)} | {ratio(g, la, 'decode_tokens_per_s')} | "
              f"{ratio(g, la, 'median_tokens_per_s')}, {ratio(ag, la, 'median_tokens_per_s')} | "
              f"{'–' if bw is None else f'{bw:.1f}'} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
