# Resident memory of --dtype gguf with and without the packed dense copy:
# python docs/results/gguf/dense-prefill-2026-11-29/memory.py MODEL keep|lean gguf|gguf+dense
import resource, sys, torch, selfspec
from selfspec.api import SelfSpec, gguf_source
from selfspec.models.loading import load_model
torch.set_num_threads(2)
model, keep, kernel = sys.argv[1], sys.argv[2] == "keep", sys.argv[3]
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
loaded = load_model(model, "bf16", show_progress=False)
print("after load_model MiB", round(rss()))
eng = SelfSpec(loaded.model, loaded.tokenizer, loaded.name, kernel, gguf=gguf_source(loaded, False), keep_packed=keep)
r = eng.generate("def fib(n):", max_new_tokens=8)
print(model, "keep_packed" if keep else "lean", kernel, "RSS MiB", round(rss()), "peak MiB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, r.token_ids[:4])
