"""DSSD: per-token exit head chosen by calibrated confidence at accuracy ε, verified by the
full model (DSSD §4.3.1; thresholds τ_k(ε) from §3.4.1). Lossless under greedy decoding."""

from __future__ import annotations

from dataclasses import dataclass

from selfspec.decoding.core.loop import Step
from selfspec.decoding.core.speculative import SpeculativeStep
from selfspec.decoding.drafting.exit_drafter import DSSDDrafter
from selfspec.decoding.drafting.exits import CalibratedExits
from selfspec.decoding.drafting.stop_rules import BufferStopRule
from selfspec.heads.calibration import CONFIDENCE_METRICS, DEFAULT_METRIC
from selfspec.heads.files import DEFAULT as DEFAULT_HEADS
from selfspec.methods.base import MethodContext, MethodSpec, WrapStopRule, wrapped
from selfspec.methods.draft_copy import DraftWeightsOptions
from selfspec.methods.exit_drafting import DRAFT_VOCAB_HELP
from selfspec.methods.options import HEAD_FILE, option

HEADS_HELP = ("calibrated exit heads: 'default' (from `selfspec heads train`) or a head "
              "file/directory")
EPSILON_HELP = "DSSD accuracy level: a head exits when it agrees with the last layer this often"
METRIC_HELP = "confidence metric of the calibrated heads"


@dataclass(frozen=True)
class CalibratedOptions:
    """The calibrated heads at one accuracy level (shared with lossy early exit)."""

    heads: str = option(DEFAULT_HEADS, HEADS_HELP, asset=HEAD_FILE)
    epsilon: float = option(0.9, EPSILON_HELP, low=0, high=1)
    metric: str = option(DEFAULT_METRIC, METRIC_HELP, choices=tuple(CONFIDENCE_METRICS))


@dataclass(frozen=True)
class Options(CalibratedOptions, DraftWeightsOptions):
    """DSSD's options (``draft_weights`` from
    :class:`~selfspec.methods.draft_copy.DraftWeightsOptions`)."""

    max_draft_len: int = option(32, "the draft buffer", low=1, high="R-1")
    draft_vocab: int | None = option(None, DRAFT_VOCAB_HELP, low=1, high="V",
                                     default_text="none (full vocabulary)")


def calibrated_exits(context: MethodContext, options: CalibratedOptions,
                     draft_vocab: int | None = None) -> CalibratedExits:
    """The heads of ``options.heads`` with their thresholds at ``options.epsilon``.

    Raises:
        NotCalibratedError: no calibration for the metric (and draft vocabulary).
        HeadsNotFoundError, HeadsModelMismatchError: see :func:`selfspec.heads.load_heads`.
    """
    trained = context.heads(options.heads)
    vocab = restricted = None
    if draft_vocab is not None:
        vocab = context.draft_vocab(trained, draft_vocab)
        restricted = [context.restricted(head, vocab) for head in trained.heads]
    return CalibratedExits(trained, options.epsilon, options.metric, vocab, context.executor,
                           draft_vocab, restricted)


def drafter(context: MethodContext, options: Options,
            wrap: WrapStopRule | None = None) -> DSSDDrafter:
    """The DSSD drafter: calibrated exits + buffer stop rule (``wrap``-ped if given), on
    ``draft_weights``' copy if given (verification then recomputes every layer)."""
    exits = calibrated_exits(context, options, options.draft_vocab)
    rule = wrapped(BufferStopRule(options.max_draft_len), wrap)
    return DSSDDrafter(context.draft_executor(options), exits, options.max_draft_len,
                       verifier=context.executor, stop_rule=rule)


def build(context: MethodContext, options: Options) -> Step:
    """DSSD drafter (calibrated exits + buffer stop rule) + verifier."""
    return SpeculativeStep(drafter(context, options))


SPEC = MethodSpec(
    name="dssd",
    summary="per-token exit head chosen by calibrated confidence at accuracy epsilon, "
            "verified by the full model",
    lossless=True,
    paper="DSSD §4.3.1 (drafting), §3.4.1 (calibration)",
    options=Options, build=build, heads_files=lambda options: [str(options.heads)],
    drafter=drafter)
