"""Registry of decoding methods: a name → how to build the decoder for a model.

A method is a composition (DESIGN.md): drafter + stop rule + verifier wired into the shared
loop. New methods add a module in ``selfspec.methods`` and one entry here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from functools import partial

from selfspec.decoding.autoregressive import decode_autoregressive
from selfspec.decoding.speculative import decode_speculative
from selfspec.decoding.stop_rules import make_stop_rule
from selfspec.decoding.state import DecodeState
from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.heads.files import DEFAULT as DEFAULT_HEADS
from selfspec.heads.files import DEFAULT_PROBES
from selfspec.methods.early_exit import EarlyExitDrafter, check_exit_layer

if TYPE_CHECKING:
    from selfspec.heads.probe import LinearProbe

# A decoder runs one generation to completion on a fresh DecodeState.
Decoder = Callable[[DecodeState], None]


@dataclass(frozen=True)
class MethodSpec:
    """One decoding method.

    Attributes:
        name: the name used by ``--method`` and ``generate(method=...)``.
        description: one line for ``--help`` and reports.
        lossless: True when greedy output equals autoregressive greedy output.
        build: ``build(executor, **options) -> Decoder``; raises InvalidArgumentError on bad options.
        options: option names the method accepts.
    """

    name: str
    description: str
    lossless: bool
    build: Callable[..., Decoder]
    options: tuple[str, ...] = ()


def _build_autoregressive(executor: LayerExecutor) -> Decoder:
    return decode_autoregressive


EARLY_EXIT_OPTIONS = ("exit_layer", "draft_len", "gamma", "max_draft_len", "adaptive", "heads",
                      "draft_vocab")


def _early_exit_builder(rule: str, probe: bool = False) -> Callable[..., Decoder]:
    """Builder of an early-exit method whose draft length is decided by stop rule ``rule``
    (with ``probe``: AdaSPEED's linear probe scores each draft token, §II.B).

    The product rule (AdaSPEED, Algorithm 2) has no draft cap in the paper: it always stops
    once the product falls below gamma. Its default ``max_draft_len`` is therefore the
    longest draft that verification keeps bit-exact (``row_attention_max - 1``), not D&V's 8;
    ``max_draft_len=8`` restores the cap.
    """

    def build(executor: LayerExecutor, exit_layer: int | None = None,
              draft_len: int | None = None, gamma: float | None = None,
              max_draft_len: int | None = None, adaptive: bool | None = None,
              heads: str | None = None, draft_vocab: int | None = None) -> Decoder:
        params: dict[str, Any] = {}
        if rule == "constant":
            params["draft_len"] = DEFAULT_DRAFT_LEN if draft_len is None else draft_len
            unused = {"gamma": gamma, "adaptive": adaptive}
        else:
            if gamma is not None:
                params["gamma"] = gamma
            if adaptive is not None:
                params["adaptive"] = adaptive
            unused = {"draft_len": draft_len}
        given = sorted(k for k, v in unused.items() if v is not None)
        if given:
            raise InvalidArgumentError(
                f"option(s) {', '.join(given)} do not apply to the {rule!r} stop rule")
        if max_draft_len is None and rule == "product":
            max_draft_len = max(1, executor.row_attention_max - 1)
        if max_draft_len is not None:
            params["max_draft_len"] = max_draft_len
        stop_rule = make_stop_rule(rule, **params)
        layer = default_exit_layer(executor) if exit_layer is None else exit_layer
        check_exit_layer(executor, layer)
        trained = _load_heads(executor, heads) if heads is not None else None
        # Trained heads: draft with the exit head at this layer when there is one, else
        # with the model's own final norm + lm_head.
        head = (trained.head_at(layer) if trained is not None and layer in trained.layers
                else None)
        greedy_probe, sampled_probe = (_probes(executor, trained, layer, head is not None)
                                       if probe else (None, None))
        vocab = None if draft_vocab is None else _draft_vocab(executor, trained, draft_vocab)
        drafter = EarlyExitDrafter(executor, layer, stop_rule, head=head, scorer=greedy_probe,
                                   vocab=vocab, sampled_scorer=sampled_probe)
        return partial(decode_speculative, drafter=drafter)

    return build


def heads_files(name: str, options: Mapping[str, Any]) -> list[str]:
    """The head files (``"default"``, ``"default-probes"`` or a path) that method ``name``
    reads with ``options``: what a benchmark checks its prompts against (held-out check)."""
    opts = dict(options)
    if name in ("dssd", "early-exit"):
        return [str(opts.get("heads", DEFAULT_HEADS))]
    if name == "adaspeed-probe":
        return [str(opts.get("heads") or DEFAULT_PROBES)]
    if name in METHODS and opts.get("heads") is not None:
        return [str(opts["heads"])]
    return []


def _probes(executor: LayerExecutor, trained, layer: int, exit_head: bool
            ) -> tuple[LinearProbe | None, LinearProbe | None]:
    """AdaSPEED probes at ``layer`` for the drafter, from the method's head file (``heads=``)
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
    container = trained if trained is not None else _load_heads(executor, DEFAULT_PROBES)
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


def default_exit_layer(executor: LayerExecutor) -> int:
    """Default exit layer: 3/4 of the depth. Without trained exit heads the model's own
    ``lm_head`` only agrees with the final layer late in the stack."""
    return max(1, min(executor.num_layers - 1, round(0.75 * executor.num_layers)))


DEFAULT_DRAFT_LEN = 4
DSSD_OPTIONS = ("heads", "epsilon", "metric", "max_draft_len", "draft_vocab")


def _load_heads(executor: LayerExecutor, path: str):
    """Exit heads for ``executor``'s model, loaded once per model and path."""
    from selfspec.heads import load_heads

    return executor.asset(("heads", str(path)), lambda: load_heads(path, executor))


def _draft_vocab(executor: LayerExecutor, trained, size: int):
    """The ``size`` most frequent tokens by the head file's counts (plus EOS ids).

    Raises:
        InvalidArgumentError: no heads, heads without token counts, or a bad size.
    """
    from selfspec.methods.draft_vocab import check_draft_vocab, frequent_rows
    from selfspec.models.eos import eos_token_ids

    check_draft_vocab(size, executor.vocab_size)
    counts = None if trained is None else trained.token_counts
    if counts is None:
        raise InvalidArgumentError(
            "draft_vocab ranks tokens by the token counts stored with trained heads: give "
            "heads=PATH or heads=default (--heads on the command line); heads calibrated by an "
            "older selfspec need `selfspec heads calibrate PATH` once")
    eos = eos_token_ids(executor.model)
    return executor.asset(("draft-vocab", id(trained), size),
                          lambda: frequent_rows(counts, size, eos))


def _calibrated_exits(executor: LayerExecutor, heads: str, epsilon: float, metric: str | None,
                      draft_vocab: int | None = None):
    from selfspec.heads import DEFAULT_METRIC
    from selfspec.methods.dssd import CalibratedExits

    trained = _load_heads(executor, heads)
    vocab = None if draft_vocab is None else _draft_vocab(executor, trained, draft_vocab)
    return CalibratedExits(trained, epsilon, metric or DEFAULT_METRIC, vocab, executor,
                           draft_vocab)


def _build_dssd(executor: LayerExecutor, heads: str = DEFAULT_HEADS, epsilon: float = 0.9,
                metric: str | None = None, max_draft_len: int = 32,
                draft_vocab: int | None = None) -> Decoder:
    from selfspec.methods.dssd import DSSDDrafter

    exits = _calibrated_exits(executor, heads, epsilon, metric, draft_vocab)
    return partial(decode_speculative, drafter=DSSDDrafter(executor, exits, max_draft_len))


def _build_calibrated_exit(executor: LayerExecutor, heads: str = DEFAULT_HEADS,
                           epsilon: float = 0.9, metric: str | None = None) -> Decoder:
    from selfspec.methods.calibrated_exit import decode_calibrated_exit

    return partial(decode_calibrated_exit, exits=_calibrated_exits(executor, heads, epsilon, metric))


METHODS: Mapping[str, MethodSpec] = {
    spec.name: spec
    for spec in (
        MethodSpec("ar", "autoregressive decoding, one full forward per token", True,
                   _build_autoregressive),
        MethodSpec("layerskip", "early-exit drafting of a constant draft_len tokens with "
                   "shared KV (LayerSkip)", True, _early_exit_builder("constant"),
                   EARLY_EXIT_OPTIONS),
        MethodSpec("dv", "early-exit drafting until a draft probability < gamma, adaptive "
                   "gamma (Draft & Verify)", True, _early_exit_builder("threshold"),
                   EARLY_EXIT_OPTIONS),
        MethodSpec("adaspeed", "early-exit drafting until the product of draft probabilities "
                   "< gamma, adaptive gamma (AdaSPEED)", True, _early_exit_builder("product"),
                   EARLY_EXIT_OPTIONS),
        MethodSpec("adaspeed-probe", "AdaSPEED with a trained linear probe's acceptance "
                   "probabilities in the product rule", True,
                   _early_exit_builder("product", probe=True), EARLY_EXIT_OPTIONS),
        MethodSpec("dssd", "per-token exit head chosen by calibrated confidence at accuracy "
                   "epsilon, verified by the full model (DSSD)", True, _build_dssd, DSSD_OPTIONS),
        MethodSpec("early-exit", "calibrated early exit without verification (DSSD §3.4.2; "
                   "lossy)", False, _build_calibrated_exit, ("heads", "epsilon", "metric")),
    )
}


def get_method(name: str) -> MethodSpec:
    """Look up a method by name.

    Raises:
        InvalidArgumentError: unknown name (the message lists the known ones).
    """
    try:
        return METHODS[name]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown method {name!r}; known methods: {', '.join(METHODS)}") from None


def build_decoder(name: str, executor: LayerExecutor, options: Mapping[str, Any]) -> Decoder:
    """Build method ``name``'s decoder with ``options``.

    Raises:
        InvalidArgumentError: unknown method, or an option the method does not take.
    """
    spec = get_method(name)
    unknown = sorted(set(options) - set(spec.options))
    if unknown:
        accepted = ", ".join(spec.options) or "none"
        raise InvalidArgumentError(
            f"method {name!r} does not take option(s) {', '.join(unknown)}; it accepts: {accepted}")
    return spec.build(executor, **options)
