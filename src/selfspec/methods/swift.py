"""SWIFT-style self-speculative decoding: drafts skip a fixed set of attention and MLP
sub-layers, searched offline on calibration text for the highest matchness (Xia et al.
2024, "SWIFT: On-the-fly self-speculative decoding", §3; KnapSpec §1.1, §2.2 and §5 compare
against it). The skip set comes from ``selfspec heads search-skip``
(:mod:`selfspec.training.skip_search`); drafting stops when the draft's top-1 probability
falls below ``confidence`` (SWIFT's ``stop_threshold=0.8`` in ``swift_draft``); verification
is the full model (lossless).

Departures from SWIFT: the skip set is searched once offline and then fixed (SWIFT re-runs
its search during the first generations of every task; the issue asks for an offline
search), by random search + local search instead of random search + Bayesian optimisation,
and drafts are one sequence verified as a chain, not SWIFT's top-k token tree.
``max_draft_len`` defaults to 10 (SWIFT's code: 25), the same cap as KnapSpec's, so the two
compare on equal terms.
"""

from __future__ import annotations

from dataclasses import dataclass

from selfspec.decoding.core.loop import Step
from selfspec.decoding.core.speculative import SpeculativeStep
from selfspec.decoding.drafting.skip_drafter import SkipPlanDrafter
from selfspec.decoding.drafting.stop_rules import ConfidenceStopRule
from selfspec.heads.skip_set import (
    HELD_OUT_PREFIX,
    SkipSet,
    load_skip_set,
    resolve_skip_set_path,
)
from selfspec.methods.base import MethodContext, MethodSpec
from selfspec.methods.draft_copy import DraftWeightsOptions
from selfspec.methods.options import SKIP_SET_FILE, option


@dataclass(frozen=True)
class Options(DraftWeightsOptions):
    """SWIFT's options (its code's values as defaults, except ``max_draft_len``;
    ``draft_weights`` from :class:`~selfspec.methods.draft_copy.DraftWeightsOptions`)."""

    skip_set: str = option("default", "skip-set file from `selfspec heads search-skip` "
                           "('default' = the model's, next to its default heads)",
                           asset=SKIP_SET_FILE)
    max_draft_len: int = option(10, "longest draft", low=1, high="R-1")
    confidence: float = option(0.8, "stop drafting when the top-1 probability falls below this",
                               low=0, high=1, low_open=True, high_open=True)


def _skip_set(context: MethodContext, path: str) -> SkipSet:
    """The skip set at ``path``, read once per file version: the check against the model
    fingerprints its output weights (a large tensor hash), too slow for every generation."""
    resolved = resolve_skip_set_path(path, context.executor.name)
    return context.file_cached("skip-set", resolved,
                               lambda: load_skip_set(path, context.executor))


def build(context: MethodContext, options: Options) -> Step:
    """Skip-plan drafter with the searched skip set + confidence stop rule + verifier.

    Raises:
        HeadsNotFoundError: no skip-set file (run ``selfspec heads search-skip``).
        HeadsModelMismatchError: the file is for another model.
        CorruptModelFileError: the file is damaged.
    """
    skip_set = _skip_set(context, options.skip_set)
    rule = ConfidenceStopRule(options.confidence, max_draft_len=options.max_draft_len)
    return SpeculativeStep(SkipPlanDrafter(context.draft_executor(options), skip_set.plan, rule,
                                           verifier=context.executor))


SPEC = MethodSpec(
    name="swift",
    summary="draft with a fixed set of attention/MLP sub-layers searched offline for "
            "matchness (`selfspec heads search-skip`); stop at top-1 probability < 0.8",
    lossless=True,
    paper="SWIFT (Xia et al. 2024) §3; KnapSpec §1.1, §2.2",
    options=Options, build=build,
    heads_files=lambda options: [HELD_OUT_PREFIX + str(options.skip_set)])
