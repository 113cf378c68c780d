"""Offline: an EAGLE-style MLP drafter (previous position's last hidden + current token embedding -> next token) vs the layer-c head."""
import sys, math, torch, selfspec, torch.nn.functional as F
from selfspec.heads.files import load_heads
from selfspec.training.pipeline import DataRequest, prepare_features, StageTimes, in_feature_order
from selfspec.training.corpus import TRAIN, CALIBRATION, TEST
from selfspec.decoding.drafting.draft_vocab import frequent_rows
from selfspec.models.eos import eos_token_ids
torch.set_num_threads(2); torch.manual_seed(0)
model, heads_path = sys.argv[1], sys.argv[2]
width = int(sys.argv[3]) if len(sys.argv) > 3 else 0
epochs = int(sys.argv[4]) if len(sys.argv) > 4 else 4
eng = selfspec.load(model, dtype="bf16", show_progress=False)
ex = eng.executor
heads = load_heads(heads_path, eng)
info = heads.card.training
req = DataRequest(",".join(info.data), info.requested_tokens or info.train_tokens, info.max_new_tokens, info.max_len, info.seed)
prep = prepare_features(eng, req, heads.layers, StageTimes(), progress=False)
f = prep.features
# previous-position index and input token per scored position
prev, tok = [], []
pos = 0
for it in in_feature_order(prep.items):
    for t in range(it.score_from, len(it.token_ids) - 1):
        prev.append(pos - 1 if t > it.score_from else -1)
        tok.append(it.token_ids[t]); pos += 1
prev = torch.tensor(prev); tok = torch.tensor(tok)
valid = prev >= 0
eos = eos_token_ids(ex.model)
rows = frequent_rows(heads.token_counts, 16384, eos).rows
inv = torch.full((ex.vocab_size,), -1, dtype=torch.long); inv[rows] = torch.arange(rows.numel())
target = inv[f.teacher_token]
H = f.final.shape[1]
W = ex.lm_head.weight[rows].float()
emb = ex.model.get_input_embeddings().weight
class Drafter(torch.nn.Module):
    def __init__(s):
        super().__init__()
        s.fc = torch.nn.Linear(2 * H, H if not width else width)
        s.out = torch.nn.Linear(H if not width else width, H) if width else None
    def forward(s, h, e):
        x = torch.cat([F.rms_norm(h, (H,)), F.rms_norm(e, (H,))], -1)
        y = s.fc(x)
        if s.out is not None: y = s.out(F.silu(y))
        g = h + y
        n = ex.final_norm(g.to(torch.bfloat16)).float() if False else F.rms_norm(g, (H,)) * ex.model.model.norm.weight.float()
        return n @ W.T
d = Drafter()
tr = torch.nonzero(valid & ((f.split == TRAIN) | (f.split == CALIBRATION)) & (target >= 0)).squeeze(1)
te = torch.nonzero(valid & (f.split == TEST)).squeeze(1)
print("train", tr.numel(), "test", te.numel(), flush=True)
opt = torch.optim.AdamW(d.parameters(), lr=1e-3, weight_decay=0.01)
steps = epochs * math.ceil(tr.numel() / 256)
sch = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
def batch(ii):
    return f.final[prev[ii]].float(), emb[tok[ii]].float()
def evaluate():
    hit1 = hit4 = 0
    with torch.no_grad():
        for st in range(0, te.numel(), 512):
            ii = te[st:st+512]
            lg = d(*batch(ii))
            top = rows[lg.topk(4, -1).indices]
            hit1 += (top[:, 0] == f.teacher_token[ii]).sum().item(); hit4 += (top == f.teacher_token[ii, None]).any(1).sum().item()
    return hit1 / te.numel(), hit4 / te.numel()
for ep in range(epochs):
    perm = tr[torch.randperm(tr.numel())]
    for st in range(0, perm.numel(), 256):
        ii = perm[st:st+256]
        loss = F.cross_entropy(d(*batch(ii)), target[ii])
        opt.zero_grad(); loss.backward(); opt.step(); sch.step()
    print("epoch", ep, "loss", round(loss.item(), 3), "held-out top1/top4", evaluate(), flush=True)
# baseline: previous position's final top-2 (a "no-train" drafter: lm_head of final[i-1] ranks token i; useless) -> use exit head at layer c
for layer in heads.layers:
    h = heads.head_at(layer); hit4 = 0
    with torch.no_grad():
        for st in range(0, te.numel(), 512):
            ii = te[st:st+512]
            lg = h(f.hidden[layer][ii].unsqueeze(0), rows)[0]
            top = rows[lg.topk(4, -1).indices]
            hit4 += (top == f.teacher_token[ii, None]).any(1).sum().item()
    print("exit head", layer, "top4 recall", hit4 / te.numel())
from safetensors.torch import save_file
save_file({k: v.contiguous() for k, v in d.state_dict().items()}, f"drafter-{model}-{width}.safetensors")
