"""The ``draft_weights`` option, declared once: the weight copy a method drafts on.

Every method that can draft on quantized copies of the model's own weights (layerskip, dv,
adaspeed, dssd, swift, knapspec, clasp, qspec, auto) inherits :class:`DraftWeightsOptions`;
its build asks :meth:`~selfspec.methods.base.MethodContext.draft_executor` for the executor
to draft on, and its drafter verifies through
:class:`~selfspec.decoding.drafting.draft_copy.DraftCopy` (recomputing every layer with the
model's own weights when the draft ran on a copy).

An option group (``__option_group__``): :func:`~selfspec.methods.options.option_fields` lists
it after the method's own options (``selfspec methods``, the CLI's help, error messages).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from selfspec.executor.quant import DRAFT_WEIGHT_CHOICES
from selfspec.methods.options import option

DRAFT_WEIGHTS_HELP = ("draft on int8 (W8A8), int4, w4a8 (4-bit weights, 8-bit activations), "
                      "q3_k or q2_k (GGUF 3-/2-bit blocks; input sizes multiples of 256) "
                      "copies of the layers (auto: the fastest of int8/int4/w4a8 here, "
                      "measured); verification then recomputes every layer with the model's "
                      "own weights (QSpec-style)")


def draft_weights_option(default: str | None = None, help: str = DRAFT_WEIGHTS_HELP) -> Any:
    """The ``draft_weights`` field: one of :data:`DRAFT_WEIGHT_CHOICES` (``int8``, ``int4``,
    ``w4a8``, ``q3_k``, ``q2_k``, ``auto``), or ``None`` (the default: the model's own weights). A
    method whose
    draft is the copy itself (``qspec``, and ``auto`` for its qspec drafter) redeclares it
    with default ``"auto"`` and its own help; the choices stay these (one CLI flag serves
    every method)."""
    return option(default, help, choices=DRAFT_WEIGHT_CHOICES,
                  default_text="none (the model's own weights)" if default is None else None)


@dataclass(frozen=True)
class DraftWeightsOptions:
    """The option group of every method that can draft on a copy of the model's weights.

    Attributes:
        draft_weights: the copy's format (``int8``, ``int4``, ``w4a8``, ``q3_k``,
            ``q2_k`` or ``auto``), or
            ``None``: draft on the model itself.
    """

    __option_group__ = True

    draft_weights: str | None = draft_weights_option()
