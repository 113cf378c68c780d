"""Per-method metrics of a benchmark run (pure functions of the records).

Definitions (docs/design.md "Glossary"):

- ``tokens_per_s``: all new tokens / all wall time of the method (long generations weigh
  more, as in Spec-Bench); ``median_tokens_per_s``: median of the per-prompt rates.
- ``speedup_vs_ar`` / ``speedup_vs_hf_ar``: ``tokens_per_s`` over that of ``ar`` /
  ``hf-ar`` in the same run (None when that baseline is absent or failed).
- ``decode_tokens_per_s``: the tokens after each prompt's first / the wall time after its
  first token (the prefill, which every method shares and which varies from row to row on a
  busy machine, left out); ``decode_speedup_vs_ar``: that over ``ar``'s (None without times
  to first token).
- ``mean_accepted``: tokens committed per verification, bonus/recovered token included,
  ``(accepted + verifications) / verifications``; ``acceptance_rate``: accepted / drafted.
- ``draft_share`` / ``verify_share``: drafting / verification time as a fraction of wall time.
- ``layer_forwards_per_token``: decoder-layer evaluations per generated token, prefill excluded.
- ``parity``: share of prompts whose greedy token ids equal ``ar``'s (greedy runs with ``ar``).
- ``ar_prefix``: mean over prompts of the share of ``ar``'s greedy output reproduced before
  the first differing token (1 for a lossless method; for a lossy one, how long it follows
  the full model).
- ``forced_agreement``: teacher-forced greedy agreement with ``ar``, pooled over prompts: the
  share of ``ar``'s tokens the row's model picks given ``ar``'s earlier tokens
  (:mod:`selfspec.bench.agreement`; rows that run another model: another decoding kernel,
  llama.cpp).
- ``mean_exit_layer``: mean layer at which exit-layer predictions were made (draft tokens,
  or every token of a lossy early exit; DSSD Table 1's "avg. exit layer").
- ``draft_rate``: draft tokens per generated token (AdaDecode's early-prediction rate:
  tokens predicted at an intermediate layer, before verification).
- ``mean_layer_batch``: mean positions per decoder-layer call of drafters that batch
  deferred layers (AdaDecode's parallel layer calls); 1 for plain decoding.
- ``predictor_share`` / ``kv_share`` (SpecEE): candidates + features + predictors, and
  writing the skipped layers' KV, as fractions of wall time; ``exit_histogram[l]``: tokens
  predicted after ``l`` layers (every exit-layer method).
- ``accuracy``: share of scored outputs that solve the task (HumanEval pass@1, GSM match,
  json-extract: the output parses as JSON and validates against its schema).
- ``roofline_fraction``: ``tokens_per_s`` / (measured bandwidth / weight bytes per token).
- ``peak_rss_mib``: the largest peak resident memory of the process during one of the
  method's generations (MiB; the weights every method shares are included, so differences
  between methods are what a method adds: heads, a draft copy, buffers).
- ``peak_gpu_mib``: on CUDA, the largest peak of GPU memory torch allocated during one of the
  method's generations (MiB, weights included); the report shows its column only then.
- ``plans`` (methods that re-choose their draft: KnapSpec, CLaSp, DEL): decisions per
  prompt, the share that chose to speculate, the mean sub-layers skipped, the mean predicted
  tokens per second (KnapSpec's TPT) against the mean measured over the steps each decision
  governed, and planning time as a share of wall time.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

from selfspec.bench.harness import BenchRun, PromptRecord
from selfspec.bench.roofline import Roofline
from selfspec.bench.spec import reference_label
from selfspec.decoding.core.stats import add_batch_counts, mean_batch

AR = "ar"
HF_AR = "hf-ar"


@dataclass
class PlanSummary:
    """The draft decisions of an adaptive method over a run (see the module docstring).

    Attributes:
        decisions: decisions made, all prompts together.
        per_prompt: mean decisions per prompt.
        speculating: share of decisions that chose a draft (the rest: plain decoding).
        mean_skipped_attention / mean_skipped_mlp: mean sub-layers skipped by the chosen
            drafts (speculating decisions only).
        predicted_tps / measured_tps: mean predicted and measured tokens per second over the
            decisions that have both (``None`` without a time model).
        planning_share: time spent deciding / wall time.
    """

    decisions: int
    per_prompt: float
    speculating: float
    mean_skipped_attention: float | None
    mean_skipped_mlp: float | None
    predicted_tps: float | None
    measured_tps: float | None
    planning_share: float


def summarize_plans(records: list[PromptRecord]) -> PlanSummary | None:
    """The :class:`PlanSummary` of one method's records (``None`` when it made none)."""
    plans = [p for r in records for p in r.output.plans]
    if not plans:
        return None
    drafting = [p for p in plans if p.draft_len > 0]
    timed = [p for p in plans if p.predicted_tps is not None and p.measured_tps is not None]
    wall_ms = sum(r.output.wall_time_s for r in records) * 1e3
    return PlanSummary(
        decisions=len(plans), per_prompt=len(plans) / len(records),
        speculating=len(drafting) / len(plans),
        mean_skipped_attention=(statistics.fmean(p.skipped_attention for p in drafting)
                                if drafting else None),
        mean_skipped_mlp=statistics.fmean(p.skipped_mlp for p in drafting) if drafting else None,
        predicted_tps=statistics.fmean(p.predicted_tps for p in timed) if timed else None,
        measured_tps=statistics.fmean(p.measured_tps for p in timed) if timed else None,
        planning_share=sum(p.planning_ms for p in plans) / wall_ms if wall_ms > 0 else 0.0)


@dataclass
class MethodSummary:
    """One row of the report (see the module docstring for each metric's definition).

    ``None`` means not applicable or unknown (shown as "–"). A failed method has ``failed``
    set and no metrics.
    """

    method: str
    lossless: bool
    failed: str | None = None
    prompts: int = 0
    new_tokens: int = 0
    wall_time_s: float = 0.0
    tokens_per_s: float | None = None
    median_tokens_per_s: float | None = None
    median_ttft_ms: float | None = None
    speedup_vs_ar: float | None = None
    speedup_vs_hf_ar: float | None = None
    decode_tokens_per_s: float | None = None
    decode_speedup_vs_ar: float | None = None
    mean_accepted: float | None = None
    acceptance_rate: float | None = None
    draft_share: float | None = None
    verify_share: float | None = None
    layer_forwards_per_token: float | None = None
    parity: float | None = None
    ar_prefix: float | None = None
    forced_agreement: float | None = None
    mean_exit_layer: float | None = None
    draft_rate: float | None = None
    mean_layer_batch: float | None = None
    predictor_share: float | None = None
    kv_share: float | None = None
    exit_histogram: list[int] = field(default_factory=list)
    accuracy: float | None = None
    roofline_fraction: float | None = None
    peak_rss_mib: float | None = None
    peak_gpu_mib: float | None = None
    plans: PlanSummary | None = None
    drafter_steps: dict[str, int] = field(default_factory=dict)


def _references(run: BenchRun, greedy: bool) -> dict[tuple[str, str], list[int]]:
    """``(method, prompt_id) →`` the token ids of its reference row
    (:func:`reference_label`) for that prompt; empty for sampling runs (outputs differ by
    design). A failed reference row leaves its methods without one."""
    if not greedy:
        return {}
    outputs = {(r.method, r.prompt_id): r.output.token_ids for r in run.records}
    labels = {r.method for r in run.records}
    refs: dict[tuple[str, str], list[int]] = {}
    for r in run.records:
        ref = reference_label(r.method, labels)
        if ref not in run.failures and (ref, r.prompt_id) in outputs:
            refs[(r.method, r.prompt_id)] = outputs[(ref, r.prompt_id)]
    return refs


def parity_flags(run: BenchRun, greedy: bool) -> dict[tuple[str, str], bool]:
    """``(method, prompt_id) → output == its reference's`` (``ar``, or ``ar`` on the row's
    decoding kernel: :func:`reference_label`) for every record whose reference has that
    prompt; empty for sampling runs."""
    reference = _references(run, greedy)
    return {(r.method, r.prompt_id): r.output.token_ids == reference[(r.method, r.prompt_id)]
            for r in run.records if (r.method, r.prompt_id) in reference}


def prefix_shares(run: BenchRun, greedy: bool) -> dict[tuple[str, str], float]:
    """``(method, prompt_id) →`` share of the reference's output (:func:`parity_flags`') that
    the method's output repeats before their first differing token; empty for sampling
    runs."""
    reference = _references(run, greedy)
    shares = {}
    for r in run.records:
        ref = reference.get((r.method, r.prompt_id))
        if ref:
            same = next((i for i, (a, b) in enumerate(zip(r.output.token_ids, ref)) if a != b),
                        min(len(ref), len(r.output.token_ids)))
            shares[(r.method, r.prompt_id)] = same / len(ref)
    return shares


def _sum_known(values: Iterable[float | int | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _summarize_one(method: str, lossless: bool, records: list[PromptRecord],
                   parity: dict[tuple[str, str], bool], prefix: dict[tuple[str, str], float],
                   roofline: Roofline | None) -> MethodSummary:
    s = MethodSummary(method=method, lossless=lossless, prompts=len(records))
    if not records:
        return s
    s.new_tokens = sum(r.new_tokens for r in records)
    s.wall_time_s = sum(r.output.wall_time_s for r in records)
    if s.wall_time_s > 0:
        s.tokens_per_s = s.new_tokens / s.wall_time_s
    s.median_tokens_per_s = statistics.median(r.tokens_per_s for r in records)
    ttfts = [r.output.ttft_ms for r in records if r.output.ttft_ms is not None]
    s.median_ttft_ms = statistics.median(ttfts) if ttfts else None
    if len(ttfts) == len(records):
        decode_s = s.wall_time_s - sum(ttfts) / 1e3
        decode_tokens = s.new_tokens - len(records)
        if decode_s > 0 and decode_tokens > 0:
            s.decode_tokens_per_s = decode_tokens / decode_s
    outs = [r.output for r in records]
    verifications = _sum_known(o.verifications for o in outs)
    accepted = _sum_known(o.accepted for o in outs)
    drafted = _sum_known(o.drafted for o in outs)
    if verifications and accepted is not None:
        s.mean_accepted = (accepted + verifications) / verifications
    if drafted and accepted is not None:
        s.acceptance_rate = accepted / drafted
    if drafted is not None and s.new_tokens:
        s.draft_rate = drafted / s.new_tokens
    batches: list[int] = []
    for o in outs:
        add_batch_counts(batches, o.layer_batches)
    s.mean_layer_batch = mean_batch(batches)
    wall_ms = s.wall_time_s * 1e3
    draft_ms = _sum_known(o.draft_ms for o in outs)
    verify_ms = _sum_known(o.verify_ms for o in outs)
    if wall_ms > 0:
        s.draft_share = None if draft_ms is None else draft_ms / wall_ms
        s.verify_share = None if verify_ms is None else verify_ms / wall_ms
    predictor_ms = _sum_known(o.predictor_ms for o in outs)
    kv_ms = _sum_known(o.kv_ms for o in outs)
    if wall_ms > 0:
        s.predictor_share = None if predictor_ms is None else predictor_ms / wall_ms
        s.kv_share = None if kv_ms is None else kv_ms / wall_ms
    for o in outs:
        add_batch_counts(s.exit_histogram, o.exit_counts)
        for name, steps in o.drafter_steps.items():
            s.drafter_steps[name] = s.drafter_steps.get(name, 0) + steps
    layer_forwards = _sum_known(o.layer_forwards for o in outs)
    if layer_forwards is not None and s.new_tokens:
        s.layer_forwards_per_token = layer_forwards / s.new_tokens
    flags = [parity[(method, r.prompt_id)] for r in records if (method, r.prompt_id) in parity]
    s.parity = sum(flags) / len(flags) if flags else None
    shares = [prefix[(method, r.prompt_id)] for r in records if (method, r.prompt_id) in prefix]
    s.ar_prefix = sum(shares) / len(shares) if shares else None
    forced = [r for r in records if r.forced_tokens]
    if forced:
        s.forced_agreement = (sum(r.forced_matches or 0 for r in forced)
                              / sum(r.forced_tokens or 0 for r in forced))
    exit_tokens = _sum_known(o.exit_tokens for o in outs)
    exit_total = _sum_known(o.exit_layer_total for o in outs)
    if exit_tokens and exit_total is not None:
        s.mean_exit_layer = exit_total / exit_tokens
    scored = [r.correct for r in records if r.correct is not None]
    s.accuracy = sum(scored) / len(scored) if scored else None
    if roofline is not None and s.tokens_per_s is not None:
        s.roofline_fraction = roofline.fraction(s.tokens_per_s, method)
    peaks = [r.peak_rss_mib for r in records if r.peak_rss_mib is not None]
    s.peak_rss_mib = max(peaks) if peaks else None
    gpu_peaks = [r.peak_gpu_mib for r in records if getattr(r, "peak_gpu_mib", None) is not None]
    s.peak_gpu_mib = max(gpu_peaks) if gpu_peaks else None
    s.plans = summarize_plans(records)
    return s


def summarize(run: BenchRun, *, greedy: bool,
              roofline: Roofline | None = None) -> list[MethodSummary]:
    """One :class:`MethodSummary` per method of ``run``, in run order.

    Args:
        run: the records and failures.
        greedy: True for a greedy run (parity with ``ar`` is only defined then).
        roofline: the bandwidth bound, for ``roofline_fraction`` (None = not measured).
    """
    parity = parity_flags(run, greedy)
    prefix = prefix_shares(run, greedy)
    summaries = []
    for method in run.methods:
        lossless = run.lossless.get(method, False)
        if method in run.failures:
            summaries.append(MethodSummary(method=method, lossless=lossless,
                                           failed=run.failures[method]))
            continue
        records = [r for r in run.records if r.method == method]
        summaries.append(_summarize_one(method, lossless, records, parity, prefix, roofline))
    by_method = {s.method: s for s in summaries}
    for base, rate, attr in ((AR, "tokens_per_s", "speedup_vs_ar"),
                             (HF_AR, "tokens_per_s", "speedup_vs_hf_ar"),
                             (AR, "decode_tokens_per_s", "decode_speedup_vs_ar")):
        ref = by_method.get(base)
        if ref is None or ref.failed or not getattr(ref, rate):
            continue
        for s in summaries:
            if getattr(s, rate) is not None:
                setattr(s, attr, getattr(s, rate) / getattr(ref, rate))
    return summaries
