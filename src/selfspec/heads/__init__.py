"""Exit heads and AdaSPEED acceptance probes as used while decoding.

Public API (what drafters build on)::

    heads = load_heads("default", engine)        # ExitHeads for engine's model
    heads.layers                                 # [6, 12, 18, 24]
    heads.heads[k](hidden [B, T, H], vocab_rows=None) -> logits [B, T, V]
    heads.thresholds(epsilon, "entropy")         # τ_k(ε): exit when confidence >= τ_k
    confidences(logits)["entropy"]               # -H(p) in nats (higher = more confident)
    heads.probes[exit_layer](hidden) -> P(accept) [B, T]

Training, calibration runs, probe fitting and the ``selfspec heads`` command live in
:mod:`selfspec.training`, which imports this package and is never imported by it.

Sources: DSSD §3.2-3.4 (losses, calibration), AdaDecode §2.1 and Appendix D (lightweight
heads E*·T), AdaSPEED §II.B (linear probe).
"""

from selfspec.heads.calibration import (
    CONFIDENCE_METRICS,
    DEFAULT_METRIC,
    Threshold,
    confidence,
    confidences,
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
from selfspec.heads.probe import LinearProbe

__all__ = [
    "CONFIDENCE_METRICS",
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
    "confidence",
    "confidences",
    "default_heads_dir",
    "default_probes_dir",
    "load_heads",
    "make_head",
    "output_layer",
    "read_head_file",
    "save_heads",
    "threshold",
    "thresholds",
]
