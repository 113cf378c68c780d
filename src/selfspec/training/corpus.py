"""Training text for exit heads: teacher-forced references and on-policy generations.

A data spec names sources, comma-separated (``"humaneval,onpolicy:humaneval"``):

- ``NAME`` (a :data:`selfspec.data.DATASETS` name): teacher-forced real text, the prompt
  followed by the dataset's reference answer (HumanEval canonical solution, MT-Bench
  reference answer, GSM worked answer, ShareGPT reply). Prompts without a reference are
  skipped.
- ``onpolicy:NAME``: the model's own greedy response to NAME's prompts (AdaDecode
  Appendix D: "We generate on-policy data ... using greedy sampling"), made with
  ``SelfSpec.generate`` and cached on disk, so it is generated once per model and dtype.

Each :class:`CorpusItem` is one token sequence and the position from which its next-token
predictions are scored: every position for raw text (HumanEval code), the response only
for chat prompts (the chat template's system preamble repeats in every item and drafting
only ever happens inside a response).

Items are assigned to a split by a hash of their *problem* id, identical across sources, so
the teacher-forced and on-policy texts of one problem land in the same split and held-out
problems are never seen in training (split by problem, not by token).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from selfspec.errors import InvalidArgumentError
from selfspec.heads.card import PromptUse, prompt_uses
from selfspec.training.engine import Engine
from selfspec.training.onpolicy import DEFAULT_BATCH, generate_greedy_batch

logger = logging.getLogger(__name__)

ONPOLICY = "onpolicy:"
WEIGHT_SEP = "*"
TRAIN, CALIBRATION, TEST = 0, 1, 2
SPLIT_NAMES = ("train", "calibration", "test")
# 80% of problems train the heads, 10% calibrate thresholds, 10% test them (DSSD §3.1
# reserves a calibration subset D_cal; the test part checks that the calibrated precision
# carries over to unseen problems).
_SPLIT_PERCENT = (80, 10, 10)
_SAVE_EVERY = 8  # on-policy generations between checkpoints of the generation cache


@dataclass(frozen=True)
class CorpusItem:
    """One training sequence.

    Attributes:
        source: the data-spec entry it came from (``"humaneval"``, ``"onpolicy:mtbench"``).
        prompt_id: the dataset's problem id (the split key).
        token_ids: the whole sequence (prompt + reference or generated response).
        score_from: first position ``t`` whose prediction of ``token_ids[t+1]`` is used.
        split: :data:`TRAIN`, :data:`CALIBRATION` or :data:`TEST`.
    """

    source: str
    prompt_id: str
    token_ids: tuple[int, ...]
    score_from: int
    split: int

    @property
    def num_scored(self) -> int:
        """Positions scored: ``t`` in ``[score_from, len - 1)`` (each needs a next token)."""
        return max(0, len(self.token_ids) - 1 - self.score_from)


def source_weight(entry: str) -> tuple[str, int]:
    """A data-spec entry's source and share weight (``"onpolicy:stdlib*3"`` →
    ``("onpolicy:stdlib", 3)``; no ``*K`` → weight 1).

    Raises:
        InvalidArgumentError: ``K`` is not an integer >= 1.
    """
    source, sep, weight = entry.partition(WEIGHT_SEP)
    if not sep:
        return entry, 1
    try:
        k = int(weight)
    except ValueError:
        k = 0
    if k < 1:
        raise InvalidArgumentError(
            f"bad weight in data source {entry!r}: write SOURCE*K with K an integer >= 1 "
            f"(e.g. onpolicy:stdlib*3)")
    return source, k


def dataset_of(source: str) -> str:
    """The dataset a data-spec entry reads (``"onpolicy:stdlib*2"`` → ``"stdlib"``)."""
    source = source.partition(WEIGHT_SEP)[0]
    return source[len(ONPOLICY):] if source.startswith(ONPOLICY) else source


def items_by_use(items: list[CorpusItem], uses: dict[int, str]) -> list[PromptUse]:
    """The prompts of ``items`` grouped by use, where ``uses`` maps a split
    (:data:`TRAIN`, ...) to the use name recorded on the card (``{TRAIN: "probe-train"}``);
    splits not in ``uses`` are left out."""
    return prompt_uses((uses[i.split], dataset_of(i.source), i.prompt_id)
                       for i in items if i.split in uses)


def split_of(prompt_id: str) -> int:
    """Deterministic split of a problem: sha256 of its id → train / calibration / test."""
    bucket = int(hashlib.sha256(prompt_id.encode()).hexdigest()[:8], 16) % 100
    return TRAIN if bucket < _SPLIT_PERCENT[0] else (
        CALIBRATION if bucket < _SPLIT_PERCENT[0] + _SPLIT_PERCENT[1] else TEST)


def parse_data_spec(spec: str | list[str]) -> list[str]:
    """``"a,onpolicy:b*2"`` → ``["a", "onpolicy:b*2"]``, validated.

    Raises:
        InvalidArgumentError: empty spec, an unknown dataset name, a bad ``*K`` weight or a
            source named twice.
    """
    from selfspec.data import DATASETS

    names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    if not names:
        raise InvalidArgumentError("give at least one data source, e.g. --data humaneval")
    seen = set()
    for name in names:
        source, _ = source_weight(name)
        if dataset_of(name) not in DATASETS:
            raise InvalidArgumentError(
                f"unknown data source {name!r}; use a dataset ({', '.join(DATASETS)}) for "
                f"teacher-forced reference text or onpolicy:DATASET for the model's own "
                f"answers, optionally *K for K times the share (onpolicy:stdlib*3)")
        if source in seen:
            raise InvalidArgumentError(
                f"data source {source!r} is named twice; give it once with a weight "
                f"({source}*K) for a larger share")
        seen.add(source)
    return names


def load_dataset_prompts(name: str) -> list[Any]:
    """Every prompt of dataset ``name`` (``selfspec.data.Prompt`` objects)."""
    from selfspec.data import load_prompts

    return load_prompts(name)


def _ordered(prompts: list[Any], seed: int) -> list[Any]:
    """A seeded shuffle, so a token budget draws problems from the whole dataset."""
    prompts = list(prompts)
    random.Random(seed).shuffle(prompts)
    return prompts


def _eos_id(engine: Engine) -> int | None:
    ids = sorted(engine.eos_token_ids)
    return ids[0] if ids else None


def teacher_forced_item(engine: Engine, source: str, prompt: Any) -> CorpusItem | None:
    """Prompt + reference as one sequence (``None`` without a reference)."""
    if not prompt.reference:
        return None
    prompt_ids = engine.encode(prompt.text, chat=prompt.chat)
    ref_ids = engine.tokenizer(prompt.reference, add_special_tokens=False)["input_ids"]
    if prompt.chat and (eos := _eos_id(engine)) is not None:
        ref_ids = list(ref_ids) + [eos]  # the turn ends as the model would end it
    score_from = len(prompt_ids) - 1 if prompt.chat else 0
    return CorpusItem(source, prompt.id, tuple(prompt_ids) + tuple(ref_ids), score_from,
                      split_of(prompt.id))


@dataclass(frozen=True)
class Budget:
    """Scored tokens wanted from one source, per split (``[train, calibration, test]``)."""

    tokens: tuple[int, int, int]


def budget_for(train_tokens: int, eval_fraction: float = 0.25) -> Budget:
    """Train tokens, plus held-out calibration and test tokens of ``eval_fraction`` each
    relative to ``train_tokens`` (capped by what the held-out problems have)."""
    held = int(train_tokens * eval_fraction)
    return Budget((train_tokens, held, held))


def select_items(candidates: list[Any], budget: Budget,
                 make: Callable[[Any], CorpusItem | None], max_len: int) -> list[CorpusItem]:
    """Take items in order until every split's token budget is full.

    ``make`` is called only for prompts whose split still needs tokens (for on-policy data
    it generates text, the expensive part).
    """
    need = list(budget.tokens)
    out = []
    for prompt in candidates:
        if all(n <= 0 for n in need):
            break
        split = split_of(prompt.id)
        if need[split] <= 0:
            continue
        item = make(prompt)
        if item is None:
            continue
        if len(item.token_ids) > max_len:
            item = CorpusItem(item.source, item.prompt_id, item.token_ids[:max_len],
                              item.score_from, item.split)
        if item.num_scored <= 0:
            continue
        out.append(item)
        need[split] -= item.num_scored
    return out


class GenerationCache:
    """On-policy generations of one model/dtype/dataset, kept in one JSON file.

    The file maps prompt id → ``{"prompt_ids": [...], "output_ids": [...]}``. It is rewritten
    atomically (temporary file + rename) every few generations and when generation stops
    (also on KeyboardInterrupt), so an interrupted run resumes where it stopped and never
    leaves a half-written file.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, dict[str, list[int]]] = {}
        self._dirty = 0
        if path.is_file():
            try:
                self.entries = json.loads(path.read_text())
            except (OSError, ValueError) as err:
                logger.warning("ignoring unreadable generation cache %s (%s)", path, err)

    def get(self, prompt_id: str) -> dict[str, list[int]] | None:
        """The cached ``{"prompt_ids", "output_ids"}`` of ``prompt_id``, or ``None``."""
        return self.entries.get(prompt_id)

    def put(self, prompt_id: str, prompt_ids: list[int], output_ids: list[int]) -> None:
        """Record one generation; saved to disk every few puts (and by :meth:`save`)."""
        self.entries[prompt_id] = {"prompt_ids": list(prompt_ids), "output_ids": list(output_ids)}
        self._dirty += 1
        if self._dirty >= _SAVE_EVERY:
            self.save()

    def save(self) -> None:
        """Write the cache atomically (a temporary file, then a rename) if it changed."""
        if not self._dirty and self.path.is_file():
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(self.entries))
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._dirty = 0


def _onpolicy_maker(engine: Engine, source: str, prompts: list[Any], cache: GenerationCache,
                    bar: tqdm, max_new_tokens: int, batch_size: int
                    ) -> Callable[[Any], CorpusItem | None]:
    """``make(prompt)`` for :func:`select_items`: the cached generation, or a fresh one made
    together with the next ``batch_size - 1`` uncached prompts of the same split (likely
    needed next; at most ``batch_size - 1`` generations per split go unused)."""
    order = {p.id: i for i, p in enumerate(prompts)}
    split = {p.id: split_of(p.id) for p in prompts}
    limit = engine.executor.max_positions
    too_long: set[str] = set()

    def encoded(prompt: Any) -> list[int] | None:
        if prompt.id in too_long:
            return None
        ids = engine.encode(prompt.text, chat=prompt.chat)
        if len(ids) + max_new_tokens > limit:  # would not fit the context: skip it
            logger.info("skipping %s: %d prompt tokens + %d new exceed the context of %d",
                        prompt.id, len(ids), max_new_tokens, limit)
            too_long.add(prompt.id)
            return None
        return ids

    def make(prompt: Any) -> CorpusItem | None:
        if cache.get(prompt.id) is None:
            batch: list[tuple[Any, list[int]]] = []
            for other in prompts[order[prompt.id]:]:
                if len(batch) == batch_size:
                    break
                # Same split only: select_items asks for a prompt only while its split
                # still needs tokens, so the batch's other prompts are likely used too.
                if (split[other.id] == split[prompt.id] and cache.get(other.id) is None
                        and (ids := encoded(other)) is not None):
                    batch.append((other, ids))
            if not batch or batch[0][0].id != prompt.id:
                return None
            outputs = generate_greedy_batch(engine, [ids for _, ids in batch], max_new_tokens)
            for (other, ids), new in zip(batch, outputs, strict=True):
                cache.put(other.id, ids, new)
        entry = cache.get(prompt.id)
        ids = tuple(entry["prompt_ids"]) + tuple(entry["output_ids"])
        item = CorpusItem(source, prompt.id, ids, len(entry["prompt_ids"]) - 1,
                          split_of(prompt.id))
        bar.update(item.num_scored)
        return item

    return make


def onpolicy_cache_path(cache_root: Path, dataset: str, max_new_tokens: int) -> Path:
    """``<cache_root>/onpolicy/<dataset>-greedy-<max_new_tokens>.json``: the model's greedy
    answers to ``dataset``'s prompts (:class:`GenerationCache`)."""
    return cache_root / "onpolicy" / f"{dataset}-greedy-{max_new_tokens}.json"


def build_corpus(engine: Engine, data: list[str], train_tokens: int, cache_root: Path, *,
                 max_new_tokens: int = 256, max_len: int = 1024, seed: int = 0,
                 eval_fraction: float = 0.25, progress: bool = True,
                 batch_size: int = DEFAULT_BATCH) -> list[CorpusItem]:
    """The items of every source of ``data``, each source with its weighted share of the budget.

    Args:
        engine: the model (an :class:`~selfspec.training.engine.Engine`, e.g. a ``SelfSpec``
            engine: tokenizer, chat template, ``model.generate``).
        data: parsed data spec (:func:`parse_data_spec`).
        train_tokens: scored training tokens over all sources (each source gets its weight's
            share, ``train_tokens * K / sum of weights``, and ``eval_fraction`` of that for
            calibration and for test; a source with fewer tokens gives what it has).
        cache_root: the model's cache directory (on-policy generations live under it).
        max_new_tokens: length cap of on-policy generations.
        max_len: sequences are cut to this many tokens.
        seed: order in which problems are drawn.
        eval_fraction: held-out tokens per split relative to training tokens.
        progress: tqdm bars for on-policy generation.
        batch_size: prompts generated together for on-policy text.

    Returns:
        Items in source order.

    Raises:
        InvalidArgumentError: ``train_tokens < 1``.
        DatasetUnavailableError: a dataset's package is missing.
    """
    if train_tokens < 1:
        raise InvalidArgumentError(f"--tokens must be >= 1, got {train_tokens}")
    weighted = [source_weight(entry) for entry in data]
    unit = train_tokens / sum(k for _, k in weighted)
    items: list[CorpusItem] = []
    for source, weight in weighted:
        share = budget_for(max(1, int(unit * weight)), eval_fraction)
        if source.startswith(ONPOLICY):
            dataset = dataset_of(source)
            prompts = _ordered(load_dataset_prompts(dataset), seed)
            cache = GenerationCache(onpolicy_cache_path(cache_root, dataset, max_new_tokens))
            bar = tqdm(total=sum(share.tokens), desc=f"on-policy {dataset}", unit="tok",
                       disable=not progress, leave=False)

            make = _onpolicy_maker(engine, source, prompts, cache, bar, max_new_tokens,
                                   batch_size)
            try:
                items += select_items(prompts, share, make, max_len)
            finally:  # also on KeyboardInterrupt: keep what was generated
                cache.save()
                bar.close()
        else:
            prompts = _ordered(load_dataset_prompts(source), seed)
            items += select_items(prompts, share,
                                  lambda p, s=source: teacher_forced_item(engine, s, p), max_len)
    for split, name in enumerate(SPLIT_NAMES):
        logger.info("%s: %d items, %d scored tokens", name,
                    sum(i.split == split for i in items),
                    sum(i.num_scored for i in items if i.split == split))
    return items
