"""Learning curve of the state-reading predictors at layers 6, 12, 18: train on a quarter, half
and all of the training positions, score on the same held-out positions."""
import torch
from selfspec.training.predictors import PredictorData, PredictorTrainConfig, fit_predictors, predictor_probs
torch.set_num_threads(2)
tr = torch.load("train.pt"); ev = torch.load("eval.pt")
exec(open("exp.py").read().split("def data")[0].split("ev = torch.load(\"eval.pt\")")[1])  # metrics()
n = tr["features"].shape[1]
perm = torch.randperm(n, generator=torch.Generator().manual_seed(1))
for i, L in enumerate(ev["layers"].tolist()):
    if L not in (6, 12, 18): continue
    for frac in (0.25, 0.5, 1.0):
        idx = perm[: int(n * frac)]
        d = PredictorData([L], tr["features"][i:i+1, idx], tr["labels"][i:i+1, idx], None, None, tr["states"][i:i+1, idx])
        e = PredictorData([L], ev["features"][i:i+1], ev["labels"][i:i+1], None, None, ev["states"][i:i+1])
        m = fit_predictors(d, 4, PredictorTrainConfig.state_reading())
        print(f"layer {L} train {len(idx)}: {metrics(predictor_probs(m, e)[0], ev['labels'][i])}", flush=True)
