"""What the training stages share: the corpus and its cached features, the data request,
stage times, the outcome of a stage that saves a head file, and small lookups.

Each stage is one module holding its request and outcome dataclasses, its driver and its
maths::

    selfspec heads train             train.py             (TrainRequest, train)
    selfspec heads calibrate         calibration.py       (calibrate, calibrate_file)
    selfspec heads train-probe       probe.py             (ProbeRequest, train_probe)
    selfspec heads train-drafter     drafter.py           (DrafterRequest, train_drafter)
    selfspec heads train-predictors  predictors.py        (PredictorRequest, train_predictors),
                                     specee_tuning.py     (its thresholds tuned by replay)
    selfspec heads tune-adadecode    adadecode_tuning.py  (tune_adadecode_file)
    selfspec heads search-skip       skip_search.py       (SkipSearchRequest, search_skip)

    corpus (real text, on-policy generations) → features (one backbone pass, cached)
      → the stage → save

Each stage takes and returns dataclasses; the CLI only parses arguments and prints.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from selfspec.errors import InvalidArgumentError
from selfspec.heads.card import PromptUse, TrainingInfo
from selfspec.heads.files import ExitHeads, model_name
from selfspec.heads.fingerprint import fingerprint
from selfspec.heads.modules import output_layer
from selfspec.training.corpus import (
    CALIBRATION,
    TEST,
    TRAIN,
    CorpusItem,
    build_corpus,
    items_by_use,
    parse_data_spec,
)
from selfspec.training.engine import Engine
from selfspec.training.features import FeatureSet, by_source, load_features

# Held out from every benchmark prompt set by construction: standard-library functions as
# code (teacher-forced bodies and the model's own completions) and ShareGPT chat requests
# that are not in sharegpt-summarize (the model's own answers). No HumanEval, MT-Bench, GSM
# or sharegpt-summarize prompt is used, so none is dropped from a benchmark.
DEFAULT_DATA = "stdlib,onpolicy:stdlib,onpolicy:sharegpt-chat"
DEFAULT_TOKENS = 40_000


def cache_root(engine: Engine) -> Path:
    """``$SELFSPEC_HOME/heads-cache/<model>/<fingerprint>/``: on-policy generations and
    feature caches of one model (the dtype is part of each entry's key)."""
    from selfspec.heads.files import _safe_name
    from selfspec.models.provision import selfspec_home

    fp = fingerprint(engine.executor.config, output_layer(engine))
    return selfspec_home() / "heads-cache" / _safe_name(model_name(engine)) / fp.short()


@dataclass(frozen=True)
class DataRequest:
    """Which text to use.

    Attributes:
        data: data spec (see :mod:`selfspec.training.corpus`).
        tokens: scored training tokens over all sources.
        max_new_tokens: length cap of on-policy generations.
        max_len: sequence length cap.
        seed: problem order.
    """

    data: str = DEFAULT_DATA
    tokens: int = DEFAULT_TOKENS
    max_new_tokens: int = 256
    max_len: int = 1024
    seed: int = 0


@dataclass
class StageTimes:
    """Wall time of each stage, in seconds (``0.0`` = not run)."""

    corpus_s: float = 0.0
    features_s: float = 0.0
    train_s: float = 0.0
    calibrate_s: float = 0.0
    probe_s: float = 0.0
    predictors_s: float = 0.0


@dataclass
class PreparedData:
    """A corpus and its backbone features.

    Attributes:
        items: the corpus (which prompt each sequence came from, and its split).
        features: cached backbone features of ``items`` at the requested layers.
    """

    items: list[CorpusItem]
    features: FeatureSet

    def uses(self, uses: dict[int, str]) -> list[PromptUse]:
        """Prompt records for the card (see :func:`~selfspec.training.corpus.items_by_use`)."""
        return items_by_use(self.items, uses)


# the card's prompt uses of exit heads (train, calibrate)
HEAD_USES = {TRAIN: "train", CALIBRATION: "calibration", TEST: "test"}


def prepare_features(engine: Engine, request: DataRequest, layers: Sequence[int],
                     times: StageTimes, progress: bool = True) -> PreparedData:
    """Corpus + cached backbone features at ``layers`` (on-policy text generated if needed)."""
    data = parse_data_spec(request.data)
    root = cache_root(engine)
    t0 = time.perf_counter()
    max_len = min(request.max_len, engine.executor.max_positions)
    items = build_corpus(engine, data, request.tokens, root, max_new_tokens=request.max_new_tokens,
                         max_len=max_len, seed=request.seed, progress=progress)
    t1 = time.perf_counter()
    features = load_features(engine.executor, items, layers, root, progress=progress)
    t2 = time.perf_counter()
    times.corpus_s += t1 - t0
    times.features_s += t2 - t1
    return PreparedData(items, features)


@dataclass
class TrainOutcome:
    """What ``selfspec heads train``, ``calibrate`` or ``train-probe`` produced: the saved
    file, its contents, the stage times and the token counts (training / held-out)."""

    path: Path
    heads: ExitHeads
    times: StageTimes
    train_tokens: int
    eval_tokens: int


def dtype_label(dtype: torch.dtype) -> str:
    """The card's name of ``dtype``: ``"fp32"``, ``"bf16"``, ``"fp16"`` (else ``str(dtype)``)."""
    return {torch.float32: "fp32", torch.bfloat16: "bf16",
            torch.float16: "fp16"}.get(dtype, str(dtype))


def model_eos_ids(engine: Engine) -> tuple[int, ...]:
    """The EOS token ids of ``engine``'s model config (what a reduced draft vocabulary keeps)."""
    from selfspec.models.eos import eos_token_ids

    return tuple(eos_token_ids(engine.executor.model))


# SpecEE's candidates and its drafter's loss: the K most frequent tokens (train-predictors,
# train-drafter)
DEFAULT_CANDIDATE_VOCAB = 16384


def default_first_layer(num_layers: int) -> int:
    """First predictor layer with drafter candidates: ``max(1, L // 8)``. The candidates exist
    before layer 0, but the first layers' states rarely point at the final token (on
    Qwen2.5-Coder-1.5B a perfect predictor from layer 1 saves 0.2 layers per token more than
    from layer 4) and every predictor layer costs features."""
    return max(1, num_layers // 8)


def in_feature_order(items: Sequence[CorpusItem]) -> list[CorpusItem]:
    """``items`` in the order :func:`~selfspec.training.features.load_features` lays out their
    scored positions (:func:`~selfspec.training.features.by_source`)."""
    return [i for group in by_source(items).values() for i in group]


def draft_rows(engine: Engine, heads: ExitHeads, target: Path, size: int
                ) -> torch.Tensor | None:
    """``[R]`` rows of the ``size`` most frequent tokens by ``heads``' counts (plus EOS), or
    ``None`` for ``size == 0`` (the full vocabulary).

    Raises:
        InvalidArgumentError: the heads have no token counts.
    """
    from selfspec.decoding.drafting.draft_vocab import frequent_rows
    from selfspec.models.eos import eos_token_ids

    if not size:
        return None
    if heads.token_counts is None:
        raise InvalidArgumentError(
            f"{target} has no token counts to rank a draft vocabulary; run `selfspec heads "
            f"calibrate {target}` once, or pass --draft-vocab 0")
    return frequent_rows(heads.token_counts, size, eos_token_ids(engine.executor.model)).rows


def card_request(info: TrainingInfo) -> DataRequest:
    """The corpus heads were trained on (same held-out problems), from their card."""
    return DataRequest(",".join(info.data), info.requested_tokens or info.train_tokens,
                       info.max_new_tokens, info.max_len, info.seed)
