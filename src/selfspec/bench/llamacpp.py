"""llama.cpp as a benchmark baseline: ``llamacpp-ar`` and ``llamacpp-prompt-lookup``.

What a CPU user typically runs is llama.cpp on a GGUF file. These runners drive it through its
maintained Python binding, llama-cpp-python (the ``llamacpp`` extra; PyPI ships it as source,
so installing it compiles llama.cpp for this CPU: a C/C++ compiler and CMake are needed), on
**the same GGUF file** the registry model was converted from (kept by
:func:`selfspec.models.gguf_cache.fetch_gguf`), with the same prompt token ids, thread count,
``max_new_tokens``, EOS ids and greedy / sampling settings as selfspec's own methods, so a
bench run puts both in one table and one interleaved timing.

The weights differ in one way, which the table shows as greedy agreement with ``ar``:
selfspec de-quantises the GGUF (e.g. Q8_0 or Q4_1) to dense bf16/fp32, llama.cpp computes on
the quantised blocks directly (and quantises activations to 8 bits for its dot products), so
near-tied argmaxes can differ.

``llamacpp-prompt-lookup`` is llama-cpp-python's ``LlamaPromptLookupDecoding`` draft model
(n-gram drafts copied from the context, verified by the model): the llama.cpp counterpart of
transformers' prompt lookup and of selfspec's ``ngram``.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from selfspec.api import SelfSpec
from selfspec.bench.run_types import (
    Clock,
    EncodedPrompt,
    RunOutput,
    RunSettings,
    refuse_constraints,
    run_one_by_one,
)
from selfspec.bench.spec import MethodConfig
from selfspec.errors import InvalidArgumentError
from selfspec.models.registry import REGISTRY

logger = logging.getLogger(__name__)

LLAMACPP_BASELINES = ("llamacpp-ar", "llamacpp-prompt-lookup")
INSTALL_HINT = ("llama.cpp baselines need the llama-cpp-python binding: pip install "
                "'selfspec[llamacpp]' (it compiles llama.cpp: needs a C/C++ compiler and "
                "cmake, about 15 minutes on 2 cores)")


def load_binding() -> Any:
    """The ``llama_cpp`` module.

    Raises:
        InvalidArgumentError: llama-cpp-python is not installed (the message says how).
    """
    try:
        import llama_cpp
    except ImportError as err:
        raise InvalidArgumentError(INSTALL_HINT) from err
    return llama_cpp


# Loads the GGUF and decodes two tokens: a crash of the native library then ends this child,
# not the benchmark process with its results.
_PROBE = """
import sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_threads=int(sys.argv[2]), verbose=False)
for i, _ in enumerate(llm.generate([int(t) for t in sys.argv[3:]], temp=0.0, top_k=1)):
    if i >= 1:
        break
"""
PROBE_TIMEOUT_S = 300.0


def probe(path: Path, threads: int, ids: list[int]) -> None:
    """Decode two tokens of ``ids`` with llama.cpp in a child process.

    Raises:
        InvalidArgumentError: the child crashed or failed; the message says what to do (a
            build that uses AMX on a VM that advertises AMX without enabling it dies in
            ``ldtilecfg`` with SIGSEGV: rebuild without AMX).
    """
    command = [sys.executable, "-c", _PROBE, str(path), str(threads), *map(str, ids)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                              check=False)
    except subprocess.TimeoutExpired as err:
        raise InvalidArgumentError(
            f"llama.cpp did not decode two tokens of {path} in {PROBE_TIMEOUT_S:.0f} s") from err
    if done.returncode == 0:
        return
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        raise InvalidArgumentError(
            f"llama.cpp crashed ({name}) decoding with {path}. Its build uses instructions this "
            "machine does not run: on VMs that list AMX without enabling it, rebuild without AMX: "
            "CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
            "-DGGML_AVX512=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF\" "
            "pip install --force-reinstall --no-deps --no-binary :all: llama-cpp-python")
    raise InvalidArgumentError(
        f"llama.cpp failed on {path} (exit {done.returncode}): {done.stderr.strip()[-500:]}")


def resolve_gguf(engine_name: str, option: str | None, show_progress: bool = False) -> Path:
    """The GGUF file to run: ``option`` if given, else the registry model's own GGUF.

    Raises:
        InvalidArgumentError: a local model without ``gguf=PATH``, or a missing ``gguf`` file.
        ProvisioningError / ChecksumError / CorruptModelFileError: fetching the registry GGUF.
    """
    if option:
        path = Path(option).expanduser()
        if not path.is_file():
            raise InvalidArgumentError(f"gguf={option}: no such file")
        return path
    if engine_name not in REGISTRY:
        raise InvalidArgumentError(
            f"{engine_name!r} is not a registry model, so its GGUF is unknown: pass the file "
            "the weights came from, e.g. llamacpp-ar:gguf=/path/to/model.gguf")
    from selfspec.models.gguf_cache import fetch_gguf

    return fetch_gguf(engine_name, show_progress=show_progress)


def gguf_decode_bytes(path: Path) -> int:
    """Bytes of a GGUF's tensors that decoding one token reads, in their stored (quantized)
    formats: every tensor but the token embedding table (one row of it is read), which counts
    only when the file has no ``output.weight`` (tied embeddings: the table is the lm_head).
    The llama.cpp rows' roofline numerator, as :meth:`LayerExecutor.decode_weight_bytes` is
    selfspec's.

    Raises:
        InvalidArgumentError: not a readable GGUF file.
    """
    try:
        sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    except Exception as err:  # gguf raises ValueError, struct.error, OSError …
        raise InvalidArgumentError(f"{path} is not a readable GGUF file ({err})") from err
    total = sum(sizes.values())
    if "output.weight" in sizes:
        total -= sizes.get("token_embd.weight", 0)
    return total


class LlamaCppRunner:
    """A llama.cpp baseline through llama-cpp-python (see the module docstring).

    Greedy runs sample with ``temp=0`` (llama.cpp's greedy sampler); sampling runs use the
    same temperature and top-p, top-k and min-p off, seeded with the run's seed (llama.cpp's
    own random stream, so sampled texts differ from selfspec's; only their distribution is
    comparable). The context is sized to the longest prompt + ``max_new_tokens``.

    Args:
        engine: the loaded selfspec model (its name locates the GGUF; its tokenizer decodes;
            its EOS ids stop generation; its thread count is used).
        config: ``llamacpp-ar`` or ``llamacpp-prompt-lookup`` with options ``gguf`` (path;
            required for a model that is not in the registry), ``draft_len`` and
            ``max_ngram`` (prompt lookup; defaults 10 and 2 as llama-cpp-python's).
        clock: the stopwatch.
    """

    lossless = True

    def __init__(self, engine: SelfSpec, config: MethodConfig,
                 clock: Clock = time.perf_counter) -> None:
        if config.name not in LLAMACPP_BASELINES:
            raise InvalidArgumentError(f"not a llama.cpp baseline: {config.name!r}")
        self.engine = engine
        self.config = config
        self.clock = clock
        self.llm: Any = None
        self.n_ctx = 0

    def setup(self) -> None:
        """Check the binding, fetch the GGUF, decode two tokens in a child process (a crash of
        the native library fails this method, not the run) and check that the GGUF's
        vocabulary is the model's.

        Raises:
            InvalidArgumentError: no binding, a bad ``gguf`` option, llama.cpp crashed or failed
                in the probe, or a GGUF whose vocabulary does not match the model's tokenizer.
        """
        load_binding()
        self.path = resolve_gguf(self.engine.name, self.config.options.get("gguf"))
        ids = self.engine.tokenizer("def f(x):")["input_ids"][:8] or [0]
        probe(self.path, torch.get_num_threads(), ids)
        self._load(n_ctx=512)

    def weight_bytes_per_token(self) -> int | None:
        """The GGUF weight bytes one decoded token reads (:func:`gguf_decode_bytes`), or
        ``None`` without the binding (the method fails in :meth:`setup`). Locates the GGUF as
        :meth:`setup` does (fetching it for a registry model).

        Raises:
            InvalidArgumentError: a bad ``gguf`` option.
        """
        try:
            load_binding()
        except InvalidArgumentError:
            return None
        self.path = resolve_gguf(self.engine.name, self.config.options.get("gguf"))
        return gguf_decode_bytes(self.path)

    def _load(self, n_ctx: int) -> None:
        llama_cpp = load_binding()
        threads = torch.get_num_threads()
        kwargs: dict[str, Any] = {
            "model_path": str(self.path), "n_ctx": n_ctx, "n_threads": threads,
            "n_threads_batch": threads, "n_batch": min(512, n_ctx), "verbose": False,
            # With a draft model llama-cpp-python keeps every position's logits but sizes
            # that buffer by this flag (n_batch rows when False), so prompts past 512 tokens
            # overflowed it ("could not broadcast … into shape (0,)"): ask for n_ctx rows.
            "logits_all": self.config.name == "llamacpp-prompt-lookup"}
        if self.config.name == "llamacpp-prompt-lookup":
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            kwargs["draft_model"] = LlamaPromptLookupDecoding(
                num_pred_tokens=int(self.config.options.get("draft_len", 10)),
                max_ngram_size=int(self.config.options.get("max_ngram", 2)))
        self.llm = None  # free the previous context first
        self.llm = llama_cpp.Llama(**kwargs)
        self.n_ctx = n_ctx
        vocab = self.llm.n_vocab()
        if vocab > len(self.engine.tokenizer) + 1024 or vocab < len(self.engine.tokenizer) - 1024:
            raise InvalidArgumentError(
                f"{self.path} has a vocabulary of {vocab} tokens, the model's tokenizer "
                f"{len(self.engine.tokenizer)}: it is not this model's GGUF")

    def forced_choices(self, prompt_ids: list[int], tokens: list[int]) -> list[int] | None:
        """llama.cpp's greedy choice at each position of ``tokens`` given the prompt and the
        tokens before it: the prompt evaluated as ``generate`` evaluates it, then ``tokens``
        one at a time (as decoding runs them: llama.cpp's batched evaluation may round
        otherwise). ``None`` for prompt lookup (the same model as ``llamacpp-ar``)."""
        if self.config.name != "llamacpp-ar" or not tokens:
            return None if tokens else []
        need = len(prompt_ids) + len(tokens) + 8
        if need > self.n_ctx:
            self._load(n_ctx=max(need, 2 * self.n_ctx))
        llama_cpp = load_binding()
        llm = self.llm
        vocab = llm.n_vocab()

        def last_choice() -> int:
            # Without logits_all, llama-cpp-python keeps no scores: read the context's
            # logits of the last evaluated token.
            row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
            return int(np.argmax(np.ctypeslib.as_array(row, shape=(vocab,))))

        llm.reset()
        llm.eval(list(prompt_ids))
        choices = [last_choice()]
        for token in tokens[:-1]:
            llm.eval([int(token)])
            choices.append(last_choice())
        llm.reset()
        return choices

    def run_batch(self, prompts: list[EncodedPrompt], settings: RunSettings) -> list[RunOutput]:
        """One prompt after another (llama-cpp-python's ``generate`` is one sequence)."""
        return run_one_by_one(self, prompts, settings, self.clock)

    def run(self, prompt: EncodedPrompt, settings: RunSettings) -> RunOutput:
        """Generate for one prompt, timing the whole call (prompt evaluation included).

        Raises:
            InvalidArgumentError: the prompt has a ``response_format`` (``json-extract``):
                these runners pass no grammar to llama.cpp, so their output would be
                unconstrained and not comparable.
        """
        refuse_constraints(self.config.name, [prompt],
                           "these runners pass no grammar to llama.cpp")
        need = len(prompt.ids) + settings.max_new_tokens + 8
        if need > self.n_ctx:
            self._load(n_ctx=max(need, 2 * self.n_ctx))
        llm = self.llm
        eos = self.engine.eos_token_ids
        if settings.temperature > 0:
            llm.set_seed(settings.seed)
            sampling = {"temp": settings.temperature, "top_p": settings.top_p, "top_k": 0,
                        "min_p": 0.0}
        else:
            sampling = {"temp": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0}
        tokens: list[int] = []
        finish = "length"
        ttft_ms = None
        # llama-cpp-python's generate keeps the longest prefix shared with the previous call's
        # tokens even with reset=True, so a prompt run right after its warmup would skip its
        # prompt evaluation: every selfspec method prefills each prompt, so llama.cpp must too.
        llm.reset()
        start = self.clock()
        if settings.max_new_tokens > 0:
            for token in llm.generate(list(prompt.ids), reset=True, repeat_penalty=1.0,
                                      typical_p=1.0, **sampling):
                if ttft_ms is None:
                    ttft_ms = (self.clock() - start) * 1000.0
                tokens.append(int(token))
                if token in eos:
                    finish = "eos"
                    break
                if len(tokens) >= settings.max_new_tokens:
                    break
        wall = self.clock() - start
        return RunOutput(
            token_ids=tokens,
            text=self.engine.tokenizer.decode(tokens, skip_special_tokens=True),
            wall_time_s=wall, ttft_ms=ttft_ms, finish_reason=finish,
            layer_forwards=(self.engine.executor.num_layers * max(len(tokens) - 1, 0)
                            if self.config.name == "llamacpp-ar" else None))
