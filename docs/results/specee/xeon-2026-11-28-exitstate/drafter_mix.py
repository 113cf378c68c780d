"""Drafter variants trained on the predictors' 320-token corpus (train split), and their
held-out top-4 recall over the 4096-token draft vocabulary by the layer of the previous state. The setup lives in corpus_setup.py (shared by both
scripts since); the computation is as run."""
import sys
import time

import torch
from corpus_setup import load

from selfspec.training.corpus import TEST, TRAIN
from selfspec.training.drafter import DrafterTrainConfig, fit_drafter
from selfspec.training.pipeline import draft_rows as _draft_rows

model, heads, mnt, layers = sys.argv[1], sys.argv[2], int(sys.argv[3]), [int(x) for x in sys.argv[4].split(",")]
variants = sys.argv[5].split(";")
s = load(model, heads, mnt, layers)
ex, f, pos, rows, out, E, c = s.ex, s.features, s.positions, s.rows, s.out, s.embedding, s.heads
rows16 = _draft_rows(s.eng, c, s.target, 16384)
idx = torch.nonzero((pos.previous >= 0) & (f.split == TEST)).squeeze(1)
tr = torch.nonzero((pos.previous >= 0) & (f.split == TRAIN)).squeeze(1)
print(f"train {tr.numel()} held-out {idx.numel()}")

def recall(d, prev_state, index):
    with torch.inference_mode():
        h = d(prev_state.to(ex.dtype), E[pos.token[index]]).to(ex.dtype)
        logits = out.project(out.norm(h).to(out.weight.dtype), rows)
        top = rows[logits.topk(4, dim=-1).indices]
        return float((top == f.teacher_token[index].unsqueeze(1)).any(1).float().mean())

def report(name, d):
    prev = pos.previous[idx]
    r = [f"last {recall(d, f.final[prev], idx):.3f}"]
    r += [f"L{l} {recall(d, f.hidden[l][prev], idx):.3f}" for l in layers]
    print(f"{name:40s} " + "  ".join(r), flush=True)

report("card drafter", c.drafter.to(ex.dtype))
for v in variants:
    mix, ls = v.split("@")
    el = [int(x) for x in ls.split(",")]
    t0 = time.time()
    d = fit_drafter(out, f, pos, E, tr, rows16, el, DrafterTrainConfig(exit_mix=float(mix)))
    report(f"mix {mix} over {el} ({time.time()-t0:.0f}s)", d.to(ex.dtype))
