"""Autoregressive decoding on the executor equals transformers' greedy decoding."""

import pytest
import torch

from selfspec.decoding.core import loop
from selfspec.decoding.core.autoregressive import ArStep
from selfspec.decoding.core.sampling import SamplingConfig
from selfspec.decoding.core.state import DecodeOptions, DecodeState
from selfspec.errors import InvalidArgumentError, PromptError
from selfspec.executor import LayerExecutor

from tiny import VOCAB, tiny_model


def _run(model, prompt, **options):
    state = DecodeState(LayerExecutor(model), prompt, DecodeOptions(**options))
    with torch.inference_mode():
        loop.run(state, ArStep())
    return state


def _hf_greedy(model, prompt, n, eos=None):
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                         eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_equals_hf_generate(arch, seed):
    model = tiny_model(arch, seed=seed)
    prompt = torch.randint(0, VOCAB - 1, (12,),
                           generator=torch.Generator().manual_seed(seed)).tolist()
    state = _run(model, prompt, max_new_tokens=40)
    assert state.tokens[len(prompt):] == _hf_greedy(model, prompt, 40, eos=[])
    assert state.stats.finish_reason == "length"
    assert state.stats.layer_forwards == 39 * 6


def test_stops_at_eos_inclusive():
    model = tiny_model("llama")
    prompt = [3, 4, 5, 6]
    free = _run(model, prompt, max_new_tokens=20).tokens[4:]
    eos = free[7]  # pretend the 8th generated token is EOS
    state = _run(model, prompt, max_new_tokens=20, eos_token_ids=frozenset({eos}))
    assert state.tokens[4:] == free[: free.index(eos) + 1]
    assert state.stats.finish_reason == "eos"


def test_sampling_is_reproducible_with_a_seed_and_varies_without_one():
    model = tiny_model("qwen2")
    prompt = [1, 2, 3]
    cfg = SamplingConfig(temperature=1.0, top_p=0.95, top_k=50, seed=123)
    a = _run(model, prompt, max_new_tokens=30, sampling=cfg).tokens
    b = _run(model, prompt, max_new_tokens=30, sampling=cfg).tokens
    c = _run(model, prompt, max_new_tokens=30,
             sampling=SamplingConfig(temperature=1.0, seed=124)).tokens
    assert a == b and a != c


def test_context_limit_ends_generation():
    model = tiny_model("llama", max_position_embeddings=20)
    state = _run(model, list(range(1, 16)), max_new_tokens=50)
    assert state.seq_len == 20 and state.stats.finish_reason == "context"


def test_bad_input_is_refused_clearly():
    model = tiny_model("llama", max_position_embeddings=20)
    ex = LayerExecutor(model)
    with pytest.raises(PromptError, match="empty"):
        DecodeState(ex, [], DecodeOptions())
    with pytest.raises(PromptError, match="context is 20"):
        DecodeState(ex, list(range(20)), DecodeOptions())
    with pytest.raises(InvalidArgumentError, match="max_new_tokens"):
        DecodeOptions(max_new_tokens=0)
    with pytest.raises(InvalidArgumentError, match="temperature"):
        SamplingConfig(temperature=-0.1)
    for p in (0.0, 1.5, float("nan")):
        with pytest.raises(InvalidArgumentError, match="top_p"):
            SamplingConfig(temperature=1.0, top_p=p)
