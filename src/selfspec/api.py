"""Python API: ``selfspec.load(model).generate(prompt, method=...)``."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from selfspec.decoding.core import loop
from selfspec.decoding.core.batch import run_batch
from selfspec.decoding.core.grammar import Grammar, GrammarCompiler, response_format_grammar
from selfspec.decoding.core.prefix_cache import PrefixCache
from selfspec.decoding.core.processors import LogitsProcessing, Penalties, TokenLogprob
from selfspec.decoding.core.sampling import SamplingConfig
from selfspec.decoding.core.state import DecodeOptions, DecodeState
from selfspec.decoding.core.stats import GenerationStats
from selfspec.decoding.core.stop_strings import StopStringSink, Streamer
from selfspec.errors import InvalidArgumentError, PromptError
from selfspec.executor import LayerExecutor
from selfspec.executor.plan import PREFILL_CHUNK
from selfspec.methods.registry import MethodContext, get_method
from selfspec.models.eos import eos_token_ids
from selfspec.validation import (
    check_bool,
    check_device,
    check_device_memory,
    check_int,
    check_stop,
    check_text,
    check_token_ids,
    prompt_kind,
    tensor_prompt,
)

logger = logging.getLogger(__name__)


@dataclass
class GenerationResult:
    """The output of one generation.

    Attributes:
        text: the generated text (special tokens removed, cut before a stop string).
        token_ids: the generated token ids (prompt excluded).
        prompt_ids: the prompt's token ids as the model saw them (chat template applied).
        stats: timings and counters.
        logprobs: each generated token's log probability and top alternatives when
            ``logprobs=`` was given (:class:`~selfspec.decoding.core.processors.TokenLogprob`),
            else ``None``.
    """

    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None


class SelfSpec:
    """A loaded model ready to generate with any selfspec method.

    Build it with :func:`load`. Attributes: ``model`` (the HF model), ``tokenizer``,
    ``executor`` (:class:`LayerExecutor`), ``methods`` (the :class:`MethodContext` methods
    are built in: it keeps the head files they load), ``name``, ``prefix_cache`` (the
    :class:`~selfspec.decoding.core.prefix_cache.PrefixCache` every generation's prefill reads
    and fills, or ``None``: :meth:`use_prefix_cache`). ``keep_packed=False`` (what
    ``load(dtype="gguf")`` and ``"w4a8"`` pass) skips oneDNN's packed copies of the dense
    weights while the 4-bit kernel serves every product (:class:`LayerExecutor`).
    ``prefill_chunk`` is the executor's prefill chunk and so the prefix cache's block size
    (:func:`load`'s argument).

    Raises:
        InvalidArgumentError: ``prefill_chunk`` not an integer >= 1 (before the executor is
            built).
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, name: str,
                 decode_kernel: str = "auto", device: str | torch.device | None = None,
                 cuda_graphs: str = "off", prefix_cache_mib: float = 0,
                 gguf: str | os.PathLike | Callable[[], Path] | None = None,
                 keep_packed: bool = True, prefill_chunk: int = PREFILL_CHUNK) -> None:
        check_prefill_chunk(prefill_chunk)
        if device is not None:
            model = move_model(model, check_device(device))
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.executor = LayerExecutor(model, name=name, rows=decode_kernel, gguf=gguf,
                                      keep_packed=keep_packed, prefill_chunk=prefill_chunk)
        from selfspec.executor.cuda_graphs import attach_graphs

        attach_graphs(self.executor, cuda_graphs)
        self.methods = MethodContext(self.executor, tokenizer)
        self._grammars: GrammarCompiler | None = None
        self.prefix_cache: PrefixCache | None = None
        self.use_prefix_cache(prefix_cache_mib)

    def use_prefix_cache(self, mib: float) -> PrefixCache | None:
        """Keep up to ``mib`` MiB of earlier prompts' KV and reuse it for later prompts that
        start with the same tokens, in whole prefill chunks
        (:mod:`selfspec.decoding.core.prefix_cache`: the logits are bit for bit those of a
        full prefill; the time to first token of a prompt whose first 1,024 tokens are kept
        falls several-fold); ``0`` turns it off and frees what was kept. Off by default in
        the library, so that timings of repeated prompts (the benchmark's) stay those of a
        full prefill; ``selfspec serve`` keeps 256 MiB.

        Returns:
            The new cache, or ``None`` for ``0``.

        Raises:
            InvalidArgumentError: ``mib`` negative or not a number.
        """
        cache = PrefixCache.from_mib(mib, block_size=self.executor.prefill_chunk)
        self.prefix_cache = cache if cache.budget_bytes > 0 else None
        return self.prefix_cache

    @property
    def device(self) -> torch.device:
        """Where the weights, the KV cache and every method's tensors live."""
        return self.executor.device

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Token ids that end generation (tokenizer EOS and the generation config's)."""
        return eos_token_ids(self.model, self.tokenizer)

    def encode(self, prompt: str | Sequence[int] | torch.Tensor, chat: bool = False) -> list[int]:
        """Token ids for ``prompt``: text (optionally through the chat template) or ids.

        Args:
            prompt: text (``str``), or token ids: a list of ints, a ``[T]`` or ``[1, T]``
                integer tensor (torch or numpy).
            chat: wrap text in the chat template as a user turn (text prompts only).

        Returns:
            The prompt's token ids, each in ``[0, V)``.

        Raises:
            PromptError: an empty prompt; text that is not valid Unicode; ``bytes`` (decode
                them first); token ids that are not integers or lie outside the vocabulary;
                a batch ``[B, T]`` with ``B > 1`` (one prompt at a time); ``chat`` with
                token ids or with a tokenizer that has no chat template.
            InvalidArgumentError: ``chat`` not a bool.
        """
        check_bool("chat", chat)
        kind = prompt_kind(prompt)
        if kind == "ids":
            if chat:
                raise PromptError("chat=True / --chat applies the chat template to text; "
                                  "pass the prompt as a str, or drop chat for token ids")
            raw = tensor_prompt(prompt) if hasattr(prompt, "shape") else list(prompt)
            return check_token_ids(raw, self.vocab_size)
        check_text("the prompt", prompt)
        if not prompt.strip():
            raise PromptError("the prompt is empty; give some text to continue")
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise PromptError(
                    f"model {self.name!r} has no chat template; drop --chat / chat=True")
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True,
                tokenize=True, return_dict=False)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
        else:
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        return check_token_ids(list(ids), self.vocab_size)

    def grammar(self, response_format: Mapping[str, Any] | Grammar | None) -> Grammar | None:
        """Compile a structured-output constraint for this model
        (:mod:`selfspec.decoding.core.grammar`).

        Args:
            response_format: OpenAI's ``response_format`` (``{"type": "json_schema",
                "json_schema": {"schema": {...}}}``, ``{"type": "json_object"}``,
                ``{"type": "text"}``) or selfspec's ``{"type": "regex", "regex": ...}`` /
                ``{"type": "lark", "lark": ...}``; a compiled :class:`Grammar` passes
                through; ``None``: no constraint.

        Returns:
            The :class:`Grammar`, or ``None`` for no constraint.

        Raises:
            InvalidArgumentError: a malformed or unsupported schema, regex or grammar (the
                message names the problem).
            MissingDependencyError: llguidance is not installed.
        """
        if response_format is None or isinstance(response_format, Grammar):
            return response_format
        if self._grammars is None:
            eos = self.eos_token_ids or {self.tokenizer.eos_token_id}
            self._grammars = GrammarCompiler(self.tokenizer, self.executor.vocab_size,
                                             sorted(t for t in eos if t is not None))
        return response_format_grammar(self._grammars, response_format)

    def processing(self, response_format: Mapping[str, Any] | Grammar | None = None,
                   presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                   logprobs: int | None = None) -> LogitsProcessing:
        """Output processing of one generation (:mod:`selfspec.decoding.core.processors`).

        Raises:
            InvalidArgumentError: a bad constraint, a penalty outside [-2, 2], ``logprobs``
                outside [0, 20].
        """
        return LogitsProcessing(Penalties(presence_penalty, frequency_penalty),
                                self.grammar(response_format), logprobs)

    @property
    def vocab_size(self) -> int:
        """Token ids the model can embed: ``[0, vocab_size)``."""
        return int(self.model.get_input_embeddings().num_embeddings)

    @torch.inference_mode()
    def generate(self, prompt: str | Sequence[int] | torch.Tensor, method: str = "ar", *,
                 max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, chat: bool = False,
                 stop: Sequence[str] = (), streamer: Streamer | None = None,
                 response_format: Mapping[str, Any] | Grammar | None = None,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 logprobs: int | None = None,
                 **method_options: Any) -> GenerationResult | list[GenerationResult]:
        """Generate a continuation of ``prompt`` with ``method``.

        Args:
            prompt: text, or token ids (``[T]`` or ``[1, T]``); a list of texts or of id
                lists is a batch (:meth:`generate_batch`, one result per prompt).
            method: a registered method name (``selfspec.methods.registry.METHODS``).
            max_new_tokens: at most this many new tokens (>= 1).
            temperature: 0 = greedy; > 0 = sampling.
            top_k: keep the k most likely tokens when sampling (0 = all).
            top_p: nucleus mass in (0, 1] when sampling.
            seed: seed for reproducible sampling: each token is the position-keyed
                Gumbel-max choice (docs/design.md "Sampling"), so every lossless method gives
                ``ar``'s tokens with this seed, whatever it drafted.
            chat: wrap a text prompt in the tokenizer's chat template as a user turn.
            stop: stop strings; generation ends once the text contains one (text is cut there).
            streamer: receives committed token ids as they come (``put``/``end``).
            response_format: a structured-output constraint (:meth:`grammar`): every token is
                chosen (and every draft token verified) under it, so lossless methods give
                exactly constrained ``ar``'s tokens. With a list of prompts, also a list of
                one constraint per prompt (:meth:`generate_batch`).
            presence_penalty / frequency_penalty: OpenAI's penalties in [-2, 2], applied to
                the target at every verified position (lossless against ``ar`` with them).
            logprobs: record each token's log probability and this many alternatives
                (0-20) in :attr:`GenerationResult.logprobs`.
            **method_options: options of the method (e.g. ``exit_layer``; ``selfspec
                methods`` lists them).

        Returns:
            :class:`GenerationResult` with text, token ids and statistics.

        Raises:
            PromptError: see :meth:`encode`; a prompt that fills the model's context.
            InvalidArgumentError: an argument of the wrong type or out of range (see
                :mod:`selfspec.validation`), an option unknown to the method or out of its
                range, an unknown method.
        """
        if _is_batch(prompt):
            if streamer is not None:
                raise InvalidArgumentError(
                    "streamer takes one generation; stream a batch through `selfspec serve`, "
                    "or generate the prompts one at a time")
            return self.generate_batch(
                prompt, method, max_new_tokens=max_new_tokens, temperature=temperature,
                top_k=top_k, top_p=top_p, seed=seed, chat=chat, stop=stop,
                response_format=response_format, presence_penalty=presence_penalty,
                frequency_penalty=frequency_penalty, logprobs=logprobs, **method_options)
        stop = check_stop(stop)
        if streamer is not None and not (callable(getattr(streamer, "put", None))
                                         and callable(getattr(streamer, "end", None))):
            raise InvalidArgumentError(
                f"streamer must have put(token_ids) and end() methods (like transformers' "
                f"TextStreamer); got {type(streamer).__name__}")
        options = self.decode_options(max_new_tokens, temperature, top_k, top_p, seed,
                                      self.processing(response_format, presence_penalty,
                                                      frequency_penalty, logprobs))
        prompt_ids = self.encode(prompt, chat=chat)  # cheap checks before heads load
        step = get_method(method).make_step(self.methods, method_options)
        sink = StopStringSink(self.tokenizer, stop, streamer)
        state = DecodeState(self.executor, prompt_ids, options, sink,
                            prefix_cache=self.prefix_cache)
        try:
            stats = loop.run(state, step)
        finally:
            if streamer is not None:
                streamer.end()
        logger.debug("generated %d tokens at %.1f tok/s", stats.new_tokens, stats.tokens_per_s)
        return self.result(state, sink)

    @torch.inference_mode()
    def generate_batch(self, prompts: Sequence[str | Sequence[int] | torch.Tensor],
                       method: str = "ar", *, max_new_tokens: int = 128,
                       temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                       seed: int | None = None, chat: bool = False, stop: Sequence[str] = (),
                       response_format: (Mapping[str, Any] | Grammar | None
                                         | Sequence[Mapping[str, Any] | Grammar | None]) = None,
                       presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                       logprobs: int | None = None,
                       **method_options: Any) -> list[GenerationResult]:
        """Generate a continuation of every prompt together, as one ragged batch
        (:mod:`selfspec.decoding.core.batch`): rows of any lengths, each accepting its own number
        of draft tokens per step and finishing on its own (EOS, stop strings, budget).

        Each row is the generation its prompt would get alone (same greedy tokens; with
        ``seed``, the same seeded tokens: every row keys its noise with that seed). Methods
        with a batched step (``selfspec methods``: ar, ngram, auto) share one forward per step
        across rows; the others run their rows one after another.

        Args:
            prompts: ``B >= 1`` prompts, each as :meth:`generate` takes it.
            response_format: as :meth:`generate`, for every row; or a list or tuple of ``B``
                of them, one per row (e.g. each prompt with its own JSON schema).
            method / max_new_tokens / ... / **method_options: as :meth:`generate`, for every
                row.

        Returns:
            One :class:`GenerationResult` per prompt, in order.

        Raises:
            PromptError, InvalidArgumentError: as :meth:`generate`, for any prompt (nothing
                runs then); an empty list of prompts; a list of response formats whose
                length is not the number of prompts.
        """
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
            raise InvalidArgumentError("prompts must be a non-empty list of prompts")
        stop = check_stop(stop)
        if isinstance(response_format, (list, tuple)):  # one per row
            if len(response_format) != len(prompts):
                raise InvalidArgumentError(
                    f"response_format: got {len(response_format)} for {len(prompts)} prompts; "
                    "give one per prompt, or one (not in a list) for all of them")
            formats = list(response_format)
        else:
            formats = [response_format]
        options = [self.decode_options(max_new_tokens, temperature, top_k, top_p, seed,
                                       self.processing(f, presence_penalty, frequency_penalty,
                                                       logprobs))
                   for f in formats]
        if len(options) == 1:  # one constraint, compiled once, for every row
            options = options * len(prompts)
        all_ids = [self.encode(p, chat=chat) for p in prompts]
        step = get_method(method).make_batch_step(self.methods, method_options)
        sinks = [StopStringSink(self.tokenizer, stop, None) for _ in all_ids]
        states = [DecodeState(self.executor, ids, row_options, sink,
                              prefix_cache=self.prefix_cache)
                  for ids, row_options, sink in zip(all_ids, options, sinks, strict=False)]
        run_batch(states, step)
        return [self.result(state, sink) for state, sink in zip(states, sinks, strict=False)]

    def decode_options(self, max_new_tokens: int, temperature: float, top_k: int,
                       top_p: float, seed: int | None,
                       processing: LogitsProcessing | None = None) -> DecodeOptions:
        """Limits, sampling and output processing of one generation, with this model's EOS
        ids.

        Raises:
            InvalidArgumentError: a value of the wrong type or out of range.
        """
        sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        return DecodeOptions(max_new_tokens=max_new_tokens, sampling=sampling,
                             eos_token_ids=self.eos_token_ids,
                             processing=processing or LogitsProcessing())

    def result(self, state: DecodeState, sink: StopStringSink) -> GenerationResult:
        """The :class:`GenerationResult` of a finished ``state`` (text cut at a stop string)."""
        generated = state.tokens[state.prompt_len:]
        text = sink.cut(self.tokenizer.decode(generated, skip_special_tokens=True))
        logprobs = (None if state.options.processing.logprobs is None or state.processor is None
                    else list(state.processor.logprobs))
        return GenerationResult(text=text, token_ids=generated,
                                prompt_ids=state.tokens[: state.prompt_len], stats=state.stats,
                                logprobs=logprobs)


def _is_batch(prompt: Any) -> bool:
    """A list or tuple of prompts (texts or id lists), as opposed to one prompt's ids."""
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0
            and all(isinstance(p, (str, list, tuple)) or hasattr(p, "shape") for p in prompt))


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters and buffers (what moving it to a device copies)."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def move_model(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model`` on ``device`` (moved in place when it is elsewhere), after checking that it
    fits there (:func:`selfspec.validation.check_device_memory`).

    Raises:
        InvalidArgumentError: it does not fit in the device's free memory.
    """
    param = next(model.parameters(), None)
    here = param.device if param is not None else torch.device("cpu")
    if here == device or (device.type == here.type == "cuda"
                          and device.index in (None, here.index)):
        return model
    check_device_memory(device, model_bytes(model))
    return model.to(device)


def load(model: str | None = None, dtype: str | torch.dtype = "bf16", *,
         show_progress: bool = True, decode_kernel: str = "auto",
         device: str | torch.device = "auto", cuda_graphs: str = "auto",
         prefix_cache_mib: float = 0, prefill_chunk: int = PREFILL_CHUNK) -> SelfSpec:
    """Load a model by registry name, local directory or hub id (fetching it on first use).

    Args:
        model: registry name (default ``smollm2-135m-instruct``), local directory, local
            ``.gguf`` file (converted once into the cache) or hub id.
        dtype: ``"bf16"`` / ``"fp32"`` / ``"fp16"`` or a ``torch.dtype``; ``"int4"`` loads
            bf16 weights and decodes on int4 copies of them (``decode_kernel="int4"``),
            ``"w4a8"`` on 4-bit copies with 8-bit activations (``decode_kernel="w4a8"``,
            llama.cpp's Q4_1 × Q8_0 scheme); ``"gguf"`` on the blocks of the GGUF file itself
            (a registry model's, fetched and kept beside its safetensors copy, or the
            ``.gguf`` passed as ``model``): the weights as published, bf16 activations
            between the products (``decode_kernel="gguf"``).
        show_progress: show download/conversion progress bars.
        decode_kernel: the kernel of decoding and verification products: ``"auto"`` (on a
            CPU that emulates bf16, FBGEMM's fp16-weight kernel for matrices of 4 MiB and
            more), ``"fp16"`` (that kernel for every matrix: fastest verification, slower
            ``ar`` on small models), ``"weights"`` (the weights' own format), ``"int4"``
            (group-wise int4 copies: the model runs with 4-bit weights, lossy against bf16,
            prefill stays bf16), ``"w4a8"`` (the same with 8-bit activations on selfspec's
            AVX2 kernel), ``"gguf"`` (the GGUF file's own blocks), ``"gguf+dense"`` (the
            blocks for decoding and verification, prefill on the dense weights: faster
            prompts where bf16 is native; ``dtype="gguf"`` takes it too). See
            :func:`selfspec.executor.cpu.choose_rows`.
        device: ``"auto"`` (CUDA when ``torch.cuda.is_available()``, else the CPU),
            ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a ``torch.device``: the weights, KV
            cache, heads and every method's tensors live there. The CPU-only kernels
            (selfspec's AVX2 ones, FBGEMM, the quantized draft copies) are never chosen on a
            GPU.
        cuda_graphs: ``"auto"`` (on for CUDA), ``"on"`` or ``"off"``: replay one-token and
            verification-sized forwards as captured CUDA graphs
            (:mod:`selfspec.executor.cuda_graphs`); ignored on the CPU.
        prefix_cache_mib: keep up to this many MiB of earlier prompts' KV for later prompts
            sharing their prefix (:meth:`SelfSpec.use_prefix_cache`; 0 = off, the default).
        prefill_chunk: positions per prefill call
            (:meth:`~selfspec.executor.LayerExecutor.prefill` runs fixed chunks over absolute
            positions), and so the prefix cache's block size: a warm prompt reuses its kept
            prefix in whole chunks and reruns up to ``prefill_chunk - 1`` kept tokens plus
            the new ones. Smaller chunks give faster warm turns and a slower cold prefill
            (docs/results/prefix-chunk-2026-12-04/). Logits are bit-identical with and
            without the cache at any one chunk size; across sizes they need not be (a
            product rounds by its row count).

    Raises:
        InvalidArgumentError: ``model`` not a str / path, a bad ``dtype`` or
            ``decode_kernel``; ``prefill_chunk`` not an integer >= 1; a bad ``device``
            (malformed, ``cuda`` without a GPU, a GPU
            index that does not exist) — before anything loads — or a model that does not
            fit in the GPU's free memory (before any weight moves there).
        ModelNotFoundError, ProvisioningError, UnsupportedArchitectureError: see
            :func:`selfspec.models.loading.load_model`.
    """
    from selfspec.models.loading import load_model
    from selfspec.models.registry import DEFAULT_MODEL

    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise InvalidArgumentError(
            f"model must be a registry name, a directory or a hub id (str); got "
            f"{type(model).__name__}")
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    from selfspec.executor.cpu import GGUF_ROWS, QUANTIZED_ROWS, ROWS_FORMATS

    target = check_device(device)  # before anything loads
    PrefixCache.from_mib(prefix_cache_mib)  # a bad size fails before anything loads
    check_prefill_chunk(prefill_chunk)
    from selfspec.executor.cuda_graphs import check_cuda_graphs

    check_cuda_graphs(cuda_graphs)
    if decode_kernel not in ROWS_FORMATS:
        raise InvalidArgumentError(
            f"decode_kernel must be one of {', '.join(ROWS_FORMATS)}, got {decode_kernel!r}")
    if isinstance(dtype, str) and dtype.strip().lower() in QUANTIZED_ROWS:
        quantized = dtype.strip().lower()
        # dtype gguf also takes its dense-prefill variant
        allowed = ("auto", *(GGUF_ROWS if quantized == "gguf" else (quantized,)))
        if decode_kernel not in allowed:
            raise InvalidArgumentError(
                f"dtype {quantized} decodes on 4-bit weights; it takes decode_kernel "
                f"{' or '.join(allowed)}, not {decode_kernel!r}")
        dtype, decode_kernel = "bf16", quantized if decode_kernel == "auto" else decode_kernel
        keep_packed = False  # the 4-bit kernel serves every product: no packed bf16 copy
    else:
        keep_packed = True
    loaded = load_model(model or DEFAULT_MODEL, dtype, show_progress=show_progress)
    return SelfSpec(loaded.model, loaded.tokenizer, loaded.name, decode_kernel, device=target,
                    cuda_graphs=cuda_graphs, prefix_cache_mib=prefix_cache_mib,
                    gguf=gguf_source(loaded, show_progress), keep_packed=keep_packed,
                    prefill_chunk=prefill_chunk)


def check_prefill_chunk(prefill_chunk: Any) -> int:
    """``prefill_chunk`` checked: an integer >= 1 (not a bool or a float).

    Raises:
        InvalidArgumentError: otherwise, naming ``prefill_chunk`` / ``--prefill-chunk``.
    """
    return check_int("prefill_chunk", prefill_chunk, low=1,
                     hint=f"positions per prefill call, --prefill-chunk; default "
                          f"{PREFILL_CHUNK}")


def gguf_source(loaded: Any, show_progress: bool = True) -> Path | Callable[[], Path] | None:
    """Where the GGUF file ``loaded`` came from: the local ``.gguf`` it was converted from, or
    for a registry model a function that fetches (once) and returns the registry's GGUF
    (:func:`selfspec.models.gguf_cache.fetch_gguf`); ``None`` for other models."""
    from selfspec.models.registry import REGISTRY

    if loaded.gguf is not None:
        return loaded.gguf
    if loaded.name in REGISTRY:
        from selfspec.models.gguf_cache import fetch_gguf

        return functools.partial(fetch_gguf, loaded.name, show_progress=show_progress)
    return None


def from_pretrained_model(model: torch.nn.Module, tokenizer: Any, name: str = "model", *,
                          device: str | torch.device = "auto",
                          cuda_graphs: str = "auto",
                          gguf: str | os.PathLike | None = None,
                          prefill_chunk: int = PREFILL_CHUNK) -> SelfSpec:
    """Wrap an already loaded HF model and tokenizer (no provisioning).

    Args:
        device: as :func:`load`'s; ``"auto"`` is CUDA when available, else the CPU. A model
            elsewhere is moved there in place (``model.to(device)``) after a check that it
            fits.
        cuda_graphs: as :func:`load`'s.
        gguf: the GGUF file the model was loaded from (``from_pretrained(..., gguf_file=)``),
            for ``executor.set_decode_kernel("gguf")``: decoding on its own blocks, which
            are checked against the model's weights at that call.
        prefill_chunk: as :func:`load`'s.

    Raises:
        InvalidArgumentError: no tokenizer; a bad ``device``, ``cuda_graphs`` or
            ``prefill_chunk``; a model that does not fit in the GPU's free memory.
    """
    if tokenizer is None:
        raise InvalidArgumentError("a tokenizer is required")
    from selfspec.executor.cuda_graphs import check_cuda_graphs

    target = check_device(device)
    check_cuda_graphs(cuda_graphs)
    return SelfSpec(model, tokenizer, name, device=target, cuda_graphs=cuda_graphs, gguf=gguf,
                    prefill_chunk=prefill_chunk)
