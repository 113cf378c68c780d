"""The hidden-state cache: one backbone pass per dataset, reused by every head and epoch.

For a list of :class:`~selfspec.training.corpus.CorpusItem` the frozen backbone runs once
(teacher forcing, batch 1, no gradient) and, for every scored position, we keep:

- ``hidden[layer]`` ``[N, H]``: the hidden state leaving each requested layer (what a head
  at that layer reads), in the model's dtype — exactly what the executor hands a head
  during decoding;
- ``final`` ``[N, H]``: the last layer's hidden state *before* the final norm. The teacher
  distribution is recomputed from it on the fly as ``softmax(lm_head(norm(final)))``: this
  is exact (the full ``V``-way distribution, which forward and reverse KL both need) and
  cheap (one ``[N, H]`` row per token instead of ``V`` floats; the ``lm_head`` matmul costs
  no more than one head's forward). Storing top-k logits instead would save nothing and
  lose the tail of the distribution;
- ``teacher_token`` ``[N]``: the final layer's argmax from the backbone pass itself (the
  token greedy decoding emits; DSSD eq. 2's reference);
- ``labels`` ``[N]``: the next token of the text (for the cross-entropy loss);
- ``split`` ``[N]``: train / calibration / test, by problem.

On disk, under ``<cache_root>/features/<source>-<key>/`` (``key`` = sha256 of the items'
tokens, scored ranges and splits, plus the model dtype), one safetensors file per layer
(``layer_<l>.safetensors``) and ``meta.safetensors`` (final, teacher tokens, labels,
splits). Each file is written to a temporary name and renamed, so an interrupted pass
leaves no partial file; layers missing from a cache entry are computed by one more pass.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save
from tqdm.auto import tqdm

from selfspec.errors import InvalidArgumentError
from selfspec.training.corpus import CorpusItem

logger = logging.getLogger(__name__)


@dataclass
class FeatureSet:
    """Scored positions of a corpus, as seen by the frozen backbone (see the module doc).

    Attributes:
        hidden: ``{layer: [N, H]}`` hidden states leaving layer ``layer - 1``.
        final: ``[N, H]`` last-layer hidden states before the final norm.
        teacher_token: ``[N]`` int64 final-layer argmax.
        labels: ``[N]`` int64 next tokens of the text.
        split: ``[N]`` int8 (``corpus.TRAIN``, ``CALIBRATION``, ``TEST``).
        source: ``[N]`` int16 index into ``sources``.
        sources: data-spec names.
    """

    hidden: dict[int, torch.Tensor]
    final: torch.Tensor
    teacher_token: torch.Tensor
    labels: torch.Tensor
    split: torch.Tensor
    source: torch.Tensor
    sources: list[str]

    @property
    def num_tokens(self) -> int:
        """``N``, the scored positions."""
        return int(self.final.shape[0])

    def count(self, split: int) -> int:
        """Scored tokens in ``split``."""
        return int((self.split == split).sum())

    def indices(self, *splits: int) -> torch.Tensor:
        """``[n]`` int64 positions whose split is one of ``splits``."""
        mask = torch.zeros_like(self.split, dtype=torch.bool)
        for s in splits:
            mask |= self.split == s
        return torch.nonzero(mask).reshape(-1)

    @staticmethod
    def concat(parts: Sequence[FeatureSet]) -> FeatureSet:
        """Concatenate feature sets with the same layers."""
        if not parts:
            raise InvalidArgumentError("no features to concatenate (empty corpus?)")
        layers = set(parts[0].hidden)
        sources: list[str] = []
        source_idx = []
        for p in parts:
            if set(p.hidden) != layers:
                raise InvalidArgumentError("feature sets hold different layers")
            remap = torch.tensor([_index(sources, s) for s in p.sources], dtype=torch.int16)
            source_idx.append(remap[p.source.long()])
        return FeatureSet(
            hidden={lay: torch.cat([p.hidden[lay] for p in parts]) for lay in layers},
            final=torch.cat([p.final for p in parts]),
            teacher_token=torch.cat([p.teacher_token for p in parts]),
            labels=torch.cat([p.labels for p in parts]),
            split=torch.cat([p.split for p in parts]),
            source=torch.cat(source_idx),
            sources=sources)


def _index(items: list[str], value: str) -> int:
    if value not in items:
        items.append(value)
    return items.index(value)


def _key(items: Sequence[CorpusItem], dtype: torch.dtype) -> str:
    digest = hashlib.sha256(str(dtype).encode())
    for item in items:
        digest.update(f"{item.prompt_id}|{item.score_from}|{item.split}|".encode())
        digest.update(torch.tensor(item.token_ids, dtype=torch.int64).numpy().tobytes())
    return digest.hexdigest()[:16]


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = str(path.parent / f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        # save() + a plain write, not save_file (which creates 0600 files): honours the umask.
        Path(tmp).write_bytes(save({k: v.contiguous() for k, v in tensors.items()}))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _try_load(path: Path) -> dict[str, torch.Tensor] | None:
    if not path.is_file():
        return None
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, RuntimeError) as err:
        logger.warning("recomputing unreadable feature cache file %s (%s)", path, err)
        return None


@torch.inference_mode()
def backbone_pass(executor: object, items: Sequence[CorpusItem], layers: Sequence[int],
                  progress: bool = True, desc: str = "backbone") -> FeatureSet:
    """Run the frozen backbone over ``items`` and collect the scored positions.

    Args:
        executor: the model's ``LayerExecutor``.
        items: corpus items (one forward each, batch 1).
        layers: exit layers whose hidden states to keep (each in ``[1, L-1]``).
        progress: show a tqdm bar (tokens).
        desc: bar label.

    Returns:
        A :class:`FeatureSet` with ``hidden`` for ``layers``.
    """
    layers = sorted(set(layers))
    num_layers = executor.num_layers
    bounds = layers + [num_layers]
    hidden: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
    final, teacher, labels, splits = [], [], [], []
    total = sum(len(i.token_ids) for i in items)
    with tqdm(total=total, desc=desc, unit="tok", disable=not progress, leave=False) as bar:
        for item in items:
            ids = torch.tensor([item.token_ids], device=executor.device)  # [1, T]
            length = ids.shape[1]
            positions = torch.arange(length, device=executor.device).unsqueeze(0)
            cache = executor.new_cache(1, capacity=length)
            lo, hi = item.score_from, length - 1  # scored positions [lo, hi)
            h = executor.embed(ids)
            start = 0
            for end in bounds:
                h = executor.run_layers(h, positions, start, end, cache)
                if end in hidden:
                    hidden[end].append(h[0, lo:hi].clone())
                start = end
            final.append(h[0, lo:hi].clone())
            teacher.append(executor.logits(h[:, lo:hi])[0].argmax(-1))
            labels.append(ids[0, lo + 1:hi + 1])
            splits.append(torch.full((hi - lo,), item.split, dtype=torch.int8))
            bar.update(length)
    return FeatureSet(
        hidden={layer: torch.cat(v) for layer, v in hidden.items()},
        final=torch.cat(final), teacher_token=torch.cat(teacher).long(),
        labels=torch.cat(labels).long(), split=torch.cat(splits),
        source=torch.zeros(sum(i.num_scored for i in items), dtype=torch.int16),
        sources=[items[0].source] if items else [])


def load_features(executor: object, items: Sequence[CorpusItem], layers: Sequence[int],
                  cache_root: Path | None, progress: bool = True) -> FeatureSet:
    """Features of ``items`` at ``layers``, from the disk cache where present.

    Items are grouped by source; each source's entry is keyed by its items' tokens and the
    model dtype, so a different selection or dtype never reads stale states. Missing layers
    (or a missing entry) cost one backbone pass over that source.

    Args:
        executor: the model's ``LayerExecutor``.
        items: corpus items.
        layers: exit layers needed.
        cache_root: the model's cache directory, or ``None`` to keep nothing on disk.
        progress: tqdm bars.

    Raises:
        InvalidArgumentError: ``items`` is empty.
    """
    if not items:
        raise InvalidArgumentError("the corpus is empty: no text to train or calibrate on")
    layers = sorted(set(layers))
    parts = [_load_source(executor, source, group, layers, cache_root, progress)
             for source, group in by_source(items).items()]
    return FeatureSet.concat(parts)


def by_source(items: Sequence[CorpusItem]) -> dict[str, list[CorpusItem]]:
    """``items`` grouped by source, sources in order of first appearance: the order in which
    :func:`load_features` lays out their scored positions."""
    groups: dict[str, list[CorpusItem]] = {}
    for item in items:
        groups.setdefault(item.source, []).append(item)
    return groups


def _load_source(executor: object, source: str, items: list[CorpusItem], layers: list[int],
                 cache_root: Path | None, progress: bool) -> FeatureSet:
    entry = None
    if cache_root is not None:
        safe = source.replace(":", "-")
        entry = cache_root / "features" / f"{safe}-{_key(items, executor.dtype)}"
    meta = _try_load(entry / "meta.safetensors") if entry else None
    have = {}
    if entry is not None:
        for layer in layers:
            tensors = _try_load(entry / f"layer_{layer}.safetensors")
            if tensors is not None:
                have[layer] = tensors["hidden"]
    missing = [layer for layer in layers if layer not in have]
    if meta is None or missing:
        computed = backbone_pass(executor, items, missing or layers[:1], progress, desc=source)
        if entry is not None:
            _atomic_save({"final": computed.final, "teacher_token": computed.teacher_token,
                          "labels": computed.labels, "split": computed.split},
                         entry / "meta.safetensors")
            for layer, h in computed.hidden.items():
                _atomic_save({"hidden": h}, entry / f"layer_{layer}.safetensors")
        have.update(computed.hidden)
        meta = {"final": computed.final, "teacher_token": computed.teacher_token,
                "labels": computed.labels, "split": computed.split}
    else:
        logger.info("features of %s loaded from %s", source, entry)
    n = meta["final"].shape[0]
    return FeatureSet(hidden={layer: have[layer] for layer in layers}, final=meta["final"],
                      teacher_token=meta["teacher_token"], labels=meta["labels"],
                      split=meta["split"], source=torch.zeros(n, dtype=torch.int16),
                      sources=[source])

