"""Shared pieces of the benchmark tests: scripted runners with prepared outputs and a tiny
engine (imported by test_bench, test_promptfile and test_extras)."""

from __future__ import annotations

from selfspec.api import from_pretrained_model
from selfspec.bench.runners import EncodedPrompt, RunOutput, RunSettings
from selfspec.bench.spec import parse_method
from selfspec.errors import InvalidArgumentError

from tiny import tiny_model, tiny_tokenizer


class ScriptedRunner:
    """Returns prepared outputs; logs every call; may fail at setup or on one prompt."""

    def __init__(self, label: str, outputs: dict[str, RunOutput], log: list, *,
                 lossless: bool = True, fail_on: str | None = None, fail_setup: bool = False):
        self.config = parse_method(label)
        self.outputs, self.log, self.lossless = outputs, log, lossless
        self.fail_on, self.fail_setup = fail_on, fail_setup

    def setup(self) -> None:
        if self.fail_setup:
            raise InvalidArgumentError("bad option value")

    def run(self, prompt: EncodedPrompt, settings: RunSettings) -> RunOutput:
        self.log.append((self.config.label, prompt.id, settings.max_new_tokens))
        if prompt.id == self.fail_on:
            raise RuntimeError("boom")
        return self.outputs[prompt.id]


def run_output(tokens, wall, **counters) -> RunOutput:
    """A runner's output with ``tokens``, ``wall`` seconds and the given counters."""
    return RunOutput(token_ids=tokens, text="", wall_time_s=wall, **counters)


def tiny_engine(seed: int = 3, num_layers: int = 6):
    """A ``SelfSpec`` engine on a tiny random Llama named ``tiny-llama``."""
    return from_pretrained_model(tiny_model("llama", seed=seed, num_layers=num_layers),
                                 tiny_tokenizer(), "tiny-llama")
