"""Offline: SpecEE exits with and without the SpecEE code's confirm check (exit-layer argmax over K rows must be the top candidate)."""
import sys, torch, selfspec
from selfspec.heads.files import load_heads
from selfspec.training.pipeline import DataRequest, prepare_features, StageTimes, in_feature_order
from selfspec.training.predictors import predictor_splits, head_candidates, ngram_tokens
from selfspec.training.predictors import predictor_data
from selfspec.decoding.specee.step import merge_ngram
from selfspec.decoding.drafting.draft_vocab import frequent_rows
from selfspec.models.eos import eos_token_ids
torch.set_num_threads(2)
model, heads_path, data_spec = sys.argv[1], sys.argv[2], sys.argv[3]
eng = selfspec.load(model, dtype="bf16", show_progress=False)
ex = eng.executor
heads = load_heads(heads_path, eng)
pc = heads.card.predictors
layers = list(pc.layers); c = pc.candidate_layer; L = ex.num_layers
prep = prepare_features(eng, DataRequest(data_spec, 12000, 128), layers, StageTimes(), progress=False)
f = prep.features
head_train = {(u.dataset, i) for u in heads.card.prompts if u.use == "train" for i in u.ids}
tr, ev = predictor_splits(prep.items, f, head_train)
eos = eos_token_ids(ex.model)
rows16 = frequent_rows(heads.token_counts, pc.draft_vocab, eos).rows
look = ngram_tokens(prep.items)
hidden = {x: f.hidden[x][ev] for x in layers}
cands = merge_ngram(head_candidates(eng, heads.head_at(c), hidden[c], pc.num_candidates, rows16), look[ev])
data = predictor_data(ex, hidden, cands, f.teacher_token[ev], layers)
final = f.teacher_token[ev]
with torch.inference_mode():
    prob = torch.sigmoid(heads.predictors.logits_all(data.features))  # [P, N]
# sequence ids of eval positions
seq = []
pos = 0
for k, it in enumerate(in_feature_order(prep.items)):
    seq += [k] * it.num_scored
seq = torch.tensor(seq)[ev]
W = ex.lm_head.weight
sizes = [int(s) for s in sys.argv[4].split(",")]
conf = {}
with torch.inference_mode():
    for K in sizes:
        rows = frequent_rows(heads.token_counts, K, eos).rows if K else None
        ok = []
        for li, layer in enumerate(layers):
            outs = []
            for st in range(0, final.numel(), 256):
                n = ex.final_norm(hidden[layer][st:st+256])
                lg = (n @ (W if rows is None else W[rows]).T).float()
                best = lg.max(-1).values
                pick = data.picks[li, st:st+256]
                pl = (n * W[pick]).sum(-1).float()
                outs.append(pl >= best - 1e-3)
            ok.append(torch.cat(outs))
        conf[K] = torch.stack(ok)
        print("K", K, "confirm pass rate per layer", [round(x, 2) for x in conf[K].float().mean(1).tolist()], flush=True)
lab = data.labels
N = final.numel()
print(f"N={N} seqs={seq.unique().numel()} recall={data.recall.float().mean():.3f}")
layer_t = torch.tensor(layers)
def sim(fire, checks=None):
    any_ = fire.any(0)
    first = torch.where(any_, fire.float().argmax(0), torch.zeros(N, dtype=torch.long))
    correct = torch.where(any_, lab.gather(0, first.unsqueeze(0))[0], torch.ones(N, dtype=torch.bool))
    el = torch.where(any_, layer_t[first], torch.full((N,), L))
    bad_seq = seq[~correct].unique().numel()
    return correct.float().mean().item(), el.float().mean().item(), bad_seq
for th in [0.3, 0.5, 0.7, 0.8, 0.9, 0.95]:
    fire = prob > th
    a, m, b = sim(fire)
    line = f"th {th}: plain acc {a:.4f} layers {m:.2f} badseq {b}"
    for K in sizes:
        fc = fire & conf[K]
        a2, m2, b2 = sim(fc)
        # checks per token: fires up to and including the exit layer
        cum = torch.cumsum(fc.int(), 0)
        before = (cum == 0) | (fc & (cum == 1))
        nchk = (fire & before).sum().item() / N
        line += f" | K{K} acc {a2:.4f} layers {m2:.2f} badseq {b2} checks/tok {nchk:.2f}"
    print(line, flush=True)
# confirm alone (no predictor): exit where argmax over K is the top candidate
for K in sizes:
    a, m, b = sim(conf[K]); print(f"confirm-only K{K}: acc {a:.4f} layers {m:.2f} badseq {b}")
# oracle
a, m, b = sim(lab); print(f"oracle (label): layers {m:.2f}")
from safetensors.torch import save_file
save_file({"prob": prob.contiguous(), "labels": lab.to(torch.uint8).contiguous(), "seq": seq.contiguous(), "layers": torch.tensor(layers), **{f"conf{K}": v.to(torch.uint8).contiguous() for K, v in conf.items()}}, "ana-%s.safetensors" % model)
