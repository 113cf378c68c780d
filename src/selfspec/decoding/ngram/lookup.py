"""Free drafts copied from text seen before: prompt lookup and a suffix automaton.

Two sources of n-gram drafts, both training-free and costing no model layer:

- :class:`ContextIndex`, prompt lookup over the current sequence (prompt + generated
  text; Saxena 2023, "Prompt Lookup Decoding", as in transformers' ``prompt_lookup_num_tokens``
  and vLLM's n-gram proposer): for every ``n <= max_ngram`` it counts which token followed each
  n-gram. A draft token is the most frequent follower of the longest suffix of the
  context (+ the draft so far) that occurred before (ties: the most recent occurrence).
- :class:`SuffixAutomaton`, over earlier texts of the same engine (kept for the life of the
  process or server), as in SuffixDecoding (Oliaro et al. 2024) and SAM-Decoding (Hu et al.
  2024): the longest suffix of the context that occurs anywhere in those texts, of any
  length, and its most frequent continuation. Repeated requests and multi-turn chats then
  draft from what was generated before.

Each proposal carries its match length and each token's frequency share (the fraction of
the matched text's occurrences that continue with it): the draft length is chosen from both
(:class:`NgramDrafter <selfspec.decoding.ngram.drafter.NgramDrafter>`). Pure Python on
token ids, no tensors: a lookup costs microseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from selfspec.errors import InvalidArgumentError
from selfspec.validation import check_int


@dataclass
class NgramProposal:
    """A continuation copied from earlier text.

    Attributes:
        tokens: ``[D]`` proposed draft token ids, ``D >= 1``.
        shares: ``[D]`` each token's frequency share among the continuations of the text
            matched before it, in ``(0, 1]``.
        match_len: tokens of the context's suffix that matched before the first draft token.
        source: ``"context"`` (prompt lookup), ``"history"`` (the suffix automaton) or
            ``"grammar"`` (only tokens a grammar forces,
            :func:`selfspec.decoding.ngram.constrained.constrain`).
        forced: the last ``forced`` tokens are not copied but forced by the generation's
            grammar (0 without one).
    """

    tokens: list[int]
    shares: list[float]
    match_len: int
    source: str
    forced: int = 0

    @property
    def copied(self) -> int:
        """Tokens copied from earlier text (the rest are forced by a grammar)."""
        return len(self.tokens) - self.forced


class ContextIndex:
    """Prompt lookup over one growing sequence (the current prompt and its generation).

    Keeps, for each ``n`` in ``[1, max_ngram]``, a map from each n-gram of the sequence to its
    followers: ``{token: (count, last position)}``. :meth:`extend` adds tokens as they are
    committed (``max_ngram`` dict updates per token), :meth:`truncate` is not needed: only
    committed tokens are indexed.

    Args:
        max_ngram: longest n-gram matched (>= 1).
        min_ngram: shortest n-gram that may start a draft (1 <= min_ngram <= max_ngram).

    Raises:
        InvalidArgumentError: bounds out of range.
    """

    source = "context"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2) -> None:
        check_int("max_ngram", max_ngram, low=1)
        check_int("min_ngram", min_ngram, low=1)
        if min_ngram > max_ngram:
            raise InvalidArgumentError(
                f"min_ngram ({min_ngram}) must not exceed max_ngram ({max_ngram})")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.tokens: list[int] = []
        # _follow[n - 1][ngram] = {next token: [count, last position of next token]}
        self._follow: list[dict[tuple[int, ...], dict[int, list[int]]]] = [
            {} for _ in range(max_ngram)]

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append ``tokens`` to the indexed sequence."""
        seq = self.tokens
        for token in tokens:
            pos = len(seq)
            for n in range(1, min(self.max_ngram, pos) + 1):
                followers = self._follow[n - 1].setdefault(tuple(seq[pos - n:pos]), {})
                entry = followers.get(token)
                if entry is None:
                    followers[token] = [1, pos]
                else:
                    entry[0] += 1
                    entry[1] = pos
            seq.append(token)

    def next_token(self, tail: list[int], min_n: int) -> tuple[int, float, int] | None:
        """The most frequent follower of the longest suffix of ``tail`` (>= ``min_n``
        tokens) seen in the sequence: ``(token, share, n)``, or ``None``."""
        for n in range(min(self.max_ngram, len(tail)), min_n - 1, -1):
            followers = self._follow[n - 1].get(tuple(tail[len(tail) - n:]))
            if followers:
                token, (count, _) = max(followers.items(), key=lambda kv: (kv[1][0], kv[1][1]))
                return token, count / sum(c for c, _ in followers.values()), n
        return None

    def propose(self, max_len: int, min_share: float = 0.0) -> NgramProposal | None:
        """Draft up to ``max_len`` tokens after the sequence by repeated lookup (each draft
        token extends the suffix matched for the next one; later tokens may match n-grams
        as short as 1). Stops at a token whose share is below ``min_share``.

        Returns:
            The proposal, or ``None`` when no suffix of >= ``min_ngram`` tokens occurred
            before.
        """
        tail = self.tokens[-self.max_ngram:]
        first = self.next_token(tail, self.min_ngram)
        if first is None or max_len < 1:
            return None
        return self._continue(first, max_len, min_share)

    def _continue(self, first: tuple[int, float, int], max_len: int,
                  min_share: float) -> NgramProposal:
        """The proposal starting with ``first = (token, share, n)``, extended by repeated
        lookup up to ``max_len`` tokens (see :meth:`propose`)."""
        tail = self.tokens[-self.max_ngram:]
        tokens, shares = [first[0]], [first[1]]
        while len(tokens) < max_len:
            nxt = self.next_token((tail + tokens)[-self.max_ngram:], 1)
            if nxt is None or nxt[1] < min_share:
                break
            tokens.append(nxt[0])
            shares.append(nxt[1])
        return NgramProposal(tokens, shares, first[2], self.source)

    def followers(self, tail: list[int], min_n: int) -> list[tuple[int, float, int]]:
        """Every token that followed a suffix of ``tail`` of ``>= min_n`` tokens in the
        sequence, once each: ``(token, share, n)`` with ``n`` the longest suffix it followed,
        longest ``n`` first, then by count and recency (``[0]`` is :meth:`next_token`'s)."""
        out: list[tuple[int, float, int]] = []
        seen: set[int] = set()
        for n in range(min(self.max_ngram, len(tail)), min_n - 1, -1):
            followers = self._follow[n - 1].get(tuple(tail[len(tail) - n:]))
            if not followers:
                continue
            total = sum(c for c, _ in followers.values())
            for token, (count, _) in sorted(followers.items(),
                                            key=lambda kv: (kv[1][0], kv[1][1]), reverse=True):
                if token not in seen:
                    seen.add(token)
                    out.append((token, count / total, n))
        return out

    def branches(self, max_len: int, max_branches: int,
                 min_share: float = 0.0) -> list[NgramProposal]:
        """Up to ``max_branches`` proposals after the sequence with distinct first tokens:
        each follower of :meth:`followers` (the first is :meth:`propose`'s), continued as
        :meth:`propose` continues (the candidates of a token tree,
        :mod:`selfspec.decoding.ngram.tree`)."""
        if max_len < 1 or max_branches < 1:
            return []
        tail = self.tokens[-self.max_ngram:]
        firsts = self.followers(tail, self.min_ngram)[:max_branches]
        return [self._continue(first, max_len, min_share) for first in firsts]


@dataclass
class _States:
    """The automaton's states as parallel lists (index 0 is the root)."""

    length: list[int] = field(default_factory=lambda: [0])
    link: list[int] = field(default_factory=lambda: [-1])
    next: list[dict[int, int]] = field(default_factory=lambda: [{}])
    ends: list[int] = field(default_factory=lambda: [0])  # texts' prefixes ending here


class SuffixAutomaton:
    """A generalized suffix automaton over a collection of token sequences ("texts").

    Every substring of every text is a path from the root; each state is a class of substrings
    with the same end positions. ``occurrences(state)`` (how many times its substrings occur,
    over all texts) gives each continuation's frequency share. Built online, amortised O(1)
    states per token (Blumer et al. 1985); the counts are recomputed lazily after texts are
    added (one pass over the states).

    Capacity is bounded: when the stored tokens exceed ``max_tokens`` the oldest texts are
    dropped and the automaton is rebuilt from the rest.

    Args:
        max_tokens: most tokens kept (>= 1).

    Raises:
        InvalidArgumentError: ``max_tokens`` < 1.
    """

    source = "history"

    def __init__(self, max_tokens: int = 1 << 18) -> None:
        check_int("max_tokens", max_tokens, low=1)
        self.max_tokens = max_tokens
        self.texts: list[list[int]] = []
        self.num_tokens = 0
        self._s = _States()
        self._occ: list[int] | None = None
        self.version = 0  # bumped when texts change (matchers restart)

    def __len__(self) -> int:
        return self.num_tokens

    def clear(self) -> None:
        """Forget every text."""
        self.texts, self.num_tokens = [], 0
        self._s, self._occ = _States(), None
        self.version += 1

    def add(self, tokens: list[int]) -> None:
        """Add one text (a finished request's prompt and output)."""
        tokens = list(tokens)[-self.max_tokens:]
        if not tokens:
            return
        if self.num_tokens + len(tokens) > self.max_tokens:
            keep: list[list[int]] = []
            total = len(tokens)
            for text in reversed(self.texts):
                if total + len(text) > self.max_tokens:
                    break
                keep.append(text)
                total += len(text)
            self.clear()
            for text in reversed(keep):
                self._insert(text)
        self._insert(tokens)

    def _insert(self, tokens: list[int]) -> None:
        last = 0
        for token in tokens:
            last = self._extend(last, token)
            self._s.ends[last] += 1
        self.texts.append(tokens)
        self.num_tokens += len(tokens)
        self._occ = None
        self.version += 1  # a split state may now hold a running match: matchers start again

    def _new_state(self, length: int, link: int, nxt: dict[int, int]) -> int:
        s = self._s
        s.length.append(length)
        s.link.append(link)
        s.next.append(nxt)
        s.ends.append(0)
        return len(s.length) - 1

    def _clone(self, p: int, q: int, token: int) -> int:
        """Split state ``q`` so that ``p --token-->`` leads to a state of length
        ``length[p] + 1``."""
        s = self._s
        clone = self._new_state(s.length[p] + 1, s.link[q], dict(s.next[q]))
        while p != -1 and s.next[p].get(token) == q:
            s.next[p][token] = clone
            p = s.link[p]
        s.link[q] = clone
        return clone

    def _extend(self, last: int, token: int) -> int:
        s = self._s
        q = s.next[last].get(token)
        if q is not None:  # the extended prefix already exists (another text had it)
            return q if s.length[q] == s.length[last] + 1 else self._clone(last, q, token)
        cur = self._new_state(s.length[last] + 1, 0, {})
        p = last
        while p != -1 and token not in s.next[p]:
            s.next[p][token] = cur
            p = s.link[p]
        if p != -1:
            q = s.next[p][token]
            s.link[cur] = q if s.length[p] + 1 == s.length[q] else self._clone(p, q, token)
        return cur

    def _occurrences(self) -> list[int]:
        if self._occ is None:
            s = self._s
            occ = list(s.ends)
            for state in sorted(range(1, len(occ)), key=s.length.__getitem__, reverse=True):
                occ[s.link[state]] += occ[state]
            self._occ = occ
        return self._occ

    def step(self, state: int, length: int, token: int) -> tuple[int, int]:
        """Advance a match ``(state, length)`` by ``token``: the longest suffix of the
        matched text + ``token`` that occurs in the texts (``(0, 0)``: none)."""
        s = self._s
        while state and token not in s.next[state]:
            state = s.link[state]
            length = s.length[state]
        nxt = s.next[state].get(token)
        return (nxt, length + 1) if nxt is not None else (0, 0)

    def match(self, tokens: list[int]) -> tuple[int, int]:
        """``(state, length)`` of the longest suffix of ``tokens`` that occurs in the texts."""
        state, length = 0, 0
        for token in tokens:
            state, length = self.step(state, length, token)
        return state, length

    def propose(self, state: int, length: int, max_len: int,
                min_share: float = 0.0) -> NgramProposal | None:
        """Draft up to ``max_len`` tokens continuing the match ``(state, length)``: each the
        most frequent continuation of the text matched so far; stops at a share below
        ``min_share`` or where the texts end.

        Returns:
            The proposal, or ``None`` for an empty match or no continuation.
        """
        if length == 0 or max_len < 1:
            return None
        return self._follow(state, length, [], [], max_len, min_share)

    def _follow(self, state: int, length: int, tokens: list[int], shares: list[float],
                max_len: int, min_share: float) -> NgramProposal | None:
        """``tokens`` (already drafted, ending at ``state``) extended as :meth:`propose`
        extends a match."""
        s, occ = self._s, self._occurrences()
        while len(tokens) < max_len and s.next[state] and occ[state]:
            token, child = max(s.next[state].items(), key=lambda kv: occ[kv[1]])
            share = occ[child] / occ[state]
            if tokens and share < min_share:
                break
            tokens.append(token)
            shares.append(share)
            state = child
        return NgramProposal(tokens, shares, length, self.source) if tokens else None

    def branches(self, state: int, length: int, max_len: int, max_branches: int,
                 min_share: float = 0.0) -> list[NgramProposal]:
        """Up to ``max_branches`` proposals continuing the match ``(state, length)`` with
        distinct first tokens: its continuations by frequency (the first is
        :meth:`propose`'s), each extended as :meth:`propose` extends it."""
        if length == 0 or max_len < 1 or max_branches < 1:
            return []
        s, occ = self._s, self._occurrences()
        if not occ[state]:
            return []
        children = sorted(s.next[state].items(), key=lambda kv: occ[kv[1]],
                          reverse=True)[:max_branches]
        out = []
        for token, child in children:
            share = occ[child] / occ[state]
            out.append(self._follow(child, length, [token], [share], max_len, min_share))
        return [p for p in out if p is not None]


class HistoryMatcher:
    """Follows one generation's context in a :class:`SuffixAutomaton` (the longest suffix of
    the context that occurs in the texts), one committed token at a time.

    Args:
        automaton: the engine's automaton of earlier texts.
    """

    def __init__(self, automaton: SuffixAutomaton) -> None:
        self.automaton = automaton
        self._version = -1
        self._seen = 0
        self._state = self._length = 0

    def sync(self, tokens: list[int]) -> None:
        """Catch up with the committed ``tokens`` (a prefix of the last call's is assumed
        unless the automaton was rebuilt)."""
        sam = self.automaton
        if self._version != sam.version or self._seen > len(tokens):
            self._version, self._seen, self._state, self._length = sam.version, 0, 0, 0
        for token in tokens[self._seen:]:
            self._state, self._length = sam.step(self._state, self._length, token)
        self._seen = len(tokens)

    def propose(self, max_len: int, min_len: int,
                min_share: float = 0.0) -> NgramProposal | None:
        """The automaton's proposal for a match of at least ``min_len`` tokens."""
        if self._length < min_len:
            return None
        return self.automaton.propose(self._state, self._length, max_len, min_share)

    def branches(self, max_len: int, min_len: int, max_branches: int,
                 min_share: float = 0.0) -> list[NgramProposal]:
        """The automaton's branches (:meth:`SuffixAutomaton.branches`) for a match of at
        least ``min_len`` tokens."""
        if self._length < min_len:
            return []
        return self.automaton.branches(self._state, self._length, max_len, max_branches,
                                       min_share)
