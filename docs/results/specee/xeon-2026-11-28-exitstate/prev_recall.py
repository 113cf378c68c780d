"""Drafter candidate recall (top-4 over the draft vocabulary, + n-gram not included) on the
held-out split of the predictors' corpus, by what the drafter reads as the previous state:
the last-layer state (draft start), an exit layer's state (inside a draft, today), or the
drafter's own prediction of the previous position's state (EAGLE's chaining). The setup lives in corpus_setup.py (shared by both
scripts since); the computation is as run."""
import sys

import torch
from corpus_setup import load

from selfspec.training.corpus import TEST

model, heads, mnt, layers = sys.argv[1], sys.argv[2], int(sys.argv[3]), [int(x) for x in sys.argv[4].split(",")]
s = load(model, heads, mnt, layers)
ex, f, pos, rows, out, E = s.ex, s.features, s.positions, s.rows, s.out, s.embedding
d = s.heads.drafter
idx = torch.nonzero((pos.previous >= 0) & (f.split == TEST)).squeeze(1)
# positions whose previous also has a previous (for chaining)
idx2 = idx[pos.previous[pos.previous[idx]] >= 0]

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
