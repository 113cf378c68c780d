"""What a method is: a :class:`MethodSpec` (name, ``Options``, lossless, paper, ``build``) and
the :class:`MethodContext` its ``build`` receives (the executor and the head files it loads).

A method module under :mod:`selfspec.methods` defines an ``Options`` dataclass (fields
declared with :func:`selfspec.methods.options.option`) and exports ``SPEC``; the registry
lists the modules. Everything else — CLI flags, API keywords, benchmark specs, validation,
``selfspec methods`` — is derived from the spec.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from selfspec.decoding.core.batch import BatchStep, SoloRows
from selfspec.decoding.core.loop import Step
from selfspec.decoding.core.speculative import Drafter
from selfspec.decoding.core.stop_rule import StopRule
from selfspec.decoding.drafting.draft_vocab import (
    DraftVocab,
    frequent_rows,
    restricted_head,
)
from selfspec.decoding.memory import EngineMemory
from selfspec.decoding.ngram.lookup import SuffixAutomaton
from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.executor.cost_model import LatencyModel, cached_latency
from selfspec.methods.draft_copy import DraftWeightsOptions
from selfspec.methods.options import (
    OptionField,
    check_model_bounds,
    model_symbols,
    option_fields,
    parse_options,
)

#: ``wrap(rule) -> rule``: how a composing method (``auto``) gives a drafter its stop rule at
#: construction, e.g. a :class:`~selfspec.decoding.planning.tpt_stop.TptStopRule` around the
#: method's own.
WrapStopRule = Callable[[StopRule], StopRule]


def wrapped(rule: StopRule, wrap: WrapStopRule | None) -> StopRule:
    """``wrap(rule)``, or ``rule`` itself without a ``wrap``: a drafter builder's stop rule."""
    return rule if wrap is None else wrap(rule)


class MethodContext:
    """The model a method is built for, and what methods load for it once.

    Head files are cached by resolved path, size and modification time, so a file that was
    retrained or recalibrated is read again; reduced draft vocabularies and heads restricted
    to them are cached per loaded head file.

    Args:
        executor: the model's executor.
        tokenizer: the model's tokenizer (what a corpus-ranked draft vocabulary counts
            with: :meth:`corpus_vocab`), or ``None``.
    """

    def __init__(self, executor: LayerExecutor, tokenizer: Any = None) -> None:
        self.executor = executor
        self.tokenizer = tokenizer
        self._heads: dict[tuple, Any] = {}
        self._derived: dict[tuple, tuple[Any, Any]] = {}
        self._latency: dict[tuple, LatencyModel] = {}
        self._memory: EngineMemory | None = None

    def latency(self, executor: LayerExecutor | None = None) -> LatencyModel:
        """The measured sub-layer latencies on this machine of the model on its current
        decoding kernel, or of ``executor`` (a :meth:`~LayerExecutor.draft_view` of it on
        quantized weights), measured once (a few seconds) and then read from
        ``$SELFSPEC_HOME/latency``."""
        from selfspec.models.provision import selfspec_home

        executor = self.executor if executor is None else executor
        # The decoding kernel can change between generations (the bench's decode_kernel=).
        key = (executor.draft_weights, executor.formats.rows, executor.formats.rows_min_bytes)
        if key not in self._latency:
            self._latency[key] = cached_latency(executor, selfspec_home())
        return self._latency[key]

    def draft_executor(self, options: DraftWeightsOptions) -> LayerExecutor:
        """The executor a method with ``options`` drafts on: the model's own when
        ``options.draft_weights`` is ``None``, else its
        :meth:`~LayerExecutor.draft_view` in that format (quantized once per format and
        kept by the executor, so every method and generation shares one copy).

        Raises:
            InvalidArgumentError: a format without a kernel on this machine.
        """
        fmt = options.draft_weights
        return self.executor if fmt is None else self.executor.draft_view(fmt)

    def memory(self) -> EngineMemory:
        """What methods learnt from earlier generations of this context (the engine, or the
        server), kept for its life: the suffix automaton of earlier texts and ``auto``'s
        drafter estimates (:mod:`selfspec.decoding.memory`)."""
        if self._memory is None:
            self._memory = EngineMemory()
        return self._memory

    def history(self) -> SuffixAutomaton:
        """The engine's suffix automaton of earlier texts (finished prompts + outputs): the
        n-gram drafters' second source (:mod:`selfspec.decoding.ngram.lookup`)."""
        return self.memory().history

    def use_memory(self, memory: EngineMemory | None) -> EngineMemory | None:
        """Make ``memory`` the one :meth:`memory` returns (``None``: a new one on next use);
        returns the previous one. A benchmark gives each method its own, so no method drafts
        from another's output of the same prompt or starts from another's estimates."""
        previous, self._memory = self._memory, memory
        return previous

    def heads(self, path: str | os.PathLike) -> Any:
        """The :class:`selfspec.heads.ExitHeads` at ``path`` (``"default"``,
        ``"default-probes"``, a head file or directory) for this model.

        Raises:
            HeadsNotFoundError, HeadsModelMismatchError, CorruptModelFileError: see
                :func:`selfspec.heads.load_heads`.
        """
        from selfspec.heads import load_heads
        from selfspec.heads.files import find_head_file

        resolved = find_head_file(path, self.executor.name)
        return self.file_cached("heads", resolved, lambda: load_heads(path, self.executor))

    def file_cached(self, kind: str, path: Path, load: Callable[[], Any]) -> Any:
        """``load()``'s result for the file at ``path``, kept while the file is unchanged
        (keyed by ``kind``, resolved path, size and mtime); a missing file is loaded each
        time so its not-found error surfaces."""
        try:
            stat = path.stat()
        except OSError:
            return load()
        key = (kind, str(path.resolve()), stat.st_size, stat.st_mtime_ns)
        if key not in self._heads:
            self._heads[key] = load()
        return self._heads[key]

    def draft_vocab(self, trained: Any, size: int) -> DraftVocab:
        """The ``size`` most frequent tokens by ``trained``'s token counts, plus EOS ids.

        Raises:
            InvalidArgumentError: heads without token counts or a bad size.
        """
        from selfspec.models.eos import eos_token_ids

        counts = None if trained is None else trained.token_counts
        if counts is None:
            raise InvalidArgumentError(
                "draft_vocab ranks tokens by the token counts stored with trained heads: give "
                "heads=PATH or heads=default (--heads on the command line); heads not yet "
                "calibrated need `selfspec heads calibrate PATH` once")
        return self.derived("vocab", trained, size, lambda: frequent_rows(
            counts, size, eos_token_ids(self.executor.model)))

    def corpus_vocab(self, size: int) -> DraftVocab:
        """The ``size`` most frequent tokens of the tokenizer over the offline corpus, plus
        EOS ids: a draft vocabulary without trained heads
        (:mod:`selfspec.decoding.drafting.corpus_vocab`; counted once per tokenizer).

        Raises:
            InvalidArgumentError: no tokenizer, or a bad size.
        """
        from selfspec.decoding.drafting.corpus_vocab import corpus_counts, corpus_vocab
        from selfspec.models.eos import eos_token_ids
        from selfspec.models.provision import selfspec_home

        def build() -> DraftVocab:
            counts = self.derived("corpus-counts", self.executor, None, lambda: corpus_counts(
                self.tokenizer, self.executor.vocab_size, selfspec_home()))
            return corpus_vocab(counts, size, eos_token_ids(self.executor.model, self.tokenizer))

        return self.derived("corpus-vocab", self.executor, size, build)

    def derived(self, kind: str, owner: Any, options: Hashable, build: Callable[[], Any]) -> Any:
        """``build()``'s result for ``owner`` (trained heads, say) and ``options``, built once
        for the context's life (``owner`` is held, so its ``id`` stays unique): what a method
        prepares from heads (a draft vocabulary, restricted heads, SpecEE's checked kernels)."""
        key = (kind, id(owner), options)
        if key not in self._derived:
            self._derived[key] = (owner, build())
        return self._derived[key][1]

    def restricted(self, head: Any, vocab: DraftVocab) -> Callable:
        """``head`` (``None`` = the model's own output) scoring only ``vocab.rows``."""
        return self.derived("restricted", head, vocab.key,
                            lambda: restricted_head(self.executor, head, vocab))


@dataclass(frozen=True)
class MethodSpec:
    """One decoding method.

    Attributes:
        name: the name used by ``--method``, ``generate(method=...)`` and ``--methods``.
        summary: one line for ``selfspec methods`` and reports.
        lossless: greedy output equals autoregressive greedy output (and sampling keeps the
            model's distribution).
        paper: the paper and section it implements.
        options: its ``Options`` dataclass.
        build: ``build(context, options) -> Step`` for one generation; raises
            :class:`InvalidArgumentError` for options the model cannot take.
        heads_files: ``heads_files(options) -> [path]``: the head files it reads (what a
            benchmark checks its prompts against).
        lossy_when: ``lossy_when(options) -> bool``: options that make a lossless method
            lossy (an ablation such as AdaDecode without verification).
        processes_logits_when: ``processes_logits_when(options) -> bool``: whether the
            method with these options supports output processing (grammars, penalties,
            logprobs; ``Step.processes_logits``); True unless a lossy Step picks tokens
            without the full distribution (SpecEE without verification).
        unused_when: ``unused_when(options) -> {names}``: options these options make
            irrelevant (AdaDecode's ``tuned`` sets ``gamma``; a sweep plot then does not
            place the row at ``gamma``'s default).
        build_batch: ``build_batch(context, options) -> BatchStep`` advancing a ragged batch
            of rows with shared forwards (:mod:`selfspec.decoding.core.batch`); ``None`` = rows run
            one after another with the method's own Step (:class:`SoloRows`).
        drafter: ``drafter(context, options, wrap) -> Drafter`` for a method whose Step is a
            :class:`~selfspec.decoding.core.speculative.SpeculativeStep` around one drafter:
            the drafter alone, its stop rule ``wrap(rule)`` of the method's own ``rule``
            (``wrap=None``: the rule itself). What ``auto`` composes its model drafters from;
            ``None`` = the method has no drafter of its own to lend.
    """

    name: str
    summary: str
    lossless: bool
    paper: str
    options: type
    build: Callable[[MethodContext, Any], Step]
    heads_files: Callable[[Any], list[str]] = field(default=lambda options: [])
    lossy_when: Callable[[Any], bool] = field(default=lambda options: False)
    unused_when: Callable[[Any], set[str]] = field(default=lambda options: set())
    processes_logits_when: Callable[[Any], bool] = field(default=lambda options: True)
    build_batch: Callable[[MethodContext, Any], BatchStep] | None = None
    drafter: Callable[[MethodContext, Any, WrapStopRule | None], Drafter] | None = None

    def lossless_for(self, values: Mapping[str, Any] | Any) -> bool:
        """Whether the method with these options (a mapping or an ``Options``) is lossless.

        Raises:
            InvalidArgumentError: see :meth:`parse`.
        """
        options = values if isinstance(values, self.options) else self.parse(values)
        return self.lossless and not self.lossy_when(options)

    def processes_logits_for(self, values: Mapping[str, Any] | Any) -> bool:
        """Whether the method with these options supports output processing (a grammar,
        penalties, logprobs), known before anything is built.

        Raises:
            InvalidArgumentError: see :meth:`parse`.
        """
        options = values if isinstance(values, self.options) else self.parse(values)
        return self.processes_logits_when(options)

    @property
    def fields(self) -> tuple[OptionField, ...]:
        """Its options, in declaration order."""
        return option_fields(self.options)

    @property
    def option_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def parse(self, values: Mapping[str, Any], executor: LayerExecutor | None = None) -> Any:
        """An ``Options`` instance from keyword values (strings are parsed); with
        ``executor``, model-dependent ranges are checked too.

        Raises:
            InvalidArgumentError: unknown option, wrong type, value out of range.
        """
        symbols = None if executor is None else model_symbols(executor)
        return parse_options(self.options, values, self.name, symbols)

    def make_step(self, context: MethodContext, values: Mapping[str, Any] | Any) -> Step:
        """Validate ``values`` (a mapping or an ``Options`` instance) for this model and build
        the Step of one generation.

        Raises:
            InvalidArgumentError: see :meth:`parse`; a value outside its range for this model.
        """
        options = (values if isinstance(values, self.options)
                   else self.parse(values, context.executor))
        check_model_bounds(options, context.executor, self.name)
        return self.build(context, options)

    def make_drafter(self, context: MethodContext, values: Mapping[str, Any] | Any,
                     wrap: WrapStopRule | None = None) -> Drafter:
        """Validate ``values`` (a mapping or an ``Options`` instance) for this model and build
        the method's drafter alone, its stop rule ``wrap(rule)`` of the method's own (see
        :attr:`drafter`).

        Raises:
            InvalidArgumentError: see :meth:`make_step`.
            TypeError: the method has no drafter builder.
        """
        if self.drafter is None:
            raise TypeError(f"method {self.name!r} has no drafter of its own to compose")
        options = (values if isinstance(values, self.options)
                   else self.parse(values, context.executor))
        check_model_bounds(options, context.executor, self.name)
        return self.drafter(context, options, wrap)

    @property
    def batched(self) -> bool:
        """Whether rows of a batch share forwards with this method."""
        return self.build_batch is not None

    def make_batch_step(self, context: MethodContext, values: Mapping[str, Any] | Any
                        ) -> BatchStep:
        """Validate ``values`` and build the step of a ragged batch: the method's batched
        step, or :class:`SoloRows` running its single-row Step per row.

        Raises:
            InvalidArgumentError: see :meth:`make_step`.
        """
        options = (values if isinstance(values, self.options)
                   else self.parse(values, context.executor))
        check_model_bounds(options, context.executor, self.name)
        if self.build_batch is not None:
            return self.build_batch(context, options)
        self.build(context, options)  # errors (missing heads, ...) surface now, not per row
        return SoloRows(lambda: self.build(context, options))
