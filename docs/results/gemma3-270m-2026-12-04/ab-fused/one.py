"""One timing of greedy ar: model, prompts fixed; prints tok/s of decoding (after the first token)."""
import sys, time, json, torch
torch.set_num_threads(1)
import selfspec
model = sys.argv[1]
eng = selfspec.load(model, dtype="bf16", show_progress=False)
prompts = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n\ndef moving_average(x, k):"]
eng.generate(prompts[0], method="ar", max_new_tokens=8)  # warm-up
total_t, total_n = 0.0, 0
for p in prompts:
    t = time.perf_counter()
    out = eng.generate(p, method="ar", max_new_tokens=64)
    total_t += time.perf_counter() - t
    total_n += len(out.token_ids)
print(json.dumps({"model": model, "src": selfspec.__file__, "tok_s": total_n / total_t,
                  "fused": eng.executor.fused_layers() is not None}))
