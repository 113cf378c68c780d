"""Method specs of the benchmark: the label grammar of :mod:`selfspec.methods.labels` with the
benchmark's baselines outside selfspec (``hf-*``: transformers; ``llamacpp-*``: llama.cpp)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from selfspec.methods import labels
from selfspec.methods.labels import DECODE_KERNEL, MethodConfig, combine, parse_value
from selfspec.methods.registry import METHODS

__all__ = ["DECODE_KERNEL", "HF_BASELINES", "BaselineSpec", "MethodConfig", "combine",
           "known_methods", "parse_method", "parse_methods", "parse_sweep", "parse_value",
           "validate"]


@dataclass(frozen=True)
class BaselineSpec:
    """A baseline outside selfspec: transformers ``generate`` on the HF model itself
    (``hf-*``), or llama.cpp on the model's GGUF (``llamacpp-*``).

    Attributes:
        name: ``hf-...`` / ``llamacpp-...`` name used in ``--methods``.
        description: one line for reports and errors.
        options: option names it accepts (selfspec glossary names; see ``runners``).
    """

    name: str
    description: str
    options: tuple[str, ...] = ()


HF_BASELINES: Mapping[str, BaselineSpec] = {
    spec.name: spec
    for spec in (
        BaselineSpec("hf-ar", "transformers generate, greedy / sampling"),
        BaselineSpec("hf-ar-compiled", "transformers generate on a static cache with "
                     "torch.compile(mode='reduce-overhead') (CUDA graphs; CUDA only, a failed "
                     "row with the reason elsewhere)"),
        BaselineSpec("hf-early-exit", "transformers assisted decoding drafting with the model's "
                     "first exit_layer layers (assistant_early_exit)",
                     ("exit_layer", "draft_len", "confidence")),
        BaselineSpec("hf-prompt-lookup", "transformers prompt lookup decoding (n-gram drafts "
                     "copied from the prompt)", ("draft_len", "max_ngram")),
        BaselineSpec("hf-assistant", "transformers assisted decoding with a smaller "
                     "same-tokenizer model=NAME as the drafter",
                     ("model", "draft_len", "confidence")),
        BaselineSpec("llamacpp-ar", "llama.cpp (llama-cpp-python) on the GGUF the model was "
                     "converted from, greedy / sampling", ("gguf",)),
        BaselineSpec("llamacpp-prompt-lookup", "llama.cpp prompt lookup decoding "
                     "(LlamaPromptLookupDecoding) on the same GGUF",
                     ("gguf", "draft_len", "max_ngram")),
    )
}


def known_methods() -> list[str]:
    """Every method name the benchmark runs: selfspec methods, then transformers baselines."""
    return [*METHODS, *HF_BASELINES]


_BASELINE_OPTIONS = {name: spec.options for name, spec in HF_BASELINES.items()}


def validate(config: MethodConfig) -> MethodConfig:
    """:func:`selfspec.methods.labels.validate` with the benchmark's baselines."""
    return labels.validate(config, _BASELINE_OPTIONS)


def parse_method(spec: str) -> MethodConfig:
    """:func:`selfspec.methods.labels.parse_method` with the benchmark's baselines."""
    return labels.parse_method(spec, _BASELINE_OPTIONS)


def parse_methods(text: str) -> list[MethodConfig]:
    """:func:`selfspec.methods.labels.parse_methods` with the benchmark's baselines."""
    return labels.parse_methods(text, _BASELINE_OPTIONS)


def parse_sweep(spec: str) -> list[MethodConfig]:
    """:func:`selfspec.methods.labels.parse_sweep` with the benchmark's baselines."""
    return labels.parse_sweep(spec, _BASELINE_OPTIONS)


def reference_label(label: str, run_labels: Iterable[str]) -> str:
    """The row whose greedy output ``label``'s is compared with: ``ar`` on the same decoding
    kernel (``m:...,decode_kernel=K`` → ``ar:decode_kernel=K``) when the run has that row,
    else ``ar`` (the run's own weights; so ``ar:decode_kernel=K`` itself is compared with
    ``ar``: its greedy agreement with the dense model)."""
    try:
        config = labels.parse_method(label)
    except ValueError:  # a baseline's label the methods' grammar does not take
        return "ar"
    kernel = config.options.get(DECODE_KERNEL)
    if kernel is None or config.name == "ar":
        return "ar"
    same = f"ar:{DECODE_KERNEL}={kernel}"
    return same if same in set(run_labels) else "ar"
