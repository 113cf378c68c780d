# Time to first token and resident memory of kernel gguf+dense with and without the packed
# dense copy (keep_packed), on one ~400-token prompt:
# python docs/results/gguf/dense-lean-2026-11-29/prefill.py MODEL keep|lean KERNEL
import resource, statistics, sys, time, torch
from selfspec.api import SelfSpec, gguf_source
from selfspec.models.loading import load_model
torch.set_num_threads(2)
model, keep, kernel = sys.argv[1], sys.argv[2] == "keep", sys.argv[3]
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
loaded = load_model(model, "bf16", show_progress=False)
eng = SelfSpec(loaded.model, loaded.tokenizer, loaded.name, kernel, gguf=gguf_source(loaded, False), keep_packed=keep)
prompt = "Summarize the following text.\n\n" + " ".join(
    f"Paragraph {i}: the committee met on day {i} to review the budget, the schedule and the staffing plan." for i in range(18))
n = len(loaded.tokenizer(prompt).input_ids)
eng.generate(prompt, max_new_tokens=1)  # warm-up (packs, compiles)
times = []
for _ in range(3):
    t = time.perf_counter(); r = eng.generate(prompt, max_new_tokens=1); times.append(time.perf_counter() - t)
out = eng.generate(prompt, max_new_tokens=16).token_ids
print(f"{model} {kernel} {'keep_packed' if keep else 'lean'} prompt {n} tokens: TTFT median {statistics.median(times):.2f} s "
      f"(runs {', '.join(f'{x:.2f}' for x in times)}); RSS {rss():.0f} MiB, peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MiB; tokens {out}")
