"""Wrong speculative-sampling rules, planted in place of ``verify_sampling`` to show that the
end-to-end distribution tests catch them (``scripts/mutation_check.py``).

Each rule is the Leviathan et al. 2023 (§2.3, Algorithm 1) / Chen et al. 2023 (Algorithm 2)
rule of :func:`selfspec.decoding.core.verification.verify_sampling` with one planted error:

- ``residual-p``: the recovered token is drawn from ``p_i`` instead of ``norm(max(0, p_i - q_i))``;
- ``accept-x1.25`` / ``accept-x0.8``: the acceptance probability ``min(1, p/q)`` scaled;
- ``bonus-wrong-position``: after a full accept the bonus token is drawn from ``p_{D-1}``;
- ``one-hot-q``: the sampled draft is treated as greedy (``q_i`` one-hot at ``x_i``);
- ``always-accept``: every draft token is accepted (the output is the draft's distribution).

Planted by :func:`plant` when the environment variable ``SELFSPEC_PLANT_RULE`` names a rule
(read by ``tests/conftest.py``; only the script sets it).
"""

from __future__ import annotations

import torch

ENV = "SELFSPEC_PLANT_RULE"
RULES = ("residual-p", "accept-x1.25", "accept-x0.8", "bonus-wrong-position", "one-hot-q",
         "always-accept")


def wrong_verify_sampling(rule: str):
    """A ``verify_sampling(draft_tokens [D], draft_probs [D, V], target_logits [D+1, V],
    config, generator)`` that applies ``rule`` (one of :data:`RULES`)."""
    from selfspec.decoding.core.sampling import logits_to_probs
    from selfspec.decoding.core.verification import VerifyOutput, _check_shapes

    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}; known: {', '.join(RULES)}")

    def verify_sampling(draft_tokens, draft_probs, target_logits, config, generator=None):
        draft_tokens, target_logits = _check_shapes(draft_tokens, draft_probs, target_logits)
        q = draft_probs[0] if draft_probs.dim() == 3 else draft_probs
        p = logits_to_probs(target_logits, config)
        d, vocab = draft_tokens.shape[0], p.shape[-1]
        x = draft_tokens.long()
        q = q.float()
        if rule == "one-hot-q":
            q = torch.nn.functional.one_hot(x, vocab).float()
        q_ext = torch.cat([q, p.new_zeros(1, vocab)])
        px = p[:d].gather(-1, x.view(-1, 1)).squeeze(-1)
        qx = q_ext[:d].gather(-1, x.view(-1, 1)).squeeze(-1)
        u = torch.rand(d, generator=generator)
        scale = {"accept-x1.25": 1.25, "accept-x0.8": 0.8}.get(rule, 1.0)
        accepted = u * qx < scale * px
        if rule == "always-accept":
            accepted = torch.ones_like(accepted)
        n = int(accepted.int().cumprod(0).sum())
        row = n - 1 if rule == "bonus-wrong-position" and n == d and d > 0 else n
        residual = (p[row] - q_ext[n]).clamp(min=0.0)
        if rule == "residual-p" or float(residual.sum()) <= 0:
            residual = p[row]
        e = torch.empty(vocab).exponential_(generator=generator).clamp_(min=1e-38)
        nxt = int((residual / e).argmax())
        committed = x[:n].tolist() + [nxt]
        return VerifyOutput(num_accepted=n, next_token=nxt, committed_tokens=committed,
                            num_drafted=d)

    return verify_sampling


def plant(patch, rule: str) -> None:
    """Replace ``verify_sampling`` by ``wrong_verify_sampling(rule)`` everywhere it is
    called from (``patch``: a ``pytest.MonkeyPatch``)."""
    from selfspec.decoding.core import speculative, verification
    from selfspec.decoding.ngram import batch

    wrong = wrong_verify_sampling(rule)
    for module in (verification, speculative, batch):
        patch.setattr(module, "verify_sampling", wrong)
