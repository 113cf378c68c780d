"""GPU check (device tool, 2026-11-27): SpecEE with state-reading predictors on CUDA, tiny random
models. Run from the repository root: PYTHONPATH=<stubs for gguf, platformdirs> python THIS."""
import sys, torch
sys.path[:0] = ["src", "tests"]
from tiny import tiny_model, run_step
from selfspec.executor import LayerExecutor
from selfspec.decoding.specee.step import HeadCandidates, PredictorSchedule, SpecEEStep
from selfspec.decoding.specee.skipped_kv import KV_POLICIES, make_skipped_kv
from selfspec.heads.predictor import ExitPredictors
from selfspec.methods.registry import build_step
print(torch.__version__, torch.cuda.get_device_name(0))
PROMPT = [5, 17, 42, 99, 3, 250, 7]
C = 2
for arch in ("llama", "qwen2"):
    for dtype in (torch.float32, torch.bfloat16):
        cpu_model = tiny_model(arch, seed=11, num_layers=8)
        H = cpu_model.config.hidden_size
        def preds(mode, device):
            torch.manual_seed(1)
            p = ExitPredictors(list(range(C, 8)), 4, hidden=16, state_dim=H)
            with torch.no_grad():
                p.feature_mean.normal_(); p.feature_std.uniform_(0.5, 2)
                if mode == "random":   # fire iff u_l . state > 0.85 sd (~20% per layer)
                    u = torch.randn(len(p.layers), H)
                    u = u / u.norm(dim=-1, keepdim=True) * H ** 0.5 / 8
                    p.fc1_weight.zero_(); p.fc1_bias.zero_(); p.fc2_weight.zero_()
                    p.fc1_weight[:, 0, 12:] = u; p.fc1_weight[:, 1, 12:] = -u
                    p.fc2_weight[:, 0] = 30.0; p.fc2_weight[:, 1] = -30.0
                    p.fc2_bias.fill_(-30.0 * 0.85)
                else:
                    p.fc2_weight.zero_(); p.fc2_bias.fill_(30.0 if mode == "always" else -30.0)
            return p.to(device).eval().requires_grad_(False)
        def step(ex, mode, policy, device):
            p = preds(mode, device)
            c = HeadCandidates(ex, C, lambda h: ex.logits(h), 4, ngram=True)
            return SpecEEStep(c, p, PredictorSchedule(p.layers, None), 0.5,
                              lambda e, cache: make_skipped_kv(policy, e, cache))
        ex = LayerExecutor(tiny_model(arch, seed=11, num_layers=8).to("cuda", dtype))
        ref = run_step(ex, build_step("ar", ex, {}), PROMPT, max_new_tokens=16).tokens
        cex = LayerExecutor(cpu_model.to(dtype))
        for policy in KV_POLICIES:
            never = run_step(ex, step(ex, "never", policy, "cuda"), PROMPT, max_new_tokens=16)
            always = run_step(ex, step(ex, "always", policy, "cuda"), PROMPT, max_new_tokens=16)
            rnd = run_step(ex, step(ex, "random", policy, "cuda"), PROMPT, max_new_tokens=16)
            rnd_cpu = run_step(cex, step(cex, "random", policy, "cpu"), PROMPT, max_new_tokens=16)
            print(arch, dtype, policy, "never-fire == ar:", never.tokens == ref,
                  "| always-fire exits at layer", C, ":", always.stats.exit_counts[C], "of 15",
                  "| random state predictors: exits", rnd.stats.exit_counts,
                  "of 15, same tokens/exits as CPU:", rnd.tokens == rnd_cpu.tokens,
                  rnd.stats.exit_counts == rnd_cpu.stats.exit_counts, flush=True)
