"""Drafting: the one early-exit drafting loop (``exit_drafter``), exit policies (``exits``),
stop rules (``stop_rules``), reduced draft vocabularies (``draft_vocab``), sub-layer plan
drafting and ``qspec``'s drafter (``skip_drafter``), where a draft runs and how it is verified
(``draft_copy``: on the model itself, reusing the drafted layers, or on a quantized copy,
recomputed with the model's weights) and
the lossy calibrated early exit that commits an exit's token unverified (``calibrated_exit``).

Builds on ``decoding.core``."""
