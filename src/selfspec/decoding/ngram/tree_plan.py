"""The shape of an n-gram token tree: how many tokens of each branch to verify, chosen by
predicted tokens per second (KnapSpec eq. 4 over branches, drafts free).

Branch ``b`` (a chain after the root, the last committed token) drafted ``d_b`` tokens is
verified as its own row of ``1 + d_b`` tokens (the root duplicated; branch 0's row is the
sequence's own). First tokens are distinct, so at most one branch is accepted and the
expected committed tokens add over branches::

    E(d) = 1 + Σ_b Σ_{k ≤ d_b} Π_{j ≤ k} α_{b,j}
    N(d) = 1 + d_0 + Σ_{b>0, d_b>0} (1 + d_b),     R(d) = branches with d_b > 0 (and b = 0)
    d*   = argmax_d E(d) / t(N(d), R(d))

``α_{0,j}`` are the chain's estimates (:meth:`NgramDrafter.alphas`); an alternative branch's
first token has its own estimate per rank (``P(the target's token is x_b)``, prior
``alt_prior``), its later tokens the estimate of their kind of match. ``t(N, R)`` is the
chain's forward time of ``N`` tokens plus ``R - 1`` times the cost of an extra row (its
attention calls and the branch cache's copy), learned online (:class:`TreeCosts`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from selfspec.decoding.ngram.drafter import NgramDrafter, proposal_key
from selfspec.decoding.ngram.lookup import NgramProposal
from selfspec.decoding.planning.tpt import ForwardCosts, MovingAverage


@dataclass(frozen=True)
class TreeSettings:
    """How n-gram token trees are shaped.

    Attributes:
        max_branches: most branches (1: chains only).
        alt_prior: acceptance assumed for an alternative branch's first token never
            verified yet.
        row_ms: prior time of one extra row (a branch) of a verification forward, ms.
        max_tokens: draft tokens of one tree, at most (over all branches).
    """

    max_branches: int = 1
    alt_prior: float = 0.1
    row_ms: float = 0.5
    max_tokens: int = 32


@dataclass(frozen=True)
class TreePlan:
    """A tree shape and what it is predicted to give.

    Attributes:
        counts: ``[B]`` draft tokens of each branch (``d_b``; 0: the branch is not verified).
        tokens: expected committed tokens ``E(d)``.
        ms: predicted time of the verification, ms.
    """

    counts: tuple[int, ...]
    tokens: float
    ms: float

    @property
    def rows(self) -> int:
        """Rows of the verification forward: branch 0's and every other drafted branch."""
        return 1 + sum(1 for c in self.counts[1:] if c)


def alt_key(rank: int) -> tuple[str, int]:
    """The acceptance-estimate key of the first token of the alternative of rank ``rank``
    (1 = the first alternative)."""
    return ("alt", rank)


def branch_alphas(drafter: NgramDrafter, branches: list[NgramProposal]) -> list[list[float]]:
    """``[B][D_b]`` acceptance estimates of each branch's tokens (module docstring)."""
    out = [drafter.alphas(branches[0])]
    for rank, branch in enumerate(branches[1:], 1):
        rest = drafter.acceptance.rate(proposal_key(branch))
        out.append([drafter.acceptance.rate(alt_key(rank))] + [rest] * (len(branch.tokens) - 1))
    return out


def plan_tree(alphas: list[list[float]], forward_ms: Callable[[int, int], float],
              max_tokens: int) -> TreePlan:
    """The tree shape of the best predicted tokens per second (module docstring), greedy:
    the next token of each branch is a candidate of gain ``Π_{j ≤ k} α_{b,j}`` (falling
    along a branch) and cost one row token (two for a branch's first: the root's copy);
    the best gain per row token is added, up to ``max_tokens``, and the best prefix of that
    order is kept. Includes the empty tree (plain decoding) and chains (branch 0 alone).

    Args:
        alphas: ``[B][D_b]`` acceptance estimates, each in ``[0, 1]``.
        forward_ms: ``(tokens, rows) -> ms`` of a verification forward.
        max_tokens: draft tokens over all branches, at most.
    """
    counts = [0] * len(alphas)
    gains = [1.0] * len(alphas)
    tokens, rows_tokens, rows = 1.0, 1, 1
    best = TreePlan(tuple(counts), tokens, forward_ms(1, 1))
    for _ in range(max_tokens):
        pick, pick_score = -1, 0.0
        for b, alpha in enumerate(alphas):
            if counts[b] < len(alpha):
                gain = gains[b] * min(max(alpha[counts[b]], 0.0), 1.0)
                cost = 2 if b and not counts[b] else 1
                if gain / cost > pick_score:
                    pick, pick_score = b, gain / cost
        if pick < 0:
            break
        gains[pick] *= min(max(alphas[pick][counts[pick]], 0.0), 1.0)
        if pick and not counts[pick]:
            rows_tokens, rows = rows_tokens + 1, rows + 1
        counts[pick] += 1
        tokens += gains[pick]
        rows_tokens += 1
        plan = TreePlan(tuple(counts), tokens, forward_ms(rows_tokens, rows))
        if plan.tokens * best.ms > best.tokens * plan.ms:
            best = plan
    return best


class TreeCosts:
    """Time of a verification forward of ``N`` tokens in ``R`` rows: the chain's
    (:class:`ForwardCosts` of ``N`` tokens) plus ``R - 1`` extra-row costs, the latter a
    moving average of what tree steps measured beyond the chain's prediction.

    Args:
        costs: the chain's forward costs (shared with the n-gram drafter).
        row_ms: prior time of one extra row, ms.
    """

    def __init__(self, costs: ForwardCosts, row_ms: float) -> None:
        self.costs = costs
        self.row = MovingAverage(row_ms)

    def forward_ms(self, tokens: int, rows: int) -> float:
        """Predicted time of a forward of ``tokens`` tokens in ``rows`` rows, ms."""
        return self.costs.forward_ms(tokens) + (rows - 1) * self.row.value

    def observe(self, tokens: int, rows: int, ms: float) -> None:
        """Record that a tree forward of ``tokens`` in ``rows >= 2`` rows took ``ms``."""
        if rows > 1 and ms > 0:
            extra = (ms - self.costs.forward_ms(tokens)) / (rows - 1)
            self.row.observe(max(extra, 0.0))
