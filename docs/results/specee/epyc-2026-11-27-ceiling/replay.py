import torch, dataclasses
from selfspec.training.adadecode_tuning import HeadTrace, ScheduleCosts, simulate
from selfspec.training.specee_tuning import SpecEECosts, tune_thresholds
d = torch.load("trace.pt")
tr = HeadTrace(tuple(d["layers"]), d["confidence"], d["correct"], tuple(d["lengths"]))
sc = ScheduleCosts(**d["schedule"])
costs = SpecEECosts(sc, tuple(d["checks"]))
for me in (3, 5, 8, 12):
    f = tune_thresholds(tr, d["num_layers"], costs, me)
    print("max_early", me, "tuned", round(f.tuned.speedup, 3), "check", round(f.tuned_check.speedup, 3), "single check", round(f.single_check.speedup, 3), f.single, flush=True)
