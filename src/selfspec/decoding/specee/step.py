"""SpecEE: speculative early exiting (Xu et al. 2025) as a Step of the one decoding loop.

Per token (batch 1):

1. ``k`` speculative tokens, the candidates, from one of two drafters. SpecEE drafts with
   EAGLE's draft model; :class:`DrafterCandidates` does the same with selfspec's
   :class:`~selfspec.heads.drafter.FeatureDrafter` (the previous position's last hidden state
   and the current token's embedding → the top-``k`` of ``lm_head``), before layer 0, so
   features start at any layer ``c``. :class:`HeadCandidates` instead runs layers ``[0, c)``
   and takes an exit head's top-``k`` at ``c`` (no drafter to train, but no exit before
   ``c``). Either costs one call of ``lm_head``'s draft-vocabulary rows. With ``ngram``, the token
   that
   prompt lookup predicts from the context (:class:`~selfspec.decoding.ngram.lookup.ContextIndex`,
   free) replaces the head's ``k``-th candidate when it is not among them
   (:func:`merge_ngram`): on code it is right where the mid-depth head is not (copied
   identifiers), which raises the candidates' recall, the ceiling on exits;
2. from layer ``c`` on, at the layers the scheduler activates, the candidates' features
   (logits, local probabilities, their change against the layer before, computed there too;
   :func:`~selfspec.heads.predictor.candidate_features`) and that layer's predictor MLP; the
   first predictor above
   ``threshold`` ends the forward pass and emits the candidate with the highest local
   probability (§4);
3. otherwise the token runs every layer and the model's own head picks it;
4. the layers the token skipped get their KV from a :mod:`~selfspec.decoding.specee.skipped_kv`
   policy.

Two-level predictor scheduling (§5, :class:`PredictorSchedule`): offline, the layers where
predictors exited most often on held-out text (the card's ``offline_layers``); online, a
circular queue of the last 5 exit layers, each adding its neighbours ±2. A predictor runs at
layer ℓ iff ℓ is in the offline set OR within 2 of one of the last 5 exits (the union, as in
the public SpecEE code, which unions a fixed layer list with the queue's neighbourhoods from
the fifth token on; we use the queue from the first exit). ``schedule="all"`` runs every
predictor instead.

Lossy by design (the paper: < 1% accuracy loss): no verification. With ``verify=true``
(:class:`SpecEEExits`, :class:`VerifiedSpecEEStep`) an exited token's deeper layers run later,
batched with the next tokens, and their output verifies it (AdaDecode §2.2): lossless.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from selfspec.decoding.core.deferred import DeferredLayers
from selfspec.decoding.core.loop import Step
from selfspec.decoding.core.sampling import SamplingConfig, choose_next
from selfspec.decoding.core.speculative import (
    DraftOutput,
    SpeculativeStep,
    TargetOutput,
)
from selfspec.decoding.core.state import DecodeState
from selfspec.decoding.core.stats import StepStats
from selfspec.decoding.drafting.draft_vocab import DraftVocab
from selfspec.decoding.drafting.exit_drafter import ExitDrafter
from selfspec.decoding.drafting.exits import Exit
from selfspec.decoding.drafting.stop_rules import BufferStopRule
from selfspec.decoding.ngram.lookup import ContextIndex
from selfspec.decoding.specee.kernel import (
    CandidateKernel,
    KernelLayerDecision,
    TorchLayerDecision,
)
from selfspec.decoding.specee.skipped_kv import SkippedKV
from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.executor.executor import Observer
from selfspec.heads.predictor import ExitPredictors

QUEUE_SIZE = 5   # SpecEE §5: the last 5 exit layers
RADIUS = 2       # each adds its neighbours ±2
CANDIDATE_SOURCES = ("head", "head+ngram", "drafter", "drafter+ngram")
NGRAM_MAX, NGRAM_MIN = 4, 2  # prompt lookup's n-gram lengths (as the ngram method's)


def merge_ngram(ids: torch.Tensor, ngram: torch.Tensor) -> torch.Tensor:
    """Head candidates with the prompt-lookup token in the last slot where it is missing.

    Args:
        ids: ``[..., k]`` int64 head candidates, most likely first.
        ngram: ``[...]`` int64 prompt-lookup token per position, ``-1`` where none.

    Returns:
        ``[..., k]``: ``ids`` where ``ngram`` is ``-1`` or already a candidate, else ``ids``
        with its ``k``-th entry replaced by ``ngram``. Training and decoding both use this, so
        the predictors see the candidates decoding gives them.
    """
    replace = (ngram >= 0) & ~(ids == ngram.unsqueeze(-1)).any(-1)
    out = ids.clone()
    out[..., -1] = torch.where(replace, ngram, ids[..., -1])
    return out


def ngram_token(index: ContextIndex) -> int:
    """The token prompt lookup predicts after ``index``'s sequence, or ``-1``."""
    found = index.next_token(index.tokens[-NGRAM_MAX:], NGRAM_MIN)
    return -1 if found is None else found[0]


def depth_thresholds(layers: Sequence[int], deep: float, shallow: float) -> dict[int, float]:
    """Exit thresholds that fall linearly from ``deep`` at the last predictor layer to
    ``shallow`` at the first (ours, for verified SpecEE: an exit at layer ``ℓ`` saves the
    ``L - ℓ`` layers of one token's pass while a rejected one costs the pending tokens' work
    whatever ``ℓ``, so a shallow exit is worth a lower confidence; AdaDecode tunes one
    threshold per exit head for the same reason).

    Args:
        layers: predictor layers, sorted.
        deep, shallow: thresholds at ``layers[-1]`` and ``layers[0]``, in (0, 1).

    Returns:
        ``{ℓ: threshold}``.
    """
    first, last = layers[0], layers[-1]
    span = max(last - first, 1)
    return {x: shallow + (deep - shallow) * (x - first) / span for x in layers}


class PredictorSchedule:
    """Which layers' predictors run for the next token (SpecEE §5, module doc).

    Args:
        available: layers that have a predictor.
        offline: the offline set (most frequent exit layers), or ``None`` = every available
            layer, always (no scheduling).
        queue_size: exits remembered by the online queue.
        radius: neighbours each remembered exit adds on either side.

    Raises:
        InvalidArgumentError: an offline layer without a predictor, or a negative size.
    """

    def __init__(self, available: Sequence[int], offline: Sequence[int] | None,
                 queue_size: int = QUEUE_SIZE, radius: int = RADIUS) -> None:
        self.available = frozenset(int(x) for x in available)
        if offline is not None and not set(offline) <= self.available:
            raise InvalidArgumentError(
                f"offline predictor layers {sorted(set(offline) - self.available)} have no "
                f"predictor (predictors: {sorted(self.available)})")
        if queue_size < 0 or radius < 0:
            raise InvalidArgumentError("queue_size and radius must be >= 0")
        self.offline = None if offline is None else frozenset(int(x) for x in offline)
        self.radius = radius
        self._recent: deque[int] = deque(maxlen=queue_size)
        self._active = self._compute()

    def _compute(self) -> frozenset[int]:
        if self.offline is None:
            return self.available
        online = {e + d for e in self._recent for d in range(-self.radius, self.radius + 1)}
        return self.offline | (online & self.available)

    def active(self) -> frozenset[int]:
        """Layers whose predictor runs for the next token."""
        return self._active

    def record(self, exit_layer: int) -> None:
        """Remember where the last token exited (``L`` when it ran every layer)."""
        if self.offline is None:
            return
        self._recent.append(int(exit_layer))
        self._active = self._compute()

    def reset(self) -> None:
        """Forget the queue (a new generation)."""
        self._recent.clear()
        self._active = self._compute()


@dataclass(frozen=True)
class Candidates:
    """The speculative tokens of one step.

    Attributes:
        ids: ``[k]`` int64 token ids, most likely first.
        rows: ``[k, H]`` their ``lm_head`` rows.
        bias: ``[k]`` float32 their ``lm_head`` bias, or ``None``.
    """

    ids: torch.Tensor
    rows: torch.Tensor
    bias: torch.Tensor | None


class HeadCandidates:
    """``k`` speculative tokens: the top-``k`` of an exit head (SpecEE's draft model's role).

    Args:
        executor: the model's executor (its ``lm_head`` rows feed the features).
        layer: the head's exit layer ``c``.
        head: ``head(hidden [1, 1, H]) -> logits [1, 1, V or R]``.
        k: number of candidates.
        vocab: the head scores only ``vocab.rows`` (``R`` logits), or ``None`` (``V``).
        ngram: merge in the prompt-lookup token (:func:`merge_ngram`).
    """

    def __init__(self, executor: LayerExecutor, layer: int,
                 head: Callable[[torch.Tensor], torch.Tensor],
                 k: int, vocab: DraftVocab | None = None, ngram: bool = False) -> None:
        self.executor = executor
        self.layer = layer
        self.head = head
        self.k = k
        self.vocab = vocab
        self.ngram = ngram

    def __call__(self, hidden: torch.Tensor, ngram: int = -1) -> Candidates:
        """Candidates from the hidden state ``[1, 1, H]`` leaving layer ``layer - 1`` and
        the prompt-lookup token ``ngram`` (``-1``: none; ignored without ``self.ngram``)."""
        return _top_candidates(self, self.head(hidden)[0, -1], ngram)


class DrafterCandidates:
    """``k`` speculative tokens drafted before the forward pass (SpecEE §4's EAGLE role) by a
    :class:`~selfspec.heads.drafter.FeatureDrafter`.

    Args:
        executor: the model's executor (token embeddings and the candidates' ``lm_head`` rows).
        drafter: the drafter, in the model's dtype.
        layer: the first layer whose features the predictors see.
        output: ``output(hidden [1, 1, H]) -> logits [1, 1, V or R]``: the model's final norm
            and ``lm_head`` (over ``vocab.rows`` when ``vocab`` is given).
        k: number of candidates.
        vocab: the draft vocabulary, or ``None``.
        ngram: merge in the prompt-lookup token (:func:`merge_ngram`).
        fused: the same drafter, norm, rows and top ``k`` in one compiled call
            (:func:`~selfspec.decoding.specee.kernel.candidate_kernel`), or ``None``: torch.
        exit_drafter: the exit-state drafter, which drafts when the previous position exited
            early and so left its exit-layer state, not its last-layer one
            (:mod:`selfspec.training.drafter`), or ``None``: ``drafter`` reads both.
        exit_fused: ``exit_drafter``'s compiled call, or ``None``.
    """

    def __init__(self, executor: LayerExecutor,
                 drafter: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 layer: int, output: Callable[[torch.Tensor], torch.Tensor], k: int,
                 vocab: DraftVocab | None = None, ngram: bool = False,
                 fused: CandidateKernel | None = None,
                 exit_drafter: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 exit_fused: CandidateKernel | None = None) -> None:
        self.executor = executor
        self.fused = fused
        self.drafter = drafter
        self.exit_drafter = exit_drafter
        self.exit_fused = exit_fused
        self.layer = layer
        self.output = output
        self.k = k
        self.vocab = vocab
        self.ngram = ngram

    def __call__(self, previous: torch.Tensor, token_id: int, ngram: int = -1,
                 exited: bool = False) -> Candidates:
        """Candidates for the token after ``token_id``.

        Args:
            previous: ``[1, 1, H]`` the previous position's last hidden state (before the
                final norm), or its exit-layer state when it exited early.
            token_id: the current token (the one this step runs through the layers).
            ngram: the prompt-lookup token, ``-1`` for none (ignored without ``self.ngram``).
            exited: ``previous`` is an exit-layer state: the exit-state drafter drafts, when
                there is one.
        """
        embedding = self.executor.embed_token(token_id)
        drafter, fused = self.drafter, self.fused
        if exited and self.exit_drafter is not None:
            drafter, fused = self.exit_drafter, self.exit_fused
        if fused is not None:  # its buffer is overwritten by the next call: copy
            return _candidates(self, fused(previous, embedding).clone(), ngram)
        predicted = drafter(previous, embedding)
        return _top_candidates(self, self.output(predicted.to(previous.dtype))[0, -1], ngram)


def _top_candidates(source: HeadCandidates | DrafterCandidates, logits: torch.Tensor,
                    ngram: int) -> Candidates:
    """``source``'s top-``k`` of ``logits`` (``[V]``, or ``[R]`` over its draft vocabulary),
    with the prompt-lookup token ``ngram`` merged in when ``source.ngram``."""
    return _candidates(source, torch.topk(logits, source.k).indices, ngram)


def _candidates(source: HeadCandidates | DrafterCandidates, top: torch.Tensor,
                ngram: int) -> Candidates:
    """The candidates at ``top`` (``[k]`` indices into ``V``, or into ``source``'s draft
    vocabulary), with the prompt-lookup token ``ngram`` merged in when ``source.ngram``."""
    ids = top if source.vocab is None else source.vocab.rows[top]
    if source.ngram and ngram >= 0:
        ids = merge_ngram(ids, torch.tensor(ngram, dtype=ids.dtype, device=ids.device))
    bias = source.executor.lm_head.bias
    return Candidates(ids, source.executor.lm_head.weight[ids],
                      None if bias is None else bias[ids].float())


@dataclass(frozen=True)
class ScanResult:
    """What the predictors decided for one token.

    Attributes:
        exit_layer: the layer whose predictor fired (layers ``[0, exit_layer)`` ran), or
            ``None``: none fired and the token must run every layer.
        ids: ``[k]`` int64 candidate ids, or ``None`` when there were no candidates.
        logits: ``[k]`` float32 the candidates' logits at the exit layer, or ``None``.
        hidden: ``[1, 1, H]`` the state leaving the last layer run.
        calls: predictor evaluations.
        seconds: wall time of candidates, features and predictors.
    """

    exit_layer: int | None
    ids: torch.Tensor | None
    logits: torch.Tensor | None
    hidden: torch.Tensor
    calls: int
    seconds: float


class PredictorScan:
    """SpecEE's exit decision for one token (§4-5): candidates, then layer by layer the
    candidates' features and the scheduled predictors, up to the first that fires. Shared by
    the lossy step (:class:`SpecEEStep`) and the verified one (:class:`SpecEEExits`).

    Args:
        candidates: the speculative-token drafter (its ``layer`` is the first feature layer).
        predictors: per-layer predictors; they must cover ``[candidates.layer, L)``
            contiguously where they exist (features change against the previous layer).
        schedule: which predictors run (reset at each generation).
        threshold: exit when a predictor's output exceeds it (0.5 in the paper), or
            ``{ℓ: threshold}`` per predictor layer (:func:`depth_thresholds`).
        lenses: ``{ℓ: lens}``, ``lens(normed [1, 1, H]) -> [1, 1, H]`` (an exit head's ``T``
            on the final norm of the state): the head lens the predictors were trained with at
            ``ℓ`` (the card's ``lens_layers``; :mod:`selfspec.heads.predictor`); ``None``: none.
        decision: computes each layer's features and predictor
            (:mod:`selfspec.decoding.specee.kernel`); ``None``: torch operations with
            ``lenses``.

    Raises:
        InvalidArgumentError: ``k`` differs from the predictors' or predictors below the
            candidate layer.
    """

    def __init__(self, candidates: HeadCandidates | DrafterCandidates, predictors: ExitPredictors,
                 schedule: PredictorSchedule, threshold: float | Mapping[int, float],
                 lenses: Mapping[int, Callable[[torch.Tensor], torch.Tensor]] | None = None,
                 decision: TorchLayerDecision | KernelLayerDecision | None = None) -> None:
        if candidates.k != predictors.num_candidates:
            raise InvalidArgumentError(
                f"the predictors were trained on {predictors.num_candidates} candidates, got "
                f"k={candidates.k}")
        if min(predictors.layers) < candidates.layer:
            raise InvalidArgumentError(
                f"predictors at layers below the candidate layer {candidates.layer}: "
                f"{[x for x in predictors.layers if x < candidates.layer]}")
        self.candidates = candidates
        self.predictors = predictors
        self.schedule = schedule
        self._thresholds = (dict(threshold) if isinstance(threshold, Mapping)
                            else dict.fromkeys(predictors.layers, float(threshold)))
        self.drafts_first = isinstance(candidates, DrafterCandidates)
        self._feature_layers = frozenset(predictors.layers)
        self.lenses = dict(lenses or {})
        self.decision = decision or TorchLayerDecision(candidates.executor, predictors,
                                                       self.lenses)
        self._last = max(predictors.layers)

    def scan(self, advance: Callable[[int], torch.Tensor], executor: LayerExecutor,
             token_id: int, previous: torch.Tensor | None, ngram: int,
             exited: bool = False) -> ScanResult:
        """Run one token up to its exit (or the last predictor layer) and record the exit in
        the schedule (``L`` when no predictor fired).

        Args:
            advance: ``advance(target) -> [1, 1, H]``: runs the token to ``target`` layers
                done and returns the state leaving layer ``target - 1``.
            executor: the model's executor (final norm; ``L``).
            token_id: the token being run (the drafter's input).
            previous: ``[1, 1, H]`` the previous position's last (or exit-layer) state, the
                drafter's input; ``None`` = no candidates from a drafter (nothing exits).
            ngram: the prompt-lookup token, ``-1`` for none.
            exited: ``previous`` is the previous position's exit-layer state (it exited
                early), not its last-layer one (:class:`DrafterCandidates`).
        """
        first = self.candidates.layer
        cand: Candidates | None = None
        seconds = 0.0
        if self.drafts_first:
            tp = time.perf_counter()
            if previous is not None:  # None only if the prefill went unobserved
                cand = self.candidates(previous, token_id, ngram, exited)
            seconds += time.perf_counter() - tp
            hidden = advance(first)
        else:
            hidden = advance(first)
            tp = time.perf_counter()
            cand = self.candidates(hidden, ngram)
            seconds += time.perf_counter() - tp
        active = self.schedule.active()
        before = None
        calls = 0
        for layer in range(first, self._last + 1) if cand is not None else ():
            hidden = advance(layer)
            # features where a predictor runs, and one layer before (its change is taken
            # against the previous layer, as in training); elsewhere they would go unread
            if layer not in self._feature_layers or (layer not in active
                                                     and layer + 1 not in active):
                continue
            tp = time.perf_counter()
            predict = layer in active
            decided = self.decision(layer, hidden, cand.rows, cand.bias, before, predict)
            before = decided.scores.probs
            calls += predict
            fire = predict and decided.prob > self._thresholds[layer]
            seconds += time.perf_counter() - tp
            if fire:
                self.schedule.record(layer)
                return ScanResult(layer, cand.ids, decided.scores.logits.clone(), hidden, calls,
                                  seconds)
        self.schedule.record(executor.num_layers)
        return ScanResult(None, None if cand is None else cand.ids, None, hidden, calls, seconds)


class SpecEEStep(Step):
    """One token per call, exiting at the first scheduled predictor above ``threshold``.

    Its :class:`StepStats` reports the token as one unverified draft token whose
    ``exit_layers`` entry is the layers it ran (L when no predictor fired), plus the time
    spent on candidates, features and predictors (``predictor_ms``), their calls, and the time
    spent settling the skipped layers' KV (``kv_ms``).

    Args:
        candidates, predictors, schedule, threshold, lenses, decision: see
            :class:`PredictorScan`.
        kv: ``kv(executor, cache) -> SkippedKV`` for one generation.

    Raises:
        InvalidArgumentError: see :class:`PredictorScan`.
    """

    # Tokens come from a reduced candidate set the predictors chose, unverified: output
    # processing (grammar, penalties, logprobs) would need the full distribution.
    processes_logits = False

    def __init__(self, candidates: HeadCandidates | DrafterCandidates, predictors: ExitPredictors,
                 schedule: PredictorSchedule, threshold: float | Mapping[int, float],
                 kv: Callable[[LayerExecutor, object], SkippedKV],
                 lenses: Mapping[int, Callable[[torch.Tensor], torch.Tensor]] | None = None,
                 decision: TorchLayerDecision | KernelLayerDecision | None = None) -> None:
        self.scanner = PredictorScan(candidates, predictors, schedule, threshold, lenses,
                                     decision)
        self._make_kv = kv
        self._kv: SkippedKV | None = None
        self._index: ContextIndex | None = None
        # The last position's hidden state (pre-norm; its exit layer's if it exited): the
        # drafter's input for the next token.
        self._previous: torch.Tensor | None = None
        self._previous_exited = False

    @property
    def schedule(self) -> PredictorSchedule:
        """The predictor schedule (:class:`PredictorScan`'s)."""
        return self.scanner.schedule

    @property
    def candidates(self) -> HeadCandidates | DrafterCandidates:
        """The speculative-token drafter (:class:`PredictorScan`'s)."""
        return self.scanner.candidates

    def prefill_observer(self, state: DecodeState) -> Observer | None:
        """With drafter candidates: record the prompt's last hidden state during the prefill
        (the drafter's input for the first generated token's successor)."""
        if not self.scanner.drafts_first:
            return None
        return _last_state_observer(state.executor, self._keep_previous)

    def _keep_previous(self, hidden: torch.Tensor) -> None:
        self._previous, self._previous_exited = hidden, False

    def start(self, state: DecodeState) -> None:
        """Begin a generation: fresh KV policy state, schedule queue and (with n-gram
        candidates) prompt-lookup index over the prompt."""
        self._kv = self._make_kv(state.executor, state.cache)
        self.schedule.reset()
        self._index = ContextIndex(NGRAM_MAX, NGRAM_MIN) if self.scanner.candidates.ngram else None

    def _ngram(self, state: DecodeState) -> int:
        if self._index is None:
            return -1
        self._index.extend(state.tokens[len(self._index):])  # the tokens it has not seen
        return ngram_token(self._index)

    def __call__(self, state: DecodeState) -> StepStats:
        ex, kv = state.executor, self._kv
        assert kv is not None, "start() was not called"
        t0 = time.perf_counter()
        before, fill_before = kv.layer_forwards, kv.fill_ms
        batches_before = list(kv.layer_batches)
        kv.begin(state.tokens[-1], state.seq_len - 1)
        found = self.scanner.scan(kv.advance, ex, state.tokens[-1], self._previous,
                                  self._ngram(state), self._previous_exited)
        if found.exit_layer is None:
            hidden = kv.advance(ex.num_layers)
            logits = ex.logits(hidden)[0, -1]
            token = int(state.choose_next(logits.unsqueeze(0)))
            kv.finish()
            exit_layer = ex.num_layers
        else:
            hidden, exit_layer = found.hidden, found.exit_layer
            noise = state.noise_rows(0, 1)  # seeded: the keyed noise of its candidates
            pick = choose_next(found.logits.unsqueeze(0), state.options.sampling,
                               state.generator, None if noise is None else noise[:, found.ids])
            token = int(found.ids[int(pick)])
            kv.stop(exit_layer)
        self._previous, self._previous_exited = hidden, exit_layer < ex.num_layers
        kept = state.commit([token])
        batches = [n - (batches_before[i] if i < len(batches_before) else 0)
                   for i, n in enumerate(kv.layer_batches)]
        return StepStats(num_drafted=1, committed=len(kept), exit_layers=(exit_layer,),
                         sublayers=2 * (kv.layer_forwards - before),
                         draft_ms=(time.perf_counter() - t0) * 1e3,
                         layer_batches=tuple(batches), predictor_ms=found.seconds * 1e3,
                         predictor_calls=found.calls, kv_ms=kv.fill_ms - fill_before)


def _last_state_observer(executor: LayerExecutor,
                         keep: Callable[[torch.Tensor], None]) -> Observer:
    """A prefill observer that hands ``keep`` the prompt's last hidden state ``[1, 1, H]``
    (leaving the last layer, before the final norm)."""
    last = executor.num_layers - 1

    def observe(layer: int, sublayer: str, hidden: torch.Tensor) -> None:
        if layer == last and sublayer == "mlp":
            keep(hidden[:, -1:].clone())
    return observe


class SpecEEExits:
    """SpecEE's exit decision as an :class:`~selfspec.decoding.drafting.exits.ExitPolicy`: verified
    SpecEE (``specee:verify=true``).

    A token whose predictor fires becomes a draft token (the candidate with the highest local
    probability, or a draw from the candidates' softmax when sampling); the next token starts
    at layer 0 and the exited token's deeper layers wait in the
    :class:`~selfspec.decoding.core.deferred.DeferredLayers`, to run batched with later tokens —
    the ``deferred`` KV policy. When they have run, the last layer's logits at that position
    verify the token (:class:`~selfspec.decoding.core.speculative.SpeculativeStep`), as AdaDecode
    §2.2 verifies its early predictions: the exit decision and the proposal are SpecEE's, the
    schedule and the verification AdaDecode's. Lossless for greedy and sampling: the exit
    decision is a function of the state, not of the draw, so the proposal ``q`` is the
    candidates' transformed softmax and speculative sampling is exact for it.

    Drafter candidates read the previous position's state: its exit-layer state inside a
    draft (as lossy SpecEE; the exit-state drafter drafts from it when the file has one), its
    last-layer state from verification at a draft's start.
    The prompt-lookup candidate looks up the committed text and the draft so far.

    Args:
        scanner: the candidates, predictors, schedule and threshold.
        executor: the model's executor.

    Attributes:
        vocab: ``None``: each exit carries its own (its ``k`` candidates; logits ``[k]``).
        calls, seconds: predictor evaluations and their wall time, cumulative.
    """

    vocab = None

    def __init__(self, scanner: PredictorScan, executor: LayerExecutor) -> None:
        self.scanner = scanner
        self.executor = executor
        self.calls = 0
        self.seconds = 0.0
        self._previous: torch.Tensor | None = None
        self._tokens: Sequence[int] = ()
        self._index: ContextIndex | None = None

    def _keep_previous(self, hidden: torch.Tensor) -> None:
        self._previous = hidden

    def start(self) -> None:
        """Begin a generation (after the prefill, whose observer set the previous state):
        schedule queue and prompt-lookup index."""
        self.scanner.schedule.reset()
        self._index = ContextIndex(NGRAM_MAX, NGRAM_MIN) if self.scanner.candidates.ngram else None

    def prefill_observer(self, state: DecodeState) -> Observer | None:
        """With drafter candidates: records the prompt's last hidden state."""
        if not self.scanner.drafts_first:
            return None
        return _last_state_observer(state.executor, self._keep_previous)

    def begin_draft(self, state: DecodeState) -> None:
        """A draft starts after ``state.tokens``: index the committed text."""
        self._tokens = state.tokens
        if self._index is not None:
            self._index.extend(state.tokens[len(self._index):])

    def verified(self, deferred: DeferredLayers, accepted: int) -> None:
        """Verification accepted ``accepted`` draft tokens of the draft whose positions are in
        ``deferred`` (all at the last layer): the next draft's first token follows pending
        position ``accepted``, whose last-layer state is the drafter's input."""
        self._previous = deferred.hidden(accepted)

    def _ngram(self, deferred: DeferredLayers) -> int:
        if self._index is None:
            return -1
        drafted = [deferred.token(i) for i in range(1, len(deferred))]
        tail = (list(self._tokens[-NGRAM_MAX:]) + drafted)[-NGRAM_MAX:]
        found = self._index.next_token(tail, NGRAM_MIN)
        return -1 if found is None else found[0]

    def choose(self, deferred: DeferredLayers, sampling: SamplingConfig,
               generator: torch.Generator | None = None) -> Exit | None:
        """Run the last pending position up to its first firing predictor; its
        :class:`~selfspec.decoding.drafting.exits.Exit` (logits ``[k]``: the candidates' logits at
        that layer, over its ``vocab``, the candidate ids ascending), or ``None`` when none
        fired."""
        # Inside a draft the previous position is an exited token, waiting at its exit layer.
        exited = len(deferred) > 1
        previous = deferred.hidden(-2) if exited else self._previous

        def advance(target: int) -> torch.Tensor:
            deferred.advance(target)
            return deferred.hidden()

        found = self.scanner.scan(advance, self.executor, deferred.token(), previous,
                                  self._ngram(deferred), exited)
        self.calls += found.calls
        self.seconds += found.seconds
        if found.exit_layer is None:
            return None
        # The draft token is picked among the k candidates alone (ascending ids, so ties go
        # to the lowest id as over [V]): an argmax and softmax over all V rows, -inf but k,
        # cost a noticeable share of a draft token on a 151,936-token vocabulary.
        ids, order = found.ids.sort()
        return Exit(found.exit_layer, found.logits[order],
                    vocab=DraftVocab(ids, self.executor.vocab_size))


class SpecEEDrafter(ExitDrafter):
    """:class:`~selfspec.decoding.drafting.exit_drafter.ExitDrafter` over :class:`SpecEEExits` with
    a buffer of ``max_early`` exited tokens: hands the exits the committed text before a draft
    and the verified states after it.

    Raises:
        InvalidArgumentError: ``max_early`` beyond :func:`check_draft_len_limit`.
    """

    def __init__(self, executor: LayerExecutor, exits: SpecEEExits, max_early: int) -> None:
        super().__init__(executor, exits, BufferStopRule(max_early))
        self.exits = exits
        self._deferred: DeferredLayers | None = None

    def draft(self, state: DecodeState) -> DraftOutput:
        self.exits.begin_draft(state)
        return super().draft(state)

    def target_logits(self, state: DecodeState, draft: DraftOutput) -> TargetOutput:
        out = super().target_logits(state, draft)
        self._deferred = draft.deferred
        return out

    def update(self, stats: StepStats) -> None:
        super().update(stats)
        if self._deferred is not None:
            self.exits.verified(self._deferred, stats.num_accepted)


class VerifiedSpecEEStep(SpeculativeStep):
    """Verified SpecEE (:class:`SpecEEExits`): draft → verify → rollback → commit, with the
    predictors' time and calls in each step's :class:`StepStats`."""

    def __init__(self, drafter: SpecEEDrafter) -> None:
        super().__init__(drafter)
        self.exits = drafter.exits

    def prefill_observer(self, state: DecodeState) -> Observer | None:
        """See :meth:`SpecEEExits.prefill_observer`."""
        return self.exits.prefill_observer(state)

    def start(self, state: DecodeState) -> None:
        """Begin a generation (:meth:`SpecEEExits.start`)."""
        self.exits.start()

    def __call__(self, state: DecodeState) -> StepStats:
        calls, seconds = self.exits.calls, self.exits.seconds
        stats = super().__call__(state)
        return replace(stats, predictor_ms=(self.exits.seconds - seconds) * 1e3,
                       predictor_calls=self.exits.calls - calls)
