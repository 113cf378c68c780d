"""bf16 rows kernel variants (compile-time knobs) over T rows on the 0.5B model's matrices."""
import ctypes, sys, time, torch
from selfspec.executor import native, bf16_rows as br
torch.set_num_threads(2)
variants = {
  "base": (),
  "pf4096": ("-DSELFSPEC_BF16_PREFETCH_ROWS=4096",),
  "pairs4": ("-DSELFSPEC_BF16_PAIR_ROWS=4",),
  "pairs4pf": ("-DSELFSPEC_BF16_PAIR_ROWS=4", "-DSELFSPEC_BF16_PREFETCH_ROWS=4096"),
  "pairs3": ("-DSELFSPEC_BF16_PAIR_ROWS=3",),
  "tb4pf": ("-DSELFSPEC_BF16_MAX_TB=4", "-DSELFSPEC_BF16_PREFETCH_ROWS=4096"),
}
names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(variants)
Ts = (1, 2, 3, 4, 5, 6, 8)
shapes = {"gate_up": (9728, 896), "down": (896, 4864), "qkv": (1152, 896)}
fns = {}
for v in names:
    lib = ctypes.CDLL(str(native.build(br.SOURCE, variants[v])))
    fn = lib.selfspec_bf16_rows; fn.restype = None; fn.argtypes = [ctypes.c_void_p]*4 + [ctypes.c_int64]*3
    assert br._probe(fn) == "", v
    fns[v] = fn
for name, (n, k) in shapes.items():
    copies = max(2, int(600e6 // (n * k * 2)))
    ws = [br._weight(torch.randn(n, k).bfloat16(), None) for _ in range(copies)]
    for v, fn in fns.items():
        row = []
        for T in Ts:
            x = torch.randn(1, T, k).bfloat16()
            ts = []
            for rep in range(3):
                t = time.perf_counter()
                for w in ws: br._product(fn, x, w)
                ts.append((time.perf_counter() - t) / len(ws))
            row.append(min(ts) * 1e3)
        print(f"{name:8s} {v:9s} " + " ".join(f"T{T}={ms:.3f}" for T, ms in zip(Ts, row)), flush=True)
