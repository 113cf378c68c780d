"""AdaDecode (Wei et al. 2025): exits where a lightweight head's token passes γ
(``threshold_exits``); the rest is the shared drafter, deferred layers and speculative step."""
