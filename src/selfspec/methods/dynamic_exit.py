"""DEL: early-exit self-speculative decoding whose exit layer and draft length are re-chosen
during generation by maximising Tokens-per-Layer on shadow tokens (Zarch et al. 2025, as
summarised in KnapSpec §2 eq. 2). The module is not called ``del``: a Python keyword."""

from __future__ import annotations

from dataclasses import dataclass

from selfspec.decoding.core.loop import Step
from selfspec.decoding.knapspec.dynamic_exit import DELConfig, DELStep
from selfspec.methods.base import MethodContext, MethodSpec
from selfspec.methods.options import option


@dataclass(frozen=True)
class Options:
    """DEL's options."""

    refresh_every: int = option(4, "steps between re-choices of the exit layer and draft length",
                                low=1)
    history_steps: int = option(4, "steps whose committed tokens the shadow tokens score", low=1)
    num_candidates: int = option(8, "candidate exit layers spread over [1, L-1]; 0 = every layer",
                                 low=0)
    max_draft_len: int = option(10, "largest draft length searched (γ)", low=1, high="R-1")
    confidence: float = option(0.7, "stop drafting when the top-1 probability falls below this",
                               low=0, high=1, low_open=True, high_open=True)
    smoothing: float = option(0.5, "weight of the previous acceptance estimate in its moving "
                              "average across refreshes; 0 = only the latest", low=0, high=1,
                              high_open=True)


def build(context: MethodContext, options: Options) -> Step:
    """The DEL Step: early-exit drafter with the model's own lm_head + confidence stop rule,
    exit layer and γ chosen by TPL."""
    config = DELConfig(refresh_every=options.refresh_every, history_steps=options.history_steps,
                       num_candidates=options.num_candidates,
                       max_draft_len=options.max_draft_len, confidence=options.confidence,
                       smoothing=options.smoothing)
    return DELStep(context.executor, config)


SPEC = MethodSpec(
    name="del",
    summary="early-exit drafting whose exit layer and draft length maximise tokens per layer, "
            "estimated on recent shadow tokens",
    lossless=True,
    paper="DEL (Zarch et al. 2025) as summarised in KnapSpec §2, eq. 2",
    options=Options, build=build)
