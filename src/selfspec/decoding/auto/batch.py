"""Ragged batches: several generations advanced together, each row at its own length.

A row is a :class:`~selfspec.decoding.core.state.DecodeState` (its tokens, its own KV cache, its
limits, EOS and stop strings, its stats); a :class:`BatchStep` advances any set of rows by one
step, and each row commits its own number of tokens (a speculative step accepts a different
prefix per row and rolls each row's cache back on its own). Rows join after their prefill
and leave when done, so the same step serves a fixed batch (:func:`run_batch`) and a
continuously changing one (:class:`selfspec.serving.scheduler.Scheduler`)::

    begin(state)                              # prefill alone + the first token
    step.join(state)                          # the row's per-generation drafter state
    while rows:                               # one call = one step of every row
        for state, stats in zip(rows, step(rows)): state.stats.add(stats)
        step.leave(done_row)                  # e.g. its text joins the n-gram history

Batch steps here: :class:`BatchArStep` (one batched forward per token),
:class:`BatchNgramStep` (n-gram drafts of different lengths per row, packed without padding
and verified in one forward; the draft lengths are chosen for the whole batch by predicted
tokens per second, so at high batch it falls back to plain decoding) and :class:`SoloRows`
(any other method: each row runs its own single-row Step in turn; correct, not faster).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import torch

from selfspec.decoding.core.loop import Step, check_processing
from selfspec.decoding.core.sampling import choose_next
from selfspec.decoding.core.state import DecodeState
from selfspec.decoding.core.stats import GenerationStats, StepStats
from selfspec.decoding.core.verification import verify_greedy, verify_sampling
from selfspec.decoding.ngram.drafter import NgramDrafter, NgramSettings
from selfspec.decoding.ngram.lookup import NgramProposal
from selfspec.decoding.ngram.lookup import SuffixAutomaton
from selfspec.decoding.planning.tpt import ForwardCosts, TptChoice
from selfspec.executor import LayerExecutor
from selfspec.executor.cost_model import LatencyModel


class BatchStep(Protocol):
    """One step of every row of a ragged batch.

    Times in a row's :class:`StepStats` are its share of the batched step (the step's time
    divided by the rows), so they add up over rows to the batch's time.

    Attributes:
        batched: True when rows really share forwards (False: :class:`SoloRows`).
        processes_logits: rows may use output processing (``Step.processes_logits``).
    """

    batched: bool
    processes_logits: bool

    def join(self, state: DecodeState) -> None:
        """A row whose prefill committed its first token enters the batch."""

    def leave(self, state: DecodeState) -> None:
        """A row leaves (done or cancelled); its per-row state is dropped."""

    def __call__(self, states: list[DecodeState]) -> list[StepStats]:
        """Commit ``>= 1`` token to each of ``states`` (fewer only for a row that became
        done); one :class:`StepStats` per row, in order."""


def _survival(alphas: list[float]) -> list[float]:
    """``[α_1, α_1 α_2, ...]``: the probability that each draft token is accepted (all
    before it accepted), its expected gain."""
    out, survive = [], 1.0
    for alpha in alphas:
        survive *= alpha
        out.append(survive)
    return out


def begin(state: DecodeState) -> None:
    """Prefill ``state``'s prompt alone (its own cache) and commit the first token."""
    logits = state.process(state.prefill())  # [1, V]
    state.commit([int(choose_next(logits, state.options.sampling, state.generator))], logits)


def run_batch(states: list[DecodeState], step: BatchStep) -> list[GenerationStats]:
    """Generate every row of ``states`` to its end with ``step``.

    Args:
        states: fresh :class:`DecodeState` rows (empty caches), any prompt lengths.
        step: the method's batch step.

    Returns:
        Each row's finished :class:`GenerationStats`, in order.

    Raises:
        RuntimeError: a step committed nothing to a row that is not done (a method bug).
        InvalidArgumentError: output processing on a method without it (before any prefill).
    """
    if any(state.processor is not None for state in states):
        for state in states:
            check_processing(step.processes_logits, state)
    for state in states:
        begin(state)
        if not state.done:
            step.join(state)
        else:
            step.leave(state)
    active = [s for s in states if not s.done]
    while active:
        before = [s.seq_len for s in active]
        for state, stats in zip(active, step(active)):
            state.stats.add(stats)
        for state, n in zip(active, before):
            if state.seq_len == n and not state.done:
                raise RuntimeError(f"{type(step).__name__} committed no token to a row")
            if state.done:
                step.leave(state)
        active = [s for s in active if not s.done]
    return [s.finish() for s in states]


def _packed(states: list[DecodeState], rows: list[list[int]],
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Row ``b``'s tokens ``rows[b]`` (its last committed token first) packed row after row:
    ``[N]`` ids, ``[N]`` positions (from the last committed token's) and the lengths."""
    ids = [t for r in rows for t in r]
    positions = [s.seq_len - 1 + k for s, r in zip(states, rows) for k in range(len(r))]
    return (torch.tensor(ids, device=device), torch.tensor(positions, device=device),
            [len(r) for r in rows])


class BatchArStep:
    """Autoregressive decoding of a ragged batch: one forward of ``B`` tokens per step (the
    weights are read once for all rows), each row sampled with its own configuration and
    seeded generator, so each row's output is the one it would have alone."""

    batched = True
    processes_logits = True

    def __init__(self, executor: LayerExecutor) -> None:
        self.executor = executor

    def join(self, state: DecodeState) -> None:
        """Nothing per row."""

    def leave(self, state: DecodeState) -> None:
        """Nothing per row."""

    def __call__(self, states: list[DecodeState]) -> list[StepStats]:
        ex = self.executor
        t0 = time.perf_counter()
        ids, positions, lengths = _packed(states, [[s.tokens[-1]] for s in states], ex.device)
        logits = ex.forward_rows(ids, positions, lengths, [s.cache for s in states])  # [B, V]
        ms = (time.perf_counter() - t0) * 1e3 / len(states)  # each row's share of the step
        out = []
        for b, state in enumerate(states):
            row = state.process(logits[b:b + 1])
            token = int(choose_next(row, state.options.sampling, state.generator))
            kept = state.commit([token], row)
            out.append(StepStats(committed=len(kept), sublayers=2 * ex.num_layers,
                                 step_ms=ms))
        return out


class BatchNgramStep:
    """n-gram drafts for every row, verified in one batched forward (lossless).

    Each row has its own :class:`~selfspec.decoding.ngram.drafter.NgramDrafter` (its prompt
    lookup index, its acceptance estimates) and, with ``history``, matches the engine's
    earlier texts. Rows are packed without padding (:meth:`LayerExecutor.run_rows`), so each
    row drafts its own number of tokens ``d_b``, chosen for the whole batch by KnapSpec eq. 4
    summed over rows::

        E(d) = Σ_b (1 + Σ_{k ≤ d_b} Π_{j ≤ k} α_{b,j}),    N(d) = Σ_b (1 + d_b)
        d*   = argmax_d E(d) / t_forward(N(d))

    where ``α_{b,j}`` is row ``b``'s acceptance estimate for its ``j``-th proposed token (its
    match's; under a grammar, forced tokens have their own) and ``t_forward(n)`` the
    latency model's time of a forward over ``n`` tokens, corrected online by the measured
    step times. For a given ``N`` the best ``d`` takes the ``N - B`` draft tokens of largest
    marginal gain ``Π_{j ≤ k} α_{b,j}`` (gains fall along a row), so one pass over the tokens
    sorted by gain finds ``d*``. At high batch a forward stops being bound by reading the weights,
    ``t_forward`` grows with every token and the step falls back to plain decoding
    (``d = 0``). A step drafts at most ``max_step_draft`` tokens over all rows: the logits of
    a verification are ``[N, V]`` floats (``N = 272`` rows of Qwen2.5's 151,936-token
    vocabulary would be 165 MB per step). Verification per row is :func:`verify_greedy` or,
    sampling, the rejection rule with a one-hot ``q`` (see
    :mod:`selfspec.decoding.ngram.drafter`).

    Args:
        executor: the model's executor.
        latency: the model's measured latencies (prior of the step time).
        settings: n-gram matching and draft limits.
        history: the engine's suffix automaton of earlier texts, or ``None``; a row's text
            joins it when the row leaves.
        max_step_draft: draft tokens of one step over all rows, at most.
    """

    batched = True
    processes_logits = True

    def __init__(self, executor: LayerExecutor, latency: LatencyModel, settings: NgramSettings,
                 history: SuffixAutomaton | None = None, max_step_draft: int = 64) -> None:
        self.max_step_draft = max_step_draft
        self.executor = executor
        self.latency = latency
        self.settings = settings
        self.history = history
        self.costs = ForwardCosts(latency)
        self._drafters: dict[int, NgramDrafter] = {}

    def join(self, state: DecodeState) -> None:
        """Give the row its own drafter."""
        self._drafters[id(state)] = NgramDrafter(self.executor, ForwardCosts(self.latency),
                                                 self.settings, self.history)

    def leave(self, state: DecodeState) -> None:
        """Drop the row's drafter; its text joins the history."""
        self._drafters.pop(id(state), None)
        if self.history is not None:
            self.history.add(state.tokens)

    def _plan(self, states: list[DecodeState], proposals: list[list[int]],
              alphas: list[list[float]]) -> tuple[list[int], TptChoice]:
        """Each row's draft length ``d_b`` maximising the batch's predicted tokens per second
        (see the class docstring), and the plan's total draft tokens, expected committed
        tokens (all rows) and predicted time."""
        self.costs.context_len = sum(s.seq_len for s in states) // len(states)
        rows = len(states)
        best = TptChoice(0, float(rows), self.costs.forward_ms(rows))
        counts = [0] * rows
        best_counts = list(counts)
        gains = sorted(((gain, b) for b, (prop, alpha) in enumerate(zip(proposals, alphas))
                        for gain in _survival(alpha[:len(prop)])), key=lambda g: -g[0])
        gains = gains[: self.max_step_draft]
        tokens = float(rows)
        for drafted, (gain, b) in enumerate(gains, 1):
            counts[b] += 1
            tokens += gain
            choice = TptChoice(drafted, tokens, self.costs.forward_ms(rows + drafted))
            if choice.tokens * best.ms > best.tokens * choice.ms:
                best, best_counts = choice, list(counts)
        return best_counts, best

    def __call__(self, states: list[DecodeState]) -> list[StepStats]:
        ex = self.executor
        t0 = time.perf_counter()
        proposals, alphas = [], []
        found: list[NgramProposal | None] = []
        for state in states:
            drafter = self._drafters[id(state)]
            limit = min(self.settings.max_draft_len, state.remaining - 1)
            prop = drafter.proposal(state, limit) if limit > 0 else None
            found.append(prop)
            proposals.append([] if prop is None else list(prop.tokens[:limit]))
            alphas.append([] if prop is None else drafter.alphas(prop))
        counts, plan = self._plan(states, proposals, alphas)
        drafts = [p[:n] for p, n in zip(proposals, counts)]
        draft_ms = (time.perf_counter() - t0) * 1e3
        t1 = time.perf_counter()
        ids, positions, lengths = _packed(
            states, [[s.tokens[-1], *d] for s, d in zip(states, drafts)], ex.device)
        logits = ex.forward_rows(ids, positions, lengths, [s.cache for s in states])  # [N, V]
        results = []
        offset = 0
        for b, (state, draft) in enumerate(zip(states, drafts)):
            draft_ids = torch.tensor(draft, dtype=torch.long, device=ex.device)  # [D_b]
            target = state.process(logits[offset: offset + len(draft) + 1], draft)  # [D_b+1, V]
            offset += len(draft) + 1
            sampling = state.options.sampling
            if sampling.greedy:
                result = verify_greedy(draft_ids, target)
            else:  # q = δ(x_i), [D_b, V]
                probs = torch.zeros(len(draft), ex.vocab_size, device=ex.device)
                probs[torch.arange(len(draft), device=probs.device), draft_ids] = 1.0
                result = verify_sampling(draft_ids, probs, target, sampling, state.generator)
            kept = state.commit(result.committed_tokens, target[: result.num_accepted + 1])
            state.cache.truncate(state.seq_len - 1)  # rejected positions go
            if draft and found[b] is not None:
                self._drafters[id(state)].record(found[b], len(draft), result.num_accepted)
            results.append((len(draft), result.num_accepted, len(kept)))
        verify_ms = (time.perf_counter() - t1) * 1e3
        self.costs.observe(len(ids), verify_ms)
        # Each row's stats carry its share of the step (times and predictions / rows), so
        # summed over rows they are the batch's, and a row's tokens / ms is the aggregate rate.
        rows = len(states)
        share = plan.tokens / rows
        draft_ms, verify_ms, predicted_ms = draft_ms / rows, verify_ms / rows, plan.ms / rows
        return [StepStats(
            num_drafted=drafted, num_accepted=accepted, committed=committed,
            verified=drafted > 0, exit_layers=(0,) * drafted,
            sublayers=2 * ex.num_layers * (drafted + 1), draft_ms=draft_ms,
            verify_ms=verify_ms, drafter="ngram" if plan.draft_len else "ar",
            step_ms=draft_ms + verify_ms, predicted_tokens=share, predicted_ms=predicted_ms)
            for drafted, accepted, committed in results]


class SoloRows:
    """Any method in a batch: each row runs its own single-row Step, one row after another.

    Correct for every method (each row is exactly a single-prompt generation) but no faster
    than running the prompts in turn; the server uses it for the methods without a batched
    step so that their requests still stream side by side.

    Args:
        make_step: builds a fresh Step for one row.
    """

    batched = False

    def __init__(self, make_step: Callable[[], Step]) -> None:
        self.make_step = make_step
        self._steps: dict[int, Step] = {}
        self._supports: bool | None = None

    @property
    def processes_logits(self) -> bool:
        """Whether the method's Step supports output processing (a Step is built once to
        ask)."""
        if self._supports is None:
            self._supports = self.make_step().processes_logits
        return self._supports

    def join(self, state: DecodeState) -> None:
        """Build and start the row's Step."""
        step = self.make_step()
        step.start(state)
        self._steps[id(state)] = step

    def leave(self, state: DecodeState) -> None:
        """Finish the row's Step (e.g. its text joins the n-gram history) and drop it."""
        step = self._steps.pop(id(state), None)
        if step is not None:
            step.finish(state)

    def __call__(self, states: list[DecodeState]) -> list[StepStats]:
        return [self._steps[id(s)](s) for s in states]
