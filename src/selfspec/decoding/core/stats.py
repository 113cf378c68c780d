"""Statistics of decoding: what one step did (:class:`StepStats`) and what a whole
generation did (:class:`GenerationStats`, the sum of its steps plus the loop's timings)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from selfspec.decoding.core.plan_log import PlanRecord
from selfspec.errors import InvalidArgumentError


def add_batch_counts(total: list[int], counts: Sequence[int]) -> None:
    """Add a batch-size histogram (``counts[b-1]`` = calls of ``b`` positions) into ``total``
    in place, growing it as needed."""
    total.extend([0] * (len(counts) - len(total)))
    for i, count in enumerate(counts):
        total[i] += count


def mean_batch(counts: Sequence[int]) -> float | None:
    """Mean batch size of a histogram ``counts[b-1]``; ``None`` when it is empty."""
    calls = sum(counts)
    return sum((i + 1) * c for i, c in enumerate(counts)) / calls if calls else None


@dataclass(frozen=True)
class StepStats:
    """What one :class:`~selfspec.decoding.core.loop.Step` call did.

    A speculative step fills every field; an autoregressive step commits one token and
    drafts nothing; the lossy early-exit step reports the token it emitted as one draft
    token (``exit_layers`` = the layers its prediction ran) that nothing verified.

    Attributes:
        num_drafted: draft tokens proposed (``D``), >= 0.
        num_accepted: draft tokens accepted by verification, ``0 <= num_accepted <= D``
            (the recovered / bonus token is not counted).
        committed: tokens committed to the sequence by this step (may be fewer than
            ``num_accepted + 1`` when EOS or a limit cut the step short).
        verified: a verification forward ran.
        exit_layers: ``[D]`` layers each draft token's prediction ran (``exit_layer``).
        sublayers: attention and MLP sub-layers run, one token each (a full layer is 2;
            a skip plan runs fewer).
        draft_ms: wall time spent drafting, in ms.
        verify_ms: wall time spent verifying (target forward + acceptance rule), in ms.
        layer_batches: ``layer_batches[b-1]`` = decoder-layer calls that ran ``b`` positions
            together (drafters that batch deferred layers; empty otherwise).
        predictor_ms: wall time of SpecEE's candidates, features and predictors (part of
            ``draft_ms``), in ms.
        predictor_calls: exit-predictor evaluations.
        kv_ms: wall time spent writing the KV of layers an early-exited token skipped (part
            of ``draft_ms``), in ms.
        drafter: the drafter that ran, for a Step that chooses one per step (``auto``);
            ``""`` otherwise.
        step_ms: wall time of the whole step, ms (``auto``; 0 when not measured).
        predicted_tokens / predicted_ms: what the chooser predicted the step would commit and
            take (0 when nothing was predicted).

    Raises:
        InvalidArgumentError: negative counts or ``num_accepted > num_drafted``.
    """

    num_drafted: int = 0
    num_accepted: int = 0
    committed: int = 0
    verified: bool = False
    exit_layers: tuple[int, ...] = ()
    sublayers: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    layer_batches: tuple[int, ...] = ()
    predictor_ms: float = 0.0
    predictor_calls: int = 0
    kv_ms: float = 0.0
    drafter: str = ""
    step_ms: float = 0.0
    predicted_tokens: float = 0.0
    predicted_ms: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.num_accepted <= self.num_drafted:
            raise InvalidArgumentError(
                "StepStats needs 0 <= num_accepted <= num_drafted; got "
                f"num_accepted={self.num_accepted}, num_drafted={self.num_drafted}")

    @property
    def acceptance_rate(self) -> float:
        """``num_accepted / num_drafted`` (0.0 for an empty draft)."""
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def layer_forwards(self) -> float:
        """Decoder-layer evaluations: ``sublayers / 2``."""
        return self.sublayers / 2


@dataclass
class DrafterUsage:
    """What one drafter did within a generation whose Step chooses drafters (``auto``).

    Attributes:
        steps: steps it ran.
        drafted / accepted / committed: draft tokens proposed, accepted, tokens committed.
        ms: wall time of its steps, ms.
        predicted_tokens / predicted_ms: the chooser's predictions for those steps, summed.
    """

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    committed: int = 0
    ms: float = 0.0
    predicted_tokens: float = 0.0
    predicted_ms: float = 0.0

    def add(self, step: StepStats) -> None:
        """Accumulate one step."""
        self.steps += 1
        self.drafted += step.num_drafted
        self.accepted += step.num_accepted
        self.committed += step.committed
        self.ms += step.step_ms
        self.predicted_tokens += step.predicted_tokens
        self.predicted_ms += step.predicted_ms

    @property
    def tokens_per_s(self) -> float:
        """Measured tokens per second of its steps."""
        return self.committed / self.ms * 1e3 if self.ms > 0 else 0.0

    @property
    def predicted_tokens_per_s(self) -> float:
        """Predicted tokens per second of its steps."""
        return self.predicted_tokens / self.predicted_ms * 1e3 if self.predicted_ms > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass
class GenerationStats:
    """What one generation did and how long it took.

    Attributes:
        prompt_tokens: prompt length in tokens.
        cached_tokens: prompt positions whose KV a prefix cache supplied (not prefilled).
        new_tokens: tokens generated.
        total_ms: wall time from the start of the prefill to the last commit, in ms.
        ttft_ms: time to first token (prefill + first token), in ms.
        tokens_per_s: ``new_tokens / total_ms`` in tokens per second.
        steps: Step calls after the prefill.
        drafted: draft tokens proposed (speculative methods; 0 for autoregressive).
        accepted: draft tokens accepted by verification.
        verifications: verification forwards run.
        draft_ms / verify_ms: wall time spent drafting / verifying, in ms.
        sublayers: attention and MLP sub-layers run, one token each, after the prefill.
        exit_layer_total: sum over draft tokens of the layers their prediction ran.
        finish_reason: ``"eos"``, ``"length"`` (max_new_tokens), ``"context"`` or ``"stop"``.
        plans: the draft decisions of a method that re-chooses its draft during generation
            (:class:`~selfspec.decoding.core.plan_log.PlanRecord`; empty for the others).
        layer_batches: ``layer_batches[b-1]`` = decoder-layer calls that ran ``b`` positions
            together, summed over steps (empty for steps that do not report it).
        exit_counts: ``exit_counts[l]`` = draft tokens whose prediction ran ``l`` layers (the
            exit-layer histogram; grows as needed).
        predictor_ms / predictor_calls / kv_ms: sums of the steps' fields (SpecEE).
        drafters: per drafter name, what it did (``auto``; empty for the other methods).
    """

    prompt_tokens: int = 0
    cached_tokens: int = 0
    new_tokens: int = 0
    total_ms: float = 0.0
    ttft_ms: float = 0.0
    tokens_per_s: float = 0.0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    verifications: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    sublayers: int = 0
    exit_layer_total: int = 0
    finish_reason: str = ""
    plans: list[PlanRecord] = field(default_factory=list)
    layer_batches: list[int] = field(default_factory=list)
    exit_counts: list[int] = field(default_factory=list)
    predictor_ms: float = 0.0
    predictor_calls: int = 0
    kv_ms: float = 0.0
    drafters: dict[str, DrafterUsage] = field(default_factory=dict)

    def add(self, step: StepStats) -> None:
        """Accumulate one step's statistics."""
        self.steps += 1
        self.drafted += step.num_drafted
        self.accepted += step.num_accepted
        self.verifications += int(step.verified)
        self.draft_ms += step.draft_ms
        self.verify_ms += step.verify_ms
        self.sublayers += step.sublayers
        self.exit_layer_total += sum(step.exit_layers)
        add_batch_counts(self.layer_batches, step.layer_batches)
        for layer in step.exit_layers:
            if layer >= len(self.exit_counts):
                self.exit_counts.extend([0] * (layer + 1 - len(self.exit_counts)))
            self.exit_counts[layer] += 1
        self.predictor_ms += step.predictor_ms
        self.predictor_calls += step.predictor_calls
        self.kv_ms += step.kv_ms
        if step.drafter:
            self.drafters.setdefault(step.drafter, DrafterUsage()).add(step)

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Tokens per verification: accepted draft tokens + the recovered/bonus token
        (0 without verification)."""
        return ((self.accepted + self.verifications) / self.verifications if self.verifications
                else 0.0)

    @property
    def mean_exit_layer(self) -> float:
        """Mean number of layers a draft token's prediction ran (0 without drafts)."""
        return self.exit_layer_total / self.drafted if self.drafted else 0.0

    @property
    def layer_forwards(self) -> float:
        """Decoder-layer evaluations of one token each (``sublayers / 2``), after the prefill."""
        return self.sublayers / 2

    @property
    def mean_layer_batch(self) -> float:
        """Mean positions per batched decoder-layer call (0 when not reported)."""
        return mean_batch(self.layer_batches) or 0.0

    @property
    def layer_forwards_per_token(self) -> float:
        """Decoder-layer evaluations per generated token (L for autoregressive decoding)."""
        return self.layer_forwards / self.new_tokens if self.new_tokens else 0.0
