"""Drafting: the one early-exit drafting loop (``exit_drafter``), exit policies (``exits``),
stop rules (``stop_rules``), reduced draft vocabularies (``draft_vocab``), sub-layer plan
drafting (``skip_drafter``), drafts on quantized copies of the model (``quant_draft``) and
the lossy calibrated early exit that commits an exit's token unverified (``calibrated_exit``).

Builds on ``decoding.core``."""
