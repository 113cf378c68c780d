"""Offline: predictors trained on drafts from exit-layer states (as decoding drafts after an exit) vs from last-layer states, both evaluated on mixed drafts."""
import sys, torch, numpy as np
exec(open("feat.py").read().split("def build(idx):")[0])
g = torch.Generator().manual_seed(0)
def build(idx, mix):
    hidden = {x: f.hidden[x][idx] for x in layers}
    layer_of = None
    if mix:
        m = torch.rand(idx.numel(), generator=g) < 0.68
        pick = torch.randint(20, 28, (idx.numel(),), generator=g)
        layer_of = torch.where(m, pick, torch.full_like(pick, -1))
    with torch.inference_mode():
        x = drafter_inputs(f, pos, ex.embed_tokens.weight, idx, layer_of)
        lg = ex.logits(heads.drafter(x.previous.to(ex.dtype), x.embedding).to(ex.dtype).unsqueeze(0), vocab_rows=rows)[0]
        c = merge_ngram(rows[lg.topk(4, -1).indices], look[idx])
    return predictor_data(ex, hidden, c, f.teacher_token[idx], layers)
cfg = PredictorTrainConfig()
A = fit_predictors(build(tr, False), 4, cfg); B = fit_predictors(build(tr, True), 4, cfg)
dev_last, dev_mix = build(ev, False), build(ev, True)
print("recall: last-state drafts", dev_last.recall.float().mean().item(), "mixed drafts", dev_mix.recall.float().mean().item())
for name, m, d in (("A on last", A, dev_last), ("A on mixed", A, dev_mix), ("B on mixed", B, dev_mix)):
    pts = [(evaluate_predictors(m, d, L, th).token_accuracy, evaluate_predictors(m, d, L, th).mean_exit_layer) for th in np.linspace(0.3, 0.995, 40)]
    acc = np.array([p[0] for p in pts]); lay = np.array([p[1] for p in pts])
    print(name, " ".join(f"acc>={t}: {lay[acc >= t].min() if (acc >= t).any() else float('nan'):.2f}" for t in (0.9, 0.95, 0.97, 0.98)), "| at 0.9:", round(evaluate_predictors(m, d, L, 0.9).token_accuracy, 4), round(evaluate_predictors(m, d, L, 0.9).mean_exit_layer, 2), flush=True)
