"""One-row and eight-row products of Qwen2.5-1.5B's matrix shapes (random weights) in bf16 and each draft format: python draft_formats.py [T]."""
import sys, time, torch
from selfspec.executor.quant import quantize_linear, fastest_format, DRAFT_WEIGHT_FORMATS, quantized_kernels_available
torch.set_num_threads(2)
torch.manual_seed(0)
H, I = 1536, 8960
shapes = {"qkv": (2048, H), "o": (H, H), "gate_up": (2 * I, H), "down": (H, I), "lm_head": (151936, H)}
ws = {k: (torch.randn(*s, dtype=torch.bfloat16) * 0.02, None) for k, s in shapes.items()}
T = int(sys.argv[1]) if len(sys.argv) > 1 else 1
for fmt in ["bf16"] + [f for f in DRAFT_WEIGHT_FORMATS if quantized_kernels_available(f)]:
    res = {}
    for k, (w, b) in ws.items():
        f = (lambda x, w=w: torch.nn.functional.linear(x, w)) if fmt == "bf16" else quantize_linear(w, b, fmt)
        x = torch.randn(T, w.shape[1]).to(torch.bfloat16)
        for _ in range(3): f(x)
        ts = []
        for _ in range(15):
            t0 = time.perf_counter(); f(x); ts.append(time.perf_counter() - t0)
        ts.sort(); res[k] = ts[len(ts) // 2] * 1e3
    layer = res["qkv"] + res["o"] + res["gate_up"] + res["down"]
    print(f"{fmt:6s} T={T} " + " ".join(f"{k} {v:.3f}" for k, v in res.items()) + f" | 28 layers + lm_head {28*layer + res['lm_head']:.1f} ms")
