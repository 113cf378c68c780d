"""The full model's residual stream on recently committed tokens, read without touching the
KV cache: what the in-context layer-selection methods score drafts against (KnapSpec §3.4
"recent history X", CLaSp's hidden states of the last verification, DEL's shadow tokens).

A :class:`History` is one read-only forward of the last ``r`` committed positions through
every layer (``score_layers``: each position attends to the cache prefix and to the
earlier history positions), recording the residual stream after every sub-layer.
:class:`CommittedWindow` remembers how many tokens the last few steps committed, so a Step
can ask for "the tokens of the last m verification steps".
:class:`ResidualRecorder` keeps the residual stream the Step's own full forwards (plain
decoding steps, verification) computed anyway, so a re-optimisation can take its history
from them instead of paying the read-only pass (CLaSp uses "hidden states from previous
verification stages" this way, KnapSpec §2).
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass, field

import torch

from selfspec.decoding.core.state import DecodeState
from selfspec.executor import LayerExecutor
from selfspec.executor.executor import Observer, SkipPlan

MAX_SHORTLIST = 64  # most top tokens per position History.shortlist offers


@dataclass
class History:
    """The full model on ``r`` committed positions.

    Attributes:
        tokens: ``[1, r]`` their token ids.
        positions: ``[1, r]`` their positions.
        states: ``2L + 1`` tensors ``[r, d]``: ``states[0]`` the embeddings, ``states[2l+1]``
            the residual stream after layer ``l``'s attention, ``states[2l+2]`` after its MLP
            (KnapSpec's ``X[0..2L]``; layer boundaries are ``states[0::2]``).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    states: list[torch.Tensor]
    _labels: torch.Tensor | None = field(default=None, repr=False)
    _top: torch.Tensor | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return self.tokens.shape[1]

    def layer_states(self) -> list[torch.Tensor]:
        """``L + 1`` tensors ``[r, d]``: the embeddings and the output of every layer."""
        return self.states[0::2]

    def run(self, executor: LayerExecutor, state: DecodeState, hidden: torch.Tensor,
            start: int, end: int, plan: SkipPlan | None = None) -> torch.Tensor:
        """Layers ``[start, end)`` (sub-layers per ``plan``) on ``B`` candidate states of the
        history positions at once, read-only: ``hidden`` ``[B, r, d]`` -> ``[B, r, d]``."""
        positions = self.positions.expand(hidden.shape[0], len(self))
        return executor.score_layers_free(hidden, positions, start, end, state.cache, plan)

    def labels(self, executor: LayerExecutor) -> torch.Tensor:
        """``[r]`` the full model's own greedy next token at each position (KnapSpec eq. 9's
        ``y``: the committed token after a generated position, the model's prediction inside
        the prompt), computed once."""
        if self._labels is None:
            logits = executor.logits(self.states[-1].unsqueeze(0))[0]             # [r, V]
            self._top = logits.topk(min(MAX_SHORTLIST, logits.shape[-1]), dim=-1).indices
            self._labels = self._top[:, 0]
        return self._labels

    def shortlist(self, executor: LayerExecutor, k: int) -> torch.Tensor:
        """``[R]`` sorted vocabulary ids: the union over the positions of the full model's
        ``k`` most likely next tokens (``k <= MAX_SHORTLIST``; the labels included)."""
        self.labels(executor)
        return torch.unique(self._top[:, :k])


@torch.inference_mode()
def read_history(executor: LayerExecutor, state: DecodeState, num_tokens: int) -> History | None:
    """Run the full model read-only over the last ``num_tokens`` positions whose KV is in
    every layer (all committed tokens but the last), recording every sub-layer's output.

    Args:
        executor: the model's executor.
        state: the generation (its cache is read, never written).
        num_tokens: ``r``; clipped to the positions available.

    Returns:
        The :class:`History`, or ``None`` when fewer than one position is available.
    """
    available = state.seq_len - 1  # the last token's KV is written by the next step
    r = min(num_tokens, available)
    if r < 1:
        return None
    start = available - r
    tokens = torch.tensor([state.tokens[start:available]], device=executor.device)   # [1, r]
    positions = state.positions(start, r)
    hidden = executor.embed(tokens)
    states = [hidden[0]]

    def record(layer_idx: int, sublayer: str, out: torch.Tensor) -> None:
        states.append(out[0])

    executor.score_layers(hidden, positions, 0, executor.num_layers, state.cache,
                          observe=record)
    return History(tokens, positions, states)


class CommittedWindow:
    """Tokens committed by each of the last ``steps`` Step calls.

    Args:
        steps: m, the window length in steps.
    """

    def __init__(self, steps: int) -> None:
        self._committed: deque[int] = deque(maxlen=steps)

    def clear(self) -> None:
        """Forget every step (a new generation)."""
        self._committed.clear()

    def add(self, committed: int) -> None:
        """Record one step's committed token count."""
        self._committed.append(committed)

    def tokens(self, minimum: int = 1) -> int:
        """Tokens the window's steps committed, at least ``minimum`` (early on the history
        reaches back into the prompt)."""
        return max(sum(self._committed), minimum)


@dataclass
class _Forward:
    """One recorded full forward: ``tokens`` fed at positions ``pos0 ..``, and the residual
    stream after each of its ``2L`` sub-layers (``[T, d]`` each, attention then MLP)."""

    pos0: int
    tokens: list[int]
    states: list[torch.Tensor] = field(default_factory=list)


class ResidualRecorder:
    """The residual stream of the full model's own forwards during generation, for the
    positions they computed, so that :meth:`history` costs no forward.

    A Step passes :meth:`observer` to the full forwards it makes anyway (a plain decoding
    step's one token, a verification's last committed token and draft). A position's states
    are those of the newest forward that computed it: positions a verification rejected are
    overwritten by the next forward, which starts there, before they can be committed. The
    states equal :func:`read_history`'s up to the matrix kernels' rounding (one-token and
    verification blocks against the read-only pass's block).

    Memory: references to the forwards' own residual tensors (no copies), for every forward
    that reaches into the last ``capacity`` positions: ``capacity`` one-token steps, or, with
    drafts of ``D`` tokens, up to ``capacity × (D + 1)`` positions' worth when every draft is
    rejected (``2L × d`` values each).

    Args:
        capacity: positions before the newest forward's first to keep (with it): at least
            the longest history a re-optimisation asks for.
    """

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self._forwards: deque[_Forward] = deque()
        self._owner: weakref.ref[DecodeState] | None = None

    def clear(self) -> None:
        """Forget everything."""
        self._forwards.clear()
        self._owner = None

    def attach(self, state: DecodeState) -> None:
        """Record for the generation ``state``: a new one forgets what another recorded; the
        same one keeps it (a Step attaches at its prefill and again at ``start``)."""
        if self._owner is None or self._owner() is not state:
            self.clear()
            self._owner = weakref.ref(state)

    @classmethod
    def for_window(cls, min_history: int, history_steps: int,
                   max_draft_len: int) -> ResidualRecorder:
        """A recorder reaching back as far as a re-planning Step's longest history: the
        tokens of ``history_steps`` steps of up to ``max_draft_len + 1`` tokens, at least
        ``min_history``."""
        return cls(max(min_history, history_steps * (max_draft_len + 1)))

    def prefill_observer(self, state: DecodeState) -> Observer:
        """Attach to ``state`` and record its prompt as the prefill computes it (a Step's
        ``prefill_observer``: the prompt's end is the first re-optimisation's history).

        The prefill runs in chunks of positions
        (:meth:`~selfspec.executor.LayerExecutor.prefill`), each a forward of its own: a
        chunk's first sub-layer call (layer 0's attention) starts its :meth:`observer`."""
        self.attach(state)
        tokens = state.tokens
        seen = 0  # prompt positions of the chunks begun so far
        chunk: Observer | None = None

        def record(layer_idx: int, sublayer: str, hidden: torch.Tensor) -> None:
            nonlocal seen, chunk
            if chunk is None or (layer_idx == 0 and sublayer == "attention"):
                count = hidden.shape[1]
                chunk = self.observer(tokens[seen:seen + count], seen)
                seen += count
            chunk(layer_idx, sublayer, hidden)
        return record

    def observer(self, tokens: list[int], pos0: int) -> Observer:
        """The ``observe`` callback for one full forward of ``tokens`` from ``pos0``
        (:meth:`~selfspec.executor.LayerExecutor.run_layers`); it keeps references, no copies
        (the executor never writes a residual stream in place), except for a forward longer
        than the recorder reaches (a prefill): its last ``capacity + 1`` positions are copied
        and the rest is not kept."""
        keep = self.capacity + 1
        skip = max(0, len(tokens) - keep)
        entry = _Forward(pos0 + skip, list(tokens[skip:]))
        while self._forwards and self._forwards[-1].pos0 >= pos0:
            self._forwards.pop()  # rewound past it: all its positions are recomputed
        while self._forwards and (self._forwards[0].pos0 + len(self._forwards[0].tokens)
                                  <= pos0 - self.capacity):
            self._forwards.popleft()  # out of reach
        self._forwards.append(entry)

        def record(layer_idx: int, sublayer: str, hidden: torch.Tensor) -> None:
            entry.states.append(hidden[0, skip:].clone() if skip else hidden[0])
        return record

    def _sources(self, state: DecodeState, num_layers: int) -> list[tuple[_Forward, int]]:
        """For the positions just below ``state.seq_len - 1`` (newest first), the forward
        and offset whose states are valid there, stopping at the first position no complete
        forward of the committed token covers."""
        available = state.seq_len - 1
        found: dict[int, tuple[_Forward, int]] = {}
        for entry in reversed(self._forwards):  # newest wins
            if len(entry.states) != 2 * num_layers:
                continue  # an interrupted forward
            for k, token in enumerate(entry.tokens):
                pos = entry.pos0 + k
                if pos < available and pos not in found:
                    found[pos] = (entry, k) if state.tokens[pos] == token else None
        sources = []
        for pos in range(available - 1, -1, -1):
            source = found.get(pos)
            if source is None:
                break
            sources.append(source)
        return sources

    def covered(self, state: DecodeState, num_layers: int) -> int:
        """How many of the last committed positions (those whose KV is in every layer) the
        recorded states cover, contiguously back from the newest."""
        return len(self._sources(state, num_layers))

    def history(self, executor: LayerExecutor, state: DecodeState,
                num_tokens: int) -> History | None:
        """The :class:`History` of the last ``num_tokens`` positions whose KV is in every
        layer, from recorded states (the embeddings are looked up); ``None`` when the
        recorded states do not cover them all (then :func:`read_history` does)."""
        sources = self._sources(state, executor.num_layers)
        r = min(num_tokens, state.seq_len - 1)
        if r < 1 or len(sources) < r:
            return None
        sources = sources[:r][::-1]  # oldest first
        # Runs of consecutive offsets in one forward become one slice.
        runs: list[tuple[_Forward, int, int]] = []
        for entry, k in sources:
            if runs and runs[-1][0] is entry and runs[-1][2] == k:
                runs[-1] = (entry, runs[-1][1], k + 1)
            else:
                runs.append((entry, k, k + 1))
        start = state.seq_len - 1 - r
        tokens = torch.tensor([state.tokens[start:start + r]], device=executor.device)
        states = [executor.embed(tokens)[0]]
        for i in range(2 * executor.num_layers):
            parts = [entry.states[i][a:b] for entry, a, b in runs]
            states.append(parts[0] if len(parts) == 1 else torch.cat(parts))
        return History(tokens, state.positions(start, r), states)
