"""Free drafts from text seen before: prompt lookup and the suffix automaton (``lookup``), the
n-gram drafter that proposes from them (``drafter``) and its batch step (``batch``)."""
