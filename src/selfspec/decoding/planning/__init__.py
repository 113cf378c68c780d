"""Planning: what a method decides from measured costs and recent text — KnapSpec's knapsack
DP (``knapsack``), predicted tokens per second (``tpt``) and the draft stop it drives
(``tpt_stop``).

Builds on ``decoding.core`` and ``decoding.drafting``."""
