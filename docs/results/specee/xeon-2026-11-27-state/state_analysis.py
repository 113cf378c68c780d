"""Offline: do predictors that read the hidden state gain from ~10x more training positions?
Drafter+ngram candidates (drafter49k), predictor layers 3..27, Qwen2.5-Coder-1.5B bf16."""
import sys, time, torch, numpy as np, torch.nn.functional as F, selfspec
from selfspec.heads.files import load_heads
from selfspec.training.pipeline import DataRequest, prepare_features, StageTimes, in_feature_order, card_request as _card_request
from selfspec.training.predictors import ngram_tokens
from selfspec.training.drafter import drafter_candidates
from selfspec.training.drafter import drafter_positions
from selfspec.training.predictors import predictor_data, fit_predictors, PredictorTrainConfig
from selfspec.training.corpus import TRAIN, CALIBRATION, TEST
from selfspec.decoding.specee.step import merge_ngram
from selfspec.decoding.drafting.draft_vocab import frequent_rows
from selfspec.models.eos import eos_token_ids
torch.set_num_threads(2)
model = "qwen2.5-coder-1.5b-instruct"
import os
H = os.path.expanduser(os.environ.get("SELFSPEC_HOME", "~/.cache/selfspec")) + "/heads/" + model + "/drafter49k"
eng = selfspec.load(model, dtype="bf16", show_progress=False)
ex = eng.executor; L = ex.num_layers
heads = load_heads(H, eng)
pc = heads.card.predictors
layers = list(pc.layers); print("layers", layers[0], layers[-1], "cands", pc.candidates, flush=True)
rows = frequent_rows(heads.token_counts, pc.draft_vocab, eos_token_ids(ex.model)).rows
def build(req, name):
    t = time.time()
    prep = prepare_features(eng, req, layers, StageTimes(), progress=False)
    f = prep.features
    pos = drafter_positions(in_feature_order(prep.items))
    look = ngram_tokens(prep.items)
    usable = pos.usable()
    out = {}
    for sname, mask in (("train", (f.split == TRAIN) | (f.split == CALIBRATION)), ("test", f.split == TEST)):
        idx = torch.nonzero(mask & usable).squeeze(1)
        cands = merge_ngram(drafter_candidates(eng, heads.drafter, f, pos, idx, 4, rows), look[idx])
        hid = {x: f.hidden[x][idx] for x in layers}
        d = predictor_data(ex, hid, cands, f.teacher_token[idx], layers)
        hn = torch.empty(len(layers), idx.numel(), hid[layers[0]].shape[1], dtype=torch.bfloat16)
        with torch.inference_mode():
            for j, x in enumerate(layers):
                hn[j] = ex.final_norm(hid.pop(x)).to(torch.bfloat16)
        del hid
        # sequence id per position (for bad-sequence counts)
        seq = torch.cat([torch.full((it.num_scored,), k) for k, it in enumerate(in_feature_order(prep.items))])[idx]
        out[sname] = (d, hn, seq)
        print(name, sname, "N", idx.numel(), "recall %.3f" % d.recall.float().mean(), "time %.0fs" % (time.time() - t), flush=True)
    del f, prep
    import gc; gc.collect()
    return out
big = build(_card_request(heads.card.training), "heads-corpus")
onp = build(DataRequest("onpolicy:humaneval,onpolicy:sharegpt-chat,stdlib", 12000, 128), "onpolicy")
lt = torch.tensor(layers)
def curve(prob, lab):
    N = lab.shape[1]; res = []
    for th in np.linspace(0.2, 0.999, 120):
        fire = prob > th
        any_ = fire.any(0); first = torch.where(any_, fire.float().argmax(0), torch.zeros(N, dtype=torch.long))
        corr = torch.where(any_, lab.gather(0, first.unsqueeze(0))[0], torch.ones(N, dtype=torch.bool))
        el = torch.where(any_, lt[first], torch.full((N,), L)).float()
        res.append((corr.float().mean().item(), el.mean().item()))
    acc = np.array([r[0] for r in res]); lay = np.array([r[1] for r in res])
    return " ".join(f"acc>={t}: {lay[acc >= t].min() if (acc >= t).any() else float('nan'):.2f}" for t in (0.9, 0.95, 0.97, 0.98, 0.99))
class HidMLP(torch.nn.Module):
    def __init__(s, P, D, W):
        super().__init__()
        s.w1 = torch.nn.Parameter(torch.randn(P, D, W) / D ** 0.5); s.b1 = torch.nn.Parameter(torch.zeros(P, 1, W))
        s.w2 = torch.nn.Parameter(torch.randn(P, W, 1) / W ** 0.5); s.b2 = torch.nn.Parameter(torch.zeros(P, 1, 1))
    def forward(s, x): return (torch.bmm(F.silu(torch.bmm(x, s.w1) + s.b1), s.w2) + s.b2).squeeze(-1)
def X(hn, feats, mu, sd):
    h = hn.float(); h = h / h.norm(dim=-1, keepdim=True) * 8
    return torch.cat([h, (feats - mu) / sd], -1)
def fit_hidden(train, width, epochs, wd=1e-4, lr=2e-3, batch=512):
    d, hn, _ = train
    mu = d.features.mean(1, keepdim=True); sd = d.features.std(1, keepdim=True) + 1e-6
    P, N, _ = hn.shape
    torch.manual_seed(0)
    m = HidMLP(P, hn.shape[2] + 12, width)
    opt = torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=wd)
    steps = epochs * ((N + batch - 1) // batch); sch = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    y = d.labels.float()
    for ep in range(epochs):
        order = torch.randperm(N)
        for st in range(0, N, batch):
            i = order[st:st + batch]
            loss = F.binary_cross_entropy_with_logits(m(X(hn[:, i], d.features[:, i], mu, sd)), y[:, i])
            opt.zero_grad(); loss.backward(); opt.step(); sch.step()
    m.eval()
    def prob(test):
        dt, ht, _ = test
        with torch.no_grad():
            return torch.cat([torch.sigmoid(m(X(ht[:, j], dt.features[:, j], mu, sd))) for j in torch.arange(ht.shape[1]).split(2048)], 1)
    return prob
def sub(t, m): return (type(t[0])(t[0].layers, t[0].features[:, m], t[0].labels[:, m], t[0].picks[:, m], t[0].recall[m]), t[1][:, m], t[2][m])
ht = big["test"]; odd = (ht[2] % 3) != 0
htA, htB = sub(ht, odd), sub(ht, ~odd)
big["test"] = htB
print("heads-test A (train)", int(odd.sum()), "B (eval)", int((~odd).sum()), flush=True)
for tname, tr in (("heads-testA(%d)" % int(odd.sum()), htA), ("onpolicy-train(%d)" % onp["train"][0].labels.shape[1], onp["train"]), ("heads-corpus-train(%d)" % big["train"][0].labels.shape[1], big["train"])):
    t = time.time()
    m12 = fit_predictors(tr[0], 4, PredictorTrainConfig())
    print(f"== trained on {tname}: specee-12 fit {time.time()-t:.0f}s", flush=True)
    for ename, te in (("onpolicy-test", onp["test"]), ("heads-test", big["test"])):
        with torch.no_grad(): p = torch.sigmoid(m12.logits_all(te[0].features))
        print(f"  specee-12 on {ename}: {curve(p, te[0].labels)}", flush=True)
    for width, epochs in ((128, 8),):
        t = time.time()
        fn = fit_hidden(tr, width, epochs)
        print(f"  hidden MLP w{width} e{epochs} fit {time.time()-t:.0f}s", flush=True)
        for ename, te in (("onpolicy-test", onp["test"]), ("heads-test", big["test"])):
            print(f"  hidden+12 on {ename}: {curve(fn(te), te[0].labels)}", flush=True)
# oracle on each test
for ename, te in (("onpolicy-test", onp["test"]), ("heads-test", big["test"])):
    lab = te[0].labels
    suf = torch.flip(torch.cumprod(torch.flip(lab.int(), [0]), 0), [0]).bool()
    first = torch.where(suf.any(0), lt[suf.float().argmax(0)], torch.full((lab.shape[1],), L))
    print(f"stable oracle {ename}: {first.float().mean():.2f}", flush=True)
