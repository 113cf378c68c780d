"""The end-of-sequence ids of a model: defined here once for every part of selfspec."""

from __future__ import annotations

from typing import Any


def eos_token_ids(model: Any, tokenizer: Any = None) -> frozenset[int]:
    """Token ids that end a generation: the ``eos_token_id`` of the model's generation
    config, of its config and (when given) of the tokenizer, each an int, a list or ``None``.

    Used by decoding (when to stop), by reduced draft vocabularies (which always keep these
    ids, at calibration and at decoding alike) and by training-data generation.
    """
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None),
                   tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is None:
            continue
        ids.update(eos if isinstance(eos, (list, tuple, set, frozenset)) else [eos])
    return frozenset(int(i) for i in ids)
