"""Oracle exit layers with drafter candidates available from layer 1 (vs exit-head candidates from layer c)."""
import sys, math, torch, selfspec, torch.nn.functional as F
from selfspec.heads.files import load_heads
from selfspec.training.pipeline import DataRequest, prepare_features, StageTimes, in_feature_order
from selfspec.training.predictors import ngram_tokens
from selfspec.training.corpus import TEST
from selfspec.decoding.drafting.draft_vocab import frequent_rows
from selfspec.decoding.specee.step import merge_ngram
from selfspec.models.eos import eos_token_ids
torch.set_num_threads(2)
model, heads_path, width = sys.argv[1], sys.argv[2], int(sys.argv[3])
eng = selfspec.load(model, dtype="bf16", show_progress=False)
ex = eng.executor; L = ex.num_layers
heads = load_heads(heads_path, eng)
info = heads.card.training
req = DataRequest(",".join(info.data), info.requested_tokens or info.train_tokens, info.max_new_tokens, info.max_len, info.seed)
prep = prepare_features(eng, req, list(range(1, L)), StageTimes(), progress=True)
f = prep.features
prev, tok = [], []
pos = 0
for it in in_feature_order(prep.items):
    for t in range(it.score_from, len(it.token_ids) - 1):
        prev.append(pos - 1 if t > it.score_from else -1); tok.append(it.token_ids[t]); pos += 1
prev = torch.tensor(prev); tok = torch.tensor(tok)
te = torch.nonzero((prev >= 0) & (f.split == TEST)).squeeze(1)
eos = eos_token_ids(ex.model)
rows = frequent_rows(heads.token_counts, 16384, eos).rows
H = f.final.shape[1]; W = ex.lm_head.weight[rows].float(); emb = ex.model.get_input_embeddings().weight
from safetensors.torch import load_file
sd = load_file(f"drafter-{model}-{width}.safetensors")  # written by prototype_drafter.py
fc_w, fc_b = sd["fc.weight"], sd["fc.bias"]
normw = ex.model.model.norm.weight.float()
def drafter(h, e):
    x = torch.cat([F.rms_norm(h, (H,)), F.rms_norm(e, (H,))], -1)
    y = F.linear(x, fc_w, fc_b)
    if "out.weight" in sd: y = F.linear(F.silu(y), sd["out.weight"], sd["out.bias"])
    return F.rms_norm(h + y, (H,)) * normw @ W.T
look = ngram_tokens(prep.items)[te]
final = f.teacher_token[te]
with torch.no_grad():
    dc = torch.cat([rows[drafter(f.final[prev[ii]].float(), emb[tok[ii]].float()).topk(4, -1).indices] for ii in te.split(1024)])
    c = heads.card.predictors.candidate_layer if heads.card.predictors else 14
    hc = torch.cat([rows[heads.head_at(c)(f.hidden[c][ii].unsqueeze(0), rows)[0].topk(4, -1).indices] for ii in te.split(1024)])
Wf = ex.lm_head.weight
def labels(cands, start):
    out = []
    rowsc = Wf[cands]  # [N,4,H]
    for layer in range(start, L):
        n = ex.final_norm(f.hidden[layer][te])
        lg = (rowsc.float() @ n.float().unsqueeze(-1)).squeeze(-1)
        out.append(cands.gather(1, lg.argmax(-1, keepdim=True)).squeeze(1) == final)
    return torch.stack(out)  # [P, N]
def report(name, cands, start):
    lab = labels(cands, start)
    N = final.numel()
    anyl = lab.any(0)
    first = torch.where(anyl, lab.float().argmax(0) + start, torch.full((N,), L))
    # stable: label true from some layer to L-1 (suffix all true)
    suf = torch.flip(torch.cumprod(torch.flip(lab.int(), [0]), 0), [0]).bool()
    anys = suf.any(0)
    firsts = torch.where(anys, suf.float().argmax(0) + start, torch.full((N,), L))
    rec = (cands == final[:, None]).any(1).float().mean().item()
    print(f"{name}: recall {rec:.3f} oracle layers {first.float().mean():.2f} stable-oracle {firsts.float().mean():.2f} (L={L})", flush=True)
report("head@%d" % c, hc, c)
report("head@%d+ngram" % c, merge_ngram(hc, look), c)
report("drafter from 1", dc, 1)
report("drafter+ngram from 1", merge_ngram(dc, look), 1)
for s in (4, 7, 10):
    report(f"drafter+ngram from {s}", merge_ngram(dc, look), s)
