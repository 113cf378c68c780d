"""A draft vocabulary that needs no trained head: tokens ranked by their frequency in an
offline corpus (FR-Spec, Zhao et al. 2025, §3: the draft scores the most frequent tokens of
a corpus; verification scores the full vocabulary, so decoding stays lossless and sampling
exact, the draft distribution being zero outside the kept rows).

The counts are the model's tokenizer over :mod:`selfspec.data.vocab_corpus` (Python library
files no benchmark set takes prompts from), made once per tokenizer and corpus and kept in
``$SELFSPEC_HOME/draft_vocab/`` with what the corpus held (:class:`CorpusCounts`). EOS ids are
always kept, so a draft can end a generation.

Also here: the restricted output head a drafter projects through (:class:`DraftHead`, on the
model's own weights or on a draft view's quantized copy) and ``lm_head``'s share of a
token's weight bytes (:func:`head_share`), which decides where a reduced head pays.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from selfspec.data.vocab_corpus import VOCAB_CORPUS_BYTES, CorpusInfo, corpus_files, corpus_pieces
from selfspec.decoding.drafting.draft_vocab import DraftVocab, frequent_rows
from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.executor.cost_model import decode_weight_bytes, output_decode_bytes

logger = logging.getLogger(__name__)

#: Rows of the corpus-ranked draft head where a method reduces it by default (``auto`` on a
#: model whose ``lm_head`` is a large share of its bytes): 1/16 of Gemma 3's 262,144 tokens,
#: FR-Spec's size for Llama-3's 128k vocabulary (§4, 16k-32k).
DEFAULT_DRAFT_VOCAB = 16384
FORMAT = 1  # bump when the counts change meaning: older files are counted again
_PIECES_PER_CALL = 64


@dataclass(frozen=True)
class CorpusCounts:
    """Token counts of one tokenizer over one corpus.

    Attributes:
        counts: ``[V]`` int64 occurrences of each token id.
        tokenizer: :func:`tokenizer_fingerprint` of the tokenizer that counted.
        corpus: what the corpus held.
        tokens: tokens counted in all.
    """

    counts: torch.Tensor
    tokenizer: str
    corpus: CorpusInfo
    tokens: int

    def describe(self) -> str:
        """One line: how many tokens of which corpus, how many distinct ids seen."""
        seen = int((self.counts > 0).sum())
        return (f"{self.tokens:,} tokens ({seen:,} distinct ids) of {self.corpus.describe()}")


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of what decides a tokenizer's ids: a fast tokenizer's whole serialized
    definition (vocabulary, merges, normalizer, pre-tokenizer), else its class and sorted
    vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = (backend.to_str() if backend is not None else type(tokenizer).__name__
            + json.dumps(sorted(tokenizer.get_vocab().items())))
    return hashlib.sha256(text.encode()).hexdigest()


def count_tokens(tokenizer: Any, pieces, vocab_size: int) -> tuple[torch.Tensor, int]:
    """``([V] int64 counts, tokens)`` of ``tokenizer`` over the text ``pieces`` (no special
    tokens added; ids outside ``[0, V)`` are dropped)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    total = 0
    batch: list[str] = []

    def flush() -> None:
        nonlocal total
        if not batch:
            return
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            t = torch.tensor(ids, dtype=torch.int64)
            t = t[(t >= 0) & (t < vocab_size)]
            counts.add_(torch.bincount(t, minlength=vocab_size))
            total += int(t.numel())
        batch.clear()

    for piece in pieces:
        batch.append(piece)
        if len(batch) >= _PIECES_PER_CALL:
            flush()
    flush()
    return counts, total


def counts_path(home: Path, fingerprint: str, info: CorpusInfo, vocab_size: int) -> Path:
    """Where :func:`corpus_counts` keeps the counts of one tokenizer over one corpus."""
    return (home / "draft_vocab"
            / f"corpus-{vocab_size}-{fingerprint[:16]}-{info.digest[:12]}.json")


def corpus_counts(tokenizer: Any, vocab_size: int, home: Path,
                  max_bytes: int | None = None) -> CorpusCounts:
    """The counts of ``tokenizer`` over the default corpus (``max_bytes`` of it, default
    :data:`~selfspec.data.vocab_corpus.VOCAB_CORPUS_BYTES`), counted once and kept under
    ``home`` (a corrupt file is counted again).

    Raises:
        InvalidArgumentError: no tokenizer.
    """
    if tokenizer is None:
        raise InvalidArgumentError(
            "a corpus-ranked draft_vocab needs the model's tokenizer (load the model with "
            "selfspec.load or from_pretrained_model); or rank by trained heads' token "
            "counts with heads=PATH")
    fingerprint = tokenizer_fingerprint(tokenizer)
    root, info = corpus_files(VOCAB_CORPUS_BYTES if max_bytes is None else max_bytes)
    path = counts_path(home, fingerprint, info, vocab_size)
    try:
        return _read(path)
    except (OSError, ValueError, KeyError, TypeError) as err:
        if path.exists():
            logger.warning("counting the draft vocabulary again: %s is unreadable (%s)",
                           path, err)
    counts, total = count_tokens(tokenizer, corpus_pieces(root, info), vocab_size)
    result = CorpusCounts(counts, fingerprint, info, total)
    logger.info("draft vocabulary: counted %s", result.describe())
    _write(path, result)
    return result


def _write(path: Path, result: CorpusCounts) -> None:
    nonzero = torch.nonzero(result.counts).flatten()
    data = {"format": FORMAT, "tokenizer": result.tokenizer, "corpus": asdict(result.corpus),
            "tokens": result.tokens, "vocab_size": int(result.counts.numel()),
            "counts": [[int(i), int(result.counts[i])] for i in nonzero]}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def _read(path: Path) -> CorpusCounts:
    """Raises: OSError, ValueError, KeyError, TypeError: missing, corrupt or another format."""
    data = json.loads(path.read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"not a format-{FORMAT} counts file")
    counts = torch.zeros(int(data["vocab_size"]), dtype=torch.int64)
    pairs = torch.tensor(data["counts"], dtype=torch.int64).reshape(-1, 2)
    counts[pairs[:, 0]] = pairs[:, 1]
    corpus = data["corpus"]
    info = CorpusInfo(**{**corpus, "files": tuple(corpus["files"])})
    return CorpusCounts(counts, data["tokenizer"], info, int(data["tokens"]))


def corpus_vocab(counts: CorpusCounts, size: int, eos_ids=()) -> DraftVocab:
    """The ``size`` most frequent tokens of ``counts`` (ties: lower id first), plus
    ``eos_ids``.

    Raises:
        InvalidArgumentError: ``size`` outside ``[1, V]``.
    """
    return frequent_rows(counts.counts, size, eos_ids)


class DraftHead:
    """The final norm and ``lm_head`` on a draft vocabulary's rows only, on the executor a
    drafter drafts on: ``[B, T, H]`` → ``[B, T, R]`` logits (scaled as the model scales its
    own: Granite's divisor, Gemma's soft cap).

    On the model's own weights the rows are a packed copy on the model's decoding kernel; on a
    :meth:`~LayerExecutor.draft_view` they are quantized in the view's format, as the view's
    full ``lm_head`` is (a row's quantization does not depend on the other rows).

    Args:
        executor: the model's executor or a draft view of it.
        vocab: the rows kept.
    """

    def __init__(self, executor: LayerExecutor, vocab: DraftVocab) -> None:
        from selfspec.executor.linear import Linear
        from selfspec.executor.quant import quantize_linear

        weight, bias = executor.lm_head.weight.detach(), executor.lm_head.bias
        rows = vocab.rows.to(weight.device)
        fmt = executor.draft_weights
        self.executor = executor
        self.vocab = vocab
        if fmt is None:
            self.matrix = Linear.of_rows(weight, bias, rows,
                                         kernel=getattr(executor.output_weights, "rows", None))
        else:
            self.matrix = quantize_linear(weight[rows].contiguous(),
                                          None if bias is None else bias.detach()[rows], fmt)

    @property
    def decode_bytes(self) -> int:
        """Bytes of weight one decoding call of this head reads."""
        return self.matrix.decode_bytes

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        ex = self.executor
        # the model's own logit scaling (a private step of the executor's project())
        return ex._scaled_logits(self.matrix(ex.final_norm(hidden)))


def head_share(executor: LayerExecutor) -> float:
    """``lm_head``'s share of the weight bytes one decoding token reads (Gemma 3 270M: 0.63;
    SmolLM2-135M: 0.2)."""
    return output_decode_bytes(executor) / max(decode_weight_bytes(executor), 1)


def reduced_draft_bytes(draft: LayerExecutor, head: DraftHead | None) -> int:
    """Weight bytes one draft token on ``draft`` reads: every layer and its full ``lm_head``,
    or with ``head`` that reduced head instead."""
    full = decode_weight_bytes(draft)
    return full if head is None else full - output_decode_bytes(draft) + head.decode_bytes
