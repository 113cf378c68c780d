"""GPU check (device tool, 2026-11-27): SpecEE with drafter candidates on CUDA, tiny random
models. Run from the repository root: PYTHONPATH=<stubs for gguf, platformdirs> python THIS."""
import sys, torch
sys.path[:0] = ["src", "tests"]
from tiny import tiny_model, run_step
from selfspec.executor import LayerExecutor
from selfspec.decoding.specee.step import DrafterCandidates, PredictorSchedule, SpecEEStep
from selfspec.decoding.specee.skipped_kv import KV_POLICIES, make_skipped_kv
from selfspec.heads.drafter import FeatureDrafter
from selfspec.heads.predictor import ExitPredictors
from selfspec.methods.registry import build_step
print(torch.__version__, torch.cuda.get_device_name(0))
PROMPT = [5, 17, 42, 99, 3, 250, 7]
for arch in ("llama", "qwen2"):
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_model(arch, seed=11, num_layers=8).to("cuda", dtype)
        ex = LayerExecutor(model)
        H = ex.config.hidden_size
        torch.manual_seed(0)
        d = FeatureDrafter(H)
        with torch.no_grad():
            d.fc_weight.normal_(0, 0.05)
        d = d.to("cuda", dtype).eval().requires_grad_(False)
        def step(fire, policy):
            p = ExitPredictors(list(range(1, 8)), 4, hidden=8)
            with torch.no_grad():
                p.fc2_weight.zero_(); p.fc2_bias.fill_(30.0 if fire else -30.0)
            p = p.to("cuda").eval().requires_grad_(False)
            c = DrafterCandidates(ex, d, 1, ex.logits, 4, ngram=True)
            return SpecEEStep(c, p, PredictorSchedule(p.layers, None), 0.5,
                              lambda e, cache: make_skipped_kv(policy, e, cache))
        ref = run_step(ex, build_step("ar", ex, {}), PROMPT, max_new_tokens=16).tokens
        for policy in KV_POLICIES:
            never = run_step(ex, step(False, policy), PROMPT, max_new_tokens=16)
            always = run_step(ex, step(True, policy), PROMPT, max_new_tokens=16)
            print(arch, dtype, policy, "never-fire == ar:", never.tokens == ref,
                  "| always-fire exits at layer 1:", always.stats.exit_counts[1], "of 15,",
                  "cache lengths", always.cache.lengths()[:3], flush=True)
