"""KnapSpec's analyses on our models and this machine (KnapSpec §3.4, §5.2, Figures 2-3):

- ``latency``: the latency model's predicted attention / MLP sub-layer and whole-token times
  against fresh measurements at context lengths 128 … 4096 (``latency.png``).
- ``throughput`` (Figure 2): many sub-layer skip drafts (the knapsack DP's candidates on a
  real prompt, each with several draft lengths) decoded on other prompts; the Pearson
  correlation of measured throughput with KnapSpec's predicted Tokens-per-Time (eq. 4 with
  α̂ of eq. 9 and the latency model) and with the measured acceptance rate
  (``throughput-vs-tpt.png``).
- ``context`` (Figure 3): the plan KnapSpec chooses after a prefix of a long document of
  128 … 4096 tokens: how many attention and MLP sub-layers it skips as the context grows
  (``skips-vs-context.png``).

Each writes a JSON file of its numbers beside the plot. Run as
``selfspec bench skip-analysis {latency,throughput,context} --model M --out DIR``.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from selfspec.cli_args import add_dtype_argument, add_model_argument, add_threads_argument
from selfspec.decoding.core import loop
from selfspec.decoding.core.speculative import SpeculativeStep
from selfspec.decoding.core.state import DecodeOptions, DecodeState
from selfspec.decoding.drafting.skip_drafter import SkipPlanDrafter
from selfspec.decoding.drafting.stop_rules import ConstantStopRule
from selfspec.decoding.knapspec.step import KnapSpecConfig, KnapSpecStep
from selfspec.decoding.planning.knapsack import choose_plan, tokens_per_time
from selfspec.executor.cost_model import (
    LatencyModel,
    measure_sublayers,
    measure_token_ms,
)
from selfspec.executor.executor import SkipPlan

logger = logging.getLogger(__name__)

LENGTHS = (128, 256, 512, 1024, 2048, 4096)


def _pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path, title: str | None = None) -> None:
    if title is not None:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------ latency
@dataclass(frozen=True)
class LatencyPoint:
    """Predicted and measured times at one context length, ms."""

    context_len: int
    attention_measured: float
    attention_predicted: float
    mlp_measured: float
    mlp_predicted: float
    token_measured: float
    token_predicted: float


def latency_points(engine, model: LatencyModel, lengths=LENGTHS,
                   repeats: int = 10) -> list[LatencyPoint]:
    """Measure every length afresh and set it beside the model's prediction."""
    ex = engine.executor
    points = []
    for n in lengths:
        n = min(n, ex.max_positions - 2)
        t = measure_sublayers(ex, n, repeats)
        points.append(LatencyPoint(n, t.attention_ms, model.t_attn(n), t.mlp_ms, model.mlp_ms,
                                   measure_token_ms(ex, n, repeats), model.target_ms(n)))
        logger.info("latency at %d: %s", n, points[-1])
    return points


def plot_latency(points: list[LatencyPoint], title: str, path: Path) -> None:
    """Write ``path`` (PNG): measured and predicted sub-layer times (left) and whole-token
    times (right), ms, against the context length."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    x = [p.context_len for p in points]
    for attr, label in (("attention", "attention sub-layer"), ("mlp", "MLP sub-layer")):
        line, = ax1.plot(x, [getattr(p, f"{attr}_measured") for p in points], "o-",
                         label=f"{label}, measured")
        ax1.plot(x, [getattr(p, f"{attr}_predicted") for p in points], "--",
                 color=line.get_color(), label=f"{label}, predicted")
    ax2.plot(x, [p.token_measured for p in points], "o-", label="one token, measured")
    ax2.plot(x, [p.token_predicted for p in points], "--",
             label="one token, predicted L(t_attn+t_mlp)+head")
    for ax, ylabel in ((ax1, "ms per sub-layer"), (ax2, "ms per token")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length n (tokens)")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    _save(plt, fig, path, title)


# --------------------------------------------------------------------------- throughput
@dataclass(frozen=True)
class ConfigPoint:
    """One draft configuration decoded on the held-out prompts."""

    skipped_attention: int
    skipped_mlp: int
    draft_len: int
    acceptance_rate: float
    mean_accepted: float
    predicted_tpt: float  # tokens per second, eq. 4 with α̂ (eq. 9) and the latency model
    tokens_per_s: float


def pearson(xs: list[float], ys: list[float]) -> float:
    """Pearson correlation coefficient of two equal-length samples."""
    return statistics.correlation(xs, ys)


def _candidate_plans(engine, prompt_ids: list[int], latency: LatencyModel,
                     count: int) -> list[tuple[SkipPlan, float]]:
    """The knapsack DP's candidates on ``prompt_ids`` (history: its last 32 tokens), spread
    over the budgets, each with its estimated acceptance rate α̂ (eq. 9)."""
    step = KnapSpecStep(engine.executor, latency,
                        KnapSpecConfig(plan_budget=1e9, min_history=32,
                                       max_alpha_candidates=count))
    state = DecodeState(engine.executor, prompt_ids, DecodeOptions(max_new_tokens=2))
    state.prefill()
    state.commit([prompt_ids[-1]])  # any token: the history is the prompt's end
    step.start(state)
    step._reoptimize(state)
    return [(SkipPlan(c.skip_attention, c.skip_mlp), alpha)
            for c, alpha in zip(step.last_candidates, step.last_alphas, strict=False)
            if c.skip_attention or c.skip_mlp]


@torch.inference_mode()
def _decode(engine, step, prompts: list[list[int]], max_new_tokens: int):
    tokens = drafted = accepted = verifications = 0
    seconds = 0.0
    for ids in prompts:
        state = DecodeState(engine.executor, ids, DecodeOptions(
            max_new_tokens=max_new_tokens, eos_token_ids=engine.eos_token_ids))
        t0 = time.perf_counter()
        stats = loop.run(state, step)
        seconds += time.perf_counter() - t0
        tokens += stats.new_tokens
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
        verifications += stats.verifications
    return tokens / seconds, drafted, accepted, verifications


def throughput_points(engine, latency: LatencyModel, plan_prompt: list[int],
                      prompts: list[list[int]], plans: int, draft_lens=(2, 4, 8),
                      max_new_tokens: int = 48) -> tuple[list[ConfigPoint], float]:
    """Decode every (candidate plan, γ) on ``prompts``; returns the points and ``ar``'s
    tokens per second."""
    from selfspec.decoding.core.autoregressive import ArStep

    ar_tps = _decode(engine, ArStep(), prompts, max_new_tokens)[0]
    points = []
    n = len(plan_prompt)
    for plan, alpha_hat in _candidate_plans(engine, plan_prompt, latency, plans):
        for gamma in draft_lens:
            drafter = SkipPlanDrafter(engine.executor, plan, ConstantStopRule(gamma))
            tps, drafted, accepted, verifications = _decode(
                engine, SpeculativeStep(drafter), prompts, max_new_tokens)
            alpha = accepted / drafted if drafted else 0.0
            # KnapSpec's prediction: α̂ from the DP's history (eq. 9), the latency model (eq. 4)
            tpt = 1e3 * tokens_per_time(alpha_hat, gamma, latency.draft_ms(plan, n),
                                        latency.verify_ms(n, gamma + 1))
            points.append(ConfigPoint(len(plan.skip_attention), len(plan.skip_mlp), gamma,
                                      alpha, (accepted + verifications) / max(1, verifications),
                                      tpt, tps))
            logger.info("config %s", points[-1])
    return points, ar_tps


def plot_throughput(points: list[ConfigPoint], ar_tps: float, title: str, path: Path) -> dict:
    """Write ``path`` (PNG): measured tokens/s against predicted TPT and against the
    acceptance rate, ``ar``'s tokens/s as a line; returns both Pearson correlations
    (``pcc_tpt``, ``pcc_acceptance``; needs at least two points)."""
    plt = _pyplot()
    tps = [p.tokens_per_s for p in points]
    r_tpt = pearson([p.predicted_tpt for p in points], tps)
    r_acc = pearson([p.acceptance_rate for p in points], tps)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.scatter([p.predicted_tpt for p in points], tps, s=14)
    ax1.set_xlabel("predicted TPT (tokens / s, eq. 4)")
    ax1.set_title(f"PCC = {r_tpt:.3f}", fontsize=9)
    ax2.scatter([p.acceptance_rate for p in points], tps, s=14, color="tab:orange")
    ax2.set_xlabel("acceptance rate")
    ax2.set_title(f"PCC = {r_acc:.3f}", fontsize=9)
    for ax in (ax1, ax2):
        ax.axhline(ar_tps, color="gray", ls=":", label=f"ar {ar_tps:.1f} tok/s")
        ax.set_ylabel("measured throughput (tokens / s)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    _save(plt, fig, path, title)
    return {"pcc_tpt": r_tpt, "pcc_acceptance": r_acc}


# ------------------------------------------------------------------------------ context
@dataclass(frozen=True)
class ContextPoint:
    """KnapSpec's choice after ``context_len`` tokens of a document, and the best drafting
    plan by TPT (the one it would draft with if plain decoding were slower)."""

    context_len: int
    w_attn: int
    w_mlp: int
    skipped_attention: int
    skipped_mlp: int
    draft_len: int
    alpha: float
    candidates: int
    best_skipped_attention: int
    best_skipped_mlp: int
    best_alpha: float
    best_tpt_vs_plain: float


@torch.inference_mode()
def context_points(engine, latency: LatencyModel, document: list[int],
                   lengths=LENGTHS) -> list[ContextPoint]:
    """Prefill ``document[:n]`` and run one KnapSpec re-optimisation (paper settings,
    ``plan_budget`` unlimited) for each ``n``."""
    points = []
    for n in lengths:
        if n > len(document) or n >= engine.executor.max_positions - 8:
            logger.warning("skipping context %d: document or context too short", n)
            continue
        step = KnapSpecStep(engine.executor, latency,
                            KnapSpecConfig(plan_budget=1e9, min_history=16))
        state = DecodeState(engine.executor, document[:n - 1], DecodeOptions(max_new_tokens=2))
        state.prefill()
        state.commit([document[n - 1]])
        step.start(state)
        step._reoptimize(state)
        record = step.history[-1]
        c = record.choice.candidate
        plans = [SkipPlan(k.skip_attention, k.skip_mlp) for k in step.last_candidates]
        best = choose_plan(step.last_candidates, step.last_alphas,
                           [latency.draft_ms(plan, n) for plan in plans],
                           lambda t, n=n: latency.verify_ms(n, t), must_beat_plain=False)
        b = best.candidate
        points.append(ContextPoint(n, *record.weights,
                                   len(c.skip_attention) if c else 0,
                                   len(c.skip_mlp) if c else 0,
                                   record.choice.draft_len, record.choice.alpha,
                                   record.candidates,
                                   len(b.skip_attention) if b else 0,
                                   len(b.skip_mlp) if b else 0, best.alpha,
                                   best.tpt / best.ar_tpt))
        logger.info("context %d: %s", n, points[-1])
    return points


def plot_context(points: list[ContextPoint], num_layers: int, title: str, path: Path) -> None:
    """Write ``path`` (PNG): the share of the ``num_layers`` layers' attention and MLP
    sub-layers skipped (best plan and chosen plan) against the context length."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    x = [p.context_len for p in points]
    ax.plot(x, [p.best_skipped_attention / num_layers for p in points], "o-",
            label="attention skipped (best drafting plan by TPT)")
    ax.plot(x, [p.best_skipped_mlp / num_layers for p in points], "s-",
            label="MLP skipped (best drafting plan by TPT)")
    ax.plot(x, [p.skipped_attention / num_layers for p in points], "o:", color="tab:blue",
            alpha=0.5, label="attention skipped (chosen; 0 = plain decoding)")
    ax.plot(x, [p.skipped_mlp / num_layers for p in points], "s:", color="tab:orange",
            alpha=0.5, label="MLP skipped (chosen)")
    for p in points:
        ax.annotate(f"{p.w_attn}:{p.w_mlp}\n{p.best_tpt_vs_plain:.2f}x",
                    (p.context_len, 0.92), fontsize=6, ha="center")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length n (tokens)")
    ax.set_ylabel(f"share of the {num_layers} layers' sub-layers skipped")
    ax.set_title(title + "\n(top: weights w_attn:w_mlp, best plan's predicted TPT / plain)",
                 fontsize=8)
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    _save(plt, fig, path)


# ---------------------------------------------------------------------------------- CLI
def _document(engine, tokens: int) -> list[int]:
    """A long real document: ShareGPT summarize requests, concatenated until ``tokens``."""
    from selfspec.data import load_prompts

    ids: list[int] = []
    for prompt in load_prompts("sharegpt-summarize"):
        ids += engine.tokenizer.encode(prompt.text + "\n\n")
        if len(ids) >= tokens:
            break
    return ids[:tokens]


def _prompts(engine, dataset: str, n: int, skip: int) -> list[list[int]]:
    from selfspec.data import load_prompts

    prompts = load_prompts(dataset)[skip:skip + n]
    return [engine.encode(p.text, chat=p.chat) for p in prompts]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the flags of ``selfspec bench skip-analysis`` to ``parser``."""
    parser.add_argument("analysis", choices=("latency", "throughput", "context"))
    add_model_argument(parser)
    add_dtype_argument(parser)
    add_threads_argument(parser)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dataset", default="humaneval", help="throughput: prompts to decode")
    parser.add_argument("--n", type=int, default=4, help="throughput: prompts decoded per config")
    parser.add_argument("--plans", type=int, default=12, help="throughput: DP candidates")
    parser.add_argument("--max-new-tokens", type=int, default=48)


def run_analysis(args: argparse.Namespace) -> int:
    """Run one analysis with the flags of :func:`add_arguments`: write its plot and
    ``ANALYSIS.json`` into ``--out``; exit status 0, or 2 without matplotlib."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        import matplotlib  # noqa: F401 (fail before measuring)
    except ImportError:
        print("this analysis plots with matplotlib: pip install matplotlib", file=sys.stderr)
        return 2
    from selfspec.api import load
    from selfspec.executor.cost_model import cached_latency
    from selfspec.models.provision import selfspec_home

    engine = load(args.model, args.dtype)
    latency = cached_latency(engine.executor, selfspec_home())
    args.out.mkdir(parents=True, exist_ok=True)
    label = (f"{engine.name} {args.dtype}, {torch.get_num_threads()} threads, "
             f"{platform.processor() or platform.machine()}")
    result: dict = {"model": engine.name, "dtype": args.dtype,
                    "threads": torch.get_num_threads(), "latency_model": asdict(latency)}
    if args.analysis == "latency":
        points = latency_points(engine, latency)
        plot_latency(points, f"KnapSpec latency model vs measured: {label}",
                     args.out / "latency.png")
        result["points"] = [asdict(p) for p in points]
    elif args.analysis == "throughput":
        # The plans come from the first prompt; throughput is measured on the next n.
        prompts = _prompts(engine, args.dataset, args.n + 1, 0)
        points, ar_tps = throughput_points(engine, latency, prompts[0], prompts[1:],
                                           args.plans, max_new_tokens=args.max_new_tokens)
        result.update(plot_throughput(points, ar_tps,
                                      f"Figure 2 on {label}, {args.dataset} n={args.n}",
                                      args.out / "throughput-vs-tpt.png"))
        result["ar_tokens_per_s"] = ar_tps
        result["points"] = [asdict(p) for p in points]
    else:
        points = context_points(engine, latency, _document(engine, max(LENGTHS)))
        plot_context(points, engine.executor.num_layers,
                     f"Figure 3: KnapSpec's skips vs context, {label}",
                     args.out / "skips-vs-context.png")
        result["points"] = [asdict(p) for p in points]
    (args.out / f"{args.analysis}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out / (args.analysis + '.json')}")
    return 0
