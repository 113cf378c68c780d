"""GPU check (device tool, 2026-11-28): after stop 55's layer-call path (LayerExecutor.run_layers_at,
embed_token, DeferredLayers.advance) and the compiled argmax, on CUDA tiny random models, fp32
and bf16: run_layers_at equals run_layers; embed_token equals embed; argmax_last equals
torch.argmax; AdaDecode (forced early predictions) and DSSD greedy output equal `ar` (the
verified SpecEE cases are in ../xeon-2026-11-27-verify/gpu_check_verify.py, run beside this).
Run from the repository root: PYTHONPATH=gpudeps python THIS (gpudeps: gguf, platformdirs)."""
import sys

import torch

sys.path[:0] = ["src", "tests"]
from tiny import run_step, tiny_model

from selfspec.decoding.adadecode.threshold_exits import ThresholdExits
from selfspec.decoding.drafting.exit_drafter import DSSDDrafter, ExitDrafter
from selfspec.decoding.drafting.exits import CalibratedExits
from selfspec.decoding.core.speculative import SpeculativeStep
from selfspec.decoding.drafting.stop_rules import BufferStopRule
from selfspec.executor import LayerExecutor
from selfspec.executor.argmax import argmax_last
from selfspec.methods.registry import build_step

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the same lines on the CPU
print(torch.__version__, torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu")
PROMPT = [5, 17, 42, 99, 3, 250, 7]
L = 8


class StubHeads:
    def __init__(self, ex, layers, taus):
        self.layers, self.taus = layers, taus
        self.heads = [lambda h, vocab_rows=None: ex.logits(h) for _ in layers]

    def thresholds(self, epsilon, metric, draft_vocab=None):
        return self.taus


x = torch.randn(3, 151936, device=DEV, dtype=torch.bfloat16)
x[1, 7] = x[1, 9] = 1e4
print("argmax_last on", DEV, " == torch.argmax:", torch.equal(argmax_last(x), x.argmax(-1)))
for arch in ("llama", "qwen2"):
    for dtype in (torch.float32, torch.bfloat16):
        ex = LayerExecutor(tiny_model(arch, seed=11, num_layers=L).to(DEV, dtype))
        ref = run_step(ex, build_step("ar", ex, {}), PROMPT, max_new_tokens=40).tokens
        # run_layers_at against run_layers on a fresh cache each
        ids = torch.tensor([PROMPT], device=DEV)
        outs = []
        for at in (False, True):
            cache = ex.new_cache(1, 64)
            h = ex.embed(ids)
            pos = torch.arange(len(PROMPT), device=DEV).unsqueeze(0)
            h = (ex.run_layers_at(h, 0, 0, L, cache) if at
                 else ex.run_layers(h, pos, 0, L, cache))
            outs.append(h)
        same_layers = torch.equal(outs[0], outs[1])
        emb = torch.equal(ex.embed_token(42).reshape(-1), ex.embed(torch.tensor([[42]], device=DEV)).reshape(-1))
        head = lambda h, ex=ex: ex.logits(h) * 40.0  # sharpened: every token predicted early
        ada = SpeculativeStep(ExitDrafter(ex, ThresholdExits([2, 4, 6], [head] * 3, 0.0), BufferStopRule(5)))
        sa = run_step(ex, ada, PROMPT, max_new_tokens=40)
        ds = SpeculativeStep(DSSDDrafter(ex, CalibratedExits(StubHeads(ex, [2, 4, 6], [0.02, 0.01, 0.0]), 0.9,
                                                             "max_prob"), max_draft_len=6))
        sd = run_step(ex, ds, PROMPT, max_new_tokens=40)
        print(arch, dtype, "run_layers_at == run_layers:", same_layers, "| embed_token == embed:", emb,
              "| adadecode == ar:", sa.tokens == ref, f"(drafted {sa.stats.drafted})",
              "| dssd == ar:", sd.tokens == ref, f"(drafted {sd.stats.drafted})", flush=True)
