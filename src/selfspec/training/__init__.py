"""Training exit heads and AdaSPEED probes, calibrating heads, and ``selfspec heads``.

Everything here runs offline, before decoding, and writes head files that
:func:`selfspec.heads.load_heads` reads; decoding code (``heads``, ``decoding``,
``executor``, ``methods``, ``models``) never imports this package. The stages::

    corpus (real text, on-policy generations)        corpus.py, onpolicy.py
      → features (one backbone pass, cached)         features.py
      → train heads (KL / CE / hybrid losses)        train.py, losses.py
      → calibrate τ_k(ε), ROC AUC, plots             calibration.py, plots.py
      → fit probes (AdaSPEED §II.B)                  probe.py
      → SpecEE's drafter and predictors              drafter.py, predictors.py, specee_tuning.py
      → AdaDecode's thresholds by replay             adadecode_tuning.py
      SWIFT's skip set                               skip_search.py, skip_set_search.py

Each stage's module holds its request and outcome dataclasses, its driver and its maths;
pipeline.py holds what the stages share (the data request, corpus + features, stage times);
cli.py is ``selfspec heads``.

Training takes the loaded model as an :class:`Engine` (a protocol that ``selfspec.SelfSpec``
satisfies). ``train.train`` (``selfspec heads train``) is not re-exported here: its name
is the submodule :mod:`selfspec.training.train`.

Sources: DSSD §3.2-3.4 (placement eq. 1, losses, calibration), AdaDecode §2.1 and
Appendix D (lightweight heads, on-policy data), AdaSPEED §II.B (linear probe).
"""

from selfspec.training.calibration import (
    DEFAULT_EPSILONS,
    RocCurve,
    calibrate,
    calibrate_file,
    realised,
    roc_auc,
    roc_curve,
)
from selfspec.training.corpus import (
    CALIBRATION,
    TEST,
    TRAIN,
    CorpusItem,
    build_corpus,
    parse_data_spec,
    split_of,
)
from selfspec.training.engine import Engine
from selfspec.training.features import FeatureSet, backbone_pass, load_features
from selfspec.training.onpolicy import generate_greedy_batch
from selfspec.training.pipeline import DEFAULT_DATA, DEFAULT_TOKENS, DataRequest, TrainOutcome
from selfspec.training.placement import check_layers, default_layers
from selfspec.training.probe import ProbeRequest, ProbeTrainConfig, fit_probe, train_probe
from selfspec.training.train import TrainConfig, TrainRequest, train_heads

__all__ = [
    "CALIBRATION",
    "DEFAULT_DATA",
    "DEFAULT_EPSILONS",
    "DEFAULT_TOKENS",
    "TEST",
    "TRAIN",
    "CorpusItem",
    "DataRequest",
    "Engine",
    "FeatureSet",
    "ProbeRequest",
    "ProbeTrainConfig",
    "RocCurve",
    "TrainConfig",
    "TrainOutcome",
    "TrainRequest",
    "backbone_pass",
    "build_corpus",
    "calibrate",
    "calibrate_file",
    "check_layers",
    "default_layers",
    "fit_probe",
    "generate_greedy_batch",
    "load_features",
    "parse_data_spec",
    "realised",
    "roc_auc",
    "roc_curve",
    "split_of",
    "train_heads",
    "train_probe",
]
