"""Verification of an n-gram token tree: chains with distinct first tokens after the last
committed token (the root), each verified as its own row (:mod:`selfspec.decoding.ngram.tree`).

Every branch's target logits are exactly those of verifying that chain alone (row ``0`` of
every branch is the root's, bit for bit), so:

- greedy: the branch whose draft agrees longest with the target argmax wins
  (:func:`~selfspec.decoding.core.verification.verify_greedy` per branch; first tokens are
  distinct, so at most one branch accepts a token, and with none accepted every branch
  gives the same next token: the root's argmax);
- seeded sampling: the same on the position-keyed Gumbel-max choices
  (:func:`~selfspec.decoding.core.verification.verify_keyed`), so the output is ``ar``'s
  seeded sample token for token;
- unseeded sampling: SpecInfer's multi-step speculative sampling at the root (Miao et al.
  2024, "SpecInfer: Accelerating Large Language Model Serving with Tree-based Speculative
  Inference and Verification", Algorithm 2; with one-hot drafts it is the recursive
  rejection sampling of Jeon et al. 2024, "Recursive Speculative Decoding"), then the
  one-draft rule of Leviathan et al. 2023 down the accepted branch (:func:`sample_tree`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfspec.decoding.core.sampling import SamplingConfig, logits_to_probs
from selfspec.decoding.core.state import DecodeState
from selfspec.decoding.core.verification import (
    VerifyOutput,
    verify_greedy,
    verify_keyed,
    verify_sampling,
)


@dataclass(frozen=True)
class TreeVerdict:
    """Which branch of a token tree was accepted, and what it commits.

    Attributes:
        branch: index of the branch whose prefix was accepted (0 when no token was).
        result: that branch's :class:`VerifyOutput` (``num_drafted`` = its draft length).
    """

    branch: int
    result: VerifyOutput


def verify_tree(drafts: list[torch.Tensor], targets: list[torch.Tensor],
                state: DecodeState) -> TreeVerdict:
    """The accepted branch of a tree of ``B`` chains (see the module docstring).

    Args:
        drafts: ``B`` int64 tensors ``[D_b]`` (``D_b >= 1``), first tokens distinct.
        targets: ``B`` tensors ``[D_b + 1, V]``: branch ``b``'s target logits (row 0 the
            root's, identical in every branch).
        state: the generation (its sampling options, keyed noise and generator).

    Returns:
        :class:`TreeVerdict`.
    """
    sampling = state.options.sampling
    if not sampling.greedy and state.noise is None:
        return sample_tree(drafts, targets, sampling, state.generator)
    best = None
    for b, (draft, target) in enumerate(zip(drafts, targets, strict=True)):
        if sampling.greedy:
            result = verify_greedy(draft, target)
        else:
            result = verify_keyed(draft, target, sampling, state.noise_rows(0, len(draft) + 1))
        if best is None or result.num_accepted > best.result.num_accepted:
            best = TreeVerdict(b, result)
    assert best is not None, "a tree has at least one branch"
    return best


def sample_tree(drafts: list[torch.Tensor], targets: list[torch.Tensor],
                config: SamplingConfig, generator: torch.Generator | None) -> TreeVerdict:
    """Multi-draft rejection sampling for deterministic drafts (``q_b = δ(x_b)``).

    Source: SpecInfer (Miao et al. 2024), multi-step speculative sampling (Algorithm 2).
    At the root, with ``p`` the target's transformed distribution and the branches' first
    tokens ``x_1 .. x_B`` (distinct) tried in order: ``x_b`` is accepted
    with probability ``min(1, p'(x_b) / q_b(x_b)) = p'(x_b)``, ``p'`` the normalised
    residual, and on rejection ``p' ← normalize(max(0, p' - q_b))``: ``p'`` with ``x_b``
    removed. If every ``x_b`` is rejected the next token is drawn from the last residual
    (``p`` without the ``x_b``). This is sequential sampling of ``p``, so the root's token is
    exactly distributed as ``p``; below an accepted ``x_b`` its chain is verified by the
    one-draft rule with one-hot ``q`` (:func:`verify_sampling`), exact as well.

    Randomness: ``B`` uniforms, then the chain rule's draws or one ``V``-exponential race,
    all from ``generator`` (``None``: the global RNG), so a seeded generator reproduces it.

    Args:
        drafts: ``B`` int64 tensors ``[D_b]`` (``D_b >= 1``), first tokens distinct.
        targets: ``B`` raw target logits ``[D_b + 1, V]`` (row 0 the root's).
        config: a sampling configuration with ``temperature > 0``.
        generator: the generation's generator, or ``None``.

    Returns:
        :class:`TreeVerdict`.
    """
    root = logits_to_probs(targets[0][:1], config)[0]  # [V]
    device = root.device
    uniform = torch.rand(len(drafts), generator=generator, device=device).tolist()
    residual = root.clone()
    for b, (draft, target) in enumerate(zip(drafts, targets, strict=True)):
        if len(draft) == 0:  # branch 0 may verify the root alone
            continue
        first = int(draft[0])
        mass = float(residual.sum())
        if uniform[b] * mass < float(residual[first]):
            rest = draft[1:]
            probs = torch.zeros(len(rest), root.shape[0], device=device)  # q = δ, [D_b-1, V]
            probs[torch.arange(len(rest), device=device), rest] = 1.0
            chain = verify_sampling(rest, probs, target[1:], config, generator)
            return TreeVerdict(b, VerifyOutput(
                num_accepted=1 + chain.num_accepted, next_token=chain.next_token,
                committed_tokens=[first, *chain.committed_tokens], num_drafted=len(draft)))
        residual[first] = 0.0
    weights = residual if float(residual.sum()) > 0 else root
    exponential = torch.empty_like(weights).exponential_(generator=generator)
    exponential.clamp_(min=torch.finfo(torch.float32).tiny)
    token = int((weights / exponential).argmax())
    return TreeVerdict(0, VerifyOutput(num_accepted=0, next_token=token,
                                       committed_tokens=[token], num_drafted=len(drafts[0])))
