"""Task accuracy of generated text: HumanEval pass@1, GSM-Symbolic exact match, json-extract
schema validity (:func:`check_json`), and a prompt file's reference answers
(:func:`check_reference`).

Used for lossy methods (their outputs may differ from autoregressive decoding) and, for
comparison, for every method of a run. MT-Bench and ShareGPT need a judge model and are
not scored.

HumanEval completions are untrusted code: they run in a sandbox (no network, read-only
filesystem but a private work dir, no capabilities, resource limits, the whole PID namespace
killed on timeout; :mod:`selfspec.bench.sandbox`), or not at all unless the user opts in to
running them unsandboxed.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from selfspec import extras
from selfspec.bench.sandbox import Sandbox, find_sandbox
from selfspec.data import Prompt
from selfspec.data.promptfile import FILE_LABEL_PREFIX

# Codex paper's stop sequences: a completion ends where the function body ends.
HUMANEVAL_STOP = ("\nclass ", "\ndef ", "\n#", "\nif __name__", "\nprint(", "\n```")
HUMANEVAL_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Score:
    """The verdict on one output.

    Attributes:
        correct: True when the output solves the task.
        detail: why (``"passed"``, ``"timed out"``, the last error line, the extracted answer).
    """

    correct: bool
    detail: str


def humaneval_completion(text: str) -> str:
    """The function body in ``text``: cut at the first Codex stop sequence."""
    cut = min((i for s in HUMANEVAL_STOP if (i := text.find(s)) >= 0), default=len(text))
    return text[:cut]


def humaneval_program(prompt: Prompt, completion: str) -> str:
    """The test program of ``completion`` for HumanEval ``prompt``: prompt + completion +
    the problem's ``check`` function, called on its entry point."""
    return (prompt.text + completion + "\n\n" + prompt.meta["test"] + "\n"
            + f"check({prompt.meta['entry_point']})\n")


def check_humaneval(prompt: Prompt, text: str, timeout_s: float = HUMANEVAL_TIMEOUT_S,
                    sandbox: Sandbox | None = None) -> Score:
    """Run HumanEval's tests on a generated completion (pass@1 of one sample), in a sandbox.

    Args:
        prompt: a ``humaneval`` prompt (``meta`` has ``test`` and ``entry_point``).
        text: the generated continuation of ``prompt.text``.
        timeout_s: wall-time limit of the test process in seconds.
        sandbox: where the code runs (default: :func:`~selfspec.bench.sandbox.find_sandbox`).

    Returns:
        Passed or not, with the reason.

    Raises:
        KeyError: ``prompt`` is not a HumanEval prompt.
        SandboxUnavailableError: no ``sandbox`` given and none works on this machine.
    """
    sandbox = sandbox or find_sandbox()
    result = sandbox.run(humaneval_program(prompt, humaneval_completion(text)), timeout_s)
    if result.timed_out:
        return Score(False, "timed out")
    if result.returncode == 0:
        return Score(True, "passed")
    lines = result.stderr.strip().splitlines()
    return Score(False, lines[-1] if lines else f"exit status {result.returncode}")


_NUMBER = r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+"
_FINAL_ANSWER = (
    re.compile(rf"####\s*\$?\s*({_NUMBER})"),
    re.compile(rf"\\boxed\{{\s*\$?\s*({_NUMBER})"),
    re.compile(rf"answer\s*(?:is|:)\s*[:\s]*\**\s*\$?\s*({_NUMBER})", re.IGNORECASE),
)


def extract_number(text: str) -> float | None:
    """The final numeric answer in ``text``: after ``####``, in ``\\boxed{}``, after
    "answer is", else the last number in the text (commas dropped). None if no number."""
    for pattern in _FINAL_ANSWER:
        matches = pattern.findall(text)
        if matches:
            return _to_float(matches[-1])
    numbers = re.findall(_NUMBER, text)
    return _to_float(numbers[-1]) if numbers else None


def _to_float(text: str) -> float | None:
    try:
        return float(text.replace(",", "").rstrip("."))
    except ValueError:
        return None


def check_gsm(prompt: Prompt, text: str) -> Score:
    """Exact match of the final number in ``text`` with the GSM answer ``prompt.meta["answer"]``.

    Raises:
        KeyError: ``prompt`` is not a GSM prompt.
    """
    return _number_match(float(prompt.meta["answer"]), text)


def _number_match(expected: float, text: str) -> Score:
    got = extract_number(text)
    if got is None:
        return Score(False, "no number in the output")
    return Score(math.isclose(got, expected, rel_tol=0, abs_tol=1e-6), f"answer {got:g}")


def _normalize(text: str) -> str:
    return " ".join(text.split()).casefold()


def check_reference(prompt: Prompt, text: str) -> Score | None:
    """Compare ``text`` with ``prompt.reference`` (prompt files, ``selfspec bench --prompts``).

    - A numeric reference (``"42"``, ``"-3.5"``, ``"1,000"``): exact match of the final number
      in ``text``, found as for GSM (:func:`extract_number`).
    - Any other reference: ``text`` starts with it, both normalized (whitespace runs collapsed
      to one space, leading and trailing whitespace dropped, case folded).

    Returns:
        The verdict, or None when the prompt has no reference (not scored).
    """
    if prompt.reference is None:
        return None
    if re.fullmatch(rf"\s*(?:{_NUMBER})\s*", prompt.reference):
        expected = _to_float(prompt.reference.strip())
        if expected is not None:
            return _number_match(expected, text)
    matched = _normalize(text).startswith(_normalize(prompt.reference))
    return Score(matched, "starts with the reference" if matched else "differs from the reference")


def check_json(prompt: Prompt, text: str) -> Score:
    """``text`` parses as JSON and validates against ``prompt.meta["schema"]`` (json-extract;
    the ``jsonschema`` package, in the ``[bench]`` extra, validates: the schema's own
    ``$schema`` draft, else 2020-12).

    Raises:
        KeyError: ``prompt`` has no schema.
        MissingDependencyError: ``jsonschema`` is not installed.
    """
    require_scorer("json-extract")
    import jsonschema

    schema = prompt.meta["schema"]
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        return Score(False, f"not JSON ({err.msg} at column {err.colno})")
    validator = jsonschema.validators.validator_for(
        schema, default=jsonschema.Draft202012Validator)(schema)
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    if error is not None:
        return Score(False, f"not valid at {error.json_path}: {error.message}")
    return Score(True, "valid JSON for the schema")


#: Modules a dataset's scorer imports: checked before generating (:func:`require_scorer`).
SCORER_MODULES = {"json-extract": ("jsonschema", "json-extract's schema validation")}


def require_scorer(dataset: str) -> None:
    """Raise before any generation if scoring ``dataset`` needs a missing package.

    Raises:
        MissingDependencyError: e.g. ``jsonschema`` for json-extract; the message names the
            ``[bench]`` extra.
    """
    if dataset in SCORER_MODULES:
        module, purpose = SCORER_MODULES[dataset]
        extras.require_module(module, purpose,
                              f"{extras.BENCH_INSTALL} (or only: pip install {module}); or "
                              "pass --no-accuracy")


SCORERS: dict[str, Callable[[Prompt, str], Score | None]] = {
    "humaneval": check_humaneval,
    "gsm": check_gsm,
    "json-extract": check_json,
    "file": check_reference,
}


def scorer(dataset: str) -> Callable[[Prompt, str], Score | None] | None:
    """The scorer of ``dataset``: :data:`SCORERS` by name; every prompt file's label
    (``file:<stem>``) gets the ``"file"`` scorer, whatever the file is called. None when the
    dataset has no automatic scorer (MT-Bench and ShareGPT need a judge)."""
    if dataset.startswith(FILE_LABEL_PREFIX):
        return SCORERS["file"]
    return SCORERS.get(dataset)


def score(dataset: str, prompt: Prompt, text: str, sandbox: Sandbox | None = None
          ) -> Score | None:
    """Score ``text`` generated for ``prompt`` of ``dataset``; None when the dataset has no
    automatic scorer (MT-Bench and ShareGPT need a judge) or the prompt has no reference.
    HumanEval code runs in ``sandbox`` (default: :func:`find_sandbox`).

    Raises:
        SandboxUnavailableError: HumanEval with no sandbox given and none available.
    """
    check = scorer(dataset)
    if check is check_humaneval:
        return check_humaneval(prompt, text, sandbox=sandbox)
    return check(prompt, text) if check else None


def runs_code(dataset: str) -> bool:
    """Whether scoring ``dataset`` runs generated code (and so needs a sandbox)."""
    return scorer(dataset) is check_humaneval
