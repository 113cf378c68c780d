"""Held-out check: which benchmark prompts shaped a method's heads, thresholds or probes?

A head file's card lists every prompt that trained its heads, ranked its draft vocabulary,
calibrated its thresholds τ_k(ε) or fitted its probes (:class:`selfspec.heads.card.PromptUse`);
a SWIFT skip-set file (:mod:`selfspec.heads.skip_set`) lists the prompts its search scored.
Before a run, :func:`check_held_out` compares the benchmark's prompts with the cards of the
head files its methods read: by default prompts seen there are dropped (a benchmark on them
would overstate acceptance and speed); with ``allow_in_sample`` they stay and the run is
labelled in-sample in the table, ``report.md`` and ``summary.json`` (docs/design.md,
"Held-out evaluation").

A dataset may also keep a calibration split of its own for anything tuned on it
(:func:`selfspec.data.calibration_ids`; ``json-extract``): those prompts count as seen in the
same way, so a reported run holds only the dataset's held-out prompts.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from selfspec.bench.spec import MethodConfig
from selfspec.data import Prompt, calibration_ids
from selfspec.errors import SelfSpecError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeldOutCheck:
    """The outcome of :func:`check_held_out`.

    Attributes:
        prompts: the prompts to run (held-out ones, plus in-sample ones if allowed).
        in_sample: ids of the benchmark prompts some head file saw (dropped or kept).
        dropped: ids of the prompts removed (empty when in-sample prompts are allowed).
        files: head file → the method labels that read it (every file checked).
        considered: how many of the given prompts were looked at (all of them, or up to the
            last one needed to fill ``limit``).
        replaced: dropped prompts were replaced by later ones (a ``limit`` was given).
        split: the dataset whose calibration split counts as seen (``""``: none has one).
    """

    prompts: list[Prompt]
    in_sample: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    files: dict[str, list[str]] = field(default_factory=dict)
    considered: int = 0
    replaced: bool = False
    split: str = ""

    @property
    def sources(self) -> list[str]:
        """What saw prompts: the head files, then the dataset's calibration split."""
        split = [f"tuning on {self.split}'s calibration split"] if self.split else []
        return list(self.files) + split

    @property
    def is_in_sample(self) -> bool:
        """True when the run includes prompts that heads, thresholds or probes saw."""
        return len(self.in_sample) > len(self.dropped)

    def describe(self, total: int) -> str:
        """One line for the report header (``total`` = prompts before the check)."""
        if not self.sources:
            return "held out: no method reads trained heads, thresholds or probes"
        names = ", ".join(f"`{f}`" if f in self.files else f for f in self.sources)
        if self.is_in_sample:
            return (f"**IN-SAMPLE RUN**: {len(self.in_sample)} of {total} prompts were seen in "
                    f"training, calibration or probe fitting by {names} (--allow-in-sample)")
        dropped = ""
        if self.dropped and self.replaced:
            dropped = (f"; {len(self.dropped)} prompts seen there were replaced by the next "
                       f"held-out ones ({', '.join(self.dropped)})")
        elif self.dropped:
            dropped = f"; {len(self.dropped)} of {total} prompts seen there were dropped"
        return f"held out: all {len(self.prompts)} prompts are unseen by {names}{dropped}"


def seen_prompts(card, dataset: str, prompts: Sequence[Prompt]) -> set[str]:
    """Ids among ``prompts`` (of ``dataset``) that ``card`` (a ``HeadCard``) saw."""
    return {p.id for p in prompts} & card.seen_prompts().get(dataset, set())


def check_held_out(prompts: Sequence[Prompt], dataset: str, methods: Sequence[MethodConfig],
                   model: str, allow_in_sample: bool = False,
                   limit: int | None = None) -> HeldOutCheck:
    """Compare ``prompts`` with the cards of every head file ``methods`` read and with
    ``dataset``'s own calibration split (:func:`selfspec.data.calibration_ids`).

    Args:
        prompts: the benchmark prompts, of ``dataset`` (a ``selfspec.data`` name, or the label
            of a prompt file, which no head file lists).
        methods: the benchmark's methods (transformers baselines read no head file).
        model: the model's name (resolves ``heads=default``).
        allow_in_sample: keep seen prompts (the run is then in-sample) instead of dropping.
        limit: keep the first ``limit`` prompts that are kept, so that a dropped prompt is
            replaced by the next one (``None``: every prompt is looked at).

    Returns:
        :class:`HeldOutCheck`. A missing or unreadable head file is skipped here: its method
        fails with that error when it is built, and the others run.
    """
    from selfspec.heads.files import find_head_file, read_head_file
    from selfspec.heads.skip_set import (
        HELD_OUT_PREFIX,
        read_skip_set,
        resolve_skip_set_path,
    )
    from selfspec.methods.registry import heads_files

    files: dict[str, list[str]] = {}
    skip_sets: set[str] = set()  # JSON skip-set files (SWIFT), named "skip-set:PATH"
    for method in methods:
        if method.is_baseline:
            continue
        for name in heads_files(method.name, method.method_options):
            if name.startswith(HELD_OUT_PREFIX):
                path = str(resolve_skip_set_path(name[len(HELD_OUT_PREFIX):], model))
                skip_sets.add(path)
            else:
                path = str(find_head_file(name, model))
            files.setdefault(path, []).append(method.label)
    seen = calibration_ids(dataset) & {p.id for p in prompts}
    for path in list(files):
        try:
            card = read_skip_set(path).card if path in skip_sets else read_head_file(path).card
        except SelfSpecError as err:
            logger.info("held-out check skips %s: %s", path, err)
            del files[path]
            continue
        seen |= seen_prompts(card, dataset, prompts)
    kept: list[Prompt] = []
    considered = 0
    for prompt in prompts:
        if limit is not None and len(kept) == limit:
            break
        considered += 1
        if allow_in_sample or prompt.id not in seen:
            kept.append(prompt)
    in_sample = [p.id for p in prompts[:considered] if p.id in seen]
    dropped = [] if allow_in_sample else in_sample
    if limit is not None and len(kept) < limit:
        logger.warning("only %d of the %d prompts asked for are held out", len(kept), limit)
    return HeldOutCheck(kept, in_sample, dropped, files, considered,
                        replaced=limit is not None and considered > limit,
                        split=dataset if calibration_ids(dataset) else "")
