"""Reduced draft vocabulary: draft heads score only the most frequent tokens.

For a small model the output projection is the largest matrix a draft token reads: in
SmolLM2-135M the ``[49152, 576]`` ``lm_head`` weighs as much as 8 of its 30 decoder layers,
so an exit at layer 24 pays 24 layers plus 8 layers' worth of projection, and DSSD pays it
once per head it tries. FR-Spec (Zhao et al. 2025, "FR-Spec: Accelerating Large-Vocabulary
Language Models via Frequency-Ranked Speculative Sampling", §3) restricts the draft's
projection to the tokens that are generated most often; verification still scores the full
vocabulary, so greedy decoding stays lossless and speculative sampling stays exact (the draft
distribution is simply zero outside the kept rows). A token outside the kept rows can only
be produced by verification (as the bonus or corrected token), never drafted.

The ranking comes from the head file's ``token_counts``: the final layer's greedy tokens
counted on the heads' training text (the model's own output distribution, which is what a
draft has to predict). EOS ids are always kept, so a draft can end a generation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property

import torch

from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor


@dataclass(frozen=True)
class DraftVocab:
    """The kept vocabulary rows.

    Attributes:
        rows: ``[R]`` int64 token ids, ascending.
        vocab_size: ``V`` of the model.
    """

    rows: torch.Tensor
    vocab_size: int

    @property
    def size(self) -> int:
        return int(self.rows.numel())

    @cached_property
    def key(self) -> bytes:
        """The rows as bytes: identifies the vocabulary in caches."""
        return self.rows.cpu().numpy().tobytes()

    def expand(self, probs: torch.Tensor) -> torch.Tensor:
        """``[R]`` probabilities over the kept rows → ``[V]`` (zero elsewhere)."""
        full = probs.new_zeros(self.vocab_size)
        return full.index_copy_(0, self.rows, probs)


def check_draft_vocab(size: object, vocab_size: int) -> int:
    """Validate a ``draft_vocab`` size.

    Raises:
        InvalidArgumentError: not an integer in ``[1, V]``.
    """
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= vocab_size:
        raise InvalidArgumentError(
            f"draft_vocab must be an integer in [1, {vocab_size}] (the number of most frequent "
            f"tokens draft heads score; e.g. {min(8192, vocab_size)}), got {size!r}")
    return size


def frequent_rows(counts: torch.Tensor, size: int, always: Iterable[int] = ()) -> DraftVocab:
    """The ``size`` most frequent tokens by ``counts`` ``[V]`` (ties: lower id first), plus
    ``always`` (EOS ids), as a :class:`DraftVocab`.

    Raises:
        InvalidArgumentError: ``size`` outside ``[1, V]``.
    """
    vocab_size = int(counts.numel())
    size = check_draft_vocab(size, vocab_size)
    # A stable sort on the negated counts keeps lower ids first among equal counts.
    order = torch.sort(-counts.to(torch.int64), stable=True).indices[:size]
    keep = torch.cat([order, torch.tensor(sorted(set(always)), dtype=torch.int64,
                                          device=order.device)])
    rows = torch.unique(keep[(keep >= 0) & (keep < vocab_size)])  # sorted ascending
    return DraftVocab(rows.to(counts.device), vocab_size)


def restricted_lm_head(executor: LayerExecutor, vocab: DraftVocab
                       ) -> Callable[[torch.Tensor], torch.Tensor]:
    """The model's final norm + ``lm_head`` on ``vocab.rows`` only: ``[B, T, H]`` → ``[B, T, R]``
    (rows copied once and packed)."""
    from selfspec.executor.linear import Linear

    project = Linear.of_rows(executor.lm_head.weight, executor.lm_head.bias, vocab.rows)
    return lambda hidden: project(executor.final_norm(hidden))


def restricted_head(executor: LayerExecutor, head: object | None, vocab: DraftVocab
                    ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``head`` (an exit head with ``restricted``, or ``None`` = the model's own output) on
    ``vocab.rows`` only: ``[B, T, H]`` → ``[B, T, R]``. Builds a copy of the kept rows: callers
    that decode repeatedly keep the result (``selfspec.methods.base.MethodContext``).

    Raises:
        InvalidArgumentError: ``head`` cannot score a subset of the vocabulary.
    """
    if head is None:
        return restricted_lm_head(executor, vocab)
    if not hasattr(head, "restricted"):
        raise InvalidArgumentError(
            f"draft_vocab needs an exit head that can score a subset of the vocabulary; "
            f"{type(head).__name__} cannot")
    return head.restricted(vocab.rows)
