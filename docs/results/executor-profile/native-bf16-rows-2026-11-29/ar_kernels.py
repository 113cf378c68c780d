import time, torch, statistics, sys
import selfspec
torch.set_num_threads(2)
model = sys.argv[1]
eng = selfspec.load(model, dtype="bf16", show_progress=False)
ex = eng.executor
p = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
res = {}
for rnd in range(2):
    for k in ("weights", "bf16"):
        ex.set_decode_kernel(k)
        eng.generate(p, max_new_tokens=4)
        r = eng.generate(p, max_new_tokens=64)
        t = time.perf_counter(); r = eng.generate(p, max_new_tokens=64); dt = time.perf_counter() - t
        res.setdefault(k, []).append(64 / dt)
        print(rnd, k, ex.formats.rows, f"{64/dt:.1f} tok/s", "fused" if ex.fused_layers() is not None else "torch path", r.token_ids[:6])
