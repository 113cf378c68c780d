"""``selfspec heads search-skip``: the offline skip-set search of ``--method swift``
(SWIFT, Xia et al. 2024, §3 layer set optimisation; the search itself is
:mod:`selfspec.training.skip_set_search`).

    calibration prompts (the CALIBRATION split of each dataset, by problem hash)
      → the model's greedy continuation of each (cached with the heads' on-policy text)
      → the full model's KV and labels per sequence → random + local search for matchness
      → ``swift-skip.json`` (the set, its score, the search settings, the prompts used)

The prompts come from the datasets of the heads' default data (standard-library code and
ShareGPT chat requests), which no benchmark prompt set contains, so no benchmark prompt is
dropped; any dataset may be given, and the file records every prompt it scored so that
``selfspec bench`` drops those.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from selfspec.errors import InvalidArgumentError
from selfspec.heads.card import PromptUse, prompt_uses
from selfspec.heads.skip_set import SkipSet, new_skip_set, save_skip_set
from selfspec.training.corpus import (
    CALIBRATION,
    GenerationCache,
    dataset_of,
    load_dataset_prompts,
    onpolicy_cache_path,
    parse_data_spec,
    split_of,
)
from selfspec.training.engine import Engine
from selfspec.training.onpolicy import DEFAULT_BATCH, generate_greedy_batch
from selfspec.training.pipeline import DEFAULT_DATA, cache_root, dtype_label
from selfspec.training.skip_set_search import (
    CalibrationSequence,
    Evaluation,
    MatchnessScorer,
    SearchSettings,
    SkipSearchResult,
    search_skip_set,
)

logger = logging.getLogger(__name__)

# The datasets of the heads' default data (stdlib, sharegpt-chat): held out from every
# benchmark prompt set by construction.
DEFAULT_SKIP_DATA = ",".join(dict.fromkeys(dataset_of(s) for s in DEFAULT_DATA.split(",")))


@dataclass(frozen=True)
class SkipSearchRequest:
    """``selfspec heads search-skip``.

    Attributes:
        data: comma-separated datasets (``onpolicy:NAME`` is accepted and means ``NAME``:
            the text is always the model's own continuation).
        prompts: calibration prompts, drawn round-robin from the datasets' calibration
            splits (>= 1).
        max_new_tokens: length of each greedy continuation (>= 1); the scored positions.
        max_len: prompts longer than ``max_len - max_new_tokens`` tokens are passed over.
        window: positions per scoring window, the draft length mirrored (>= 1).
        settings: the search (:class:`~selfspec.training.skip_set_search.SearchSettings`);
            its seed also orders the prompts.
        out: where to save (``None`` = ``$SELFSPEC_HOME/heads/<model>/swift-skip.json``).
    """

    data: str = DEFAULT_SKIP_DATA
    prompts: int = 8
    max_new_tokens: int = 64
    max_len: int = 1024
    window: int = 8
    settings: SearchSettings = field(default_factory=SearchSettings)
    out: str | None = None


@dataclass
class SkipSearchOutcome:
    """What ``selfspec heads search-skip`` produced.

    Attributes:
        path: the skip-set file written.
        skip_set: its contents.
        result: the search (every evaluation).
        calibration_tokens: positions scored per evaluation.
        prepare_s: wall time of generating continuations and the full-model passes.
    """

    path: Path
    skip_set: SkipSet
    result: SkipSearchResult
    calibration_tokens: int
    prepare_s: float


def check_request(request: SkipSearchRequest) -> list[str]:
    """Validate ``request`` and check that its datasets' packages are installed, before a
    model is loaded.

    Returns:
        The datasets, in order, without duplicates.

    Raises:
        InvalidArgumentError: a value out of range or an unknown dataset.
        DatasetUnavailableError: a dataset's package is missing (the message gives the pip
            command).
    """
    from selfspec.data.packages import require_dataset

    for name, value in (("--prompts", request.prompts),
                        ("--max-new-tokens", request.max_new_tokens),
                        ("--window", request.window)):
        if value < 1:
            raise InvalidArgumentError(f"{name} must be >= 1, got {value}")
    if request.max_len <= request.max_new_tokens:
        raise InvalidArgumentError(
            f"max_len ({request.max_len}) must exceed --max-new-tokens ({request.max_new_tokens})")
    request.settings.check()
    datasets = list(dict.fromkeys(dataset_of(s) for s in parse_data_spec(request.data)))
    for dataset in datasets:
        require_dataset(dataset)
    return datasets


def calibration_prompts(datasets: list[str], seed: int) -> list[tuple[str, Any]]:
    """Every calibration-split prompt of ``datasets`` as ``(dataset, Prompt)``, each dataset
    in a seeded order, interleaved round-robin (so a few prompts cover every dataset)."""
    queues = []
    for dataset in datasets:
        prompts = [p for p in load_dataset_prompts(dataset) if split_of(p.id) == CALIBRATION]
        random.Random(seed).shuffle(prompts)
        queues.append([(dataset, p) for p in prompts])
    out = []
    for i in range(max((len(q) for q in queues), default=0)):
        out += [q[i] for q in queues if i < len(q)]
    return out


def calibration_sequences(engine: Engine, request: SkipSearchRequest, datasets: list[str],
                          progress: bool = True
                          ) -> tuple[list[CalibrationSequence], list[PromptUse]]:
    """Prompt + greedy continuation of ``request.prompts`` calibration prompts.

    Continuations are read from (and added to) the on-policy generation cache that
    ``selfspec heads train`` uses, so each is generated once per model and length.

    Returns:
        The sequences (scored from the prompt's last token) and the prompts used.

    Raises:
        InvalidArgumentError: the datasets have no calibration prompt that fits.
    """
    limit = min(request.max_len, engine.executor.max_positions) - request.max_new_tokens
    chosen: list[tuple[str, Any, list[int]]] = []
    for dataset, prompt in calibration_prompts(datasets, request.settings.seed):
        if len(chosen) == request.prompts:
            break
        ids = engine.encode(prompt.text, chat=prompt.chat)
        if 0 < len(ids) <= limit:
            chosen.append((dataset, prompt, ids))
    if not chosen:
        raise InvalidArgumentError(
            f"no calibration prompt of {', '.join(datasets)} fits in {limit} tokens; give "
            "other --data or fewer --max-new-tokens")
    if len(chosen) < request.prompts:
        logger.warning("only %d calibration prompts available (asked for %d)", len(chosen),
                       request.prompts)
    root = cache_root(engine)
    caches = {d: GenerationCache(onpolicy_cache_path(root, d, request.max_new_tokens))
              for d in datasets}
    missing = [(d, p, ids) for d, p, ids in chosen if caches[d].get(p.id) is None]
    bar = tqdm(total=len(missing), desc="greedy continuations", unit="prompt",
               disable=not progress or not missing, leave=False)
    try:
        for start in range(0, len(missing), DEFAULT_BATCH):
            batch = missing[start:start + DEFAULT_BATCH]
            outputs = generate_greedy_batch(engine, [ids for _, _, ids in batch],
                                            request.max_new_tokens)
            for (dataset, prompt, ids), new in zip(batch, outputs, strict=True):
                caches[dataset].put(prompt.id, ids, new)
            bar.update(len(batch))
    finally:  # also on KeyboardInterrupt: keep what was generated
        for cache in caches.values():
            cache.save()
        bar.close()
    sequences, used = [], []
    for dataset, prompt, _ in chosen:
        entry = caches[dataset].get(prompt.id)
        prompt_ids, output_ids = list(entry["prompt_ids"]), list(entry["output_ids"])
        seq = CalibrationSequence(tuple(prompt_ids + output_ids), len(prompt_ids) - 1)
        if seq.num_scored > 0:
            sequences.append(seq)
            used.append(("calibration", dataset, prompt.id))
    return sequences, prompt_uses(used)


def search_skip(engine: Engine, request: SkipSearchRequest,
                progress: bool = True) -> SkipSearchOutcome:
    """Search a skip set for ``engine``'s model and save it (see the module doc).

    Raises:
        InvalidArgumentError, DatasetUnavailableError: see :func:`check_request`; no
            calibration text.
    """
    datasets = check_request(request)
    t0 = time.perf_counter()
    sequences, uses = calibration_sequences(engine, request, datasets, progress)
    scorer = MatchnessScorer(engine.executor, sequences, request.window)
    prepare_s = time.perf_counter() - t0
    settings = request.settings
    logger.info("scoring skip sets on %d positions of %d sequences", scorer.num_positions,
                len(sequences))
    bar = tqdm(total=settings.max_evaluations, desc="skip-set search", unit="set",
               disable=not progress, leave=False)

    def on_evaluation(evaluation: Evaluation) -> None:
        bar.update(1)
        bar.set_postfix(best=f"{evaluation.best:.3f}")

    try:
        result = search_skip_set(scorer, engine.executor.num_layers, settings, on_evaluation)
    finally:
        bar.close()
    search = {
        "algorithm": "random search + swap local search (SWIFT: random search + Bayesian "
                     "optimisation)",
        "objective": "matchness", "skip_ratio": settings.skip_ratio, "trials": settings.trials,
        "refine_steps": settings.refine_steps, "max_evaluations": settings.max_evaluations,
        "keep_ends": settings.keep_ends, "seed": settings.seed, "window": request.window,
        "num_skipped": result.num_skipped, "searchable_sublayers": len(result.candidates),
        "evaluations": len(result.evaluations), "local_optimum": result.local_optimum,
        "best_curve": [round(e.best, 5) for e in result.evaluations],
        "data": datasets, "prompts": len(sequences), "max_new_tokens": request.max_new_tokens,
        "calibration_tokens": scorer.num_positions, "seconds": round(result.seconds, 2),
    }
    skip_set = new_skip_set(engine, result.plan, result.score,
                            dtype_label(engine.executor.dtype), search, uses)
    path = save_skip_set(skip_set, request.out or "default")
    return SkipSearchOutcome(path, skip_set, result, scorer.num_positions, prepare_s)
