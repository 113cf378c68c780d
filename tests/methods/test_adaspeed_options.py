"""AdaSPEED options as the paper has them: no draft cap of its own for the product rule, and
``adaspeed-probe`` drafting exactly like ``adaspeed`` (same head) so that the two differ only
in the stop rule (AdaSPEED §II, Table I); probes per decoding mode."""

from __future__ import annotations

import pytest
import torch

from selfspec.decoding.core.speculative import SpeculativeStep
from selfspec.decoding.drafting.exit_drafter import EarlyExitDrafter
from selfspec.decoding.drafting.stop_rules import make_stop_rule
from selfspec.errors import InvalidArgumentError
from selfspec.executor import LayerExecutor
from selfspec.heads import ExitHeads, HeadsNotFoundError, save_heads
from selfspec.heads.card import ProbeCard
from selfspec.heads.files import default_probes_dir, new_card
from selfspec.methods.registry import build_step, heads_files
from selfspec.training import fit_probe

from tiny import run_step, tiny_model

PROMPT = [1, 5, 9, 13, 17]


@pytest.fixture
def executor():
    # One per test: loaded head files are cached per executor and path keyword.
    return LayerExecutor(tiny_model("llama", seed=31, num_layers=6), name="tiny-ada")


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))
    return tmp_path


def _drafter(decoder) -> EarlyExitDrafter:
    return decoder.drafter


def _probe_card(layer: int, draft_head: str, mode: str = "greedy") -> ProbeCard:
    return ProbeCard(exit_layer=layer, draft_head=draft_head, train_tokens=1, eval_tokens=1,
                     base_rate=0.5, accuracy=0.5, auc=0.5, max_prob_auc=0.5, bce=0.7, seconds=0.0,
                     mode=mode)


def _save_probes(executor, draft_head: str = "lm_head", layer: int = 3):
    probe = fit_probe(layer, torch.randn(50, 64), torch.rand(50) > 0.5)
    card = new_card(executor, None, [])
    card.probes = [_probe_card(layer, draft_head)]
    save_heads(ExitHeads([], [], card, probes={layer: probe}),
               default_probes_dir(executor.name) / "heads.safetensors")
    return probe


def test_the_product_rule_has_no_cap_of_its_own_by_default(executor):
    limit = executor.row_attention_max - 1
    for name in ("adaspeed",):
        assert _drafter(build_step(name, executor, {})).stop_rule.max_draft_len == limit
        capped = build_step(name, executor, {"max_draft_len": 8})
        assert _drafter(capped).stop_rule.max_draft_len == 8
    # Draft & Verify keeps its paper's max_step_draft = 8
    assert _drafter(build_step("dv", executor, {})).stop_rule.max_draft_len == 8
    with pytest.raises(InvalidArgumentError, match="max_draft_len"):
        build_step("adaspeed", executor, {"max_draft_len": limit + 1})


def test_adaspeed_probe_drafts_like_adaspeed_and_reads_the_default_probes(executor, home):
    with pytest.raises(HeadsNotFoundError, match="train-probe"):
        build_step("adaspeed-probe", executor, {"exit_layer": 3})
    probe = _save_probes(executor)
    plain = _drafter(build_step("adaspeed", executor, {"exit_layer": 3}))
    probed = _drafter(build_step("adaspeed-probe", executor, {"exit_layer": 3}))
    # both draft with the model's lm_head
    assert plain.policy.head is None and probed.policy.head is None
    assert plain.policy.scorer is None and torch.equal(probed.policy.scorer.weight, probe.weight)
    assert probed.stop_rule.max_draft_len == plain.stop_rule.max_draft_len
    assert heads_files("adaspeed-probe", {}) == ["default-probes"]
    assert heads_files("adaspeed-probe", {"heads": "x"}) == ["x"]
    assert heads_files("adaspeed", {}) == [] and heads_files("dssd", {}) == ["default"]


def test_a_probe_trained_for_another_drafter_is_refused(executor, home):
    _save_probes(executor, draft_head="exit_head")
    with pytest.raises(InvalidArgumentError, match="trained on drafts of the exit_head"):
        build_step("adaspeed-probe", executor, {"exit_layer": 3})


def test_the_drafter_scores_with_the_probe_of_the_decoding_mode(executor):
    calls = []

    def scorer(tag):
        def score(hidden):
            calls.append(tag)
            return torch.full((1, 1), 0.9)
        return score

    rule = make_stop_rule("product", gamma=0.5, adaptive=False)
    both = EarlyExitDrafter(executor, 3, rule, scorer=scorer("greedy"),
                            sampled_scorer=scorer("sampled"))
    decoder = SpeculativeStep(both)
    run_step(executor, decoder, PROMPT, max_new_tokens=6)
    assert set(calls) == {"greedy"}
    calls.clear()
    run_step(executor, decoder, PROMPT, max_new_tokens=6, sampling=_sampling())
    assert set(calls) == {"sampled"}
    greedy_only = EarlyExitDrafter(executor, 3, rule, scorer=scorer("greedy"))
    with pytest.raises(InvalidArgumentError, match="no acceptance probe for sampled decoding"):
        run_step(executor, SpeculativeStep(greedy_only), PROMPT,
                    max_new_tokens=6, sampling=_sampling())


def _sampling():
    from selfspec.decoding.core.sampling import SamplingConfig

    return SamplingConfig(temperature=1.0, top_p=0.9, seed=1)


def test_a_rewritten_head_file_is_read_again(executor, home):
    """Head files are cached per model by path, size and mtime: a retrained file is not served
    stale (the executor-held cache keyed by path alone was)."""
    import os

    from selfspec.methods.base import MethodContext

    context = MethodContext(executor)
    first = _save_probes(executor)
    loaded = context.heads("default-probes")
    assert context.heads("default-probes") is loaded  # cached
    second = _save_probes(executor)
    path = default_probes_dir(executor.name) / "heads.safetensors"
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # coarse mtime clocks
    reloaded = context.heads("default-probes")
    assert reloaded is not loaded
    assert torch.equal(reloaded.probes[3].weight, second.weight)
    assert not torch.equal(second.weight, first.weight)
