"""A next-token drafter on the model's own last hidden state: SpecEE's speculative tokens
from the start of the forward pass.

SpecEE drafts its speculative tokens with EAGLE's draft model (SpecEE §4; EAGLE, Li et al.
2024, §4.1): the top-layer feature of the previous position and the embedding of the current
token predict the current position's top-layer feature, which the model's ``lm_head`` turns into
tokens. Its candidates exist *before* the current token runs any layer, so a predictor may stop
the forward pass at any layer. Candidates from an exit head exist only from that head's layer
on (:class:`~selfspec.decoding.specee.step.HeadCandidates`), which caps the layers an exit can save
(on Qwen2.5-Coder-1.5B a perfect predictor with the layer-14 head's candidates still runs 22 of
28 layers per token; with this drafter's, 20; ``docs/results/specee``).

This drafter is EAGLE's feature regression without its decoder layer (no attention, so no
KV cache of its own): with ``h`` the previous position's last hidden state (before the final
norm) and ``e`` the current token's input embedding,

``g = h + W · [rms(h); rms(e)] + b``   (``W``: ``[H, 2H]``, ``b``: ``[H]``)

and the candidates are the top-``k`` of ``lm_head(final_norm(g))`` (over the draft vocabulary's
rows when one is used). ``rms`` is a parameter-free RMS normalisation that puts the two inputs
on one scale. When the previous token exited early, decoding passes the hidden state at its
exit layer instead of the last one (as the SpecEE code does); training mixes such states in
(:mod:`selfspec.training.drafter`). One map reads both poorly, so a head file may hold a
second drafter of this form, the *exit-state drafter*, trained on exit-layer states only, that
drafts after an exited token (``ExitHeads.exit_drafter``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.errors import InvalidArgumentError


def _rms(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],))


class FeatureDrafter(nn.Module):
    """EAGLE-style feature regression without attention (module doc).

    Args:
        hidden_size: ``H``.

    Attributes:
        fc_weight: ``[H, 2H]``; fc_bias: ``[H]`` (float32 while training; the model's dtype
            after :meth:`prepare_inference`).
    """

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        if hidden_size < 1:
            raise InvalidArgumentError(f"hidden_size must be >= 1, got {hidden_size}")
        self.hidden_size = int(hidden_size)
        self.fc_weight = nn.Parameter(torch.zeros(hidden_size, 2 * hidden_size))
        self.fc_bias = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, previous: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        """Predicted last hidden state of the current position.

        Args:
            previous: ``[..., H]`` the previous position's last hidden state (before the final
                norm), or its exit-layer state.
            embedding: ``[..., H]`` the current token's input embedding.

        Returns:
            ``[..., H]`` in the dtype of ``fc_weight``; feed it to the model's final norm and
            ``lm_head``.
        """
        x = torch.cat([_rms(previous), _rms(embedding)], dim=-1).to(self.fc_weight.dtype)
        return previous.to(self.fc_weight.dtype) + F.linear(x, self.fc_weight, self.fc_bias)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Parameters by name (what head files store under ``drafter.``)."""
        return {"fc_weight": self.fc_weight, "fc_bias": self.fc_bias}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy stored parameters in.

        Raises:
            InvalidArgumentError: a tensor is missing or has the wrong shape.
        """
        for name, param in self.tensors().items():
            if name not in tensors:
                raise InvalidArgumentError(f"drafter tensor {name} is missing")
            value = tensors[name]
            if tuple(value.shape) != tuple(param.shape):
                raise InvalidArgumentError(
                    f"drafter tensor {name} has shape {tuple(value.shape)}, expected "
                    f"{tuple(param.shape)}")
            param.data.copy_(value)
