import torch, numpy as np, sys
from safetensors.torch import load_file
d = load_file(sys.argv[1]); L = int(sys.argv[2]); cost = {4096: float(sys.argv[3]), 16384: 4 * float(sys.argv[3])}
prob, lab, layers = d["prob"], d["labels"].bool(), d["layers"].tolist()
conf = {4096: d["conf4096"].bool(), 16384: d["conf16384"].bool()}
N = lab.shape[1]; lt = torch.tensor(layers)
def sim(fire):
    any_ = fire.any(0); first = torch.where(any_, fire.float().argmax(0), torch.zeros(N, dtype=torch.long))
    corr = torch.where(any_, lab.gather(0, first.unsqueeze(0))[0], torch.ones(N, dtype=torch.bool))
    el = torch.where(any_, lt[first], torch.full((N,), L)).float()
    return corr.float().mean().item(), el.mean().item()
for name, K in (("plain", None), ("confirm4096", 4096), ("confirm16384", 16384)):
    pts = []
    for th in np.linspace(0.2, 0.995, 60):
        fire = prob > th
        if K:
            fc = fire & conf[K]
            cum = torch.cumsum(fc.int(), 0); before = (cum == 0) | (fc & (cum == 1))
            nchk = (fire & before).sum().item() / N
            a, m = sim(fc); m += nchk * cost[K]
        else:
            a, m = sim(fire)
        pts.append((a, m))
    acc = np.array([p[0] for p in pts]); lay = np.array([p[1] for p in pts])
    print(name, " ".join(f"acc>={t}: {lay[acc >= t].min() if (acc >= t).any() else float('nan'):.2f}" for t in (0.9, 0.95, 0.97, 0.98, 0.99)))
