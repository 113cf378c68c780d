import sys, torch
exec(open("feat.py").read().split("dtr, ptr = build(tr)")[0])
dtr, _ = build(tr); dev, _ = build(ev)
cfg = PredictorTrainConfig()
g = torch.Generator().manual_seed(0)
N = dtr.features.shape[1]; perm = torch.randperm(N, generator=g)
def sub(d, idx):
    return PredictorData(d.layers, d.features[:, idx], d.labels[:, idx], d.picks[:, idx], d.recall[idx])
import numpy as np
for frac in (0.25, 0.5, 1.0):
    m = fit_predictors(sub(dtr, perm[:int(N * frac)]), 4, cfg)
    pts = [(evaluate_predictors(m, dev, L, th).token_accuracy, evaluate_predictors(m, dev, L, th).mean_exit_layer) for th in np.linspace(0.3, 0.995, 40)]
    pts.sort()
    acc = np.array([p[0] for p in pts]); lay = np.array([p[1] for p in pts])
    line = f"train {int(N*frac)}:"
    for target in (0.90, 0.95, 0.97, 0.98, 0.99):
        ok = lay[acc >= target]
        line += f" acc>={target}: {ok.min() if len(ok) else float('nan'):.2f} layers |"
    print(line, flush=True)
