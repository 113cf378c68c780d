"""Head files: one safetensors file holding heads, probes, calibration vectors and the card.

Layout of ``heads.safetensors`` (a directory path means ``<dir>/heads.safetensors``)::

    head.<layer>.transform        [H, H]   lightweight: T (logits = E*·T·norm(h))
    head.<layer>.weight           [V, H]   full: output matrix (+ head.<layer>.bias [V])
    head.<layer>.norm.weight      [H]      the head's norm (+ norm.bias for LayerNorm models)
    probe.<layer>.weight          [H]      AdaSPEED probe v (float32)
    probe.<layer>.bias            [1]      AdaSPEED probe b (float32)
    probe.<layer>.sampled.weight  [H]      the probe for sampled decoding (labels: expected
    probe.<layer>.sampled.bias    [1]      acceptance under speculative sampling)
    calib.<layer>.correct         [M] u8   DSSD eq. 2 correctness on the calibration tokens
    calib.<layer>.<metric>        [M] f32  confidence of each calibration token
    calib.<layer>.v<K>.correct    [M] u8   the same on the K most frequent tokens only
    calib.<layer>.v<K>.<metric>   [M] f32  (DSSD with draft_vocab=K; K in the card's
                                           calibration_draft_vocabs)
    predictor.fc1_weight          [P, 512, 3k]  SpecEE exit predictors at the card's
    predictor.fc1_bias            [P, 512]      ``predictors.layers`` (float32; candidates
    predictor.fc2_weight          [P, 512]      from the head at ``candidate_layer``); state-
    predictor.fc2_bias            [P]           reading ones: fc1 [P, w, 3k + H] and
    predictor.feature_mean/std    [P, 3k]       the features' standardisation
    drafter.fc_weight             [H, 2H]  SpecEE's next-token drafter (card: ``drafter``;
    drafter.fc_bias               [H]      :class:`~selfspec.heads.drafter.FeatureDrafter`)
    exit_drafter.fc_weight        [H, 2H]  its exit-state drafter, which drafts after an exited
    exit_drafter.fc_bias          [H]      token (card: ``drafter.exit_state_layers``)
    vocab.token_counts            [V] i64  final-layer greedy tokens counted on the training
                                           split (ranks the draft vocabulary, ``draft_vocab``)
    metadata: {"format": "selfspec-heads", "card": <HeadCard JSON>}

Heads are stored in float32 (trained weights) and cast to the model's dtype at load. The card
lives inside the file, so tensors and card are replaced together by one rename (written to a
temporary file in the same directory first): an interrupted save leaves the old file or the
new one, never a mix. ``card.json`` beside the file is a copy for people; it is never read.

Only safetensors is read (no pickle).
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from selfspec.errors import CorruptModelFileError, InvalidArgumentError
from selfspec.heads.calibration import (
    Threshold,
    check_epsilon,
    check_metric,
    thresholds,
)
from selfspec.heads.card import HeadCard
from selfspec.heads.drafter import FeatureDrafter
from selfspec.heads.errors import (
    HeadsModelMismatchError,
    HeadsNotFoundError,
    NotCalibratedError,
)
from selfspec.heads.fingerprint import fingerprint
from selfspec.heads.modules import ExitHead, OutputLayer, make_head, output_layer
from selfspec.heads.predictor import ExitPredictors
from selfspec.heads.probe import LinearProbe

logger = logging.getLogger(__name__)

FILE_NAME = "heads.safetensors"
CARD_NAME = "card.json"
FORMAT_TAG = "selfspec-heads"
DEFAULT = "default"  # path keyword: the model's default exit heads
DEFAULT_PROBES = "default-probes"  # path keyword: the model's probes for lm_head drafting


@dataclass
class CalibrationSet:
    """Per-token calibration data of one head (DSSD §3.4.1 vectors ``c_k`` and ``t_k``).

    Attributes:
        layer: exit layer.
        correct: ``[M]`` bool, head argmax == final-layer argmax (DSSD eq. 2).
        scores: ``{metric: [M] float32}`` confidences (higher = more confident).
    """

    layer: int
    correct: torch.Tensor
    scores: dict[str, torch.Tensor]


@dataclass
class ExitHeads:
    """Exit heads of one model, with their card, probes and calibration.

    Attributes:
        layers: exit layers, sorted (``heads[i]`` reads the state after layers ``[0, layers[i])``).
        heads: :class:`ExitHead` modules (``Head`` callables) aligned with ``layers``.
        card: the :class:`HeadCard`.
        probes: AdaSPEED probes for greedy decoding, by exit layer.
        sampled_probes: AdaSPEED probes for sampled decoding (temperature / top-p), by exit
            layer.
        calibration: calibration vectors by exit layer (empty until calibrated).
        vocab_calibration: ``{K: {layer: CalibrationSet}}``: calibration of the heads
            restricted to the K most frequent tokens (confidence and correctness over those
            rows), for DSSD with ``draft_vocab=K``.
        token_counts: ``[V]`` int64 how often the final layer's greedy prediction was each
            token on the training text (set at calibration; ``None`` before it). Ranks
            the tokens of a reduced draft vocabulary (``draft_vocab``).
        predictors: SpecEE's exit predictors (card: ``card.predictors``), or ``None``.
        drafter: SpecEE's next-token drafter (card: ``card.drafter``), or ``None``.
        exit_drafter: the drafter that reads an exited position's exit-layer state instead
            of its last-layer state (card: ``card.drafter.exit_state_layers``), or ``None``.
    """

    layers: list[int]
    heads: list[ExitHead]
    card: HeadCard
    probes: dict[int, LinearProbe] = field(default_factory=dict)
    calibration: dict[int, CalibrationSet] = field(default_factory=dict)
    token_counts: torch.Tensor | None = None
    sampled_probes: dict[int, LinearProbe] = field(default_factory=dict)
    vocab_calibration: dict[int, dict[int, CalibrationSet]] = field(default_factory=dict)
    predictors: ExitPredictors | None = None
    drafter: FeatureDrafter | None = None
    exit_drafter: FeatureDrafter | None = None

    def head_at(self, layer: int) -> ExitHead:
        """The head at ``layer``.

        Raises:
            InvalidArgumentError: no head there (the message lists the layers).
        """
        for lay, head in zip(self.layers, self.heads):
            if lay == layer:
                return head
        raise InvalidArgumentError(f"no exit head at layer {layer}; heads are at {self.layers}")

    def probe_at(self, layer: int, sampled: bool = False) -> LinearProbe:
        """The AdaSPEED probe at ``layer``, for greedy or (``sampled``) sampled decoding.

        Raises:
            InvalidArgumentError: no such probe (the message gives the command that trains it).
        """
        probes = self.sampled_probes if sampled else self.probes
        if layer not in probes:
            flags = " --temperature 1 --top-p 0.9" if sampled else ""
            kind = "sampled-decoding" if sampled else "greedy-decoding"
            raise InvalidArgumentError(
                f"no {kind} probe at exit layer {layer}; such probes exist at "
                f"{sorted(probes) or 'no layer'}. Train one with `selfspec heads train-probe "
                f"--model {self.card.model} --exit-layer {layer}{flags}`")
        return probes[layer]

    def threshold_details(self, epsilon: float, metric: str = "entropy",
                          draft_vocab: int | None = None) -> list[Threshold]:
        """τ_k(ε) of every head with its calibration coverage and precision (DSSD §3.4.1),
        on the full vocabulary or (``draft_vocab=K``) on the K most frequent tokens.

        Raises:
            InvalidArgumentError: ``epsilon`` outside [0, 1] or unknown metric.
            NotCalibratedError: a head has no calibration data for ``metric`` (on that
                restricted vocabulary).
        """
        check_epsilon(epsilon)
        check_metric(metric)
        if draft_vocab is None:
            sets, hint = self.calibration, "`selfspec heads calibrate PATH`"
        else:
            sets = self.vocab_calibration.get(draft_vocab, {})
            hint = f"`selfspec heads calibrate PATH --draft-vocab {draft_vocab}`"
            if not sets:
                raise NotCalibratedError(
                    f"these heads have no thresholds calibrated on a {draft_vocab}-token draft "
                    f"vocabulary (calibrated sizes: {sorted(self.vocab_calibration) or 'none'}): "
                    f"thresholds of another vocabulary would not keep ε. Run {hint} first")
        out = []
        for layer in self.layers:
            data = sets.get(layer)
            if data is None or metric not in data.scores:
                raise NotCalibratedError(
                    f"the head at layer {layer} has no {metric!r} calibration"
                    + ("" if draft_vocab is None else f" for draft_vocab={draft_vocab}")
                    + f"; run {hint} first")
            out.append(thresholds(data.scores[metric], data.correct, [epsilon])[0])
        return out

    def thresholds(self, epsilon: float, metric: str = "entropy",
                   draft_vocab: int | None = None) -> list[float]:
        """τ_k(ε) per head, aligned with :attr:`layers`, in confidence units: use head ``k``'s
        prediction when ``confidences(logits)[metric] >= τ_k`` (for ``entropy`` the confidence
        is ``-H`` in nats, so the rule is ``H <= -τ_k``); ``+inf`` = never.

        ``draft_vocab=K``: the thresholds calibrated on the K most frequent tokens.

        Raises:
            InvalidArgumentError: ``epsilon`` outside [0, 1] or unknown metric.
            NotCalibratedError: the heads are not calibrated (for ``draft_vocab``).
        """
        return [t.value for t in self.threshold_details(epsilon, metric, draft_vocab)]


# --------------------------------------------------------------------------- locations
def _safe_name(model: str) -> str:
    """A directory name for a model name, hub id or path."""
    return re.sub(r"[^A-Za-z0-9._-]+", "--", model.strip("/")) or "model"


def default_heads_dir(model: str) -> Path:
    """``$SELFSPEC_HOME/heads/<model>/default`` (where ``--heads default`` looks)."""
    from selfspec.models.provision import selfspec_home

    return selfspec_home() / "heads" / _safe_name(model) / DEFAULT


def default_probes_dir(model: str) -> Path:
    """``$SELFSPEC_HOME/heads/<model>/probes``: AdaSPEED probes for drafting with the model's
    own final norm + ``lm_head`` (a head file without heads; ``--heads default-probes``)."""
    return default_heads_dir(model).parent / "probes"


def resolve_path(path: str | os.PathLike, model: str | None = None) -> Path:
    """The head file meant by ``path``: ``"default"`` / ``"default-probes"`` (need ``model``),
    a directory (its ``heads.safetensors``) or a file."""
    if str(path) in (DEFAULT, DEFAULT_PROBES):
        if not model:
            raise InvalidArgumentError(f"{str(path)!r} needs a model name")
        folder = default_heads_dir(model) if str(path) == DEFAULT else default_probes_dir(model)
        return folder / FILE_NAME
    p = Path(path).expanduser()
    if p.suffix != ".safetensors":
        p = p / FILE_NAME
    return p


def find_head_file(path: str | os.PathLike, model: str | None = None) -> Path:
    """The head file to read for ``path``: as :func:`resolve_path`, and a bare name that is
    not a local file or directory (``"lensstate"``) names a folder beside the default heads,
    ``$SELFSPEC_HOME/heads/<model>/<name>/heads.safetensors``, when that file exists.

    Only for reading: a write target keeps :func:`resolve_path`'s meaning, so ``--out NAME``
    never overwrites a file in the model's heads folder that the user did not name by path.
    """
    local = resolve_path(path, model)
    if local.exists() or not model or not _bare_name(path):
        return local  # a path with folders is only what it says
    named = default_heads_dir(model).parent / str(path) / FILE_NAME
    return named if named.is_file() else local


def _bare_name(path: str | os.PathLike) -> bool:
    """``path`` is one folder name (``"lensstate"``), not ``default``, a path or a dot."""
    text = str(path)
    return (Path(text).name == text and text not in (".", "..")
            and text not in (DEFAULT, DEFAULT_PROBES))


def model_name(source: object) -> str:
    """Name of a ``SelfSpec`` engine (``.name``) or an HF model (``config._name_or_path``)."""
    name = getattr(source, "name", None)
    if isinstance(name, str) and name:
        return name
    model = getattr(source, "model", source)
    config = getattr(model, "config", None)
    return str(getattr(config, "_name_or_path", "") or "model")


def _model_config(source: object) -> object:
    executor = getattr(source, "executor", None)
    if executor is not None:
        return executor.config
    return getattr(source, "config", None) or source.model.config


# --------------------------------------------------------------------------------- save
def _tensors(heads: ExitHeads) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for layer, head in zip(heads.layers, heads.heads):
        for name, t in head.tensors().items():
            out[f"head.{layer}.{name}"] = t.detach().to("cpu", torch.float32).contiguous().clone()
    for prefix, probes in (("probe.{}.", heads.probes),
                           ("probe.{}.sampled.", heads.sampled_probes)):
        for layer, probe in probes.items():
            for name, t in probe.tensors().items():
                out[prefix.format(layer) + name] = (
                    t.detach().to("cpu", torch.float32).contiguous().clone())
    sets = [("calib.{}.", heads.calibration)]
    sets += [(f"calib.{{}}.v{k}.", by_layer) for k, by_layer in heads.vocab_calibration.items()]
    for prefix, by_layer in sets:
        for layer, data in by_layer.items():
            key = prefix.format(layer)
            out[key + "correct"] = data.correct.to("cpu", torch.uint8).contiguous()
            for metric, s in data.scores.items():
                out[key + metric] = s.to("cpu", torch.float32).contiguous()
    if heads.predictors is not None:
        for name, t in heads.predictors.tensors().items():
            out[f"predictor.{name}"] = t.detach().to("cpu", torch.float32).contiguous().clone()
    for prefix, drafter in (("drafter.", heads.drafter), ("exit_drafter.", heads.exit_drafter)):
        if drafter is not None:
            for name, t in drafter.tensors().items():
                out[prefix + name] = t.detach().to("cpu", torch.float32).contiguous().clone()
    if heads.token_counts is not None:
        out["vocab.token_counts"] = heads.token_counts.to("cpu", torch.int64).contiguous()
    return out


def _atomic_write(path: Path, write: Callable[[str], object]) -> None:
    """Write via a temporary file in ``path``'s directory, then rename over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # Not mkstemp: its files are private (0600); a plain create honours the umask.
    tmp = str(path.parent / f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:  # includes KeyboardInterrupt: never leave the temp file behind
        Path(tmp).unlink(missing_ok=True)
        raise


def save_heads(heads: ExitHeads, path: str | os.PathLike) -> Path:
    """Write ``heads`` to ``path`` (a ``.safetensors`` file, or a directory) atomically, and
    ``card.json`` beside it.

    Returns:
        The path of the safetensors file.
    """
    from selfspec.version import __version__

    target = resolve_path(path, heads.card.model)
    heads.card.created = datetime.now(timezone.utc).isoformat(timespec="seconds")
    heads.card.selfspec_version = __version__
    card_json = json.dumps(heads.card.to_dict(), indent=1)
    tensors = _tensors(heads)
    metadata = {"format": FORMAT_TAG, "card": card_json}
    # safetensors' save_file creates 0600 files; writing its bytes ourselves honours the umask.
    _atomic_write(target, lambda tmp: Path(tmp).write_bytes(save(tensors, metadata=metadata)))
    _atomic_write(target.parent / CARD_NAME, lambda tmp: Path(tmp).write_text(card_json + "\n"))
    logger.info("saved heads at layers %s to %s", heads.layers, target)
    return target


# --------------------------------------------------------------------------------- load
@dataclass
class HeadFile:
    """A head file as stored: its card and float32 tensors by name (layout in the module doc),
    and the path it was read from."""

    card: HeadCard
    tensors: dict[str, torch.Tensor]
    path: Path


def _corrupt(path: Path, why: str) -> CorruptModelFileError:
    return CorruptModelFileError(
        f"head file {path} is truncated or damaged ({why}). Train the heads again into it "
        "(`selfspec heads train --out PATH`) or restore a good copy.")


def _not_heads(path: Path, why: str) -> CorruptModelFileError:
    # Not ours (e.g. the model's own model.safetensors): never advise deleting it.
    return CorruptModelFileError(
        f"{path} is not a selfspec head file ({why}); point --heads / heads= at a file "
        "written by `selfspec heads train` (or 'default').")


def read_head_file(path: str | os.PathLike, model: str | None = None) -> HeadFile:
    """Read a head file's card and tensors without a model (``selfspec heads show``).

    Args:
        path: as for :func:`load_heads`; ``model`` names the model whose heads folder
            ``"default"`` and a bare folder name refer to (:func:`find_head_file`).

    Raises:
        HeadsNotFoundError: no file at ``path``.
        CorruptModelFileError: unreadable, truncated, or not a selfspec head file.
    """
    target = find_head_file(path, model)
    if not target.is_file():
        raise HeadsNotFoundError(_missing(path, target, model))
    return _read(target)


def _missing(path: str | os.PathLike, target: Path, model: str | None) -> str:
    """The not-found message for ``path`` (resolved to ``target``): how to train a missing
    default, and where a bare name was looked up."""
    text = str(path)
    if text == DEFAULT:
        return (f"no default heads for model {model!r} at {target.parent}; train them with "
                f"`selfspec heads train --model {model}`")
    if text == DEFAULT_PROBES:
        return (f"no default probes for model {model!r} at {target.parent}; train one with "
                f"`selfspec heads train-probe --model {model} --exit-layer E`")
    hint = f"no head file at {target}"
    if model and _bare_name(path):
        hint += (f" (nor at {default_heads_dir(model).parent / text / FILE_NAME}, where a bare "
                 f"name is looked up)")
    return hint


def _read(path: Path) -> HeadFile:
    if not path.is_file():
        raise HeadsNotFoundError(f"no head file at {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            # Copies, not views of the file's memory map: a head file rewritten in place
            # later (cp, an editor) must not change heads and thresholds of a running process.
            tensors = {name: f.get_tensor(name).clone() for name in f.keys()}
    except (SafetensorError, OSError, RuntimeError, ValueError) as err:
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CorruptModelFileError(
            f"cannot read {path} as a safetensors file ({why}). If it is a selfspec head file "
            "it is truncated or damaged: train the heads again into it (`selfspec heads train "
            "--out PATH`) or restore a good copy; otherwise point --heads / heads= at a head "
            "file.") from err
    if metadata.get("format") != FORMAT_TAG or "card" not in metadata:
        raise _not_heads(path, "its 'format'/'card' metadata is missing")
    try:
        card = HeadCard.from_dict(json.loads(metadata["card"]))
    except (KeyError, TypeError, ValueError) as err:
        raise _corrupt(path, f"unreadable card: {err}") from err
    return HeadFile(card, tensors, path)


def load_heads(path: str | os.PathLike, source: object, *, check_model: bool = True) -> ExitHeads:
    """Load exit heads (and probes, calibration) for a model.

    Args:
        path: ``"default"`` (``$SELFSPEC_HOME/heads/<model>/default/``), a directory holding
            ``heads.safetensors``, the file itself, or a bare folder name under
            ``$SELFSPEC_HOME/heads/<model>/`` (``"lensstate"``; :func:`find_head_file`).
        source: the model they are for: a ``SelfSpec`` engine, a ``LayerExecutor`` or an HF
            causal LM. Heads are built in that model's dtype and device and share its
            ``lm_head``.
        check_model: compare the file's model fingerprint with ``source`` (turn off only to
            inspect heads on purpose with another model).

    Returns:
        :class:`ExitHeads` in inference mode.

    Raises:
        HeadsNotFoundError: no file (for ``"default"``: no default heads trained yet).
        HeadsModelMismatchError: the heads belong to another model.
        CorruptModelFileError: the file is truncated, damaged or incomplete.
    """
    name = model_name(source)
    target = find_head_file(path, name)
    if not target.is_file():
        raise HeadsNotFoundError(_missing(path, target, name))
    raw = _read(target)
    card = raw.card
    out = output_layer(source)
    if check_model:
        mine = fingerprint(_model_config(source), out)
        if not card.fingerprint.matches(mine):
            raise HeadsModelMismatchError(
                f"the heads in {target} belong to model {card.model!r} (fingerprint "
                f"{card.fingerprint.short()}), not to the loaded model {name!r} (fingerprint "
                f"{mine.short()}). Load model {card.model!r}, or train heads for this model with "
                f"`selfspec heads train --model {name}`.")
    _check_layers(card, int(_model_config(source).num_hidden_layers), target,
                  same_depth=check_model)
    return _build(raw, out, target)


def _check_layers(card: HeadCard, num_layers: int, target: Path, same_depth: bool) -> None:
    """Every exit layer the card names (heads, probes, predictors) lies in ``[1, L-1]`` of the
    model the heads are loaded for, so a bad card fails at load time, not mid-generation.

    Raises:
        HeadsModelMismatchError: a layer outside the model, or a card written for a model of
            another depth.
    """
    named = {"exit head": list(card.layers),
             "probe": [p.exit_layer for p in card.probes]}
    if card.predictors is not None:
        named["predictor"] = [*card.predictors.layers, card.predictors.candidate_layer]
    bad = [f"{what} at layer {layer}" for what, layers in named.items() for layer in layers
           if not 1 <= layer <= num_layers - 1]
    if (same_depth and card.num_layers != num_layers) or bad:
        raise HeadsModelMismatchError(
            f"the card of {target} is for a {card.num_layers}-layer model"
            + (f" and names {', '.join(bad)}" if bad else "")
            + f", but the loaded model has {num_layers} layers (exit layers 1..{num_layers - 1}). "
            f"Load the model the heads were trained for ({card.model!r}), or train heads for "
            "this one with `selfspec heads train`.")


def _build(raw: HeadFile, out: OutputLayer, target: Path) -> ExitHeads:
    card, tensors = raw.card, raw.tensors
    dtype, device = out.weight.dtype, out.weight.device
    heads: list[ExitHead] = []
    try:
        for layer in card.layers:
            prefix = f"head.{layer}."
            own = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
            # A fresh lightweight head or lm_head-initialised full head; its tensors are then
            # overwritten (the random init would only cost time).
            head = make_head(card.kind or "", layer, out, init="lm_head", dtype=dtype)
            head.load_tensors({k: v.to(device) for k, v in own.items()})
            heads.append(head.prepare_inference())
        probes: dict[int, LinearProbe] = {}
        sampled: dict[int, LinearProbe] = {}
        for key in tensors:
            match = re.fullmatch(r"probe\.(\d+)\.(sampled\.)?weight", key)
            if match:
                layer = int(match.group(1))
                probe = LinearProbe(layer, card.hidden_size)
                probe.weight.data.copy_(tensors[key])
                probe.bias.data.copy_(tensors[key.removesuffix("weight") + "bias"])
                (sampled if match.group(2) else probes)[layer] = (
                    probe.to(device).eval().requires_grad_(False))
        calibration = _calibration_sets(card, tensors, "calib.{}.")
        by_vocab = {k: _calibration_sets(card, tensors, f"calib.{{}}.v{k}.")
                    for k in card.calibration_draft_vocabs}
        predictors = None
        if card.predictors is not None:
            pc = card.predictors
            predictors = ExitPredictors(pc.layers, pc.num_candidates, pc.hidden, pc.state_dim)
            predictors.load_tensors({k[len("predictor."):]: v for k, v in tensors.items()
                                     if k.startswith("predictor.")})
            predictors = predictors.to(device).eval().requires_grad_(False)
        drafter = exit_drafter = None
        if card.drafter is not None:
            drafter = _drafter(card, tensors, "drafter.", device, dtype)
            if card.drafter.exit_state_layers:
                exit_drafter = _drafter(card, tensors, "exit_drafter.", device, dtype)
        counts = tensors.get("vocab.token_counts")
        if counts is not None and tuple(counts.shape) != (out.vocab_size,):
            raise InvalidArgumentError(
                f"vocab.token_counts has shape {tuple(counts.shape)}, expected ({out.vocab_size},)")
    except (InvalidArgumentError, KeyError, RuntimeError) as err:
        raise _corrupt(target, f"incomplete tensors: {err}") from err
    return ExitHeads(list(card.layers), heads, card, probes, calibration,
                     None if counts is None else counts.to(torch.int64), sampled, by_vocab,
                     predictors, drafter, exit_drafter)


def _drafter(card: HeadCard, tensors: dict[str, torch.Tensor], prefix: str,
             device: torch.device | str, dtype: torch.dtype) -> FeatureDrafter:
    """The drafter stored under ``prefix`` (raises ``InvalidArgumentError`` when a tensor
    is missing or misshapen)."""
    drafter = FeatureDrafter(card.hidden_size)
    drafter.load_tensors({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
    return drafter.to(device=device, dtype=dtype).eval().requires_grad_(False)


def _calibration_sets(card: HeadCard, tensors: dict[str, torch.Tensor], prefix: str
                      ) -> dict[int, CalibrationSet]:
    """Calibration vectors stored under ``prefix.format(layer)``, by layer."""
    out = {}
    for layer in card.layers:
        key = prefix.format(layer)
        if key + "correct" in tensors:
            scores = {m: tensors[key + m] for m in card.calibration_metrics if key + m in tensors}
            out[layer] = CalibrationSet(layer, tensors[key + "correct"].bool(), scores)
    return out


def new_card(source: object, kind: str | None, layers: list[int]) -> HeadCard:
    """An empty :class:`HeadCard` for heads of ``kind`` at ``layers`` of model ``source``."""
    out = output_layer(source)
    config = _model_config(source)
    return HeadCard(model=model_name(source), fingerprint=fingerprint(config, out), kind=kind,
                    layers=sorted(layers), num_layers=int(config.num_hidden_layers),
                    hidden_size=out.hidden_size, vocab_size=out.vocab_size)

