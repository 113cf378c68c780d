"""Head training losses (DSSD §3.3), per token in nats, averaged over the batch.

- ``kl`` forward: ``KL(p || q) = Σ_v p_v (log p_v - log q_v)`` with ``p`` the final layer's
  distribution and ``q`` the head's (AdaDecode §2.1's loss);
- ``kl`` reverse: ``KL(q || p)``, DSSD §3.3's formula read literally;
- ``ce``: ``-log q_{y}`` with ``y`` the next token of the text (DSSD ``L_CE``);
- ``hybrid``: ``α·CE + (1 - α)·KL`` (DSSD ``L_hyb``).

Every function takes logits over any set of vocabulary columns: ``[N, V]`` for the full
vocabulary (AdaDecode §2.1), or ``[N, R]`` for a restricted one (``TrainConfig.loss_vocab``,
our departure for ``V = 151,936`` on a CPU): a :class:`Teacher` built from the final layer's
logits on the same ``R`` rows is then ``softmax`` renormalised over ``R``, and the KL is
``KL(p_R || q_R)`` (see :mod:`selfspec.training.train`).

The forward KL, the default, has a fused implementation (:func:`forward_kl`): with
``V = 49152`` the softmax-sized element-wise work costs as much as the matmuls, so it is done
in row chunks that stay in cache, and the gradient ``(q - p) / N`` is produced in the same
pass (every training step back-propagates, so nothing is wasted).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

_CHUNK_ROWS = 8  # 8 × 49152 float32 = 1.5 MiB: the chunk's temporaries stay in L2/L3


@dataclass(frozen=True)
class Teacher:
    """The final layer's distribution for a batch, shared by every head's loss.

    Attributes:
        logp: ``[N, V]`` float32 log-probabilities (``[N, R]`` over a restricted vocabulary).
        p: ``[N, V]`` float32 probabilities.
        neg_entropy: ``[N]`` float32 ``Σ_v p_v log p_v``.
    """

    logp: torch.Tensor
    p: torch.Tensor
    neg_entropy: torch.Tensor

    @staticmethod
    def from_logits(logits: torch.Tensor) -> Teacher:
        """From final-layer logits ``[N, V]`` (any float dtype)."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        p = logp.exp()
        return Teacher(logp, p, torch.linalg.vecdot(p, logp))


class _ForwardKL(torch.autograd.Function):
    """Mean ``KL(p || softmax(z))`` with its gradient computed in the forward pass."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, p: torch.Tensor, neg_entropy: torch.Tensor
                ) -> torch.Tensor:
        n = logits.shape[0]
        grad = torch.empty_like(logits)
        total = torch.zeros((), dtype=torch.float64)
        for s in range(0, n, _CHUNK_ROWS):
            logq = torch.log_softmax(logits[s:s + _CHUNK_ROWS].float(), dim=-1)
            pc = p[s:s + _CHUNK_ROWS]
            total += (neg_entropy[s:s + _CHUNK_ROWS] - torch.linalg.vecdot(pc, logq)).sum().double()
            # d/dz KL(p || softmax z) = softmax(z) - p, scaled by 1/N for the mean.
            grad[s:s + _CHUNK_ROWS] = logq.exp_().sub_(pc).mul_(1.0 / n)
        ctx.save_for_backward(grad)
        return (total / n).float()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return grad.mul_(grad_output.to(grad.dtype)), None, None


def forward_kl(logits: torch.Tensor, teacher: Teacher) -> torch.Tensor:
    """Mean ``KL(p_teacher || softmax(logits))`` over ``N`` tokens (scalar, nats).

    Args:
        logits: ``[N, V]`` head logits (bf16 or fp32; the gradient has the same dtype), or
            ``[N, R]`` on the teacher's restricted rows.
        teacher: the batch's :class:`Teacher`.
    """
    return _ForwardKL.apply(logits, teacher.p, teacher.neg_entropy)


def reverse_kl(logits: torch.Tensor, teacher: Teacher) -> torch.Tensor:
    """Mean ``KL(softmax(logits) || p_teacher)`` (scalar, nats)."""
    logq = torch.log_softmax(logits.float(), dim=-1)
    return torch.linalg.vecdot(logq.exp(), logq - teacher.logp).mean()


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: ``[N, V]``, ``[N]`` int64 → scalar (nats)."""
    return F.cross_entropy(logits.float(), labels)


def kl_divergence(logits: torch.Tensor, teacher: Teacher, direction: str = "forward"
                  ) -> torch.Tensor:
    """Mean KL in the given ``direction`` (``"forward"`` or ``"reverse"``)."""
    return forward_kl(logits, teacher) if direction == "forward" else reverse_kl(logits, teacher)
