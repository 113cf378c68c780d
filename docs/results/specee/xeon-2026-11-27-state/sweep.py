"""Held-out threshold sweep (finer, up to 0.999) of a head file's SpecEE predictors on the test split."""
import sys, torch, numpy as np, selfspec
from selfspec.heads.files import load_heads
from selfspec.training.pipeline import DataRequest, prepare_features, StageTimes, in_feature_order, card_request as _card_request
from selfspec.training.predictors import ngram_tokens
from selfspec.training.drafter import drafter_candidates
from selfspec.training.drafter import drafter_positions
from selfspec.training.predictors import predictor_data, predictor_probs
from selfspec.training.corpus import TEST
from selfspec.decoding.specee.step import merge_ngram
from selfspec.decoding.drafting.draft_vocab import frequent_rows
from selfspec.models.eos import eos_token_ids
torch.set_num_threads(2)
eng = selfspec.load("qwen2.5-coder-1.5b-instruct", dtype="bf16", show_progress=False)
ex = eng.executor; L = ex.num_layers
for spec in sys.argv[2].split(","):
  req = _card_request(load_heads(sys.argv[1].split(",")[0], eng).card.training) if spec == "heads" else DataRequest(spec.replace("+", ","), 12000, 128)
  for path in sys.argv[1].split(","):
    heads = load_heads(path, eng); pc = heads.card.predictors; layers = list(pc.layers)
    rows = frequent_rows(heads.token_counts, pc.draft_vocab, eos_token_ids(ex.model)).rows
    prep = prepare_features(eng, req, layers, StageTimes(), progress=False)
    f = prep.features
    pos = drafter_positions(in_feature_order(prep.items))
    idx = torch.nonzero((f.split == TEST) & pos.usable()).squeeze(1)
    c = merge_ngram(drafter_candidates(eng, heads.drafter, f, pos, idx, 4, rows), ngram_tokens(prep.items)[idx])
    d = predictor_data(ex, {x: f.hidden[x][idx] for x in layers}, c, f.teacher_token[idx], layers, with_states=bool(pc.state_dim))
    prob = predictor_probs(heads.predictors, d); lab = d.labels; N = lab.shape[1]; lt = torch.tensor(layers)
    print(path.split("/")[-1], "on", spec, "N", N, flush=True)
    for th in (0.9, 0.95, 0.97, 0.98, 0.99, 0.993, 0.995, 0.997, 0.998, 0.999):
        fire = prob > th; any_ = fire.any(0); first = torch.where(any_, fire.float().argmax(0), torch.zeros(N, dtype=torch.long))
        corr = torch.where(any_, lab.gather(0, first.unsqueeze(0))[0], torch.ones(N, dtype=torch.bool))
        el = torch.where(any_, lt[first], torch.full((N,), L)).float()
        print(f"  {th}: acc {corr.float().mean():.4f} layers {el.mean():.2f}", flush=True)
    del f, prep, d
