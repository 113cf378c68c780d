"""Where a draft runs, and the one way a draft is verified (:class:`DraftCopy`).

A drafter drafts on the model itself or on a *draft copy*: a
:meth:`~selfspec.executor.LayerExecutor.draft_view` whose linears are int8, int4 or w4a8
copies of the model's own weights (QSpec-style self-speculation, Zhao et al. 2024, "QSpec:
Speculative Decoding with Complementary Quantization Schemes" §3: the draft is the same
network at lower precision; no second model). Every drafter built on
:class:`~selfspec.decoding.drafting.exit_drafter.ExitDrafter` (early exit, DSSD, AdaDecode,
SpecEE, skip plans) holds a :class:`DraftCopy` and verifies through it, in one of two modes:

- **reuse** (drafts on the model itself): the KV and hidden states the draft computed are the
  model's, so verification runs only what the draft skipped (an early exit's deeper layers,
  LayerSkip §4's exit-query cache,
  :func:`~selfspec.decoding.drafting.exit_drafter.complete_to_last_layer`);
- **recompute** (drafts on a copy): the draft's KV and hidden states are not the model's, so
  verification drops the KV the draft wrote and runs the model with its own weights over the
  last committed token and the draft (``D + 1`` positions, :func:`recompute_target_logits`).

A drafter with nothing to reuse recomputes on the model itself too: a skip-plan draft's hidden
states differ from the model's after its first skipped sub-layer (KnapSpec, CLaSp, SWIFT), and
the n-gram drafter runs no layer. Either way the output is exactly the model's (greedy: its
argmax tokens; sampling: its distribution, by the usual acceptance rule).

``qspec`` is a configuration of the skip-plan drafter: every layer up to ``exit_layer`` (default
all) on a draft copy (:func:`~selfspec.decoding.drafting.skip_drafter.quantized_drafter`);
``layerskip``, ``dv``, ``adaspeed``, ``dssd``, ``swift``, ``knapspec`` and ``clasp`` take a copy
with ``draft_weights=``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from selfspec.decoding.core.history import ResidualRecorder
from selfspec.decoding.core.speculative import DraftOutput, TargetOutput
from selfspec.decoding.core.state import DecodeState
from selfspec.executor import LayerExecutor
from selfspec.executor.sync import device_tensor

#: ``reuse(state, draft) -> TargetOutput``: a drafter's verification from its own drafted
#: layers (valid only when the draft ran on the model itself).
Reuse = Callable[[DecodeState, DraftOutput], TargetOutput]


@dataclass(frozen=True)
class DraftCopy:
    """The weights a drafter drafts on and the model that verifies its drafts.

    Attributes:
        draft: the executor drafts run on: ``target`` itself, or a
            :meth:`~selfspec.executor.LayerExecutor.draft_view` of it (quantized copies).
        target: the model's own executor: it verifies.
    """

    draft: LayerExecutor
    target: LayerExecutor

    @property
    def on_copy(self) -> bool:
        """Whether drafts run on other weights than the model's (verification recomputes)."""
        return self.draft is not self.target

    def target_logits(self, state: DecodeState, draft: DraftOutput, reuse: Reuse | None = None,
                      recorder: ResidualRecorder | None = None) -> TargetOutput:
        """The target's ``[D+1, V]`` logits for ``draft``: ``reuse(state, draft)`` when the
        draft ran on the model itself and the drafter has something to reuse, else
        :func:`recompute_target_logits` with the target's weights (``recorder``, if given,
        keeps that forward's residual stream)."""
        if reuse is not None and not self.on_copy:
            return reuse(state, draft)
        return recompute_target_logits(self.target, state, draft, recorder)


def recompute_target_logits(executor: LayerExecutor, state: DecodeState, draft: DraftOutput,
                            recorder: ResidualRecorder | None = None) -> TargetOutput:
    """Drop the KV the draft wrote, then run ``executor`` (the full model) over the last
    committed token and the draft: ``[D+1, V]`` target logits, every layer's KV filled
    (``recorder``, if given, keeps the forward's residual stream)."""
    start = state.seq_len - 1
    state.cache.truncate(start)
    fed = [state.tokens[-1], *draft.tokens]
    ids = device_tensor([fed], executor.device)  # no sync on CUDA
    observe = None if recorder is None else recorder.observer(fed, start)
    logits = executor.forward(ids, state.positions(start, ids.shape[1]), state.cache,
                              observe=observe)[0]
    return TargetOutput(logits=logits, sublayers=2 * executor.num_layers * ids.shape[1])
