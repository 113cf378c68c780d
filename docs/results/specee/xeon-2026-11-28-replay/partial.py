"""Ratios from a bench's journal.jsonl over the prompts every method finished (a bench stopped
by hand): python partial.py OUT/journal.jsonl. Per method: tokens, tok/s, × the first method
(ar), acceptance, tokens per verification, layer calls per token (weight reads), parity."""
import collections
import json
import sys

records = [json.loads(line) for line in open(sys.argv[1])]
records = [r for r in records if r.get("event") == "record"]
methods = list(dict.fromkeys(r["method"] for r in records))
by_prompt = collections.defaultdict(dict)
for r in records:
    by_prompt[r["question_id"]][r["method"]] = r  # the last record (warm-up first) wins
done = [q for q, got in by_prompt.items() if len(got) == len(methods)]
print(f"{len(done)} prompts finished by all {len(methods)} methods: {', '.join(done)}")
base = None
for m in methods:
    rs = [by_prompt[q][m] for q in done]
    tokens = sum(r["new_tokens"] for r in rs)
    tps = tokens / sum(r["wall_time"] for r in rs)
    base = base or tps
    drafted = sum(r["drafted"] or 0 for r in rs)
    accepted = sum(r["accepted"] or 0 for r in rs)
    checks = sum(r["verifications"] or 0 for r in rs)
    calls = sum(sum(r["layer_batches"]) if isinstance(r["layer_batches"], list) else 0
                for r in rs)
    parity = sum(r["token_ids"] == by_prompt[q][methods[0]]["token_ids"] for q, r in zip(done, rs))
    extra = (f", acceptance {accepted / drafted:.0%}, {tokens / checks:.2f} tokens / "
             f"verification, {calls / tokens:.1f} layer calls / token" if drafted else "")
    print(f"{m}: {tokens} tokens, {tps:.2f} tok/s, {tps / base:.3f}x{extra}, parity "
          f"{parity}/{len(done)}")
