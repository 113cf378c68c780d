#!/usr/bin/env python
"""``selfspec batch`` over real prompts, in this process and on Ray Data, and a killed job
resumed: outputs compared, each id counted, tokens/s of both runs.

Usage::

    python scripts/batch_ray_check.py                      # 200 prompts, default model
    python scripts/batch_ray_check.py --n 50 --max-new-tokens 32 --out /tmp/batch-check

Steps (each a ``selfspec batch`` command, printed before it runs):

1. in-process (``--threads 2``): the reference results;
2. ``--ray --concurrency 2 --threads 1``: results equal to (1) for every id;
3. ``--ray`` again into a new file, the driver killed (SIGKILL) once a third of the results
   are written, then the same command rerun: every id exactly once, equal to (1).

The prompts are MT-Bench's first turns (up to 80) and HumanEval's (the rest), alternating, as chat
messages, greedy.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from selfspec.data.prompts import load_prompts


def _prompts(n: int, path: Path) -> None:
    chat = load_prompts("mtbench", n=min(n // 2, 80))  # MT-Bench has 80
    code = load_prompts("humaneval", n=n - len(chat))
    mixed = [p for pair in zip(code, chat) for p in pair] + code[len(chat):]
    with path.open("w", encoding="utf-8") as f:
        for i, p in enumerate(mixed[:n]):
            f.write(json.dumps({"id": f"p{i}", "messages": [
                {"role": "user", "content": p.text}]}) + "\n")


def _command(args, prompts: Path, out: Path, ray: bool) -> list[str]:
    base = ["selfspec", "batch", str(prompts), "--output", str(out), "--method", args.method,
            "--max-new-tokens", str(args.max_new_tokens)]
    return base + (["--ray", "--concurrency", "2", "--threads", "1"] if ray
                   else ["--threads", "2"])


def _run(command: list[str]) -> float:
    print("$", " ".join(command), flush=True)
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def _results(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _killed_then_resumed(command: list[str], out: Path, n: int) -> None:
    print("$", " ".join(command), "(killed at a third)", flush=True)
    job = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    while job.poll() is None and (not out.exists() or len(_results(out)) < n // 3):
        time.sleep(0.2)
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    print(f"  killed with {len(_results(out)) if out.exists() else 0} of {n} results written")
    _run(command)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--method", default="auto")
    parser.add_argument("--out", default="/tmp/selfspec-batch-check")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.jsonl"):
        old.unlink()
    prompts = out / "prompts.jsonl"
    _prompts(args.n, prompts)
    local_s = _run(_command(args, prompts, out / "local.jsonl", ray=False))
    ray_s = _run(_command(args, prompts, out / "ray.jsonl", ray=True))
    _killed_then_resumed(_command(args, prompts, out / "resumed.jsonl", ray=True),
                         out / "resumed.jsonl", args.n)
    local = {r["id"]: r for r in _results(out / "local.jsonl")}
    tokens = sum(r["usage"]["completion_tokens"] for r in local.values())
    ok = True
    for name in ("ray", "resumed"):
        rows = _results(out / f"{name}.jsonl")
        counts = Counter(r["id"] for r in rows)
        same = sum(local[r["id"]]["token_ids"] == r["token_ids"] for r in rows)
        once = len(counts) == args.n and set(counts.values()) == {1}
        print(f"{name}: {len(rows)} lines, every id exactly once: {once}, "
              f"token ids equal to in-process: {same}/{len(rows)}")
        ok &= once and same == len(rows)
    print(f"in-process: {tokens} tokens in {local_s:.1f} s ({tokens / local_s:.1f} tok/s, "
          f"model load included); Ray Data 2 actors x 1 thread: {ray_s:.1f} s "
          f"({tokens / ray_s:.1f} tok/s, cluster start and 2 loads included) -> "
          f"{local_s / ray_s:.2f}x in-process")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
