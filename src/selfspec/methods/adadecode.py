"""AdaDecode: a token predicted early by a lightweight head lets the next token start at layer
0; its deeper layers run later, batched with later tokens; the full model verifies every early
prediction (Wei et al. 2025, §2.2, Algorithm 1, eq. 1-2). Lossless (greedy and sampling).

A composition: :class:`~selfspec.decoding.drafting.exit_drafter.ExitDrafter` with the exit policy
:class:`~selfspec.decoding.adadecode.threshold_exits.ThresholdExits` (eq. 1) and a buffer of
``max_early`` early predictions, inside
:class:`~selfspec.decoding.core.speculative.SpeculativeStep`. The
options also give Table 3's ablations: ``verify=false`` (no verification, lossy), one entry in
``layers`` (fixed-layer early prediction), ``heads=none`` (the original LM head) and a file of
full-parameter heads (``selfspec heads train --kind full``).
"""

from __future__ import annotations

from dataclasses import dataclass

from selfspec.decoding.adadecode.threshold_exits import ThresholdExits
from selfspec.decoding.core.loop import Step
from selfspec.decoding.core.speculative import SpeculativeStep, accept_all
from selfspec.decoding.drafting.exit_drafter import ExitDrafter
from selfspec.decoding.drafting.stop_rules import BufferStopRule
from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.heads.files import DEFAULT as DEFAULT_HEADS
from selfspec.methods.base import MethodContext, MethodSpec
from selfspec.methods.exit_drafting import DRAFT_VOCAB_HELP
from selfspec.methods.options import HEAD_FILE, Asset, changed_options, option

NO_HEADS = "none"
ALL_LAYERS = "all"
TUNED_OPTIONS = ("layers", "gamma", "draft_vocab")  # what tuned=true takes from the card


@dataclass(frozen=True)
class Options:
    """AdaDecode's options (defaults: the paper's appendix D)."""

    heads: str = option(DEFAULT_HEADS, "lightweight heads: 'default' (from `selfspec heads "
                        "train`), a head file/directory, or 'none' = the model's own final "
                        "norm + lm_head at every L/4 layers (Table 3's 'original LM head')",
                        asset=Asset(HEAD_FILE.kind, (*HEAD_FILE.keywords, NO_HEADS)))
    layers: str = option(ALL_LAYERS, "head layers to predict early at: 'all' of the heads', "
                         "or a comma list such as 14 (Table 3's fixed-layer early prediction)")
    gamma: float = option(0.75, "a head predicts early when its token's probability exceeds "
                          "gamma (eq. 1)", low=0, high=1, high_open=True)
    max_early: int = option(5, "most early predictions outstanding before one token must run "
                            "every layer", low=1, high="R-1")
    draft_vocab: int | None = option(None, DRAFT_VOCAB_HELP, low=1, high="V",
                                     default_text="none (full vocabulary)")
    verify: bool = option(True, "verify early predictions with the full model (false: "
                          "Table 3's lossy 'w/o verification')")
    tuned: bool = option(False, "use the head layers, per-head thresholds and draft vocabulary "
                         "that `selfspec heads tune-adadecode` stored on the heads' card "
                         "(they replace layers, gamma and draft_vocab)")


def quarter_layers(num_layers: int) -> list[int]:
    """AdaDecode's head placement, every ``L/4`` layers: ``⌊k·L/4⌋`` for ``k = 1..3``
    (the paper: 8, 16, 24 of Llama-3.1-8B's 32), dropping duplicates and layer 0."""
    return sorted({k * num_layers // 4 for k in (1, 2, 3)} - {0})


def _parse_layers(text: str, available: list[int], executor: LayerExecutor,
                  source: str) -> list[int]:
    """The head layers named by ``text`` (``'all'`` or ``'7,14'``) among ``available``.

    Raises:
        InvalidArgumentError: a malformed list or a layer without a head.
    """
    if text.strip().lower() == ALL_LAYERS:
        return available
    try:
        layers = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise InvalidArgumentError(
            f"layers must be 'all' or a comma list of head layers such as "
            f"{','.join(map(str, available))}; got {text!r}") from None
    missing = [layer for layer in layers if layer not in available]
    if not layers or missing:
        raise InvalidArgumentError(
            f"adadecode: {source} has heads at layers {available} (of {executor.num_layers}); "
            f"got layers={text!r}. Choose among those or train heads there (`selfspec heads "
            f"train --layers ...`)")
    return layers


def _tuned(trained: object | None, name: str) -> tuple[list[int], list[float], int | None]:
    """Layers, per-head thresholds and draft vocabulary (``None`` = all) from the card.

    Raises:
        InvalidArgumentError: ``heads=none``, or heads whose card has no tuned thresholds.
    """
    card = None if trained is None else trained.card.adadecode
    if card is None:
        raise InvalidArgumentError(
            "adadecode:tuned=true reads thresholds tuned for the heads; "
            + ("heads=none has none" if trained is None else
               f"the head file {name!r} has none yet: run `selfspec heads tune-adadecode "
               f"{name} --model MODEL` (a replay of Algorithm 1 on the heads' held-out "
               f"text)"))
    return list(card.layers), list(card.gammas), card.draft_vocab or None


def build(context: MethodContext, options: Options) -> Step:
    """Threshold exits over the heads' layers + a buffer of ``max_early`` + verification.

    Raises:
        InvalidArgumentError: bad ``layers``; ``draft_vocab`` without trained heads.
        HeadsNotFoundError, HeadsModelMismatchError: see :func:`selfspec.heads.load_heads`.
    """
    ex = context.executor
    trained = None if options.heads == NO_HEADS else context.heads(options.heads)
    if trained is None:
        available, source = quarter_layers(ex.num_layers), "heads=none (the model's lm_head)"
    else:
        available, source = list(trained.layers), f"the head file {options.heads!r}"
    if options.tuned:
        given = changed_options(options, TUNED_OPTIONS)
        if given:
            raise InvalidArgumentError(
                f"adadecode: tuned=true takes layers, gamma and draft_vocab from the heads' "
                f"card; drop {', '.join(given)} (or drop tuned)")
        layers, gamma, draft_vocab = _tuned(trained, options.heads)
    else:
        layers = _parse_layers(options.layers, available, ex, source)
        gamma, draft_vocab = options.gamma, options.draft_vocab
    heads = [None if trained is None else trained.head_at(layer) for layer in layers]
    vocab = None
    if draft_vocab is not None:
        vocab = context.draft_vocab(trained, draft_vocab)
        calls = [context.restricted(head, vocab) for head in heads]
    else:
        calls = [(lambda hidden, head=head: ex.logits(hidden, head)) for head in heads]
    exits = ThresholdExits(layers, calls, gamma, vocab)
    drafter = ExitDrafter(ex, exits, BufferStopRule(options.max_early))
    return SpeculativeStep(drafter, verifier=None if options.verify else accept_all)


SPEC = MethodSpec(
    name="adadecode",
    summary="a confident lightweight head lets the next token start; deferred layers run "
            "batched with later tokens; the full model verifies",
    lossless=True,
    paper="AdaDecode §2.2, Algorithm 1, eq. 1-2 (verification of sampled tokens: exact "
          "proposal, see decoding/adadecode/threshold_exits.py)",
    options=Options, build=build,
    heads_files=lambda options: [] if options.heads == NO_HEADS else [str(options.heads)],
    lossy_when=lambda options: not options.verify,
    unused_when=lambda options: set(TUNED_OPTIONS) if options.tuned else set())
