"""Runners: one per benchmark row, each generating for one encoded prompt and timing it.

selfspec methods run through :meth:`selfspec.SelfSpec.generate`; the transformers
baselines through ``engine.model.generate`` (the same HF model the executor drives: the
executor only re-points q/k/v and gate/up weights at fused views holding the same values).
Both are timed by the same clock around the whole call, and both report commits through
the same streamer interface, which gives time to first token and per-step accepted lengths.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from selfspec.api import SelfSpec
from selfspec.bench.agreement import forced_greedy
from selfspec.bench.run_types import (
    Clock,
    EncodedPrompt,
    Runner,
    RunOutput,
    RunSettings,
    refuse_constraints,
    run_one_by_one,
)
from selfspec.bench.spec import DECODE_KERNEL, MethodConfig
from selfspec.decoding.memory import EngineMemory
from selfspec.errors import InvalidArgumentError
from selfspec.methods.registry import METHODS, default_exit_layer

logger = logging.getLogger(__name__)

class _CommitRecorder:
    """A streamer that records when the first token came and how many tokens each put
    carried. transformers puts the prompt first: ``skip_first`` drops that put."""

    def __init__(self, clock: Clock, start: float, skip_first: bool) -> None:
        self.clock = clock
        self.start = start
        self.skip = skip_first
        self.lengths: list[int] = []
        self.first_s: float | None = None

    def put(self, value: torch.Tensor) -> None:
        if self.skip:
            self.skip = False
            return
        if self.first_s is None:
            self.first_s = self.clock() - self.start
        self.lengths.append(int(value.numel()))

    def end(self) -> None:
        pass

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_s is None else self.first_s * 1e3


class SelfSpecRunner:
    """A selfspec method through :meth:`SelfSpec.generate`.

    Args:
        engine: the loaded model.
        config: method name and options.
        clock: the stopwatch.
    """

    def __init__(self, engine: SelfSpec, config: MethodConfig, clock: Clock = time.perf_counter):
        self.engine = engine
        self.config = config
        self.clock = clock
        # decode_kernel is the row's, not the method's (bench.spec.DECODE_KERNEL).
        self.decode_kernel: str | None = config.options.get(DECODE_KERNEL)
        self.options = config.method_options
        # Another kernel than the run's computes other numbers (int4 is another model), so
        # the row is lossless against ``ar:decode_kernel=...`` on the same kernel, when the
        # run has that row (the harness decides: bench.metrics.reference_label).
        self.lossless = METHODS[config.name].lossless_for(dict(self.options)) and (
            self.decode_kernel is None or config.name != "ar")
        # This method's own memory of earlier generations (n-gram history, auto's drafter
        # estimates): drafting from another method's output of the same prompt would not be
        # a measurement.
        self.memory = EngineMemory()

    def forget(self) -> None:
        """Drop the memory (after the warm-up, which saw the first prompts)."""
        self.memory.clear()

    def setup(self) -> None:
        """Build the method's Step once (loading its head files) so bad option values fail
        before any timing.

        Raises:
            InvalidArgumentError: an option value out of range.
        """
        with self._kernel():  # builds the kernel's weight copies before any timing
            METHODS[self.config.name].make_step(self.engine.methods, dict(self.options))

    def weight_bytes_per_token(self) -> int | None:
        """The weight bytes one decoded token reads on this row's decoding kernel (building
        the kernel's copies, as :meth:`setup` would), or ``None`` on the run's own kernel.

        Raises:
            InvalidArgumentError: a kernel unavailable here.
        """
        if self.decode_kernel is None:
            return None
        with self._kernel():
            return self.engine.executor.decode_weight_bytes()

    def forced_choices(self, prompt_ids: list[int], tokens: list[int]) -> list[int] | None:
        """This row's greedy choice at each position of ``tokens`` given the prompt and the
        tokens before it (:func:`selfspec.bench.agreement.forced_greedy`, on this row's
        kernel); ``None`` unless the row is ``ar`` on another decoding kernel (a method's
        tokens are not one model's choices)."""
        if self.decode_kernel is None or self.config.name != "ar":
            return None
        with self._kernel():
            return forced_greedy(self.engine.executor, prompt_ids, tokens)

    @contextmanager
    def _running(self) -> Iterator[None]:
        """This method's memory and decoding kernel for the length of one call."""
        previous = self.engine.methods.use_memory(self.memory)
        try:
            with self._kernel():
                yield
        finally:
            self.engine.methods.use_memory(previous)

    @contextmanager
    def _kernel(self) -> Iterator[None]:
        """Run on this row's decoding kernel, then switch back."""
        if self.decode_kernel is None:
            yield
            return
        previous = self.engine.executor.set_decode_kernel(self.decode_kernel)
        try:
            yield
        finally:
            self.engine.executor.set_decode_kernel(previous)

    def run_batch(self, prompts: list[EncodedPrompt],
                  settings: RunSettings) -> list[RunOutput]:
        """The prompts as one ragged batch (:meth:`SelfSpec.generate_batch`)."""
        with self._running():
            start = self.clock()
            results = self.engine.generate_batch(
                [p.ids for p in prompts], method=self.config.name,
                max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                top_p=settings.top_p, seed=settings.seed,
                response_format=[p.response_format for p in prompts], **self.options)
            wall = self.clock() - start
        return [_output(r, wall / len(prompts), r.stats.ttft_ms, []) for r in results]

    def run(self, prompt: EncodedPrompt, settings: RunSettings) -> RunOutput:
        with self._running():
            start = self.clock()
            recorder = _CommitRecorder(self.clock, start, skip_first=False)
            result = self.engine.generate(
                prompt.ids, method=self.config.name, max_new_tokens=settings.max_new_tokens,
                temperature=settings.temperature, top_p=settings.top_p, seed=settings.seed,
                streamer=recorder, response_format=prompt.response_format,
                **self.options)
            wall = self.clock() - start
        return _output(result, wall, recorder.ttft_ms, recorder.lengths)


def _output(result: Any, wall: float, ttft_ms: float | None,
            lengths: list[int]) -> RunOutput:
    """The :class:`RunOutput` of a selfspec :class:`GenerationResult`."""
    s = result.stats
    speculative = s.verifications > 0
    # accept_lengths starts with the prefill's token (1); then one entry per verification
    # (or per token for autoregressive methods), as the decoding loop commits them.
    return RunOutput(
        token_ids=result.token_ids, text=result.text, wall_time_s=wall,
        ttft_ms=ttft_ms, accept_lengths=lengths,
        drafted=s.drafted if speculative else None,
        accepted=s.accepted if speculative else None,
        verifications=s.verifications if speculative else None,
        draft_ms=s.draft_ms if speculative else None,
        verify_ms=s.verify_ms if speculative else None,
        layer_forwards=s.layer_forwards, finish_reason=s.finish_reason,
        exit_tokens=s.drafted if s.exit_layer_total else None,
        exit_layer_total=s.exit_layer_total or None, plans=list(s.plans),
        layer_batches=list(s.layer_batches), exit_counts=list(s.exit_counts),
        predictor_ms=s.predictor_ms if s.predictor_calls else None,
        kv_ms=s.kv_ms if s.predictor_calls else None,
        drafter_steps={name: u.steps for name, u in s.drafters.items()})


def _hf_generate_kwargs(config: MethodConfig, engine: SelfSpec,
                        assistant: torch.nn.Module | None) -> dict[str, Any]:
    """transformers ``generate`` arguments of a baseline (glossary names → HF names)."""
    o = config.options
    kwargs: dict[str, Any] = {}
    if config.name == "hf-early-exit":
        layer = o.get("exit_layer", default_exit_layer(engine.executor))
        if not 1 <= layer < engine.executor.num_layers:
            raise InvalidArgumentError(
                f"exit_layer must be in [1, {engine.executor.num_layers - 1}], got {layer}")
        kwargs["assistant_early_exit"] = layer
    elif config.name == "hf-prompt-lookup":
        kwargs["prompt_lookup_num_tokens"] = o.get("draft_len", 10)
        if "max_ngram" in o:
            kwargs["max_matching_ngram_size"] = o["max_ngram"]
    elif config.name == "hf-assistant":
        kwargs["assistant_model"] = assistant
    if config.name in ("hf-early-exit", "hf-assistant"):
        if "draft_len" in o:
            kwargs["num_assistant_tokens"] = o["draft_len"]
        if "confidence" in o:
            kwargs["assistant_confidence_threshold"] = o["confidence"]
    return kwargs


_HF_NO_GRAMMAR = "transformers' generate has no grammar constraint"


class HFRunner:
    """A transformers ``generate`` baseline on the engine's HF model.

    Greedy runs pass ``do_sample=False``; sampling runs pass the same temperature with
    top-k and top-p off, seeded through ``torch.manual_seed``. The model's generation
    config is overridden where it would change the output (repetition penalty, EOS ids), so
    every method stops at the same EOS tokens and ``max_new_tokens``.

    Args:
        engine: the loaded model.
        config: ``hf-*`` name and options.
        clock: the stopwatch.
        load_assistant: ``name → HF model`` for ``hf-assistant`` (same dtype as the engine).
    """

    lossless = True  # assisted decoding verifies every draft with the full model

    def __init__(self, engine: SelfSpec, config: MethodConfig, clock: Clock = time.perf_counter,
                 load_assistant: Callable[[str], torch.nn.Module] | None = None) -> None:
        self.engine = engine
        self.config = config
        self.clock = clock
        self.load_assistant = load_assistant
        self.kwargs: dict[str, Any] = {}

    def setup(self) -> None:
        """Load the assistant model (``hf-assistant``) and check the options.

        Raises:
            InvalidArgumentError: ``hf-assistant`` without ``model=NAME``, a bad exit layer.
        """
        assistant = None
        if self.config.name == "hf-assistant":
            name = self.config.options.get("model")
            if not name:
                raise InvalidArgumentError(
                    "hf-assistant needs model=NAME, a smaller model with the same tokenizer "
                    "(e.g. hf-assistant:model=qwen2.5-coder-0.5b-instruct)")
            if self.load_assistant is None:
                raise InvalidArgumentError("hf-assistant: no way to load an assistant model here")
            assistant = self.load_assistant(str(name))
        self.kwargs = _hf_generate_kwargs(self.config, self.engine, assistant)
        if self.config.name == "hf-ar-compiled":
            self._compiled = compiled_forward(self.engine)
            self.kwargs["cache_implementation"] = "static"

    def _kwargs(self, settings: RunSettings) -> dict[str, Any]:
        engine = self.engine
        eos = sorted(engine.eos_token_ids)
        pad = engine.tokenizer.pad_token_id
        kwargs = dict(self.kwargs, max_new_tokens=settings.max_new_tokens,
                      eos_token_id=eos, pad_token_id=pad if pad is not None else eos[0],
                      repetition_penalty=1.0)
        if settings.temperature > 0:
            kwargs.update(do_sample=True, temperature=settings.temperature, top_k=0,
                          top_p=settings.top_p)
            torch.manual_seed(settings.seed)
        else:
            kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        return kwargs

    def _cut(self, tokens: list[int], settings: RunSettings) -> tuple[list[int], str]:
        """Generated ids up to the first EOS (and ``max_new_tokens``), with the finish."""
        tokens = tokens[: settings.max_new_tokens]
        for i, tok in enumerate(tokens):
            if tok in self.engine.eos_token_ids:
                return tokens[: i + 1], "eos"
        return tokens, "length"

    @torch.inference_mode()
    def run_batch(self, prompts: list[EncodedPrompt],
                  settings: RunSettings) -> list[RunOutput]:
        """``hf-ar``: one left-padded batch through ``generate``; the assisted baselines
        (batch size 1 only in transformers): one prompt after another.

        Raises:
            InvalidArgumentError: a prompt with a ``response_format`` (transformers'
                ``generate`` has no grammar constraint).
        """
        refuse_constraints(self.config.name, prompts, _HF_NO_GRAMMAR)
        if self.config.name != "hf-ar" or len(prompts) == 1:
            return run_one_by_one(self, prompts, settings, self.clock)
        engine = self.engine
        kwargs = self._kwargs(settings)
        width = max(len(p.ids) for p in prompts)
        pad = kwargs["pad_token_id"]
        ids = torch.tensor([[pad] * (width - len(p.ids)) + p.ids for p in prompts],
                           device=engine.executor.device)
        mask = torch.tensor([[0] * (width - len(p.ids)) + [1] * len(p.ids) for p in prompts],
                            device=engine.executor.device)
        start = self.clock()
        out = engine.model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        share = (self.clock() - start) / len(prompts)
        outputs = []
        for row in out[:, width:].tolist():
            tokens, finish = self._cut(row, settings)
            outputs.append(RunOutput(
                token_ids=tokens, text=engine.tokenizer.decode(tokens, skip_special_tokens=True),
                wall_time_s=share, finish_reason=finish,
                layer_forwards=engine.executor.num_layers * max(len(tokens) - 1, 0)))
        return outputs

    @torch.inference_mode()
    def run(self, prompt: EncodedPrompt, settings: RunSettings) -> RunOutput:
        refuse_constraints(self.config.name, [prompt], _HF_NO_GRAMMAR)
        engine = self.engine
        kwargs = self._kwargs(settings)
        input_ids = torch.tensor([prompt.ids], device=engine.executor.device)
        start = self.clock()
        recorder = _CommitRecorder(self.clock, start, skip_first=True)
        with _forward_as(engine.model, getattr(self, "_compiled", None)):
            out = engine.model.generate(input_ids=input_ids,
                                        attention_mask=torch.ones_like(input_ids),
                                        streamer=recorder, **kwargs)
            if engine.executor.device.type == "cuda":
                torch.cuda.synchronize(engine.executor.device)
        wall = self.clock() - start
        tokens, finish = self._cut(out[0, len(prompt.ids):].tolist(), settings)
        lengths = recorder.lengths
        if self.config.name in ("hf-ar", "hf-ar-compiled"):
            # Plain decoding runs every layer for each token after the first (which the
            # prefill gives), exactly as selfspec's ``ar`` counts them.
            counters = {"layer_forwards": engine.executor.num_layers * max(len(tokens) - 1, 0)}
        else:
            # Assisted decoding puts each verification's accepted tokens + the target's next
            # token at once (the first verification includes the prompt's forward). How many
            # tokens were drafted is not exposed, so the acceptance rate stays unknown.
            counters = {"verifications": len(lengths), "accepted": sum(lengths) - len(lengths)}
        return RunOutput(
            token_ids=tokens, text=engine.tokenizer.decode(tokens, skip_special_tokens=True),
            wall_time_s=wall, ttft_ms=recorder.ttft_ms, accept_lengths=lengths,
            finish_reason=finish, **counters)


def compiled_forward(engine: SelfSpec) -> Callable[..., Any]:
    """``torch.compile(model.forward, mode="reduce-overhead")`` for ``hf-ar-compiled``
    (transformers' static cache + CUDA graphs).

    Raises:
        InvalidArgumentError: the model is not on CUDA (reduce-overhead is CUDA graphs; on a
            CPU the row is marked failed with this reason rather than dropped).
    """
    device = engine.executor.device
    if device.type != "cuda":
        raise InvalidArgumentError(
            f"hf-ar-compiled runs on CUDA only (torch.compile mode='reduce-overhead' captures "
            f"CUDA graphs); the model is on {device}: skipped")
    return torch.compile(engine.model.forward, mode="reduce-overhead")


@contextmanager
def _forward_as(model: torch.nn.Module, forward: Callable[..., Any] | None) -> Iterator[None]:
    """``model.forward`` replaced by ``forward`` inside the block (``None``: unchanged)."""
    if forward is None:
        yield
        return
    model.forward = forward
    try:
        yield
    finally:
        del model.forward  # back to the class's method


def make_runner(engine: SelfSpec, config: MethodConfig, clock: Clock = time.perf_counter,
                load_assistant: Callable[[str], torch.nn.Module] | None = None) -> Runner:
    """The runner of ``config`` (selfspec method, ``hf-*`` or ``llamacpp-*`` baseline)."""
    if config.name.startswith("llamacpp-"):
        from selfspec.bench.llamacpp import (
            LlamaCppRunner,  # the optional binding loads lazily
        )

        return LlamaCppRunner(engine, config, clock)
    if config.is_baseline:
        return HFRunner(engine, config, clock, load_assistant)
    return SelfSpecRunner(engine, config, clock)
