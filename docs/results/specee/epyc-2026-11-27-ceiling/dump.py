import sys, torch, dataclasses
import selfspec.training.pipeline as pl
KEEP = [3, 6, 12, 17, 18]
def sub(d):
    idx = [d.layers.index(x) for x in KEEP]
    return {"layers": torch.tensor(KEEP), "features": d.features[idx].clone(), "labels": d.labels[idx].clone(),
            "states": d.states[idx].clone()}
of = pl.fit_predictors
def fit(data, k, config):
    torch.save(sub(data), "train.pt"); print("saved train", data.features.shape, config, flush=True)
    return of(data, k, config)
pl.fit_predictors = fit
ot = pl._tune_predictors
def tune(engine, items, eval_idx, model, prob, data, *a, **k):
    d = sub(data); d["prob"] = prob[[data.layers.index(x) for x in KEEP]].clone(); torch.save(d, "eval.pt")
    print("saved eval", data.features.shape, flush=True)
    return ot(engine, items, eval_idx, model, prob, data, *a, **k)
pl._tune_predictors = tune
from selfspec.cli import main
sys.argv = ["selfspec"] + sys.argv[1:]
main()
