import torch, time, sys
from selfspec.training.predictors import PredictorData, PredictorTrainConfig, fit_predictors, predictor_probs
torch.set_num_threads(2)
tr = torch.load("train.pt"); ev = torch.load("eval.pt")
def metrics(p, y):
    o = torch.argsort(p, descending=True); ys = y[o].float()
    tp = ys.cumsum(0); prec = tp / torch.arange(1, len(ys)+1); rec = tp / ys.sum()
    out = []
    for t in (0.9, 0.95, 0.98):
        ok = prec >= t
        # recall at largest k with precision>=t (after some min count)
        idx = torch.nonzero(ok[20:]).flatten()
        out.append(rec[20 + idx[-1]].item() if len(idx) else 0.0)
    # AUC
    pos = ys.sum(); neg = len(ys) - pos
    auc = ((1 - ys) * tp).sum() / (pos * neg)  # fraction of (neg, pos) pairs with pos ranked above
    return f"base {y.float().mean():.3f} AUC {auc:.3f} R@P90 {out[0]:.3f} R@P95 {out[1]:.3f} R@P98 {out[2]:.3f}"
def data(d, i, feats=True, states=True):
    f = d["features"][i:i+1]
    return PredictorData(layers=[int(d["layers"][i])], features=f, labels=d["labels"][i:i+1], picks=None, recall=None, states=d["states"][i:i+1] if states else None)
configs = {
 "h128e8": PredictorTrainConfig.state_reading(),
 "h512e8": PredictorTrainConfig(epochs=8, lr=2e-3, hidden=512, state=True),
 "h128e20": PredictorTrainConfig(epochs=20, lr=2e-3, hidden=128, state=True),
 "h128e4": PredictorTrainConfig(epochs=4, lr=2e-3, hidden=128, state=True),
 "feat-only h512 e30": PredictorTrainConfig(epochs=30, lr=3e-3, hidden=512, state=False),
}
for i, L in enumerate(ev["layers"].tolist()):
    if L not in (6, 12, 18): continue
    print(f"layer {L} pipeline:", metrics(ev["prob"][i], ev["labels"][i]), flush=True)
    for name, c in configs.items():
        t = time.time()
        m = fit_predictors(data(tr, i, states=c.state), 4, c)
        p = predictor_probs(m, data(ev, i, states=c.state))[0]
        print(f"layer {L} {name}: {metrics(p, ev['labels'][i])} ({time.time()-t:.0f}s)", flush=True)
