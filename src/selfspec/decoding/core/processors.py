"""Output processing: presence / frequency penalties, a grammar constraint and log
probabilities, applied to the target's logits at every position a step verifies, drafts
included (docs/design.md "Output processing").

Every method chooses or verifies tokens on *processed* target logits:

    logits = state.process(target_logits, draft_tokens)   # [D+1, V]: row i after draft[:i]
    result = verify(draft, logits)                          # or choose_next(logits)
    state.commit(result.committed_tokens, logits)           # advances penalties + grammar

Row ``i`` is processed as if ``draft[:i]`` were committed: its penalties count them and
its grammar mask follows them. Because the processed rows of a verification block equal
the rows autoregressive decoding would see at those positions, greedy speculative decoding
commits exactly the tokens of greedy decoding *with the same processing*, and speculative
sampling (Leviathan et al. 2023, §2.3) reproduces the processed distribution, whatever the
drafter proposed; drafters need not know about it.

Penalties follow the OpenAI API (``presence_penalty``, ``frequency_penalty`` in [-2, 2]):
``logit[j] -= frequency * count[j] + presence * (count[j] > 0)`` with ``count`` over the
generated tokens (the prompt excluded, as vLLM and llama.cpp's server count).

Log probabilities are ``log_softmax`` of the processed logits (penalties and grammar
applied; temperature, top-k and top-p not), of the committed token and of the ``k`` most
likely tokens: the verifying model's distribution, so a speculative method reports the same
values as ``ar`` at the same positions (equal up to float rounding where a verification
block's rows are not bit-identical to one-token decoding).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from selfspec.decoding.core.grammar import DraftGuide, Grammar, GrammarMatcher
from selfspec.errors import InvalidArgumentError
from selfspec.validation import check_float

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class Penalties:
    """OpenAI's presence and frequency penalties.

    Attributes:
        presence: subtracted once from the logit of every token generated so far.
        frequency: subtracted per occurrence of a token generated so far.

    Raises:
        InvalidArgumentError: a value that is not a finite number in [-2, 2].
    """

    presence: float = 0.0
    frequency: float = 0.0

    def __post_init__(self) -> None:
        for name in ("presence", "frequency"):
            value = check_float(f"{name}_penalty", getattr(self, name), low=-2.0, high=2.0)
            object.__setattr__(self, name, value)

    @property
    def active(self) -> bool:
        """Either penalty is non-zero."""
        return self.presence != 0.0 or self.frequency != 0.0


@dataclass(frozen=True)
class LogitsProcessing:
    """What is done to the target's logits before a token is chosen, and what is recorded.

    Attributes:
        penalties: presence / frequency penalties.
        grammar: a compiled constraint (:class:`~selfspec.decoding.core.grammar.Grammar`), or
            ``None``.
        logprobs: ``None``: record nothing; ``k >= 0``: record each generated token's log
            probability and the ``k`` most likely alternatives (``k <= 20``, as OpenAI).

    Raises:
        InvalidArgumentError: ``logprobs`` not an integer in ``[0, 20]``; ``grammar`` not a
            :class:`Grammar`.
    """

    penalties: Penalties = field(default_factory=Penalties)
    grammar: Grammar | None = None
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.logprobs is not None and (
                isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidArgumentError(
                f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] (alternatives per "
                f"token) or None; got {self.logprobs!r}")
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise InvalidArgumentError(
                "grammar must be a Grammar (SelfSpec.grammar(...) compiles one); got "
                f"{type(self.grammar).__name__}")

    @property
    def active(self) -> bool:
        """Anything to do at all (else the decoding path is untouched)."""
        return self.penalties.active or self.grammar is not None or self.logprobs is not None


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log probability (natural log) and the most likely alternatives.

    Attributes:
        token: the token id.
        logprob: its log probability under the processed target distribution.
        top: ``(token id, log probability)`` of the ``k`` most likely tokens, most likely
            first (may include ``token``).
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class LogitsProcessor:
    """One generation's output processing (built by :class:`DecodeState` from
    :class:`LogitsProcessing`).

    Args:
        processing: what to apply and record.
        vocab_size: ``V``, the logits width.
    """

    def __init__(self, processing: LogitsProcessing, vocab_size: int) -> None:
        self.processing = processing
        self.vocab_size = vocab_size
        self.penalties = processing.penalties if processing.penalties.active else None
        self.counts: torch.Tensor | None = None  # [V] float32, generated-token counts
        self.matcher: GrammarMatcher | None = (
            None if processing.grammar is None else processing.grammar.matcher())
        self.logprobs: list[TokenLogprob] = []

    @property
    def changes_logits(self) -> bool:
        """Penalties or a grammar (logprobs alone leave the logits as they are)."""
        return self.penalties is not None or self.matcher is not None

    def apply(self, logits: torch.Tensor, draft: Sequence[int] = ()) -> torch.Tensor:
        """Processed logits.

        Args:
            logits: ``[N, V]`` target logits; row ``i`` predicts the token after the committed
                sequence and ``draft[:i]``.
            draft: at least ``N - 1`` draft tokens (host ints).

        Returns:
            ``[N, V]`` float32 logits (a new tensor; ``logits`` is not modified), or
            ``logits`` itself when nothing changes them.
        """
        if not self.changes_logits:
            return logits
        rows = logits.shape[0]
        out = logits.float().clone() if logits.dtype == torch.float32 else logits.float()
        if self.penalties is not None and self.counts is not None:
            counts = self.counts.to(out.device).expand(rows, -1)
            if rows > 1:  # row i also counts draft[:i]
                drafted = torch.zeros(rows, self.vocab_size, device=out.device)
                idx = torch.tensor(list(draft[: rows - 1]), dtype=torch.long, device=out.device)
                drafted[torch.arange(1, rows, device=out.device), idx] = 1.0
                counts = counts + drafted.cumsum(dim=0)
            p = self.penalties
            out -= p.frequency * counts + p.presence * (counts > 0).float()
        if self.matcher is not None:
            allowed = self.matcher.masks(draft, rows).to(out.device)
            out.masked_fill_(~allowed, -math.inf)
        return out

    def commit(self, tokens: Sequence[int], logits: torch.Tensor | None) -> None:
        """Record ``tokens``' log probabilities from ``logits`` (the processed rows they were
        chosen from, ``[len(tokens), V]``) and advance the penalties and grammar."""
        if self.processing.logprobs is not None and logits is not None:
            self._record(tokens, logits)
        if self.penalties is not None:
            if self.counts is None:
                self.counts = torch.zeros(self.vocab_size)
            for token in tokens:
                self.counts[token] += 1.0
        if self.matcher is not None:
            self.matcher.commit(tokens)

    def _record(self, tokens: Sequence[int], logits: torch.Tensor) -> None:
        logp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)   # [n, V]
        chosen = logp.gather(-1, torch.tensor(list(tokens), device=logp.device).view(-1, 1))
        k = self.processing.logprobs or 0
        if k:
            top = torch.topk(logp, k, dim=-1)
            top_ids, top_vals = top.indices.tolist(), top.values.tolist()
        for i, token in enumerate(tokens):
            # A token the grammar forbids stays with -inf (the server answers OpenAI's -9999).
            alternatives = (tuple(zip(top_ids[i], top_vals[i])) if k else ())
            self.logprobs.append(TokenLogprob(int(token), float(chosen[i, 0]), alternatives))

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` the grammar allows in a row (all without a grammar)."""
        return len(tokens) if self.matcher is None else self.matcher.valid_prefix(tokens)

    def draft_guide(self) -> DraftGuide | None:
        """A guide for a model drafter under the grammar (``None`` without one;
        :class:`~selfspec.decoding.core.grammar.DraftGuide`)."""
        return None if self.matcher is None else self.matcher.guide()

    def forced_tokens(self, after: Sequence[int] = (), limit: int = 64) -> list[int]:
        """The tokens the grammar forces after the committed ones and ``after`` (none
        without a grammar; :meth:`GrammarMatcher.forced_tokens`)."""
        return [] if self.matcher is None else self.matcher.forced_tokens(after, limit)
