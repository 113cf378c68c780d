"""Every method's Options drive the CLI, the API and the benchmark: each option is accepted
by all three, and each out-of-range value is refused by all three with a message naming the
method and the option."""

import dataclasses

import pytest

import selfspec
from selfspec.bench.spec import parse_method
from selfspec.cli import build_parser, main, method_option_fields, method_options
from selfspec.errors import InvalidArgumentError
from selfspec.methods.options import MODEL_BOUNDS, option_fields
from selfspec.methods.registry import METHODS, build_step, get_method

from bench_helpers import tiny_engine

EXAMPLES = {"drafters": "ngram"}  # free-form strings whose content is checked


def _valid(field):
    """A value every model accepts."""
    if field.name in EXAMPLES:
        return EXAMPLES[field.name]
    if field.default is not None:
        return field.default
    if field.type is int:
        return field.info.low if isinstance(field.info.low, int) else 1
    if field.type is str:
        return field.info.choices[0] if field.info.choices else "some-heads"
    if field.type is float:
        return 0.5
    return True


def _invalid(field):
    """A value outside the option's range, or ``None`` when every value of its type is valid."""
    if field.info.choices:
        return "no-such-choice"
    if field.type is bool:
        return "maybe"
    low = field.info.low
    if isinstance(low, (int, float)):
        return low if field.info.low_open else low - 1
    return None


CASES = [(spec.name, f) for spec in METHODS.values() for f in spec.fields]
INVALID = [(name, f) for name, f in CASES if _invalid(f) is not None]


def test_every_method_is_described():
    for spec in METHODS.values():
        assert spec.summary and spec.paper and isinstance(spec.lossless, bool)
        assert dataclasses.is_dataclass(spec.options)
        option_fields(spec.options)  # every field is declared with option()
        for f in spec.fields:
            assert f.info.help, f"{spec.name}.{f.name} has no help text"
            for bound in (f.info.low, f.info.high):
                assert bound is None or isinstance(bound, (int, float)) or bound in MODEL_BOUNDS
    method_option_fields()  # one CLI flag per option name: the same type in every method


@pytest.mark.parametrize("method,field", CASES, ids=[f"{m}.{f.name}" for m, f in CASES])
def test_cli_api_and_bench_accept_every_option(method, field):
    value = _valid(field)
    spec = get_method(method)
    assert getattr(spec.parse({field.name: value}), field.name) == value  # API keywords
    argv = ["generate", "hi", "--method", method]
    if field.type is bool:
        argv.append(field.flag if value else "--no-" + field.flag[2:])
    else:
        argv += [field.flag, str(value)]
    assert method_options(build_parser().parse_args(argv)) == {field.name: value}  # CLI
    text = str(value).lower() if isinstance(value, bool) else str(value)
    assert parse_method(f"{method}:{field.name}={text}").options == {field.name: value}  # bench


@pytest.mark.parametrize("method,field", INVALID, ids=[f"{m}.{f.name}" for m, f in INVALID])
def test_cli_api_and_bench_refuse_out_of_range_values(method, field, capsys, monkeypatch):
    bad = _invalid(field)
    message = f"method '{method}': {field.name} must be"
    with pytest.raises(InvalidArgumentError, match=message):  # API
        get_method(method).parse({field.name: bad})
    with pytest.raises(InvalidArgumentError, match=message):  # bench
        parse_method(f"{method}:{field.name}={bad}")
    if field.type is bool:
        return  # a CLI switch has no out-of-range value
    # The CLI refuses before loading the model.
    monkeypatch.setattr(selfspec, "load", lambda *a, **k: pytest.fail("model loaded"))
    if field.info.choices:  # argparse's own choices check: a one-line usage error
        assert main(["generate", "hi", "--method", method, field.flag, str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "invalid choice" in err and err.count("\n") == 1
        return
    assert main(["generate", "hi", "--method", method, field.flag, str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_generate_refuses_bad_options_with_the_option_named():
    engine = tiny_engine()
    with pytest.raises(InvalidArgumentError, match="exit_layer must be an integer in \\[1, 5\\]"):
        engine.generate("hi", method="layerskip", exit_layer=6)
    with pytest.raises(InvalidArgumentError, match="does not take option.*epsilon"):
        engine.generate("hi", method="dv", epsilon=0.5)
    with pytest.raises(InvalidArgumentError,
                       match="max_draft_len must be an integer in \\[1, 63\\]"):
        engine.generate("hi", method="adaspeed", max_draft_len=64)
    out = engine.generate("hi", method="dv", exit_layer="3", gamma="0.5", max_new_tokens=4)
    assert len(out.token_ids) == 4  # strings are parsed by the option's type


def test_model_bounds_are_checked_when_the_step_is_built():
    engine = tiny_engine()
    spec = get_method("layerskip")
    assert spec.parse({"exit_layer": 6}).exit_layer == 6  # no model yet: L is unknown
    with pytest.raises(InvalidArgumentError, match=r"\[1, 5\]"):
        build_step("layerskip", engine.executor, {"exit_layer": 6})


def test_methods_command_lists_every_method_and_option(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    for spec in METHODS.values():
        assert spec.name in out and ("lossless" if spec.lossless else "lossy") in out
        for f in spec.fields:
            assert f.flag in out
    assert main(["methods", "dssd"]) == 0
    out = capsys.readouterr().out
    assert "--epsilon" in out and "default 0.9" in out and "layerskip" not in out
    # lossless only with an option: said so on the method's line
    assert main(["methods", "specee"]) == 0
    assert capsys.readouterr().out.startswith("specee  (lossy by default;")
