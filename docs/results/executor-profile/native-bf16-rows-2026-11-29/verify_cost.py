# Cost of a forward of T tokens (over 256 cached positions, with the output head) on each
# decoding kernel of a bf16 model, in ms and relative to T = 1; two rounds:
# python docs/results/executor-profile/native-bf16-rows-2026-11-29/verify_cost.py MODEL
import torch, sys, selfspec
from selfspec.executor.cost_model import _verify_points, _time_ms, _step, _filled_cache
from selfspec.executor.cost_model import position_block
torch.set_num_threads(2)
eng = selfspec.load(sys.argv[1], dtype="bf16", show_progress=False)
ex = eng.executor
for rnd in range(2):
  for k in ("weights", "bf16"):
    ex.set_decode_kernel(k)
    cache = _filled_cache(ex, 256, range(ex.num_layers))
    out = []
    for T in (1, 2, 4, 8, 16):
        hidden = torch.randn(1, T, ex.config.hidden_size, dtype=ex.dtype) * 0.1
        pos = position_block(256, T, ex.device)
        out.append(_time_ms(lambda: _step(ex, hidden, pos, cache, head=True), 7, ex.device))
    print(rnd, k, "  ".join(f"T={T}: {m:.1f} ms ({m/out[0]:.2f})" for T, m in zip((1,2,4,8,16), out)))
