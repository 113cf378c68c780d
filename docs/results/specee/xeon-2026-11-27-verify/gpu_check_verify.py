"""GPU check (device tool, 2026-11-27): verified SpecEE (specee:verify=true) on CUDA, tiny random
models: greedy output equals `ar` (fp32 and bf16) with every candidate source and predictors
that fire never / always / on a state-dependent rule, and sampling runs. Run from the repository
root: PYTHONPATH=<stubs for gguf, platformdirs> python THIS."""
import sys, torch
sys.path[:0] = ["src", "tests"]
from tiny import tiny_model, run_step
from selfspec.executor import LayerExecutor
from selfspec.decoding.core.sampling import SamplingConfig
from selfspec.decoding.specee.step import (DrafterCandidates, HeadCandidates, PredictorScan,
                                      PredictorSchedule, SpecEEDrafter, SpecEEExits,
                                      VerifiedSpecEEStep)
from selfspec.heads.drafter import FeatureDrafter
from selfspec.heads.predictor import ExitPredictors
from selfspec.methods.registry import build_step
print(torch.__version__, torch.cuda.get_device_name(0))
PROMPT = [5, 17, 42, 99, 3, 250, 7, 5, 17, 42]
L = 8
for arch in ("llama", "qwen2"):
    for dtype in (torch.float32, torch.bfloat16):
        ex = LayerExecutor(tiny_model(arch, seed=11, num_layers=L).to("cuda", dtype))
        H = ex.config.hidden_size
        ref = run_step(ex, build_step("ar", ex, {}), PROMPT, max_new_tokens=24).tokens
        for source in ("head+ngram", "drafter+ngram"):
            for mode in ("never", "always", "random"):
                first = 1 if source.startswith("drafter") else 3
                torch.manual_seed(1)
                p = ExitPredictors(list(range(first, L)), 4, hidden=16, state_dim=H)
                with torch.no_grad():
                    if mode == "random":   # fire iff u_l . state > 0.85 sd
                        u = torch.randn(len(p.layers), H)
                        u = u / u.norm(dim=-1, keepdim=True) * H ** 0.5 / 8
                        p.fc1_weight.zero_(); p.fc1_bias.zero_(); p.fc2_weight.zero_()
                        p.fc1_weight[:, 0, 12:] = u; p.fc1_weight[:, 1, 12:] = -u
                        p.fc2_weight[:, 0] = 30.0; p.fc2_weight[:, 1] = -30.0
                        p.fc2_bias.fill_(-30.0 * 0.85)
                    else:
                        p.fc2_weight.zero_(); p.fc2_bias.fill_(30.0 if mode == "always" else -30.0)
                p = p.to("cuda").eval().requires_grad_(False)
                if source.startswith("drafter"):
                    d = FeatureDrafter(H)
                    with torch.no_grad():
                        d.fc_weight.normal_(0, 0.05)
                    c = DrafterCandidates(ex, d.to("cuda", dtype).eval(), first, ex.logits, 4, ngram=True)
                else:
                    c = HeadCandidates(ex, first, lambda h: ex.logits(h), 4, ngram=True)
                scan = PredictorScan(c, p, PredictorSchedule(p.layers, None), 0.5)
                step = VerifiedSpecEEStep(SpecEEDrafter(ex, SpecEEExits(scan, ex), 4))
                st = run_step(ex, step, PROMPT, max_new_tokens=24)
                sm = run_step(ex, step, PROMPT, max_new_tokens=24,
                              sampling=SamplingConfig(temperature=1.0, top_k=3, seed=0))
                print(arch, dtype, source, mode, "greedy == ar:", st.tokens == ref,
                      "| drafted", st.stats.drafted, "accepted", st.stats.accepted,
                      "| sampling ran:", sm.num_generated == 24, flush=True)
