"""Offline: do the drafter's own candidate probabilities (4 more features) make the predictors more precise?"""
import sys, torch, selfspec
import selfspec.heads.predictor as P
from selfspec.heads.files import load_heads
from selfspec.training import pipeline as pl
from selfspec.training.predictors import predictor_data, fit_predictors, evaluate_predictors, PredictorData, PredictorTrainConfig
from selfspec.training.drafter import drafter_positions, drafter_inputs
from selfspec.decoding.specee.step import merge_ngram
from selfspec.decoding.drafting.draft_vocab import frequent_rows
from selfspec.models.eos import eos_token_ids
torch.set_num_threads(2)
model, hp, spec = sys.argv[1], sys.argv[2], sys.argv[3]
eng = selfspec.load(model, dtype="bf16", show_progress=False); ex = eng.executor; L = ex.num_layers
heads = load_heads(hp, eng); pc = heads.card.predictors
layers = list(pc.layers)
prep = pl.prepare_features(eng, pl.DataRequest(spec, 12000, 128), layers, pl.StageTimes(), progress=False)
f = prep.features
head_train = {(u.dataset, i) for u in heads.card.prompts if u.use == "train" for i in u.ids}
tr, ev = pl.predictor_splits(prep.items, f, head_train)
pos = drafter_positions(pl.in_feature_order(prep.items)); u = pos.usable()
tr, ev = tr[u[tr]], ev[u[ev]]
rows = frequent_rows(heads.token_counts, pc.draft_vocab, eos_token_ids(ex.model)).rows
look = pl.ngram_tokens(prep.items)
inv = torch.full((ex.vocab_size,), -1); inv[rows] = torch.arange(rows.numel())
def build(idx):
    hidden = {x: f.hidden[x][idx] for x in layers}
    with torch.inference_mode():
        x = drafter_inputs(f, pos, ex.embed_tokens.weight, idx)
        lg = ex.logits(heads.drafter(x.previous, x.embedding).to(ex.dtype).unsqueeze(0), vocab_rows=rows)[0].float()
        prob = lg.softmax(-1)
        c = rows[lg.topk(4, -1).indices]
        c = merge_ngram(c, look[idx])
        j = inv[c]
        dp = torch.where(j >= 0, prob.gather(1, j.clamp_min(0)), torch.zeros_like(j, dtype=prob.dtype))
    d = predictor_data(ex, hidden, c, f.teacher_token[idx], layers)
    return d, dp
dtr, ptr = build(tr); dev, pev = build(ev)
cfg = PredictorTrainConfig()
base = fit_predictors(dtr, 4, cfg)
def ext(d, dp):
    return PredictorData(d.layers, torch.cat([d.features, dp.unsqueeze(0).expand(len(d.layers), -1, -1)], -1), d.labels, d.picks, d.recall)
P.FEATURES_PER_CANDIDATE = 4
import selfspec.training.predictors as TP
extm = fit_predictors(ext(dtr, ptr), 4, cfg)
for th in (0.5, 0.7, 0.8, 0.9, 0.95, 0.97):
    a = evaluate_predictors(base, dev, L, th); b = evaluate_predictors(extm, ext(dev, pev), L, th)
    print(f"th {th}: base acc {a.token_accuracy:.4f} layers {a.mean_exit_layer:.2f} | +drafter probs acc {b.token_accuracy:.4f} layers {b.mean_exit_layer:.2f}", flush=True)
