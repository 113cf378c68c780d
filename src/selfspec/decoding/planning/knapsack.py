"""KnapSpec's layer selection: a 0/1 knapsack over attention and MLP sub-layers solved by
dynamic programming on hidden states, then a Tokens-per-Time grid search (KnapSpec §3.3-3.5,
Algorithm 1). Pure functions: the sub-layers are passed in as callables. The DP itself
(:func:`solve_knapsack`) takes any sequence of weighted items; CLaSp runs it over whole
layers of weight 1.

Sub-layers are numbered ``i = 1 .. 2L``: odd ``i`` is the attention of layer ``(i-1)//2``,
even ``i`` its MLP. ``X[i]`` (``[r, d]``) is the full model's residual stream after sub-layer
``i`` on the ``r`` tokens of the recent history (``X[0]``: the embeddings). A state
``g[i][j]`` is the best hidden state (by cosine similarity to ``X[i]``) reachable after the
first ``i`` sub-layers having skipped sub-layers of total integer weight ``j``:

    h_e = f_i(g[i-1][j])      (run sub-layer i)       → candidate for g[i][j]
    h_s = g[i-1][j]           (skip it, weight w_i)   → candidate for g[i][j + w_i]

A candidate replaces the current entry when its similarity is higher and above ``tau``
(pruning (i)); skipped weight above ``max_skip`` is never reached (pruning (ii), ``K/2``).
All live budgets of one row run through ``f_i`` in one batched call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# f(i, hidden [B, r, d]) -> [B, r, d]: sub-layer i (1-based) applied to B candidate states.
SubLayer = Callable[[int, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Candidate:
    """The best plan found for one skipped-weight budget.

    Attributes:
        skipped_weight: total integer weight of the skipped sub-layers (the budget ``j``).
        skip_attention: layer indices whose attention is skipped.
        skip_mlp: layer indices whose MLP is skipped.
        similarity: mean cosine similarity of its final state to ``X[2L]``.
        hidden: ``[r, d]`` its final hidden state on the history tokens.
    """

    skipped_weight: int
    skip_attention: frozenset[int]
    skip_mlp: frozenset[int]
    similarity: float
    hidden: torch.Tensor


def mean_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of the cosine similarity of ``a`` ``[..., r, d]`` and ``b`` ``[r, d]``
    (computed in float32): ``[...]``."""
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).mean(-1)


@dataclass(frozen=True)
class Solution:
    """The best subset found for one skipped-weight budget of a generic knapsack over
    sequential items (sub-layers for KnapSpec, whole layers for CLaSp).

    Attributes:
        skipped_weight: total integer weight of the skipped items (the budget ``j``).
        skipped: 1-based indices of the skipped items.
        similarity: mean cosine similarity of its final state to the reference's.
        hidden: ``[r, d]`` its final hidden state on the history tokens.
    """

    skipped_weight: int
    skipped: frozenset[int]
    similarity: float
    hidden: torch.Tensor


def solve_knapsack(reference: Sequence[torch.Tensor], apply: SubLayer,
                   weights: Sequence[int], tau: float = 0.5,
                   max_skip: int | None = None, bin_width: int = 1) -> list[Solution]:
    """The DP of KnapSpec Algorithm 1 (eq. 6-8) over any sequence of items: one
    :class:`Solution` per reachable skipped-weight budget.

    Args:
        reference: ``N + 1`` tensors ``[r, d]``: the full model's state before the first item
            and after each of the ``N`` items.
        apply: ``apply(i, hidden [B, r, d]) -> [B, r, d]`` runs item ``i`` (1-based) on ``B``
            candidate states at once.
        weights: ``N`` integer weights (>= 1).
        tau: similarity below which a state is pruned (KnapSpec: 0.5; -1 disables).
        max_skip: largest skipped weight explored (default: half the total weight,
            KnapSpec's pruning (ii)).

    Returns:
        Solutions sorted by skipped weight (budget 0, every item run, first); empty when
        pruning removed every state.

    Raises:
        ValueError: ``len(reference) != len(weights) + 1``, no items, a weight < 1 or
            ``bin_width`` < 1.
    """
    num_items = len(weights)
    if num_items < 1 or len(reference) != num_items + 1:
        raise ValueError(f"reference must hold {num_items + 1} states (one before the first "
                         f"item and one after each), got {len(reference)}")
    if min(weights) < 1 or bin_width < 1:
        raise ValueError("item weights and bin_width must be >= 1")
    limit = sum(weights) // 2 if max_skip is None else max_skip
    # row[k] = (hidden [r, d], similarity, skipped weight) for bin k = weight // bin_width;
    # back[i][k] = (previous bin, ran item i). bin_width 1 is the exact DP of eq. 6-8.
    row: dict[int, tuple[torch.Tensor, float, int]] = {0: (reference[0], 1.0, 0)}
    back: list[dict[int, tuple[int, bool]]] = [{}]
    for i in range(1, num_items + 1):
        w = weights[i - 1]
        target = reference[i]
        keys = sorted(row)
        states = torch.stack([row[k][0] for k in keys])               # [B, r, d]
        executed = apply(i, states)                                    # [B, r, d]
        sim_e = mean_cosine(executed, target).tolist()
        sim_s = mean_cosine(states, target).tolist()
        new: dict[int, tuple[torch.Tensor, float, int]] = {}
        links: dict[int, tuple[int, bool]] = {}
        for b, k in enumerate(keys):
            j = row[k][2]
            if sim_e[b] > max(tau, new.get(k, (None, -2.0))[1]):
                new[k], links[k] = (executed[b], sim_e[b], j), (k, True)
            if j + w <= limit:
                k2 = (j + w) // bin_width
                if sim_s[b] > max(tau, new.get(k2, (None, -2.0))[1]):
                    new[k2], links[k2] = (states[b], sim_s[b], j + w), (k, False)
        row = new
        back.append(links)
        if not row:
            return []
    solutions = []
    for k in sorted(row):
        skipped, key = set(), k
        for i in range(num_items, 0, -1):
            key, ran = back[i][key]
            if not ran:
                skipped.add(i)
        hidden, similarity, weight = row[k]
        solutions.append(Solution(weight, frozenset(skipped), similarity, hidden))
    return solutions


def knapsack_candidates(reference: Sequence[torch.Tensor], sublayer: SubLayer,
                        w_attn: int, w_mlp: int, tau: float = 0.5,
                        max_skip: int | None = None, bin_width: int = 1) -> list[Candidate]:
    """Algorithm 1, forward search and backtracking over the ``2L`` sub-layers: one
    :class:`Candidate` per reachable skipped-weight budget (KnapSpec eq. 6-8).

    Args:
        reference: ``2L + 1`` tensors ``X[0..2L]``, each ``[r, d]``.
        sublayer: ``sublayer(i, hidden [B, r, d]) -> [B, r, d]`` for ``i`` in ``1..2L``.
        w_attn, w_mlp: integer weights of an attention / MLP sub-layer (>= 1).
        tau: similarity below which a state is pruned (paper: 0.5).
        max_skip: largest skipped weight explored (default ``K // 2`` with
            ``K = L (w_attn + w_mlp)``, the paper's pruning (ii)).
        bin_width: see :func:`solve_knapsack` (1 = the paper's exact DP).

    Returns:
        Candidates sorted by skipped weight (budget 0, the full model, first).

    Raises:
        ValueError: an even number of reference states, or a weight < 1.
    """
    if len(reference) % 2 != 1 or len(reference) < 3:
        raise ValueError("reference must hold X[0..2L]: 2L + 1 states")
    if w_attn < 1 or w_mlp < 1:
        raise ValueError("sub-layer weights must be >= 1")
    num_layers = (len(reference) - 1) // 2
    limit = num_layers * (w_attn + w_mlp) // 2 if max_skip is None else max_skip
    solutions = solve_knapsack(reference, sublayer, [w_attn, w_mlp] * num_layers, tau, limit,
                               bin_width)
    return [Candidate(s.skipped_weight,
                      frozenset((i - 1) // 2 for i in s.skipped if i % 2 == 1),
                      frozenset((i - 1) // 2 for i in s.skipped if i % 2 == 0),
                      s.similarity, s.hidden) for s in solutions]


def tokens_per_time(alpha: float, gamma: int, t_draft: float, t_target: float) -> float:
    """KnapSpec eq. 4: expected tokens per unit time of drafting ``gamma`` tokens at cost
    ``t_draft`` each, with acceptance rate ``alpha``, then verifying at cost ``t_target``:
    ``(1 - α^{γ+1}) / ((1 - α)(γ t_draft + t_target))`` (``(γ + 1) / (...)`` at α = 1)."""
    expected = gamma + 1 if alpha >= 1.0 else (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)
    return expected / (gamma * t_draft + t_target)


@dataclass(frozen=True)
class PlanChoice:
    """The (plan, draft length) that maximises TPT, with its prediction.

    Attributes:
        candidate: the chosen :class:`Candidate` (``None``: no plan beats plain decoding).
        draft_len: γ.
        alpha: the estimated acceptance rate α̂ (eq. 9).
        tpt: the predicted tokens per unit time.
        ar_tpt: plain decoding's ``1 / t_target`` on the same scale.
    """

    candidate: Candidate | None
    draft_len: int
    alpha: float
    tpt: float
    ar_tpt: float


def choose_plan(candidates: Sequence[Candidate], alphas: Sequence[float],
                draft_costs: Sequence[float], verify_cost: Callable[[int], float],
                max_draft_len: int = 10, *, must_beat_plain: bool = True) -> PlanChoice:
    """Grid search over candidates × ``γ in [1, max_draft_len]`` (KnapSpec §3.5, eq. 4).

    Args:
        candidates: from :func:`knapsack_candidates`.
        alphas: α̂ of each candidate.
        draft_costs: predicted time of one draft token with each candidate's plan.
        verify_cost: ``verify_cost(T)``: predicted time of a full forward of ``T`` tokens
            (the verification of ``γ = T - 1`` draft tokens; ``T = 1`` is plain decoding).
            The paper's GPU setting is a constant.
        max_draft_len: D (paper: 10).
        must_beat_plain: ``False`` returns the best drafting plan even when plain decoding
            is predicted faster (analyses of what the DP prefers).

    Returns:
        The best :class:`PlanChoice`; its ``candidate`` is ``None`` when no plan's TPT beats
        plain decoding (``1 / verify_cost(1)``), so the caller falls back to it.
    """
    ar_cost = verify_cost(1)
    ar_tpt = 1.0 / ar_cost
    best = PlanChoice(None, 0, 0.0, ar_tpt if must_beat_plain else 0.0, ar_tpt)
    for cand, alpha, cost in zip(candidates, alphas, draft_costs):
        if not cand.skip_attention and not cand.skip_mlp and cost >= ar_cost:
            continue  # a draft that costs a whole step never pays (unless on cheaper weights)
        for gamma in range(1, max_draft_len + 1):
            tpt = tokens_per_time(alpha, gamma, cost, verify_cost(gamma + 1))
            if tpt > best.tpt:
                best = PlanChoice(cand, gamma, alpha, tpt, ar_tpt)
    return best
