"""n-gram drafts under a grammar (structured output): trimmed to what the grammar allows and
extended with what it forces.

With a grammar (``response_format``), the target's logits are masked at every verified
position (:mod:`selfspec.decoding.core.processors`), so

- a copied draft token the grammar forbids can never be accepted, nor can anything after it:
  the draft is cut before it (:meth:`GrammarMatcher.valid_prefix`) and those positions are
  not verified at all;
- where the grammar leaves one continuation (the keys, quotes, colons and commas between the
  values of a JSON schema, the rest of an enum value or of ``true``: 42% of the tokens of
  json-extract's reference answers), its tokens (:meth:`GrammarMatcher.forced_tokens`) are
  drafted after the copied ones, or alone when nothing is copied, and are accepted unless
  the model prefers another tokenization of the same bytes.

The draft stays a deterministic function of the context, so verification is unchanged and
the output is exactly the (constrained) target's, greedy or sampled
(:mod:`selfspec.decoding.ngram.drafter`). Forced tokens have an acceptance estimate of their
own (:data:`FORCED_KEY`), starting from :data:`FORCED_PRIOR`.
"""

from __future__ import annotations

from selfspec.decoding.core.processors import LogitsProcessor
from selfspec.decoding.ngram.lookup import NgramProposal

#: Acceptance-estimate key of forced tokens (``(source, match bucket)`` like the others).
FORCED_KEY = ("grammar", 0)
#: A forced token's acceptance before any is verified: the target can only reject one by
#: preferring another tokenization of the same bytes (a fixed guess, not fitted; in
#: json-extract's reference answers, SmolLM2's tokenizer, 26 of 707 forced tokens were
#: another tokenization, all of them a segment's last token).
FORCED_PRIOR = 0.95


def constrain(found: list[NgramProposal], processor: LogitsProcessor | None,
              max_len: int) -> NgramProposal | None:
    """The proposal to draft under ``processor``'s grammar.

    Args:
        found: the copied proposals (prompt lookup, history), best first.
        processor: the generation's output processing (``None`` or no grammar: ``found[0]``
            unchanged).
        max_len: longest draft.

    Returns:
        The grammar's forced tokens when it forces any now; else the first proposal with a
        valid prefix, cut to it and extended with the tokens forced after it; ``None`` when
        nothing is valid and nothing forced.
    """
    if processor is None or processor.matcher is None:
        return found[0] if found else None
    forced = processor.forced_tokens((), max_len)
    if forced:
        return NgramProposal(forced, [1.0] * len(forced), 0, FORCED_KEY[0], forced=len(forced))
    for proposal in found:
        copied = proposal.tokens[: processor.valid_prefix(proposal.tokens[:max_len])]
        if copied:
            more = processor.forced_tokens(copied, max_len - len(copied))
            return NgramProposal(copied + more, proposal.shares[: len(copied)] + [1.0] * len(more),
                                 proposal.match_len, proposal.source, forced=len(more))
    return None
