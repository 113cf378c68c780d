"""What LayerSkip, Draft & Verify and AdaSPEED share: the early-exit drafter at one exit
layer, its options and how it finds its head, probes and draft vocabulary."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from selfspec.decoding.core.loop import Step
from selfspec.decoding.core.speculative import SpeculativeStep
from selfspec.decoding.drafting.exit_drafter import EarlyExitDrafter
from selfspec.decoding.drafting.stop_rules import StopRule
from selfspec.errors import InvalidArgumentError, SelfSpecError
from selfspec.executor import LayerExecutor
from selfspec.heads.errors import HeadsNotFoundError
from selfspec.heads.files import DEFAULT, DEFAULT_PROBES
from selfspec.methods.base import MethodContext
from selfspec.methods.draft_copy import DraftWeightsOptions
from selfspec.methods.options import HEAD_FILE, option

EXIT_LAYER_HELP = "layers the draft runs: layers [0, exit_layer)"
HEADS_HELP = ("exit heads: 'default' (from `selfspec heads train`) or a head file/directory; "
              "drafts use the head at exit_layer (an error if there is none)")
DRAFT_VOCAB_HELP = ("draft heads score only the K most frequent tokens (ranked by the heads' "
                    "token counts; needs heads), FR-Spec §3")


@dataclass(frozen=True)
class ExitOptions(DraftWeightsOptions):
    """Options of every early-exit drafter (``draft_weights`` from
    :class:`~selfspec.methods.draft_copy.DraftWeightsOptions`)."""

    exit_layer: int | None = option(None, EXIT_LAYER_HELP, low=1, high="L-1",
                                    default_text="3/4 depth / nearest head")
    heads: str | None = option(None, HEADS_HELP, default_text="none (the model's lm_head)",
                               asset=HEAD_FILE)
    draft_vocab: int | None = option(None, DRAFT_VOCAB_HELP, low=1, high="V",
                                     default_text="none (full vocabulary)")


def default_exit_layer(executor: LayerExecutor) -> int:
    """Default exit layer: 3/4 of the depth. Without trained exit heads the model's own
    ``lm_head`` only agrees with the final layer late in the stack."""
    return max(1, min(executor.num_layers - 1, round(0.75 * executor.num_layers)))


def heads_files(options: Any, probe: bool = False) -> list[str]:
    """The head files an early-exit method reads: ``heads``, or with ``probe`` and no heads,
    the model's default probes."""
    if options.heads is not None:
        return [str(options.heads)]
    return [DEFAULT_PROBES] if probe else []


def build_exit_step(context: MethodContext, options: ExitOptions, stop_rule: StopRule,
                    probe: bool = False) -> Step:
    """The speculative Step of an early-exit method whose draft length ``stop_rule``
    decides: :func:`build_exit_drafter` in a :class:`SpeculativeStep`.

    Raises:
        see :func:`build_exit_drafter`.
    """
    return SpeculativeStep(build_exit_drafter(context, options, stop_rule, probe))


def build_exit_drafter(context: MethodContext, options: ExitOptions, stop_rule: StopRule,
                       probe: bool = False) -> EarlyExitDrafter:
    """The early-exit drafter of ``options`` with ``stop_rule``; with ``probe``, AdaSPEED's
    linear probes (§II.B) score each draft token. With ``draft_weights`` it drafts on that
    copy and verification recomputes every layer with the model's own weights
    (:class:`~selfspec.decoding.drafting.draft_copy.DraftCopy`).

    Raises:
        InvalidArgumentError: options the model's heads cannot serve (no probe at the layer,
            a probe for another drafter, draft_vocab without token counts), or a draft
            weight format without a kernel here.
        HeadsNotFoundError: a missing head or probe file.
    """
    ex = context.executor
    trained = context.heads(options.heads) if options.heads is not None else None
    layer = options.exit_layer
    if layer is None:
        layer = default_exit_layer(ex)
        if trained is not None and trained.layers:
            layer = min(trained.layers, key=lambda h: (abs(h - layer), -h))
        if probe:
            layer = _probe_exit_layer(context, trained, options.heads, layer)
    head = _exit_head(trained, layer, options.heads, probe)
    greedy_probe = sampled_probe = None
    if probe:
        greedy_probe, sampled_probe = _probes(context, trained, layer, head is not None)
    vocab = restricted = None
    if options.draft_vocab is not None:
        vocab = context.draft_vocab(trained, options.draft_vocab)
        restricted = context.restricted(head, vocab)
    return EarlyExitDrafter(context.draft_executor(options), layer, stop_rule, head=head,
                            scorer=greedy_probe, vocab=vocab, sampled_scorer=sampled_probe,
                            restricted=restricted, verifier=ex)


def _probe_exit_layer(context: MethodContext, trained: Any, path: str | None,
                     fallback: int) -> int:
    """The default exit layer of a probe method: the layer of the one probe in its file
    (``heads``, else the model's default probes, where ``selfspec heads train-probe`` saves
    them); with probes at several layers, ``fallback`` (the depth default) when one is there.

    Raises:
        InvalidArgumentError: probes at several layers, none at ``fallback``: the error names
            the layers to choose from.
        HeadsNotFoundError: no probe file.
    """
    container = trained if trained is not None else _default_probes(context)
    layers = sorted({c.exit_layer for c in container.card.probes}
                    | set(container.probes) | set(container.sampled_probes))
    if len(layers) == 1:
        return layers[0]
    if not layers or fallback in layers:
        return fallback  # none: the drafter's error says how to train one
    where = repr(path) if path is not None else "the model's default probes"
    raise InvalidArgumentError(
        f"{where} hold probes at exit layers {layers}, none at the default {fallback}; choose "
        f"one with --exit-layer (exit_layer=)")


def _exit_head(trained: Any, layer: int, path: str | None, probe: bool) -> Any:
    """The exit head the draft uses at ``layer``: the file's head there, or ``None`` (the
    model's own final norm + ``lm_head``) when the file holds no heads at all (probes only),
    or holds a probe at ``layer`` trained on ``lm_head`` drafts for a probe method.

    Raises:
        InvalidArgumentError: the file has heads but none at ``layer``: drafting with the
            model's ``lm_head`` instead would silently be another method.
    """
    if trained is None or not trained.layers:
        return None
    if layer in trained.layers:
        return trained.head_at(layer)
    if probe and any(c.exit_layer == layer and c.draft_head == "lm_head"
                     for c in trained.card.probes):
        return None
    raise InvalidArgumentError(
        f"the heads in {path!r} have exit heads at layers {trained.layers}, not at exit layer "
        f"{layer}; choose --exit-layer (exit_layer=) among {trained.layers}, train a head there "
        f"(`selfspec heads train --layers {layer}`), or drop --heads to draft with the model's "
        "own lm_head")


def _probes(context: MethodContext, trained: Any, layer: int, exit_head: bool) -> tuple:
    """AdaSPEED probes at ``layer`` for the drafter, from the method's head file (``heads``)
    or, when drafting with the model's own ``lm_head`` and no heads, from the model's default
    probes: so ``adaspeed`` and ``adaspeed-probe`` with the same options draft identically
    and differ only in the stop rule (AdaSPEED Table I).

    Returns:
        ``(greedy, sampled)`` probes at ``layer``, either ``None`` where not trained (the
        drafter refuses that decoding mode with the command that trains the probe).

    Raises:
        InvalidArgumentError: no greedy or sampled probe at ``layer``, or a probe trained for
            another drafter (exit head vs ``lm_head``).
        HeadsNotFoundError: no probe file.
    """
    container = trained if trained is not None else _default_probes(context)
    drafter = "exit_head" if exit_head else "lm_head"
    for card in container.card.probes:
        if card.exit_layer == layer and card.draft_head != drafter:
            raise InvalidArgumentError(
                f"the {card.mode} probe at layer {layer} was trained on drafts of the "
                f"{card.draft_head}, but this method drafts with the {drafter}; train a probe for "
                f"this drafter with `selfspec heads train-probe --exit-layer {layer}` "
                + ("--heads PATH" if exit_head else "(no --heads)"))
    greedy = container.probes.get(layer)
    sampled = container.sampled_probes.get(layer)
    if greedy is None and sampled is None:
        container.probe_at(layer)  # raises with the command that trains one
    return greedy, sampled


def _default_probes(context: MethodContext) -> Any:
    """The model's default probes (``selfspec heads train-probe`` without ``--heads``).

    Raises:
        HeadsNotFoundError: none trained; when the model's default heads hold probes
            (``train-probe --heads default`` saves them there, for drafts of those heads), the
            message says to pass ``--heads default``.
    """
    try:
        return context.heads(DEFAULT_PROBES)
    except HeadsNotFoundError as err:
        try:
            layers = sorted({c.exit_layer for c in context.heads(DEFAULT).card.probes})
        except SelfSpecError:  # no (usable) default heads either: the first error stands
            layers = []
        if not layers:
            raise
        raise HeadsNotFoundError(
            f"{err}; the model's default heads hold probes at exit layers {layers}, for drafts "
            f"of their exit heads: pass --heads default (heads=default) to use them") from None
