"""Draft weight formats on one model: time of one draft token (every layer and lm_head, 256
cached positions, read-only) on each quantized copy, interleaved over 5 rounds (median), and
the copy's teacher-forced top-1 agreement with the model on 400 tokens of standard-library
source (what a draft token's acceptance rests on).

    python docs/results/executor-profile/w4a8_probe.py [MODEL]   # default qwen2.5-coder-1.5b-instruct
"""
import inspect
import json
import statistics
import sys
import textwrap

import torch

import selfspec
from selfspec.executor.cost_model import measure_token_ms
from selfspec.executor.quant import quantized_kernels_available

name = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-1.5b-instruct"
torch.set_num_threads(2)
engine = selfspec.load(name, "bf16")
ex = engine.executor
views = {"bf16": ex} | {f: ex.draft_view(f) for f in ("int8", "int4", "w4a8")
                        if quantized_kernels_available(f)}
ms = {k: [] for k in views}
for _ in range(5):
    for k, view in views.items():
        ms[k].append(measure_token_ms(view, 256, repeats=5))
text = inspect.getsource(json.decoder)[:3000] + "\n" + inspect.getsource(textwrap)[:3000]
ids = torch.tensor([engine.tokenizer(text)["input_ids"][:400]])
pos = torch.arange(ids.shape[1])[None]
with torch.inference_mode():
    full = ex.forward(ids, pos, ex.new_cache(capacity=512)).argmax(-1)
    agree = {}
    for k, view in views.items():
        if view is ex:
            continue
        # one row at a time, as drafts run (int8's activation scale is per call)
        cache, got = view.new_cache(capacity=512), []
        for i in range(ids.shape[1]):
            got.append(view.forward(ids[:, i:i + 1], pos[:, i:i + 1], cache).argmax(-1))
        agree[k] = (torch.cat(got, dim=1) == full).float().mean().item()
print(f"{name}, bf16, 2 threads")
print("| weights | ms / draft token (median of 5) | × bf16 | top-1 agreement with the model |")
print("|---|---:|---:|---:|")
base = statistics.median(ms["bf16"])
for k in views:
    m = statistics.median(ms[k])
    print(f"| {k} | {m:.1f} | {m / base:.2f} | {agree.get(k, 1.0):.3f} |")
