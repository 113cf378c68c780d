"""Offline: predictors that also read the layer's normed hidden state (linear part on H dims + SpecEE's 12 features)."""
import sys, torch, numpy as np
exec(open("feat.py").read().split("dtr, ptr = build(tr)")[0])
dtr, _ = build(tr); dev, _ = build(ev)
cfg = PredictorTrainConfig()
base = fit_predictors(dtr, 4, cfg)
def normed(idx):
    with torch.inference_mode():
        return torch.stack([ex.final_norm(f.hidden[x][idx]).float() for x in layers])  # [P, N, H]
Htr, Hev = normed(tr), normed(ev)
P_, N_, Hd = Htr.shape
# per-layer logistic regression on [hidden, 12 features], weight decay, Adam
torch.manual_seed(0)
W = torch.zeros(P_, Hd + 12, requires_grad=True); b = torch.zeros(P_, requires_grad=True)
mu = dtr.features.mean(1, keepdim=True); sd = dtr.features.std(1, keepdim=True) + 1e-6
def X(Hs, d): return torch.cat([Hs / Hs.norm(dim=-1, keepdim=True) * 8, (d.features - mu) / sd], -1)
Xtr, Xev = X(Htr, dtr), X(Hev, dev)
opt = torch.optim.Adam([W, b], lr=3e-3, weight_decay=float(sys.argv[4]) if len(sys.argv) > 4 else 1e-3)
y = dtr.labels.float()
for it in range(400):
    logit = (Xtr * W.unsqueeze(1)).sum(-1) + b.unsqueeze(1)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logit, y)
    opt.zero_grad(); loss.backward(); opt.step()
with torch.no_grad():
    pe = torch.sigmoid((Xev * W.unsqueeze(1)).sum(-1) + b.unsqueeze(1))
    pb = torch.sigmoid(base.logits_all(dev.features))
lab = dev.labels; N = lab.shape[1]; lt = torch.tensor(layers)
def sim(prob, th):
    fire = prob > th
    any_ = fire.any(0); first = torch.where(any_, fire.float().argmax(0), torch.zeros(N, dtype=torch.long))
    corr = torch.where(any_, lab.gather(0, first.unsqueeze(0))[0], torch.ones(N, dtype=torch.bool))
    el = torch.where(any_, lt[first], torch.full((N,), L)).float()
    return corr.float().mean().item(), el.mean().item()
for name, prob in (("specee-12", pb), ("hidden+12 logistic", pe)):
    pts = [sim(prob, th) for th in np.linspace(0.2, 0.998, 80)]
    acc = np.array([p[0] for p in pts]); lay = np.array([p[1] for p in pts])
    print(name, " ".join(f"acc>={t}: {lay[acc >= t].min() if (acc >= t).any() else float('nan'):.2f}" for t in (0.9, 0.95, 0.97, 0.98, 0.99)), flush=True)
