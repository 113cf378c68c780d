import os, sys, torch, time, glob
from safetensors import safe_open
from selfspec.training.predictors import PredictorData, PredictorTrainConfig, fit_predictors, predictor_probs
from selfspec.decoding.drafting.draft_vocab import frequent_rows
torch.set_num_threads(2)
tr = torch.load("train.pt"); ev = torch.load("eval.pt")
exec(open("exp.py").read().split("def data")[0].split("ev = torch.load(\"eval.pt\")")[1])  # metrics()
hf = safe_open(sys.argv[1] if len(sys.argv) > 1 else "heads.safetensors", "pt")
mf = safe_open(glob.glob(os.path.expanduser(os.environ.get("SELFSPEC_HOME", "~/.cache/selfspec")) + "/models/qwen2.5-coder-0.5b-instruct/.bf*/model.safetensors")[0], "pt")
W = mf.get_tensor("model.embed_tokens.weight")
rows = frequent_rows(hf.get_tensor("vocab.token_counts"), 4096).rows
Wr = W[rows].float()
def extra(d, i, L):
    T = hf.get_tensor(f"head.{L}.transform")
    s = d["states"][i].float()
    out = []
    for c in s.split(4096):
        lg = (c @ T.t()) @ Wr.t()
        lse = torch.logsumexp(lg, -1); mx = lg.max(-1).values
        top2 = lg.topk(2, -1).values
        p = torch.softmax(lg, -1); ent = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
        out.append(torch.stack([lse, mx - lse, top2[:, 0] - top2[:, 1], ent], -1))
    e = torch.cat(out)
    f = d["features"][i]
    topc = f[:, :4].max(-1).values  # candidates' logits (first 4 features?)
    e = torch.cat([e, (topc - e[:, :1].squeeze(-1) * 0 - (e[:, 0]))[:, None], (e[:, 0] + e[:, 1] - topc)[:, None]], -1)
    return e
print("feature sample", tr["features"][1, :3])
for i, L in enumerate(ev["layers"].tolist()):
    if L not in (6, 12, 18): continue
    et, ee = extra(tr, i, L), extra(ev, i, L)
    for name, use in (("base", False), ("+headstats", True)):
        def data(d, e):
            f = d["features"][i:i+1]
            if use: f = torch.cat([f, e[None]], -1)
            return PredictorData(layers=[L], features=f, labels=d["labels"][i:i+1], picks=None, recall=None, states=d["states"][i:i+1])
        c = PredictorTrainConfig.state_reading()
        import selfspec.heads.predictor as hp
        k = (f := data(tr, et).features.shape[-1]) // 3
        # ExitPredictors sizes features as 3k; pad to a multiple of 3
        Ft, Fe = data(tr, et), data(ev, ee)
        pad = (-f) % 3
        if pad:
            Ft = PredictorData([L], torch.cat([Ft.features, torch.zeros(1, Ft.features.shape[1], pad)], -1), Ft.labels, None, None, Ft.states)
            Fe = PredictorData([L], torch.cat([Fe.features, torch.zeros(1, Fe.features.shape[1], pad)], -1), Fe.labels, None, None, Fe.states)
        kk = Ft.features.shape[-1] // 3
        m = fit_predictors(Ft, kk, c); p = predictor_probs(m, Fe)[0]
        print(f"layer {L} {name}: {metrics(p, ev['labels'][i])}", flush=True)
    # single feature AUC: head global log-prob of top candidate
    print(f"layer {L} head maxprob alone: {metrics(ee[:, 1], ev['labels'][i])}; cand global logp: {metrics(ee[:, 4], ev['labels'][i])}")
