"""Bad input at the boundary: every argument of the CLI and the API is checked for type and
range, every prompt for what it is; nothing ends in a raw traceback or a silently
reinterpreted value (issue: nothing silent, nothing lost)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from selfspec import from_pretrained_model
from selfspec.cli import main
from selfspec.decoding.core.sampling import SamplingConfig, logits_to_probs
from selfspec.errors import InvalidArgumentError, PromptError, SelfSpecError
from selfspec.validation import check_float, check_int, check_seed, check_stop

from tiny import VOCAB, save_tiny, tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def engine():
    return from_pretrained_model(tiny_model("llama"), tiny_tokenizer(), "tiny-llama")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny-model"), seed=3)


# ------------------------------------------------------------------------- unit checks
@pytest.mark.parametrize("value", [True, False, 2.5, "3", None, [1]])
def test_check_int_refuses_what_is_not_an_integer(value):
    with pytest.raises(InvalidArgumentError, match="n must be an integer"):
        check_int("n", value)


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, True, "0.5", None])
def test_check_float_refuses_non_finite_and_non_numbers(value):
    with pytest.raises(InvalidArgumentError, match="x must be a finite number"):
        check_float("x", value, low=0.0)


def test_seed_must_fit_in_64_bits():
    assert check_seed(2**64 - 1) == 2**64 - 1 and check_seed(-(2**63)) == -(2**63)
    for bad in (2**64, -(2**63) - 1, 1.5, "7", True):
        with pytest.raises(InvalidArgumentError, match="seed"):
            check_seed(bad)


@pytest.mark.parametrize("stop", ["", [""], [None], 5, [b"x"], "a\udcff"])
def test_bad_stop_strings_are_refused(stop):
    with pytest.raises(InvalidArgumentError):
        check_stop(stop)


def test_a_tiny_temperature_is_greedy_not_nan():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0 - 1e-3]])
    probs = logits_to_probs(logits, SamplingConfig(temperature=1e-45))
    assert torch.isfinite(probs).all() and probs[0, 1] == 1.0


def test_a_temperature_below_float32_is_greedy_not_nan():
    # Found by tests/serving/test_fuzz.py: 5e-324 is 0 in float32 (0 / 0 at the top token).
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0 - 1e-3]])
    probs = logits_to_probs(logits, SamplingConfig(temperature=5e-324))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))


def test_a_tiny_top_p_keeps_the_top_token():
    # Found by tests/serving/test_fuzz.py: top_p = 5e-324 is 0 in float32 and dropped every token.
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    for top_p in (5e-324, 1e-45, 1e-30):
        probs = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_p=top_p))
        assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0]])), top_p


# ------------------------------------------------------------------------- API prompts
BAD_PROMPTS = {
    "float tensor": torch.tensor([1.5, 2.0]),
    "bool tensor": torch.tensor([True, False]),
    "batch [2, T]": torch.tensor([[1, 2], [3, 4]]),
    "[1, 1, T]": torch.tensor([[[1, 2]]]),
    "0-d tensor": torch.tensor(5),
    "id = V": [1, VOCAB],
    "negative id": [1, -3],
    "None": None,
    "int": 5,
    "bytes": b"hello",
    "bools": [True, False],
    "floats": [1.0, 2.5],
    "nested list": [[[1, 2]]],  # (a list of id lists is a batch: tests/decoding/test_batch.py)
    "lone surrogate": "abc\udcff",
    "empty text": "   ",
    "empty ids": [],
    "dict": {"input_ids": [1, 2]},
}


@pytest.mark.parametrize("name", BAD_PROMPTS)
def test_bad_prompts_are_refused_with_a_prompt_error(engine, name):
    with pytest.raises(PromptError):
        engine.generate(BAD_PROMPTS[name], max_new_tokens=1)


def test_batch_tensor_says_batches_are_not_supported(engine):
    with pytest.raises(PromptError, match="batch of 2 prompts; pass a batch as a list of prompts"):
        engine.encode(torch.tensor([[1, 2], [3, 4]]))


def test_chat_needs_text_and_a_bool(engine):
    with pytest.raises(PromptError, match="chat template to text"):
        engine.encode([1, 2, 3], chat=True)
    with pytest.raises(InvalidArgumentError, match="chat must be True or False"):
        engine.encode("hi", chat="yes")


def test_every_id_form_gives_the_same_prompt(engine):
    ids = [5, 6, 7]
    forms = [ids, tuple(ids), torch.tensor(ids), torch.tensor([ids]), np.array(ids),
             torch.tensor(ids, dtype=torch.int32)]
    assert all(engine.encode(f) == ids for f in forms)


@pytest.mark.parametrize("kwargs", [
    {"max_new_tokens": 2.5}, {"max_new_tokens": "3"}, {"max_new_tokens": True},
    {"max_new_tokens": 0}, {"temperature": "0.5"}, {"temperature": math.inf},
    {"temperature": math.nan}, {"temperature": True}, {"top_k": 2.5}, {"top_k": True},
    {"top_p": 0.0}, {"top_p": 1.5}, {"seed": 2**70}, {"seed": "x"}, {"seed": 1.5},
    {"stop": 5}, {"stop": [None]}, {"stop": ""}, {"streamer": print},
    {"method": "layerskip", "exit_layer": True},
])
def test_bad_generation_arguments_are_refused(engine, kwargs):
    kwargs = {"max_new_tokens": 2, **kwargs}
    with pytest.raises(InvalidArgumentError):
        engine.generate("hi", **kwargs)


# ------------------------------------------------------------------- property-based tests
_prompts = st.one_of(
    st.text(max_size=12),
    st.binary(max_size=6),
    st.lists(st.one_of(st.integers(-5, VOCAB + 5), st.floats(allow_nan=True), st.booleans(),
                       st.none(), st.text(max_size=2)), max_size=6),
    st.builds(lambda xs, dt: torch.tensor(xs, dtype=dt),
              st.lists(st.integers(0, 300), min_size=0, max_size=6),
              st.sampled_from([torch.int64, torch.int32, torch.float32, torch.bool])),
    st.builds(lambda b, t: torch.randint(0, VOCAB, (b, t)), st.integers(1, 3), st.integers(0, 4)),
    st.none(), st.integers(), st.floats(),
)
_numbers = st.one_of(st.integers(-3, 40), st.floats(allow_nan=True, allow_infinity=True),
                     st.booleans(), st.none(), st.text(max_size=3),
                     st.integers(2**62, 2**70))


def _expected_ids(engine, prompt):
    """How a prompt that is accepted must be read (None = it must be refused)."""
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            return None
        return engine.tokenizer(prompt)["input_ids"] if prompt.strip() else None
    if isinstance(prompt, torch.Tensor):
        if prompt.dtype not in (torch.int64, torch.int32) or prompt.dim() not in (1, 2):
            return None
        if prompt.dim() == 2 and prompt.shape[0] != 1:
            return None
        prompt = prompt.reshape(-1).tolist()
    if isinstance(prompt, list) and prompt and all(
            type(t) is int and 0 <= t < VOCAB for t in prompt):
        return prompt
    return None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=_prompts, max_new_tokens=_numbers, temperature=_numbers, top_k=_numbers,
       top_p=_numbers, seed=_numbers)
def test_api_never_raises_raw_and_never_reinterprets_a_prompt(
        engine, prompt, max_new_tokens, temperature, top_k, top_p, seed):
    expected = _expected_ids(engine, prompt)
    try:
        out = engine.generate(prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                              top_k=top_k, top_p=top_p, seed=seed)
    except SelfSpecError:
        return
    assert expected is not None, f"accepted a prompt that should be refused: {prompt!r}"
    assert out.prompt_ids == expected
    assert type(max_new_tokens) is int and 1 <= max_new_tokens
    assert 1 <= len(out.token_ids) <= max_new_tokens


_flag_values = st.one_of(st.integers(-3, 70).map(str), st.sampled_from(
    ["0", "-1", "1e-45", "inf", "-inf", "nan", "2.5", str(2**70), "", "x", "true", "1e400"]))
_flags = ["--max-new-tokens", "--temperature", "--top-k", "--top-p", "--seed", "--threads",
          "--exit-layer", "--draft-len", "--gamma", "--max-draft-len", "--epsilon",
          "--draft-vocab", "--stop", "--presence-penalty", "--frequency-penalty", "--logprobs",
          "--regex"]


@settings(max_examples=40, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # capsys is read per example
@given(method=st.sampled_from(["ar", "layerskip", "dv", "adaspeed", "early-exit", "dssd",
                               "knapspec", "nope"]),
       flags=st.dictionaries(st.sampled_from(_flags), _flag_values, max_size=3),
       prompt=st.one_of(st.text(min_size=0, max_size=8), st.just("abc\udcff")))
def test_cli_ends_in_a_clear_error_or_success(model_dir, capsys, method, flags, prompt):
    argv = ["generate", "--model", str(model_dir), "--method", method]
    for flag, value in flags.items():
        argv += [f"{flag}={value}"]
    if "--max-new-tokens" not in flags:
        argv += ["--max-new-tokens", "2"]
    threads = torch.get_num_threads()
    try:
        status = main(argv + ["--", prompt])
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    # 0 = done, 2 = a clear error; 1 (unexpected) would be a gap in the validation.
    assert status in (0, 2), err
    if status == 2:
        lines = [line for line in err.splitlines() if line.strip()]
        assert lines and lines[-1].startswith("error: ") and "Traceback" not in err


def test_unexpected_errors_are_one_line_and_debug_shows_the_traceback(monkeypatch, capsys):
    from selfspec import cli

    def boom(args):
        raise RuntimeError("something broke\nsecond line")

    monkeypatch.setattr(cli, "_cmd_methods", boom)
    assert main(["methods"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: unexpected RuntimeError: something broke") and "--debug" in err
    assert err.count("\n") == 1
    with pytest.raises(RuntimeError):
        main(["--debug", "methods"])


_commands = {
    "bench": ["--methods", "ar", "--n", "--max-new-tokens", "--temperature", "--top-p", "--seed",
              "--threads", "--warmup", "--bandwidth-mib", "--out"],
    "heads train": ["--layers", "--alpha", "--loss-vocab", "--epochs", "--lr", "--batch-tokens",
                    "--tokens", "--max-new-tokens", "--seed", "--threads", "--epsilon"],
    "heads search-skip": ["--prompts", "--max-new-tokens", "--window", "--skip-ratio",
                          "--trials", "--refine-steps", "--max-evaluations", "--seed"],
}


@settings(max_examples=60, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # capsys is read per example
@given(command=st.sampled_from(sorted(_commands)), data=st.data())
def test_every_command_refuses_bad_flags_in_one_line_before_loading(
        command, data, capsys, tmp_path):
    flags = [f for f in _commands[command] if f.startswith("--")]
    chosen = data.draw(st.dictionaries(st.sampled_from(flags), _flag_values, max_size=3))
    argv = [*command.split(), "--model", "no-such-model"]
    for flag, value in chosen.items():
        argv.append(f"{flag}={value if flag != '--out' else tmp_path / value}")
    status = main(argv)
    err = capsys.readouterr().err
    # Whatever the flags, the run ends before any work: a bad flag or the unknown model.
    assert status == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and "Traceback" not in err


@pytest.mark.parametrize("command", [["generate"], ["bench"], ["bench-cpu"], ["heads", "train"],
                                     ["serve"]])
def test_a_thread_count_beyond_a_c_int_is_a_usage_error(command, capsys):
    # torch.set_num_threads overflowed on 2**70 ("Overflow when unpacking long long").
    argv = [*command, "--threads", str(2 ** 70), "--model", "no-such-model"]
    assert main(argv) == 2
    assert "--threads: must be an integer in [1, 4096]" in capsys.readouterr().err
