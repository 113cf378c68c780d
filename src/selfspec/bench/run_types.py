"""The types every benchmark runner shares: the prompt it gets, the run's settings, what it
returns, and the :class:`Runner` protocol (selfspec methods, ``hf-*`` and ``llamacpp-*``
baselines all implement it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from selfspec.bench.spec import MethodConfig
from selfspec.decoding.core.plan_log import PlanRecord

# Seconds, monotonic; injectable so tests can script timings.
Clock = Callable[[], float]


@dataclass(frozen=True)
class EncodedPrompt:
    """A dataset prompt as the model sees it.

    Attributes:
        id: the dataset prompt id.
        ids: prompt token ids (chat template applied where the dataset is a chat).
        response_format: the prompt's output constraint (``json-extract``: its JSON schema),
            compiled for the model before any timing
            (:class:`~selfspec.decoding.core.grammar.Grammar`); every method decodes under
            it, ``ar`` included. ``None``: unconstrained.
    """

    id: str
    ids: list[int]
    response_format: Any = None


@dataclass(frozen=True)
class RunSettings:
    """What every method of a run shares.

    Attributes:
        max_new_tokens: at most this many new tokens per prompt.
        temperature: 0 = greedy; > 0 = sampling (no top-k), seeded with ``seed``.
        seed: sampling seed.
        top_p: nucleus mass in (0, 1] when sampling (1 = the whole distribution).
        batch_size: prompts generated together (:meth:`Runner.run_batch`).
    """

    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0
    top_p: float = 1.0
    batch_size: int = 1


@dataclass
class RunOutput:
    """One generation by one method.

    Attributes:
        token_ids: generated ids (prompt excluded; ends with EOS when generation hit it).
        text: the decoded generation (special tokens removed).
        wall_time_s: wall time of the whole call in seconds (prefill included).
        ttft_ms: time to the first generated token in ms (None if nothing was generated).
        accept_lengths: tokens committed by each forward of the full model after the prompt,
            in order (1 per step for autoregressive decoding; accepted + 1 per verification).
        drafted / accepted / verifications / draft_ms / verify_ms / layer_forwards: counters as
            in :class:`selfspec.GenerationStats`; None where a runner cannot know them.
        exit_tokens / exit_layer_total: tokens predicted at an exit layer (draft tokens, or
            every token of a lossy early exit) and the sum of their exit layers; None when
            the method does not exit early.
        finish_reason: ``"eos"``, ``"length"``, ... (``""`` when unknown).
        plans: the draft decisions of an adaptive method (KnapSpec, CLaSp, DEL), in order.
        layer_batches: ``[b-1]`` = decoder-layer calls that ran ``b`` positions together
            (drafters with deferred layers: AdaDecode, DSSD, LayerSkip); empty when unknown.
        exit_counts: ``[l]`` = tokens predicted after ``l`` layers (the exit-layer histogram);
            empty when unknown.
        predictor_ms / kv_ms: SpecEE's candidate + predictor time and skipped-layer KV time.
        drafter_steps: steps each drafter ran (``auto``; empty otherwise).
    """

    token_ids: list[int]
    text: str
    wall_time_s: float
    ttft_ms: float | None = None
    accept_lengths: list[int] = field(default_factory=list)
    drafted: int | None = None
    accepted: int | None = None
    verifications: int | None = None
    draft_ms: float | None = None
    verify_ms: float | None = None
    layer_forwards: float | None = None
    finish_reason: str = ""
    exit_tokens: int | None = None
    exit_layer_total: int | None = None
    plans: list[PlanRecord] = field(default_factory=list)
    layer_batches: list[int] = field(default_factory=list)
    exit_counts: list[int] = field(default_factory=list)
    predictor_ms: float | None = None
    kv_ms: float | None = None
    drafter_steps: dict[str, int] = field(default_factory=dict)


class Runner(Protocol):
    """Generates for one method. ``setup`` runs once before the warm-up and may raise;
    ``run_batch`` generates for several prompts together (one output per prompt, each with
    ``wall_time_s`` = the batch's wall time / its rows). A runner that cannot decode under a
    prompt's ``response_format`` raises :class:`~selfspec.errors.InvalidArgumentError`
    (:func:`refuse_constraints`): the method is marked failed with that message."""

    config: MethodConfig
    lossless: bool

    def setup(self) -> None: ...

    def run(self, prompt: EncodedPrompt, settings: RunSettings) -> RunOutput: ...

    def run_batch(self, prompts: list[EncodedPrompt],
                  settings: RunSettings) -> list[RunOutput]: ...


def run_one_by_one(runner: Runner, prompts: list[EncodedPrompt], settings: RunSettings,
                   clock: Clock) -> list[RunOutput]:
    """``run_batch`` for a runner without batches: the prompts one after another, each
    output's ``wall_time_s`` the whole call's wall time / the number of prompts (as a
    batch's rows are reported)."""
    start = clock()
    outputs = [runner.run(p, settings) for p in prompts]
    share = (clock() - start) / len(prompts)
    for output in outputs:
        output.wall_time_s = share
    return outputs


def refuse_constraints(runner: str, prompts: list[EncodedPrompt], why: str) -> None:
    """Raise if any of ``prompts`` has an output constraint ``runner`` cannot apply.

    Raises:
        InvalidArgumentError: a prompt with a ``response_format``; the message names the
            runner, ``why`` and what to run instead.
    """
    from selfspec.errors import InvalidArgumentError

    if any(p.response_format is not None for p in prompts):
        raise InvalidArgumentError(
            f"{runner} cannot decode under this dataset's JSON schemas ({why}); benchmark "
            "structured output with selfspec methods (ar, auto, ngram, ...), which all "
            "decode under the schema")
