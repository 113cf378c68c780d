"""Exit heads, their training and calibration, and AdaSPEED acceptance probes.

Public API (what drafters build on)::

    heads = load_heads("default", engine)        # ExitHeads for engine's model
    heads.layers                                 # [6, 12, 18, 24]
    heads.heads[k](hidden [B, T, H], vocab_rows=None) -> logits [B, T, V]
    heads.thresholds(epsilon, "entropy")         # τ_k(ε): exit when confidence >= τ_k
    confidences(logits)["entropy"]               # -H(p) in nats (higher = more confident)
    heads.probes[exit_layer](hidden) -> P(accept) [B, T]

Sources: DSSD §3.2-3.4 (placement eq. 1, losses, calibration), AdaDecode §2.1 and
Appendix D (lightweight heads E*·T, on-policy data), AdaSPEED §II.B (linear probe).
"""

from selfspec.heads.calibration import (
    CONFIDENCE_METRICS,
    DEFAULT_EPSILONS,
    DEFAULT_METRIC,
    Threshold,
    confidence,
    confidences,
    roc_auc,
    threshold,
    thresholds,
)
from selfspec.heads.card import HeadCard
from selfspec.heads.errors import HeadsModelMismatchError, HeadsNotFoundError, NotCalibratedError
from selfspec.heads.files import (
    CalibrationSet,
    ExitHeads,
    default_heads_dir,
    default_probes_dir,
    load_heads,
    read_head_file,
    save_heads,
)
from selfspec.heads.modules import ExitHead, FullHead, LightweightHead, make_head, output_layer
from selfspec.heads.placement import check_layers, default_layers
from selfspec.heads.probe import LinearProbe, fit_probe

__all__ = [
    "CONFIDENCE_METRICS",
    "DEFAULT_EPSILONS",
    "DEFAULT_METRIC",
    "CalibrationSet",
    "ExitHead",
    "ExitHeads",
    "FullHead",
    "HeadCard",
    "HeadsModelMismatchError",
    "HeadsNotFoundError",
    "LightweightHead",
    "LinearProbe",
    "NotCalibratedError",
    "Threshold",
    "check_layers",
    "confidence",
    "confidences",
    "default_heads_dir",
    "default_probes_dir",
    "default_layers",
    "fit_probe",
    "load_heads",
    "make_head",
    "output_layer",
    "read_head_file",
    "roc_auc",
    "save_heads",
    "threshold",
    "thresholds",
]
