"""Skip-set files: the fixed sub-layer skip set SWIFT drafts with (Xia et al. 2024, §3),
found offline by ``selfspec heads search-skip`` and read by ``--method swift``.

A skip-set file is a small JSON document (never pickle)::

    {"format": "selfspec-skip-set", "format_version": 1,
     "model": "smollm2-135m-instruct", "fingerprint": {...},   # heads/fingerprint.py
     "dtype": "bf16", "num_layers": 30,
     "skip_attention": [3, 7, ...], "skip_mlp": [2, 9, ...],   # 0-based layer indices
     "score": 0.71,                                            # matchness on calibration text
     "search": {...},                                          # how it was searched
     "prompts": [{"use": "calibration", "dataset": "stdlib", "ids": [...]}],
     "created": "...", "selfspec_version": "..."}

``prompts`` lists the calibration prompts the search scored (:class:`PromptUse`, as head
cards do), so a benchmark drops them (:mod:`selfspec.bench.heldout`). The default file of a
model is ``$SELFSPEC_HOME/heads/<model>/swift-skip.json``, next to its default heads.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from selfspec.errors import CorruptModelFileError, InvalidArgumentError
from selfspec.executor.executor import SkipPlan
from selfspec.heads.card import IN_SAMPLE_USES, PromptUse
from selfspec.heads.errors import HeadsModelMismatchError, HeadsNotFoundError
from selfspec.heads.fingerprint import ModelFingerprint, fingerprint
from selfspec.heads.modules import output_layer

logger = logging.getLogger(__name__)

FORMAT_TAG = "selfspec-skip-set"
FORMAT_VERSION = 1
FILE_NAME = "swift-skip.json"
DEFAULT = "default"  # path keyword: the model's default skip set
# How a method names a skip-set file among its ``heads_files`` (what the bench's held-out
# check reads): ``"skip-set:default"`` or ``"skip-set:/path/to/file.json"``.
HELD_OUT_PREFIX = "skip-set:"


@dataclass
class SkipSetCard:
    """Everything a skip-set file records besides the skip set.

    Attributes:
        model: name of the model the set was searched for.
        fingerprint: that model's :class:`ModelFingerprint`.
        dtype: the dtype the search ran in (``"bf16"``, ``"fp32"``); informative only.
        num_layers: the model's layers.
        score: the set's matchness on the calibration text, in [0, 1].
        search: the search settings and counts (skip ratio, trials, evaluations, window,
            calibration tokens, seconds, ...).
        prompts: the calibration prompts scored (use ``"calibration"``).
        created / selfspec_version: when and by what it was written.
        format_version: :data:`FORMAT_VERSION`.
    """

    model: str
    fingerprint: ModelFingerprint
    dtype: str
    num_layers: int
    score: float
    search: dict[str, Any] = field(default_factory=dict)
    prompts: list[PromptUse] = field(default_factory=list)
    created: str = ""
    selfspec_version: str = ""
    format_version: int = FORMAT_VERSION

    def seen_prompts(self) -> dict[str, set[str]]:
        """Dataset → ids of the prompts that chose this skip set."""
        seen: dict[str, set[str]] = {}
        for u in self.prompts:
            if u.use in IN_SAMPLE_USES:
                seen.setdefault(u.dataset, set()).update(u.ids)
        return seen


@dataclass
class SkipSet:
    """A skip set and its card.

    Attributes:
        plan: the sub-layers drafts skip.
        card: :class:`SkipSetCard`.
    """

    plan: SkipPlan
    card: SkipSetCard

    def to_dict(self) -> dict[str, Any]:
        """The JSON document (see the module doc)."""
        card = asdict(self.card)
        card["fingerprint"] = self.card.fingerprint.to_dict()
        return {"format": FORMAT_TAG, "format_version": self.card.format_version,
                "model": card["model"], "fingerprint": card["fingerprint"],
                "dtype": card["dtype"], "num_layers": card["num_layers"],
                "skip_attention": sorted(self.plan.skip_attention),
                "skip_mlp": sorted(self.plan.skip_mlp), "score": card["score"],
                "search": card["search"], "prompts": card["prompts"],
                "created": card["created"], "selfspec_version": card["selfspec_version"]}

    @classmethod
    def from_dict(cls, data: Any) -> SkipSet:
        """Inverse of :meth:`to_dict`.

        Raises:
            KeyError, TypeError, ValueError: a malformed document (callers turn these into
                :class:`~selfspec.errors.CorruptModelFileError`).
        """
        if not isinstance(data, dict) or data.get("format") != FORMAT_TAG:
            raise ValueError(f"not a selfspec skip-set file (no \"format\": \"{FORMAT_TAG}\")")
        version = int(data["format_version"])
        if version > FORMAT_VERSION:
            raise ValueError(f"format version {version} is newer than this selfspec reads "
                             f"({FORMAT_VERSION}); upgrade selfspec")
        num_layers = int(data["num_layers"])
        layers = {}
        for key in ("skip_attention", "skip_mlp"):
            values = data[key]
            if not isinstance(values, list) or not all(
                    isinstance(i, int) and not isinstance(i, bool) for i in values):
                raise TypeError(f"{key} must be a list of layer indices")
            if any(not 0 <= i < num_layers for i in values):
                raise ValueError(f"{key} has a layer index outside [0, {num_layers})")
            layers[key] = frozenset(values)
        search = data.get("search", {})
        if not isinstance(search, dict):
            raise TypeError("search must be an object")
        card = SkipSetCard(
            model=str(data["model"]),
            fingerprint=ModelFingerprint.from_dict(data["fingerprint"]),
            dtype=str(data["dtype"]), num_layers=num_layers, score=float(data["score"]),
            search=search,
            prompts=[PromptUse(str(u["use"]), str(u["dataset"]), [str(i) for i in u["ids"]])
                     for u in data.get("prompts", [])],
            created=str(data.get("created", "")),
            selfspec_version=str(data.get("selfspec_version", "")), format_version=version)
        return cls(SkipPlan(layers["skip_attention"], layers["skip_mlp"]), card)


# --------------------------------------------------------------------------- locations
def default_skip_set_path(model: str) -> Path:
    """``$SELFSPEC_HOME/heads/<model>/swift-skip.json`` (where ``skip_set=default`` looks)."""
    from selfspec.heads.files import default_heads_dir

    return default_heads_dir(model).parent / FILE_NAME


def resolve_skip_set_path(path: str | os.PathLike, model: str | None = None) -> Path:
    """The skip-set file meant by ``path``: ``"default"`` (needs ``model``), a ``.json``
    file, or a directory (its ``swift-skip.json``).

    Raises:
        InvalidArgumentError: ``"default"`` without a model name.
    """
    if str(path) == DEFAULT:
        if not model:
            raise InvalidArgumentError(f"{DEFAULT!r} needs a model name")
        return default_skip_set_path(model)
    p = Path(path).expanduser()
    return p if p.suffix == ".json" else p / FILE_NAME


def _source_name(source: object) -> str:
    from selfspec.heads.files import model_name

    return model_name(source)


def _config(source: object) -> object:
    executor = getattr(source, "executor", source)
    return getattr(executor, "config", None) or source.model.config


def _search_hint(model: str, path: str | os.PathLike) -> str:
    out = "" if str(path) == DEFAULT else f" --out {path}"
    return f"`selfspec heads search-skip --model {model}{out}`"


# ------------------------------------------------------------------------------- read
def _corrupt(path: Path, why: str, model: str) -> CorruptModelFileError:
    return CorruptModelFileError(
        f"{path} is not a readable skip-set file ({why}). If it is one, search again into it "
        f"with {_search_hint(model, path)} or restore a good copy; otherwise point "
        "--skip-set at a file written by `selfspec heads search-skip`.")


def read_skip_set(path: str | os.PathLike, model: str | None = None) -> SkipSet:
    """Read a skip-set file without checking which model it is for (``selfspec heads show``,
    the bench's held-out check).

    Args:
        path: ``"default"`` (with ``model``), a directory or the file.
        model: the model name that ``"default"`` and the messages use.

    Raises:
        HeadsNotFoundError: no file there (the message gives the command that makes one).
        CorruptModelFileError: unreadable, truncated, not JSON, or fields missing or wrong.
    """
    name = model or "MODEL"
    target = resolve_skip_set_path(path, model)
    if not target.is_file():
        where = f"for model {model!r} " if str(path) == DEFAULT else ""
        raise HeadsNotFoundError(
            f"no skip-set file {where}at {target}; search one with {_search_hint(name, path)}")
    try:
        text = target.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise _corrupt(target, str(err), name) from err
    try:
        data = json.loads(text)
    except ValueError as err:
        raise _corrupt(target, f"not valid JSON: {err}", name) from err
    try:
        return SkipSet.from_dict(data)
    except (KeyError, TypeError, ValueError) as err:
        detail = f"missing field {err}" if isinstance(err, KeyError) else str(err)
        raise _corrupt(target, detail, name) from err


def load_skip_set(path: str | os.PathLike, source: object) -> SkipSet:
    """Read a skip-set file for a model and check that it belongs to that model.

    Args:
        path: ``"default"`` (``$SELFSPEC_HOME/heads/<model>/swift-skip.json``), a directory
            holding ``swift-skip.json``, or the file.
        source: the model: a ``LayerExecutor`` or a ``SelfSpec`` engine.

    Raises:
        HeadsNotFoundError: no file (the message says to run ``selfspec heads search-skip``).
        CorruptModelFileError: unreadable, truncated or malformed.
        HeadsModelMismatchError: the set was searched for another model (another number of
            layers or another fingerprint).
    """
    name = _source_name(source)
    skip_set = read_skip_set(path, name)
    card = skip_set.card
    target = resolve_skip_set_path(path, name)
    executor = getattr(source, "executor", source)
    num_layers = int(getattr(executor, "num_layers", 0) or _config(source).num_hidden_layers)
    hint = (f"Load model {card.model!r}, or search a skip set for this model with "
            f"{_search_hint(name, path)}.")
    if card.num_layers != num_layers:
        raise HeadsModelMismatchError(
            f"the skip set in {target} is for a {card.num_layers}-layer model "
            f"({card.model!r}), not for the loaded {num_layers}-layer model {name!r}. {hint}")
    mine = fingerprint(_config(source), output_layer(source))
    if not card.fingerprint.matches(mine):
        raise HeadsModelMismatchError(
            f"the skip set in {target} belongs to model {card.model!r} (fingerprint "
            f"{card.fingerprint.short()}), not to the loaded model {name!r} (fingerprint "
            f"{mine.short()}). {hint}")
    return skip_set


# ------------------------------------------------------------------------------ write
def new_skip_set(source: object, plan: SkipPlan, score: float, dtype: str,
                 search: dict[str, Any] | None = None,
                 prompts: list[PromptUse] | None = None) -> SkipSet:
    """A :class:`SkipSet` of ``plan`` for model ``source`` (engine or executor), with its
    fingerprint."""
    config = _config(source)
    return SkipSet(plan, SkipSetCard(
        model=_source_name(source), fingerprint=fingerprint(config, output_layer(source)),
        dtype=dtype, num_layers=int(config.num_hidden_layers), score=float(score),
        search=dict(search or {}), prompts=list(prompts or [])))


def save_skip_set(skip_set: SkipSet, path: str | os.PathLike) -> Path:
    """Write ``skip_set`` to ``path`` (``"default"``, a directory or a file) atomically.

    Returns:
        The path of the file.
    """
    from selfspec.heads.files import _atomic_write
    from selfspec.version import __version__

    target = resolve_skip_set_path(path, skip_set.card.model)
    skip_set.card.created = datetime.now(timezone.utc).isoformat(timespec="seconds")
    skip_set.card.selfspec_version = __version__
    text = json.dumps(skip_set.to_dict(), indent=1) + "\n"
    _atomic_write(target, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    logger.info("saved a skip set of %d attention and %d MLP sub-layers to %s",
                len(skip_set.plan.skip_attention), len(skip_set.plan.skip_mlp), target)
    return target
