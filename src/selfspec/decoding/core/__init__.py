"""The decoding core: the one loop (``loop``), the state of a generation (``state``), its
statistics (``stats``), the speculative step (``speculative``), verification as pure tensor
functions (``verification``), sampling (``sampling``), deferred layers (``deferred``), stop
strings and streaming (``stop_strings``), plain decoding (``autoregressive``), the ragged-batch
engine (``batch``), the residual history of recent tokens (``history``), the log of re-chosen
drafts (``plan_log``) and the stop-rule contract drafters hold (``stop_rule``).

Imports nothing else from ``selfspec.decoding``: every other package builds on it."""
