"""Structured output: grammars (JSON schema, JSON object, regex, Lark) compiled with
llguidance and matched token by token, drafts included.

Why llguidance (``pip install llguidance``) rather than xgrammar: it needs no grammar
compilation step (masks are computed lazily by an Earley parser over a token trie, cheap
next to a decoding step even for a whole draft), ships one Rust wheel with
no dependencies, and has the two calls speculative decoding needs — masks for every position
of a draft without changing the matcher (``fill_next_token_bitmask_par_with_draft_tokens``)
and ``validate_tokens``. It is maintained by the guidance-ai team and used by vLLM, SGLang
and llama.cpp's server.

Speculation and a grammar (docs/design.md "Output processing"): the target's logits at
draft position ``i`` are masked by the grammar's state after the committed tokens *and*
draft tokens ``0 .. i-1``; a draft token the grammar forbids can never be accepted (its
target probability is 0 after the mask), and only committed tokens advance the matcher, so
rejected draft tokens never need rolling back. Greedy constrained speculative decoding
therefore commits exactly the tokens of constrained autoregressive decoding, and speculative
sampling reproduces the constrained distribution (Leviathan et al. 2023, §2.3, applied to the
masked target).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from selfspec.errors import InvalidArgumentError, MissingDependencyError

_KINDS = ("json_schema", "json_object", "regex", "lark")


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf  # noqa: F401  (binds HF tokenizers)
        import llguidance.torch  # noqa: F401  (bitmask helpers)
    except ImportError as error:
        raise MissingDependencyError(
            "structured output needs llguidance: pip install 'selfspec[structured]' (or "
            "pip install llguidance; the serve and bench extras have it too)") from error
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """A validated grammar bound to one model's tokenizer.

    Attributes:
        kind: ``"json_schema"``, ``"json_object"``, ``"regex"`` or ``"lark"``.
        source: llguidance's grammar text (what :class:`GrammarMatcher` parses).
        tokenizer: the ``llguidance.LLTokenizer`` of the model (vocabulary size = the model's
            logits width; ids the tokenizer does not know are never allowed).
        vocab_size: ``V``, the width of the logits the masks apply to.
    """

    kind: str
    source: str
    tokenizer: Any
    vocab_size: int

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar (one per generation)."""
        return GrammarMatcher(self)


class GrammarCompiler:
    """Turns constraints into :class:`Grammar` objects for one model (the tokenizer's
    llguidance form is built once, a fraction of a second).

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: ``V``, the model's logits width (may exceed the tokenizer's vocabulary).
        eos_token_ids: the tokens that may end generation once the grammar is complete (the
            model's end-of-turn tokens).

    Raises:
        MissingDependencyError: llguidance is not installed.
        InvalidArgumentError: the tokenizer's vocabulary cannot be read.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        ll = _llguidance()
        eos = sorted(eos_token_ids)
        try:
            self.tokenizer = ll.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        except Exception:  # noqa: BLE001 - llguidance reads byte-level / metaspace decoders only
            self.tokenizer = _from_vocabulary(ll, tokenizer, vocab_size, eos)
        self.vocab_size = vocab_size

    def compile(self, kind: str, spec: Any = None) -> Grammar:
        """A validated grammar.

        Args:
            kind: ``"json_schema"`` (``spec``: the schema, a dict or its JSON text),
                ``"json_object"`` (any JSON object; ``spec`` ignored), ``"regex"`` (``spec``:
                a pattern the whole output must match) or ``"lark"`` (``spec``: a Lark
                grammar in llguidance's dialect).

        Raises:
            InvalidArgumentError: an unknown kind, or a spec that is not valid (an
                unsupported or malformed schema, a bad regex or grammar); the message names
                the problem. Nothing is generated before this check.
        """
        source = grammar_source(kind, spec)
        _validate(kind, source, self.tokenizer)
        return Grammar(kind, source, self.tokenizer, self.vocab_size)


def grammar_source(kind: str, spec: Any = None) -> str:
    """llguidance's grammar text of a constraint (see :meth:`GrammarCompiler.compile` for
    ``kind`` and ``spec``), not yet validated.

    Raises:
        InvalidArgumentError: an unknown kind, a spec of the wrong type, a JSON schema whose
            text is not JSON.
        MissingDependencyError: llguidance is not installed.
    """
    matcher = _llguidance().LLMatcher
    if kind not in _KINDS:
        raise InvalidArgumentError(
            f"unknown grammar kind {kind!r}; use one of {', '.join(_KINDS)}")
    try:
        if kind == "json_schema":
            if isinstance(spec, str):
                spec = json.loads(spec)
            if not isinstance(spec, Mapping):
                raise InvalidArgumentError(
                    f"a JSON schema must be a JSON object; got {type(spec).__name__}")
            # Compact JSON (no free whitespace): what a model writes most often and fewer
            # tokens to generate; llguidance's default allows any whitespace.
            return matcher.grammar_from_json_schema(
                dict(spec), defaults={"whitespace_flexible": False})
        if kind == "json_object":
            return matcher.grammar_from_json_schema(
                {"type": "object"}, defaults={"whitespace_flexible": False})
        if kind == "regex":
            if not isinstance(spec, str) or not spec:
                raise InvalidArgumentError("a regex constraint must be a non-empty string")
            return matcher.grammar_from_regex(spec)
        if not isinstance(spec, str) or not spec.strip():
            raise InvalidArgumentError("a Lark grammar must be a non-empty string")
        return matcher.grammar_from_lark(spec)
    except (ValueError, TypeError, RecursionError) as error:
        if isinstance(error, InvalidArgumentError):
            raise
        raise InvalidArgumentError(f"invalid {kind}: {_one_line(str(error))}") from error


def check_grammar(kind: str, spec: Any = None) -> None:
    """Validate a constraint without a tokenizer (schema keywords, regex syntax, Lark
    syntax), so a command can refuse it before loading a model; what depends on the
    vocabulary is checked again by :meth:`GrammarCompiler.compile`.

    Raises:
        InvalidArgumentError: as :meth:`GrammarCompiler.compile`.
        MissingDependencyError: llguidance is not installed.
    """
    _validate(kind, grammar_source(kind, spec), None)


def _validate(kind: str, source: str, tokenizer: Any) -> None:
    """Raise :class:`InvalidArgumentError` (one line) unless llguidance accepts ``source``
    (with ``tokenizer``: for that vocabulary; ``None``: the grammar alone)."""
    is_error, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(
        source, tokenizer)
    if is_error:
        raise InvalidArgumentError(
            f"invalid {kind}: {'; '.join(_one_line(m) for m in messages)}")


def _one_line(message: str) -> str:
    """llguidance's multi-line error (message, the source excerpt with a caret, the regex
    parser's ``error:`` line) as one line: the CLI prints an error as one line."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return message
    kept = [lines[0]] + [line for line in lines[1:] if line.startswith("error:")]
    return " ".join(kept)


class _VocabularyTokenizer:
    """What ``llguidance.TokenizerWrapper`` reads, built from a tokenizer's vocabulary: each
    id's bytes are its text as the tokenizer decodes it alone (exact for tokenizers whose
    tokens are whole characters; llguidance's own reader handles byte-level and SentencePiece
    vocabularies, which is every registry model)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos: list[int]) -> None:
        special = set(getattr(tokenizer, "all_special_ids", []))
        self.eos_token_id = eos[0] if eos else None
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self.special_token_ids = sorted(special)
        names = tokenizer.convert_ids_to_tokens(list(range(min(len(tokenizer), vocab_size))))
        self.tokens = [b"" if i in special or name is None
                       else tokenizer.convert_tokens_to_string([name]).encode("utf-8")
                       for i, name in enumerate(names)]
        self.tokens += [b""] * (vocab_size - len(self.tokens))
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


def _from_vocabulary(ll: Any, tokenizer: Any, vocab_size: int, eos: list[int]) -> Any:
    """An ``LLTokenizer`` read from the vocabulary (see :class:`_VocabularyTokenizer`).

    Raises:
        InvalidArgumentError: the vocabulary cannot be read.
    """
    try:
        wrapper = ll.TokenizerWrapper(_VocabularyTokenizer(tokenizer, vocab_size, eos))
        return ll.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos)
    except Exception as error:  # noqa: BLE001 - any failure means: this tokenizer won't do
        raise InvalidArgumentError(
            f"structured output cannot read this model's tokenizer vocabulary: {error}"
        ) from error


class GrammarViolation(InvalidArgumentError):
    """A generation's output constraint cannot be followed: llguidance refused a token that
    its mask allowed (see :meth:`GrammarMatcher.commit`). The request's constraint is at
    stake, not the decoder: the server answers a 400 naming it."""


class GrammarMatcher:
    """One generation's position in a :class:`Grammar`.

    Only committed tokens advance it (:meth:`commit`); masks for a draft are computed without
    changing its state (:meth:`masks`), so a rejected draft leaves nothing to roll back.

    Raises:
        InvalidArgumentError: the grammar cannot be instantiated (llguidance's error).
    """

    def __init__(self, grammar: Grammar) -> None:
        ll = _llguidance()
        self._torch = ll.torch
        self.grammar = grammar
        self._matcher = ll.LLMatcher(grammar.tokenizer, grammar.source)
        if self._matcher.is_error():
            raise InvalidArgumentError(f"invalid {grammar.kind}: {self._matcher.get_error()}")
        self._executor = ll.LLExecutor()
        self._words = (grammar.vocab_size + 31) // 32
        self._violation: GrammarViolation | None = None

    def masks(self, draft: Sequence[int], rows: int) -> torch.Tensor:
        """Allowed tokens at ``rows`` consecutive positions.

        Args:
            draft: draft tokens after the committed sequence (at least ``rows - 1``).
            rows: positions to mask: row ``i`` follows the committed tokens and
                ``draft[:i]``.

        Returns:
            ``[rows, V]`` bool, True where a token is allowed. Rows after the first draft
            token the grammar forbids allow everything (no token there can be accepted).
        """
        bitmask = torch.full((rows, self._words), -1, dtype=torch.int32)
        if rows == 1:
            self._torch.fill_next_token_bitmask(self._matcher, bitmask, 0)
        else:
            self._torch.fill_next_token_bitmask_par_with_draft_tokens(
                self._executor, [(self._matcher, 0, list(draft[: rows - 1]))], bitmask)
        if self._matcher.is_error():  # a row run again after its failed (batched) step
            raise self._violation or RuntimeError(
                f"grammar matcher failed: {self._matcher.get_error()}")
        return _unpack(bitmask, self.grammar.vocab_size)

    def guide(self) -> DraftGuide:
        """A :class:`DraftGuide`: a copy of this matcher that a drafter advances through its
        draft (this one stays on the committed tokens)."""
        return DraftGuide(self)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (after the committed ones) the grammar allows in a row."""
        return self._matcher.validate_tokens(list(tokens))

    def forced_tokens(self, after: Sequence[int] = (), limit: int = 64) -> list[int]:
        """The tokens of the bytes the grammar forces next (e.g. ``","email":"`` between two
        required fields of a schema), after the committed tokens and ``after``: the forced
        bytes in the tokenizer's own tokenization, cut to what the grammar allows.

        The matcher is not changed (a copy follows ``after``). A drafter may
        propose these: under the grammar's mask the forced bytes are the only continuation,
        so the target accepts them unless it prefers another tokenization of them. The last
        token may join the forced bytes with bytes that follow (the tokenizer never saw
        those), which is why llguidance's own fast-forward tokens stop before it; drafting it
        anyway covered 681 rather than 614 of the 1,498 tokens of json-extract's reference
        answers (SmolLM2's tokenizer), 26 of those last tokens being another tokenization.

        Args:
            after: tokens after the committed ones (e.g. a draft's valid prefix).
            limit: at most this many tokens.

        Returns:
            Up to ``limit`` token ids; empty when nothing is forced, when ``after`` breaks the
            grammar, or once the grammar is complete.
        """
        if limit <= 0 or self._matcher.is_stopped():
            return []
        matcher = self._matcher
        if after:
            matcher = matcher.deep_copy()
            if matcher.try_consume_tokens(list(after)) != len(after):
                return []
        return _forced(matcher, self.grammar.tokenizer, limit)

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance past committed tokens.

        Raises:
            GrammarViolation: llguidance refuses a committed token. Every committed token is
                chosen from masked logits, so llguidance refuses a token its own mask
                allowed: it happens with some constraints on some vocabularies (llguidance
                1.9.1: a regex of U+5F06A on SmolLM2's byte-level vocabulary; any character
                a vocabulary cannot spell), and the request cannot go on.
        """
        # One by one: llguidance's consume_tokens refuses the end-of-sequence token once the
        # grammar is complete, consume_token takes it (llguidance 1.9).
        for token in tokens:
            if not self._matcher.consume_token(token):
                self._violation = GrammarViolation(
                    f"the {self.grammar.kind} constraint cannot be followed with this model's "
                    f"tokenizer: llguidance refused token {token} it had allowed "
                    f"({self._matcher.get_error().splitlines()[0]})")
                raise self._violation

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing but end-of-sequence."""
        return self._matcher.is_stopped()


def _forced(matcher: Any, tokenizer: Any, limit: int) -> list[int]:
    """Up to ``limit`` tokens of the bytes ``matcher`` forces next, as the tokenizer splits
    them, cut to what the grammar allows (see :meth:`GrammarMatcher.forced_tokens`)."""
    if limit <= 0 or matcher.is_stopped():
        return []
    forced = matcher.compute_ff_bytes()
    if not forced:
        return []
    tokens = tokenizer.tokenize_bytes(forced)[:limit]
    return list(tokens[: matcher.validate_tokens(tokens)])


def _unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """llguidance's ``[N, ceil(V / 32)]`` int32 bitmask as ``[N, V]`` bool (True = allowed)."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little",
                         count=vocab_size)
    return torch.from_numpy(bits.view(np.bool_))


class DraftGuide:
    """The grammar's state along one draft: lets a model drafter (qspec, layerskip, ...)
    choose each draft token among the tokens the grammar allows after the committed ones and
    the draft so far (docs/design.md "Output processing").

    A draft token the grammar forbids could never be accepted (the target is masked), and
    neither could anything drafted after it; masked, the draft model proposes the
    continuation it prefers among the valid ones, e.g. the forced ``"`` that opens a JSON
    string value rather than an unconstrained guess. The draft stays a function of the
    context (and, sampling, of the recorded draft distribution ``q``), so verification and
    losslessness are unchanged.

    Args:
        matcher: the generation's matcher (copied; it is not changed).
    """

    def __init__(self, matcher: GrammarMatcher) -> None:
        self._torch = matcher._torch
        self._matcher = matcher._matcher.deep_copy()
        self._tokenizer = matcher.grammar.tokenizer
        self._words = matcher._words
        self.vocab_size = matcher.grammar.vocab_size
        self.broken = False  # a token it does not allow was drafted (e.g. from a proposal)

    def allowed(self) -> torch.Tensor | None:
        """``[V]`` bool: the tokens allowed next (on the CPU), or ``None`` after a token the
        grammar forbids."""
        if self.broken:
            return None
        bitmask = torch.full((1, self._words), -1, dtype=torch.int32)
        self._torch.fill_next_token_bitmask(self._matcher, bitmask, 0)
        if self._matcher.is_error():
            self.broken = True
            return None
        return _unpack(bitmask, self.vocab_size)[0]

    def mask(self, logits: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor | None:
        """Draft logits with the forbidden tokens at ``-inf``.

        Args:
            logits: ``[V]`` draft logits, or ``[R]`` over a reduced draft vocabulary.
            rows: ``[R]`` the vocabulary ids of a reduced draft vocabulary's logits.

        Returns:
            ``[V]`` / ``[R]`` float32 logits (a new tensor), or ``None`` when the grammar
            allows none of these tokens (the draft should end).
        """
        allowed = self.allowed()
        if allowed is None:
            return None
        allowed = allowed.to(logits.device)
        if rows is not None:
            allowed = allowed[rows]
        if not bool(allowed.any()):
            return None
        return logits.float().masked_fill(~allowed, -math.inf)

    def advance(self, token: int) -> None:
        """Follow a drafted token (a forbidden one marks the guide broken: nothing after it
        can be accepted)."""
        if not self.broken and not self._matcher.consume_token(token):
            self.broken = True

    def forced_tokens(self, limit: int) -> list[int]:
        """The tokens the grammar forces after the draft so far
        (:meth:`GrammarMatcher.forced_tokens`); none once broken."""
        return [] if self.broken else _forced(self._matcher, self._tokenizer, limit)


def response_format_constraint(response_format: Mapping[str, Any] | None
                               ) -> tuple[str, Any] | None:
    """The ``(kind, spec)`` of an OpenAI ``response_format`` (plus selfspec's ``regex`` /
    ``lark``), not yet validated; ``None`` for no constraint.

    Accepted shapes: ``{"type": "text"}`` (no grammar), ``{"type": "json_object"}``,
    ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``,
    ``{"type": "regex", "regex": "..."}``, ``{"type": "lark", "lark": "..."}``.

    Raises:
        InvalidArgumentError: not an object, an unknown type, a ``json_schema`` without its
            ``schema``.
    """
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise InvalidArgumentError("response_format must be an object with a 'type'")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return kind, None
    if kind == "json_schema":
        wrapper = response_format.get("json_schema")
        if not isinstance(wrapper, Mapping) or "schema" not in wrapper:
            raise InvalidArgumentError(
                "response_format json_schema must be {\"type\": \"json_schema\", "
                "\"json_schema\": {\"name\": ..., \"schema\": {...}}}")
        return kind, wrapper["schema"]
    if kind in ("regex", "lark"):
        return kind, response_format.get(kind)
    raise InvalidArgumentError(
        f"response_format type must be one of text, json_object, json_schema, regex, lark; "
        f"got {kind!r}")


def check_response_format(response_format: Mapping[str, Any] | None) -> None:
    """Validate a ``response_format`` without a model (:func:`check_grammar`): what a
    command checks before loading one.

    Raises:
        InvalidArgumentError: as :func:`response_format_grammar`.
        MissingDependencyError: a constraint is given and llguidance is not installed.
    """
    constraint = response_format_constraint(response_format)
    if constraint is not None:
        check_grammar(*constraint)


def response_format_grammar(compiler: GrammarCompiler,
                            response_format: Mapping[str, Any] | None) -> Grammar | None:
    """The grammar of an OpenAI ``response_format`` (shapes: see
    :func:`response_format_constraint`).

    Raises:
        InvalidArgumentError: an unknown type or a malformed or unsupported schema, regex or
            grammar; the message names the field at fault.
    """
    constraint = response_format_constraint(response_format)
    return None if constraint is None else compiler.compile(*constraint)
