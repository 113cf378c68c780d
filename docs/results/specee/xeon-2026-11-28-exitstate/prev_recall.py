"""Drafter candidate recall (top-4 over the draft vocabulary, + n-gram not included) on the
held-out split of the predictors' corpus, by what the drafter reads as the previous state:
the last-layer state (draft start), an exit layer's state (inside a draft, today), or the
drafter's own prediction of the previous position's state (EAGLE's chaining)."""
import sys, torch
import selfspec
from selfspec.heads import load_heads
from selfspec.heads.files import find_head_file
from selfspec.heads.modules import output_layer
from selfspec.training.pipeline import (DataRequest, StageTimes, prepare_features, in_feature_order,
                                        _draft_rows)
from selfspec.training.drafter import drafter_positions
from selfspec.training.corpus import TEST

model, heads, mnt, layers = sys.argv[1], sys.argv[2], int(sys.argv[3]), [int(x) for x in sys.argv[4].split(",")]
torch.set_num_threads(2)
eng = selfspec.load(model, dtype="bf16", show_progress=False)
ex = eng.executor
target = find_head_file(heads, model)
c = load_heads(target, eng)
req = DataRequest("stdlib*4,onpolicy:humaneval,onpolicy:stdlib,onpolicy:gsm*2", 49000, mnt)
prep = prepare_features(eng, req, layers, StageTimes(), progress=False)
f = prep.features
items = in_feature_order(prep.items)
pos = drafter_positions(items)
rows = _draft_rows(eng, c, target, 4096)
out = output_layer(eng)
E = ex.embed_tokens.weight
d = c.drafter
idx = torch.nonzero((pos.previous >= 0) & (f.split == TEST)).squeeze(1)
# positions whose previous also has a previous (for chaining)
idx2 = idx[pos.previous[pos.previous[idx]] >= 0]
src = torch.tensor([items_i for items_i in range(0)])

def recall(prev_state, index):
    with torch.inference_mode():
        h = d(prev_state.to(ex.dtype), E[pos.token[index]]).to(ex.dtype)
        logits = out.project(out.norm(h).to(out.weight.dtype), rows)
        top = rows[logits.topk(4, dim=-1).indices]
        return float((top == f.teacher_token[index].unsqueeze(1)).any(1).float().mean())

prev = pos.previous[idx2]
print(f"{model} {heads}: {idx2.numel()} held-out positions")
print(f"  previous = last-layer state       : {recall(f.final[prev], idx2):.3f}")
for l in layers:
    print(f"  previous = state leaving layer {l-1:2d} : {recall(f.hidden[l][prev], idx2):.3f}")
pp = pos.previous[prev]
with torch.inference_mode():
    hhat = d(f.final[pp].to(ex.dtype), E[pos.token[prev]]).to(ex.dtype)
print(f"  previous = drafter's prediction   : {recall(hhat, idx2):.3f}")
for l in layers:
    with torch.inference_mode():
        hh = d(f.hidden[l][pp].to(ex.dtype), E[pos.token[prev]]).to(ex.dtype)
    print(f"  previous = prediction from layer {l-1:2d} state : {recall(hh, idx2):.3f}")
