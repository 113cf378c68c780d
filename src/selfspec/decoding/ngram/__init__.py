"""Free drafts from text seen before: prompt lookup and the suffix automaton (``lookup``) and
the n-gram drafter that proposes from them (``drafter``)."""
