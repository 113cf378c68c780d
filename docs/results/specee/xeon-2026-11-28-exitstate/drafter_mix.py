"""Drafter variants trained on the predictors' 320-token corpus (train split), and their
held-out top-4 recall over the 4096-token draft vocabulary by the layer of the previous state."""
import sys, time, torch
import selfspec
from selfspec.heads import load_heads
from selfspec.heads.files import find_head_file
from selfspec.heads.modules import output_layer
from selfspec.training.pipeline import (DataRequest, StageTimes, prepare_features, in_feature_order,
                                        _draft_rows)
from selfspec.training.drafter import drafter_positions, fit_drafter, DrafterTrainConfig
from selfspec.training.corpus import TEST, TRAIN

model, heads, mnt, layers = sys.argv[1], sys.argv[2], int(sys.argv[3]), [int(x) for x in sys.argv[4].split(",")]
variants = sys.argv[5].split(";")
torch.set_num_threads(2)
eng = selfspec.load(model, dtype="bf16", show_progress=False)
ex = eng.executor
target = find_head_file(heads, model)
c = load_heads(target, eng)
req = DataRequest("stdlib*4,onpolicy:humaneval,onpolicy:stdlib,onpolicy:gsm*2", 49000, mnt)
prep = prepare_features(eng, req, layers, StageTimes(), progress=False)
f = prep.features
pos = drafter_positions(in_feature_order(prep.items))
rows16 = _draft_rows(eng, c, target, 16384)
rows = _draft_rows(eng, c, target, 4096)
out = output_layer(eng)
E = ex.embed_tokens.weight
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
