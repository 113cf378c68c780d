"""Does torch.compile pay for one-token decoding on this CPU? Issue 15 asks for
``torch.compile`` of the layer block "where it pays". This measures, in one process and on
one prompt, greedy tokens/s of:

- selfspec's own eager executor (``ar``),
- transformers' ``generate`` with a static KV cache, eager,
- the same with ``model.forward`` compiled by inductor (``mode="default"``),
- the same with inductor's freezing (weights constant-folded and packed for oneDNN, the
  configuration PyTorch recommends for CPU inference).

A compiled HF forward is the upper bound of what compiling our layer block can remove: it
fuses every small operator (norms, RoPE, SiLU, residual adds) and packs the linears itself.
An experiment behind the executor-profile README, not a selfspec code path.

    python docs/results/executor-profile/compile_probe.py [MODEL] [NEW_TOKENS] [DTYPE]
"""
from __future__ import annotations

import sys
import time
import warnings

import torch
import torch._inductor.config as inductor_config
from transformers import AutoModelForCausalLM

import selfspec

warnings.filterwarnings("ignore")
torch.set_num_threads(2)
name = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m-instruct"
new = int(sys.argv[2]) if len(sys.argv) > 2 else 64
dtype = sys.argv[3] if len(sys.argv) > 3 else "bf16"
torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
prompt = "def fibonacci(n):"

engine = selfspec.load(name, dtype=dtype, show_progress=False)
engine.generate(prompt, method="ar", max_new_tokens=8)
start = time.perf_counter()
ours = engine.generate(prompt, method="ar", max_new_tokens=new)
print(f"{name} {dtype}, 2 threads\nselfspec ar (eager executor): {len(ours.token_ids) / (time.perf_counter() - start):.1f} tok/s",
      flush=True)
model_dir = engine.model.name_or_path
del engine

ids = torch.tensor([ours.prompt_ids])


def hf_rate(model: torch.nn.Module, n: int = new) -> float:
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                   cache_implementation="static")
    return n / (time.perf_counter() - start)


for label, freezing in (("eager", None), ("compiled", False), ("compiled + freezing", True)):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    if freezing is not None:
        torch._dynamo.reset()
        inductor_config.freezing = freezing
        model.forward = torch.compile(model.forward, dynamic=False)
    start = time.perf_counter()
    with torch.inference_mode():
        hf_rate(model, 8)
        warm = time.perf_counter() - start
        rates = [hf_rate(model) for _ in range(2)]
    print(f"transformers static cache, {label}: {max(rates):.1f} tok/s "
          f"(first call incl. compilation {warm:.0f} s)", flush=True)
