"""AdaSPEED with its linear acceptance probe: the product rule multiplies the probe's
acceptance estimates instead of the draft probabilities (AdaSPEED §II.B, Table I).

The probe comes from ``heads`` (trained on that drafter) or, without heads, from the model's
default probes (``selfspec heads train-probe`` without ``--heads``): so ``adaspeed`` and
``adaspeed-probe`` with the same options draft identically and differ only in the stop rule.
Without ``exit_layer`` it drafts at the exit layer of the one probe in that file
(:func:`~selfspec.methods.exit_drafting.build_exit_drafter`).
"""

from __future__ import annotations

from selfspec.decoding.core.loop import Step
from selfspec.methods.adaspeed import Options, product_rule
from selfspec.methods.base import MethodContext, MethodSpec
from selfspec.methods.exit_drafting import build_exit_step, heads_files


def build(context: MethodContext, options: Options) -> Step:
    """Early-exit drafter scored by the probe + product stop rule + verifier."""
    return build_exit_step(context, options, product_rule(context, options), probe=True)


SPEC = MethodSpec(
    name="adaspeed-probe",
    summary="AdaSPEED with a trained linear probe's acceptance probabilities in the product rule",
    lossless=True,
    paper="AdaSPEED §II.B, Table I",
    options=Options, build=build,
    heads_files=lambda options: heads_files(options, probe=True))
