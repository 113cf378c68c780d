"""Tables of commands.sh's eight runs: × `ar` of each row (all new tokens / all wall time,
prefill included, as in the reports) and of its decoding alone (tokens after the first /
time after the first token), plus auto's drafter shares.

    python docs/results/auto/bench-2026-11-26-seven/summary.py RUNS_DIR

RUNS_DIR holds the runs' folders with their records.jsonl (not kept in the tree: commands.sh
writes them).
"""

import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

MODELS = {"qwen2.5-coder-1.5b-instruct": "Qwen", "smollm2-135m-instruct": "SmolLM2"}
DATASETS = {"humaneval": "HumanEval", "mtbench": "MT-Bench", "gsm": "GSM",
            "sharegpt-summarize": "summarize"}


def rates(records):
    """Per method: (tok/s, decode tok/s, prefill share of wall), summed over prompts."""
    sums = defaultdict(lambda: [0, 0.0, 0, 0.0, 0.0])
    for r in records:
        s = sums[r["method"]]
        ttft = (r["ttft_ms"] or 0) / 1e3
        s[0] += r["new_tokens"]
        s[1] += r["wall_time"]
        s[2] += r["new_tokens"] - 1
        s[3] += r["wall_time"] - ttft
        s[4] += ttft
    return {m: (n / t, d / dt if dt > 0 else float("nan"), p / t)
            for m, (n, t, d, dt, p) in sums.items()}


def main(root: Path) -> None:
    columns, table, decode, prefill, shares = [], defaultdict(dict), defaultdict(dict), {}, {}
    for model, short in MODELS.items():
        for ds, name in DATASETS.items():
            path = root / f"{model}-{ds}" / "records.jsonl"
            if not path.exists():
                continue
            records = [json.loads(line) for line in path.open()]
            col = f"{short} {name}"
            columns.append(col)
            r = rates(records)
            ar = r["ar"]
            for method, (tps, dps, _) in r.items():
                table[method][col] = (tps / ar[0], tps)
                decode[method][col] = dps / ar[1]
            prefill[col] = r["ar"][2]
            steps = Counter()
            for rec in records:
                if rec["method"] == "auto":
                    steps.update(rec["drafter_steps"] or {})
            total = sum(steps.values()) or 1
            shares[col] = " / ".join(f"{steps[k] * 100 // total}" for k in ("qspec", "ngram", "ar"))
    print("| × `ar` (same run, prefill included) | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    print("| `ar` tok/s | " + " | ".join(f"{table['ar'][c][1]:.1f}" for c in columns) + " |")
    for method in table:
        if method != "ar":
            print(f"| `{method}` | " + " | ".join(
                f"{table[method][c][0]:.2f}" if c in table[method] else "–" for c in columns) + " |")
    print("| `auto` steps: qspec / ngram / ar (%) | " + " | ".join(shares[c] for c in columns) + " |")
    print("| prefill share of `ar`'s wall | " + " | ".join(f"{prefill[c]:.0%}" for c in columns) + " |")
    print()
    print("| × `ar`, decoding only (after the first token) | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for method in decode:
        if method != "ar":
            print(f"| `{method}` | " + " | ".join(
                f"{decode[method][c]:.2f}" if c in decode[method] else "–" for c in columns) + " |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
