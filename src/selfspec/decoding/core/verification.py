"""Verification of a draft against the target model: pure functions of tensors, no model inside.

One speculative step drafts ``D`` tokens, runs the target once over them and calls one of
the functions below on the target's logits. Terms, used with these meanings everywhere:

- **draft tokens** ``draft_tokens [D]``: the tokens the drafter proposed, ``x_0 .. x_{D-1}``.
- **draft probs** ``draft_probs [D, V]``: ``q_i``, the distribution draft token ``i`` was sampled
  from, *after* the sampling transform (temperature / top-k / top-p) of ``SamplingConfig``.
- **target logits** ``target_logits [D+1, V]``: raw logits of the full model. Row ``i`` is the
  target distribution for the position of draft token ``i``; row ``D`` is the position after
  the whole draft (the bonus position). ``p_i = logits_to_probs(target_logits[i])``.
- **accepted**: a draft token that passes verification. Verification stops at the first draft
  token that does not; ``num_accepted`` (0..D) is the length of the accepted prefix.
- **recovered** token: on a rejection at position ``i = num_accepted < D``, the token the target
  emits instead (greedy: ``argmax p_i``; sampling: a draw from the residual
  ``normalize(max(0, p_i - q_i))``).
- **bonus** token: when all ``D`` draft tokens are accepted, the token the target emits at
  position ``D`` for free (greedy: ``argmax p_D``; sampling: a draw from ``p_D``).
- **next token** = the recovered token or the bonus token: every step commits
  ``num_accepted + 1`` tokens, so a step never commits fewer tokens than plain decoding.

Greedy verification (:func:`verify_greedy`) is the rule of Algorithms 1-2 of AdaSPEED (Liu et
al., §I.C/§II.A) and of LayerSkip / Draft & Verify. Sampling verification
(:func:`verify_sampling`) is the speculative sampling rule of Leviathan et al. 2023 (§2.3,
Algorithm 1) and Chen et al. 2023 (Algorithm 2), whose output has exactly the target's
distribution ``p`` whatever ``q`` is, provided each draft token was sampled from ``q``.
Seeded sampling (:func:`verify_keyed`) is an exact match against the target's position-keyed
Gumbel-max choice (:mod:`selfspec.decoding.core.sampling`), so its output is ``ar``'s seeded
sample token for token, whatever was drafted.

Inputs may carry a leading batch dimension of size 1 (``[1, D]``, ``[1, D+1, V]``); larger
batches are not supported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfspec.decoding.core.sampling import SamplingConfig, keyed_choice, logits_to_probs
from selfspec.errors import InvalidArgumentError
from selfspec.executor.argmax import argmax_last
from selfspec.executor.sync import to_host

__all__ = ["VerifyOutput", "verify_greedy", "verify_keyed", "verify_sampling"]


@dataclass(frozen=True)
class VerifyOutput:
    """Result of verifying one draft.

    Attributes:
        num_accepted: number of draft tokens accepted, ``0 <= num_accepted <= num_drafted``.
        next_token: the token the target emits after the accepted prefix: the recovered token
            when ``num_accepted < num_drafted``, else the bonus token.
        committed_tokens: the tokens to commit, in order: the ``num_accepted`` accepted draft
            tokens followed by ``next_token`` (length ``num_accepted + 1``).
        num_drafted: number of draft tokens verified (``D``).
    """

    num_accepted: int
    next_token: int
    committed_tokens: list[int]
    num_drafted: int

    @property
    def all_accepted(self) -> bool:
        """True when every draft token was accepted (``next_token`` is the bonus token)."""
        return self.num_accepted == self.num_drafted

    @property
    def acceptance_rate(self) -> float:
        """``num_accepted / num_drafted`` (0.0 for an empty draft)."""
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> VerifyOutput:
    """Greedy verification: accept the longest prefix where the draft equals the target argmax.

    Source: AdaSPEED (Liu et al.) Algorithm 1, lines 7-10 (the same rule as LayerSkip and
    Draft & Verify): draft token ``i`` is accepted while ``x_i == argmax target_logits[i]``;
    the next token is ``argmax target_logits[num_accepted]``. Lossless: the committed tokens
    are exactly what greedy decoding with the target would produce.

    Cost: one argmax over ``[D+1, V]``, one comparison, one device→host copy (a single sync),
    as this runs once per speculative step on the decode hot path.

    Args:
        draft_tokens: ``[D]`` (or ``[1, D]``) int64 draft token ids, ``D >= 0``.
        target_logits: ``[D+1, V]`` (or ``[1, D+1, V]``) target logits; row ``D`` is the bonus
            position. Any float dtype; same device as ``draft_tokens``.

    Returns:
        :class:`VerifyOutput`.

    Raises:
        InvalidArgumentError: shapes do not match ``[D]`` / ``[D+1, V]``, or the batch is > 1.
    """
    draft_tokens, target_logits = _check_shapes(draft_tokens, None, target_logits)
    # [D+1]: the target's greedy choice at every position, bonus position included.
    return _accept_prefix(draft_tokens, argmax_last(target_logits))


def verify_keyed(draft_tokens: torch.Tensor, target_logits: torch.Tensor,
                 config: SamplingConfig, noise: torch.Tensor) -> VerifyOutput:
    """Seeded verification: accept the longest prefix where the draft equals the target's
    position-keyed Gumbel-max choice ``argmax_x p_i(x) / E_i(x)``.

    Source: the Gumbel-max trick (Gumbel 1954; Maddison, Tarlow & Minka 2014) used as a coupling
    of draft and target (Daliri, Musco & Suresh 2024, "Coupling without Communication and
    Drafter-Invariant Speculative Decoding"). ``E_i`` is the :class:`~selfspec.decoding.
    core.sampling.KeyedNoise` row of draft token ``i``'s absolute position, so the target's
    choice at each position depends on the seed and the prefix only: the committed tokens
    are exactly those of autoregressive decoding with the same seed (the rule of
    :func:`verify_greedy` on the keyed choices), distributed as the target's samples over
    seeds. ``draft_probs`` are not needed. Cost: the transform of ``[D+1, V]``, one division,
    one argmax, one device→host copy.

    Args:
        draft_tokens: ``[D]`` (or ``[1, D]``) int64 draft token ids, ``D >= 0``.
        target_logits: ``[D+1, V]`` (or ``[1, D+1, V]``) raw target logits.
        config: a sampling configuration with ``temperature > 0``.
        noise: ``[D+1, V]`` Exp(1) rows of the ``D+1`` positions (all > 0), on the device of
            ``target_logits``.

    Returns:
        :class:`VerifyOutput`.

    Raises:
        InvalidArgumentError: ``config`` is greedy, or shapes do not match ``[D]`` /
            ``[D+1, V]`` / ``noise`` ``[D+1, V]``.
    """
    if config.greedy:
        raise InvalidArgumentError(
            "verify_keyed needs temperature > 0; with temperature 0 use verify_greedy")
    draft_tokens, target_logits = _check_shapes(draft_tokens, None, target_logits)
    if tuple(noise.shape) != tuple(target_logits.shape):
        raise InvalidArgumentError(
            f"noise must be [D+1, V] = {list(target_logits.shape)}; got {list(noise.shape)}")
    return _accept_prefix(draft_tokens,
                          keyed_choice(logits_to_probs(target_logits, config), noise))


def _accept_prefix(draft_tokens: torch.Tensor, choice: torch.Tensor) -> VerifyOutput:
    """The longest prefix of ``draft_tokens [D]`` equal to the target's ``choice [D+1]``,
    then the target's choice after it; one device→host copy."""
    num_drafted = draft_tokens.shape[0]
    # [D]: 1 while the draft still agrees with the target, 0 from the first mismatch on.
    agree_prefix = (draft_tokens == choice[:num_drafted]).cumprod(dim=0)
    # [1]
    num_accepted = agree_prefix.sum(dim=0, keepdim=True)
    # Accepted draft tokens equal the target's choice at their positions, so the committed
    # tokens are choice[:num_accepted + 1]: one copy of [D+2] ints brings everything to host.
    host = to_host(torch.cat([num_accepted, choice]))
    n = host[0]
    committed = host[1 : n + 2]
    return VerifyOutput(
        num_accepted=n, next_token=committed[-1], committed_tokens=committed,
        num_drafted=num_drafted,
    )


def verify_sampling(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    config: SamplingConfig,
    generator: torch.Generator | None = None,
) -> VerifyOutput:
    """Speculative sampling: accept draft tokens by rejection sampling against the target.

    Source: Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
    Decoding", §2.3 and Algorithm 1; Chen et al. 2023, "Accelerating Large Language Model
    Decoding with Speculative Sampling", Algorithm 2. With ``p_i = logits_to_probs(
    target_logits[i], config)`` and ``q_i = draft_probs[i]``:

    1. draft token ``x_i`` is accepted with probability ``min(1, p_i(x_i) / q_i(x_i))``,
       in order, until the first rejection;
    2. at the first rejection (position ``i``) the recovered token is drawn from
       ``normalize(max(0, p_i - q_i))``; if that residual is all zero (``p_i == q_i``, reachable
       only through the ``q_i(x_i) == 0`` case below) it is drawn from ``p_i``;
    3. when all ``D`` are accepted, the bonus token is drawn from ``p_D``.

    The committed tokens are then distributed exactly as ``D+1`` (or fewer) tokens sampled from
    the target with the same temperature / top-k / top-p, provided each ``x_i`` was drawn from
    ``q_i`` (``draft_probs`` must be the post-transform distribution the drafter sampled from).

    Edge case ``q_i(x_i) == 0`` (impossible if ``x_i ~ q_i``; can come from underflow): the test
    is ``u * q_i(x_i) < p_i(x_i)`` with ``u ~ U[0, 1)``, i.e. no division; the token is accepted
    iff ``p_i(x_i) > 0`` (the limit of the ratio). A token the target's transform masks out
    (``p_i(x_i) == 0``, e.g. outside its top-p set) is always rejected.

    Randomness: ``D`` uniforms for the acceptance tests, then ``V`` exponentials for the one
    recovered/bonus draw (exponential-race sampling, ``argmax(w / E)``, ``E ~ Exp(1)``, picks
    token ``k`` with probability ``w_k / sum(w)`` without a host sync), both from ``generator``,
    so a seeded generator reproduces the output. One device→host copy in total.

    Args:
        draft_tokens: ``[D]`` (or ``[1, D]``) int64 draft token ids, ``D >= 0``.
        draft_probs: ``[D, V]`` (or ``[1, D, V]``) ``q``: the transformed draft distributions.
            ``None`` is an error: without ``q`` the rule cannot be applied losslessly, and
            silently treating the draft as greedy (``q`` one-hot) would be wrong for a
            sampled draft. A drafter that takes the argmax while the target samples must pass
            one-hot rows (its actual ``q``), not its softmax.
        target_logits: ``[D+1, V]`` (or ``[1, D+1, V]``) raw target logits; the transform of
            ``config`` is applied here, identically to what the drafter applied to ``q``.
        config: a sampling configuration with ``temperature > 0``.
        generator: ``torch.Generator`` on the device of ``target_logits``; ``None`` uses the
            global RNG.

    Returns:
        :class:`VerifyOutput`.

    Raises:
        InvalidArgumentError: ``config`` is greedy (use :func:`verify_greedy`), ``draft_probs``
            is ``None``, or shapes do not match ``[D]`` / ``[D, V]`` / ``[D+1, V]``.
    """
    if config.greedy:
        raise InvalidArgumentError(
            "verify_sampling needs temperature > 0; with temperature 0 use verify_greedy"
        )
    if draft_probs is None:
        raise InvalidArgumentError(
            "verify_sampling needs draft_probs [D, V] (the drafter's transformed distribution q); "
            "got None. Have the drafter return its probabilities when sampling."
        )
    draft_tokens, target_logits = _check_shapes(draft_tokens, draft_probs, target_logits)
    if draft_probs.dim() == 3:
        draft_probs = draft_probs[0]
    num_drafted, vocab = draft_tokens.shape[0], target_logits.shape[-1]
    device = target_logits.device

    # [D+1, V] float32: p, the transformed target distributions.
    target_probs = logits_to_probs(target_logits, config)
    # [D+1, V]: q with an all-zero row for the bonus position, so that the residual
    # max(0, p_D - 0) = p_D makes the bonus draw the same code path as the recovered draw.
    draft_probs_ext = torch.cat(
        [draft_probs.to(device=device, dtype=torch.float32), target_probs.new_zeros(1, vocab)]
    )
    # [D, 1] int64, as gather requires.
    index = draft_tokens.long().view(-1, 1)
    # [D]: p_i(x_i) and q_i(x_i).
    target_token_probs = target_probs[:num_drafted].gather(-1, index).squeeze(-1)
    draft_token_probs = draft_probs_ext[:num_drafted].gather(-1, index).squeeze(-1)
    # [D]
    uniform = torch.rand(num_drafted, generator=generator, device=device)
    # [D]: u < p/q written without division, so q(x) == 0 cannot produce NaN.
    accepted = uniform * draft_token_probs < target_token_probs
    # [1]: length of the accepted prefix.
    num_accepted = accepted.int().cumprod(dim=0).sum(dim=0, keepdim=True)

    # [V]: p and q at the first rejected position, or at the bonus position if none.
    target_row = target_probs.index_select(0, num_accepted).squeeze(0)
    draft_row = draft_probs_ext.index_select(0, num_accepted).squeeze(0)
    # [V]: unnormalised residual; the exponential race below is invariant to scale.
    residual = (target_row - draft_row).clamp_(min=0.0)
    weights = torch.where(residual.sum() > 0, residual, target_row)
    # [V]: E ~ Exp(1), kept > 0 so a zero weight can never produce 0/0.
    exponential = torch.empty(vocab, device=device).exponential_(generator=generator)
    exponential.clamp_(min=torch.finfo(torch.float32).tiny)
    # [1]
    next_token = (weights / exponential).argmax(dim=0, keepdim=True)

    host = to_host(torch.cat([num_accepted.long(), next_token, draft_tokens.long()]))
    n = host[0]
    committed = host[2 : 2 + n] + [host[1]]
    return VerifyOutput(
        num_accepted=n, next_token=host[1], committed_tokens=committed, num_drafted=num_drafted,
    )


def _check_shapes(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate shapes (Python-side only, no sync) and drop a leading batch dim of 1.

    Returns ``(draft_tokens [D], target_logits [D+1, V])``.

    Raises:
        InvalidArgumentError: a shape mismatch or a batch size > 1.
    """
    if draft_tokens.dim() == 2 and target_logits.dim() == 3:
        if draft_tokens.shape[0] != 1 or target_logits.shape[0] != 1:
            raise InvalidArgumentError(
                "verification supports batch size 1 only; got draft_tokens "
                f"{tuple(draft_tokens.shape)} and target_logits {tuple(target_logits.shape)}"
            )
        draft_tokens, target_logits = draft_tokens[0], target_logits[0]
    if draft_tokens.dim() != 1 or target_logits.dim() != 2:
        raise InvalidArgumentError(
            "expected draft_tokens [D] and target_logits [D+1, V]; got "
            f"{tuple(draft_tokens.shape)} and {tuple(target_logits.shape)}"
        )
    num_drafted = draft_tokens.shape[0]
    if target_logits.shape[0] != num_drafted + 1:
        raise InvalidArgumentError(
            f"target_logits must have D+1 = {num_drafted + 1} rows (one per draft token plus the "
            f"bonus position); got {target_logits.shape[0]}"
        )
    if draft_probs is not None:
        batched = draft_probs.dim() == 3
        if batched and draft_probs.shape[0] != 1:
            raise InvalidArgumentError(
                "verification supports batch size 1 only; got draft_probs "
                f"{tuple(draft_probs.shape)}"
            )
        probs_shape = tuple(draft_probs.shape[1:] if batched else draft_probs.shape)
        if probs_shape != (num_drafted, target_logits.shape[1]):
            raise InvalidArgumentError(
                f"draft_probs must be [D, V] = [{num_drafted}, {target_logits.shape[1]}]; "
                f"got {tuple(draft_probs.shape)}"
            )
    return draft_tokens, target_logits
