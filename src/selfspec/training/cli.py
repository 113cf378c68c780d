"""``selfspec heads train | calibrate | tune-adadecode | show | train-probe | train-predictors |
train-drafter | search-skip``: the parser and printing. The work is in each stage's module
(:mod:`~selfspec.training.train`, :mod:`~selfspec.training.calibration`,
:mod:`~selfspec.training.adadecode_tuning`, :mod:`~selfspec.training.probe`,
:mod:`~selfspec.training.predictors`, :mod:`~selfspec.training.drafter`,
:mod:`~selfspec.training.skip_search`); every option's default is read from the request
dataclass (or function) it fills."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

from selfspec.cli_args import (
    TRAINING_DTYPES,
    add_device_argument,
    add_dtype_argument,
    add_model_argument,
    add_threads_argument,
    float_arg,
    int_arg,
)
from selfspec.errors import InvalidArgumentError
from selfspec.validation import SEED_MAX, SEED_MIN

_EPS_SHOWN = (0.6, 0.7, 0.8, 0.9, 0.95)


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def _exit_state_layers(text: str) -> tuple[int, ...] | None:
    """``--exit-state-layers``: comma-separated layers, ``auto`` (``None``: the default
    layers) or ``none`` (an empty tuple)."""
    if text.strip().lower() == "none":
        return ()
    if text.strip().lower() == "auto":
        return None
    layers = _ints(text)
    if not layers:
        raise argparse.ArgumentTypeError("expected comma-separated layers, 'auto' or 'none'")
    return layers


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None


def _default(cls: type, name: str):
    """The default of field ``name`` of dataclass ``cls`` (its factory's value), so that the
    parser states no default of its own."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _add_data_args(p: argparse.ArgumentParser, default=None) -> None:
    """``--data``, ``--tokens``, ``--max-new-tokens``, ``--seed`` of a
    :class:`~selfspec.training.pipeline.DataRequest`; ``default``: the command's request
    data (``None``: the data the heads were trained on, from their card)."""
    from selfspec.data import DATASETS
    from selfspec.training.pipeline import DataRequest

    base = DataRequest()
    what = "the data the heads were trained on" if default is None else default.data
    tokens = "the heads' training tokens" if default is None else default.tokens
    g = p.add_argument_group("data")
    g.add_argument("--data", default=None,
                   help=f"comma-separated sources: a dataset ({', '.join(DATASETS)}) = prompt "
                        "+ reference text; onpolicy:DATASET = the model's own greedy answers; "
                        "SOURCE*K = K times an unweighted source's share of --tokens "
                        f"(default: {what}; the card records every prompt used, and "
                        "selfspec bench drops those prompts from its runs)")
    g.add_argument("--tokens", type=int_arg(1), default=None,
                   help="scored training tokens over all sources; held-out calibration and test "
                        f"text add 25%% each (default: {tokens})")
    g.add_argument("--max-new-tokens", type=int_arg(1), default=base.max_new_tokens,
                   help="on-policy answer length cap")
    g.add_argument("--seed", type=int_arg(SEED_MIN, SEED_MAX), default=base.seed)


def _add_model_args(p: argparse.ArgumentParser, required: bool) -> None:
    add_model_argument(p, required=required, help="registry name, local directory or hub id")
    add_dtype_argument(p, choices=TRAINING_DTYPES, default=None,
                       help="backbone dtype (default bf16, the default decoding dtype; calibrate: "
                            "the dtype the heads were trained with)")
    add_threads_argument(p, help="torch intra-op threads")
    add_device_argument(p)
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def add_heads_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``selfspec heads ...`` on the top-level subparsers."""
    p = subparsers.add_parser("heads", help="train, calibrate and inspect exit heads and probes")
    sub = p.add_subparsers(dest="heads_cmd", required=True)
    _add_train_parser(sub)
    _add_calibrate_parser(sub)
    _add_tune_adadecode_parser(sub)
    _add_show_parser(sub)
    _add_train_probe_parser(sub)
    _add_train_predictors_parser(sub)
    _add_train_drafter_parser(sub)
    _add_search_skip_parser(sub)


def _add_train_parser(sub: argparse._SubParsersAction) -> None:
    """``selfspec heads train`` (defaults: :class:`~selfspec.training.train.TrainRequest`)."""
    from selfspec.heads.modules import FULL_INITS, HEAD_KINDS
    from selfspec.training.train import KL_DIRECTIONS, LOSSES, TrainConfig, TrainRequest

    req, cfg = TrainRequest(), TrainConfig()
    t = sub.add_parser("train", help="train exit heads on the frozen model, calibrate, save",
                       description="Train exit heads (DSSD / AdaDecode) with the backbone frozen, "
                                   "calibrate their thresholds and save them (default: the "
                                   "model's default heads, used by --heads default).")
    _add_model_args(t, required=False)
    t.add_argument("--layers", type=_ints, default=req.layers,
                   help="exit layers, e.g. 6,12,18,24 (default: floor(k*L/5), k=1..4, DSSD eq. 1)")
    t.add_argument("--kind", default=cfg.kind, choices=list(HEAD_KINDS))
    t.add_argument("--init", default=cfg.init, choices=list(FULL_INITS),
                   help="full heads: copy lm_head or start at random")
    t.add_argument("--loss", default=cfg.loss, choices=list(LOSSES))
    t.add_argument("--kl-direction", default=cfg.kl_direction, choices=list(KL_DIRECTIONS),
                   help="forward = KL(final || head) (default), reverse = KL(head || final)")
    t.add_argument("--alpha", type=float_arg(0.0, 1.0), default=cfg.alpha,
                   help="CE weight of the hybrid loss")
    t.add_argument("--loss-vocab", type=int_arg(0), default=cfg.loss_vocab, metavar="K",
                   help="compute the KL over the K tokens the model emits most often on the "
                        "training text (plus EOS), renormalised: the rows of --draft-vocab K, "
                        "at K/V of the cost; 0 = the full vocabulary (default, AdaDecode §2.1)")
    t.add_argument("--epochs", type=int_arg(1), default=cfg.epochs)
    t.add_argument("--lr", type=float_arg(0.0, low_open=True), default=cfg.lr,
                   help="peak Adam learning rate")
    t.add_argument("--batch-tokens", type=int_arg(1), default=cfg.batch_tokens)
    _add_compute_dtype_arg(t)
    t.add_argument("--out", default=req.out, help="directory or .safetensors file "
                                                  "(default: $SELFSPEC_HOME/heads/<model>/default)")
    t.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                   default=req.calibrate)
    t.add_argument("--epsilon", type=_floats, default=req.epsilons,
                   help="ε sweep, e.g. 0.5,0.7,0.9")
    t.add_argument("--no-plots", dest="plots", action="store_false",
                   help="skip roc.png / epsilon.png")
    t.add_argument("--draft-vocab", type=_ints, default=req.draft_vocabs,
                   help="also calibrate thresholds on the K most frequent tokens, e.g. 4096 "
                        "(what DSSD with --draft-vocab K uses)")
    _add_data_args(t, req.data)
    t.set_defaults(func=_cmd_train)


def _add_calibrate_parser(sub: argparse._SubParsersAction) -> None:
    """``selfspec heads calibrate`` (defaults:
    :func:`~selfspec.training.calibration.calibrate_file`)."""
    from selfspec.training.calibration import DEFAULT_EPSILONS

    c = sub.add_parser("calibrate", help="calibrate thresholds of a head file (DSSD §3.4.1)")
    c.add_argument("path", help="head file or directory, or 'default'")
    _add_model_args(c, required=False)
    c.add_argument("--epsilon", type=_floats, default=DEFAULT_EPSILONS,
                   help="ε sweep, e.g. 0.5,0.7,0.9")
    c.add_argument("--no-plots", dest="plots", action="store_false",
                   help="skip roc.png / epsilon.png")
    c.add_argument("--draft-vocab", type=_ints, default=None,
                   help="reduced draft-vocabulary sizes K to calibrate too, e.g. 4096 (default: "
                        "those the file was calibrated for before)")
    _add_data_args(c)
    c.set_defaults(func=_cmd_calibrate)


def _add_tune_adadecode_parser(sub: argparse._SubParsersAction) -> None:
    """``selfspec heads tune-adadecode`` (defaults:
    :func:`~selfspec.training.adadecode_tuning.tune_adadecode_file`)."""
    from selfspec.training.adadecode_tuning import DEFAULT_MAX_EARLY, DEFAULT_TUNE_VOCABS

    t = sub.add_parser("tune-adadecode",
                       help="choose AdaDecode's head layers, per-head thresholds and draft "
                            "vocabulary by replaying its schedule on the heads' held-out "
                            "on-policy text (read by adadecode:tuned=true)")
    t.add_argument("path", help="head file or directory, or 'default'")
    _add_model_args(t, required=False)
    t.add_argument("--data", default=None,
                   help="on-policy sources of the heads' training data to replay, e.g. "
                        "onpolicy:humaneval,onpolicy:stdlib for code (default: all of them)")
    t.add_argument("--draft-vocab", type=_ints, default=DEFAULT_TUNE_VOCABS,
                   help="draft-vocabulary sizes to try, 0 = the full vocabulary (default: "
                        f"{','.join(map(str, DEFAULT_TUNE_VOCABS))})")
    t.add_argument("--max-early", type=int_arg(1), default=DEFAULT_MAX_EARLY,
                   help=f"AdaDecode's outstanding early predictions (default {DEFAULT_MAX_EARLY}, "
                        "appendix D)")
    t.set_defaults(func=_cmd_tune_adadecode)


def _add_show_parser(sub: argparse._SubParsersAction) -> None:
    """``selfspec heads show``."""
    from selfspec.heads.calibration import CONFIDENCE_METRICS

    s = sub.add_parser("show", help="print a head file's card (or a skip-set .json file)")
    s.add_argument("path", help="head file or directory, 'default' or a folder name under the "
                                "model's heads (with --model), or a skip-set .json file")
    add_model_argument(s, help="model for 'default' or a folder name "
                               "(default: the registry default)")
    s.add_argument("--metric", default="entropy", choices=list(CONFIDENCE_METRICS))
    s.add_argument("--json", action="store_true", help="print the card as JSON")
    s.set_defaults(func=_cmd_show)


def _add_train_probe_parser(sub: argparse._SubParsersAction) -> None:
    """``selfspec heads train-probe`` (defaults: :class:`~selfspec.training.probe.ProbeRequest`,
    and greedy :class:`~selfspec.decoding.core.sampling.SamplingConfig`)."""
    from selfspec.decoding.core.sampling import SamplingConfig
    from selfspec.training.probe import ProbeRequest

    greedy = SamplingConfig()
    pr = sub.add_parser("train-probe", help="train an AdaSPEED acceptance probe (§II.B)")
    _add_model_args(pr, required=True)
    pr.add_argument("--exit-layer", type=int_arg(1), required=True)
    pr.add_argument("--heads", default=_default(ProbeRequest, "heads"),
                    help="head file whose head at the exit layer drafts (the probe is saved "
                         "into it; --method adaspeed-probe --heads PATH reads it); default: "
                         "lm_head drafting, saved under <model>/probes/, which --method "
                         "adaspeed-probe without --heads reads")
    pr.add_argument("--out", default=_default(ProbeRequest, "out"),
                    help="where to save an lm_head probe")
    pr.add_argument("--temperature", type=float_arg(0.0), default=greedy.temperature,
                    help="0 = a probe for greedy decoding (default); > 0 = a probe for sampled "
                         "decoding, trained on the expected acceptance of speculative sampling "
                         "at this temperature and --top-p (AdaSPEED Table I's top-p rows)")
    pr.add_argument("--top-p", type=float_arg(0.0, 1.0, low_open=True), default=greedy.top_p,
                    help="nucleus mass of a sampled probe")
    _add_data_args(pr, _default(ProbeRequest, "data"))
    pr.set_defaults(func=_cmd_train_probe)


def _add_train_predictors_parser(sub: argparse._SubParsersAction) -> None:
    """``selfspec heads train-predictors`` (defaults:
    :class:`~selfspec.training.predictors.PredictorRequest`)."""
    from selfspec.decoding.specee.step import CANDIDATE_SOURCES
    from selfspec.training.predictors import PredictorRequest, PredictorTrainConfig

    req = PredictorRequest()
    pp = sub.add_parser("train-predictors",
                        help="train SpecEE's per-layer exit predictors (§4) and rank the offline "
                             "layer schedule (§5) on held-out text")
    _add_model_args(pp, required=True)
    pp.add_argument("--heads", default=req.heads,
                    help="head file whose head drafts the candidates; the predictors are saved "
                         f"into it (default: '{req.heads}', the model's default heads)")
    pp.add_argument("--candidate-layer", type=int_arg(1), default=req.candidate_layer,
                    help="exit layer of the candidate head (default: the deepest head in the "
                         "first half of the layers, else the shallowest); with drafter "
                         "candidates, the first predictor layer (default: L // 8)")
    pp.add_argument("--k", type=int_arg(1), default=req.num_candidates,
                    help="speculative tokens per step (4 in the paper)")
    pp.add_argument("--draft-vocab", type=int_arg(0), default=req.draft_vocab,
                    help="candidates = the head's top-k over the K most frequent tokens (0 = full "
                         "vocabulary)")
    pp.add_argument("--offline", type=int_arg(1), default=req.offline,
                    help="offline layer-set size (default round(L/4), as SpecEE's 8 of 32)")
    pp.add_argument("--candidates", choices=list(CANDIDATE_SOURCES), default=req.candidates,
                    help="head = the candidate head's top-k; drafter = the file's next-token "
                         "drafter's top-k (`selfspec heads train-drafter`; candidates before "
                         "layer 0); +ngram = the prompt-lookup token replaces the k-th when it "
                         "is not among them")
    pp.add_argument("--state", action="store_true", default=req.config.state,
                    help="predictors that also read the layer's state (MLP 3k+H→128→1; not in "
                         "the paper): ~1.5 layers per token fewer at equal held-out accuracy "
                         "on ~60k training positions, no better on a few thousand")
    pp.add_argument("--head-lens", action="store_true", default=req.head_lens,
                    help="at layers with a lightweight exit head, the features read the "
                         "candidates through that head (its tuned lens) instead of the final "
                         "norm + lm_head (not in the paper)")
    pp.add_argument("--include-head-train", action="store_true", default=req.include_head_train,
                    help="train on the prompts the heads/drafter trained on too (more data; "
                         "held-out figures stay on the test split)")
    pp.add_argument("--epochs", type=int_arg(1), default=None,
                    help=f"default {PredictorTrainConfig().epochs} "
                         f"({PredictorTrainConfig.state_reading().epochs} with --state)")
    pp.add_argument("--row-cost", type=_row_cost_arg, default=req.row_cost,
                    help="for the thresholds tuned by replay (specee:verify=true,tuned=true): "
                         "cost of one more position in a decoder-layer call, as a share of "
                         "one position's; default 'auto': this machine's, from its measured "
                         "forwards of 2-4 tokens (`selfspec models latency`, measured once "
                         "and kept: run it on a quiet machine)")
    pp.add_argument("--output-cost", type=_output_cost_arg, default=req.output_cost,
                    help="for the same replay: the output layer's cost in decoder-layer "
                         f"calls; default '{req.output_cost}': this machine's, from the same "
                         "latency model (4.8-6.1 on Qwen2.5-Coder-0.5B where its bytes say 9.1); "
                         "'bytes': its weight bytes over a decoder layer's; or a number > 0")
    _add_data_args(pp, req.data)
    pp.set_defaults(func=_cmd_train_predictors)


def _add_train_drafter_parser(sub: argparse._SubParsersAction) -> None:
    """``selfspec heads train-drafter`` (defaults:
    :class:`~selfspec.training.drafter.DrafterRequest`, its ``DrafterTrainConfig``)."""
    from selfspec.training.drafter import DrafterRequest, DrafterTrainConfig

    req, cfg = DrafterRequest(), DrafterTrainConfig()
    dr = sub.add_parser("train-drafter",
                        help="train SpecEE's next-token drafter (EAGLE-style, on the model's "
                             "last hidden state) into a head file, for specee's drafter "
                             "candidates")
    dr.add_argument("path", help="head file or directory, or 'default'")
    _add_model_args(dr, required=False)
    dr.add_argument("--draft-vocab", type=int_arg(0), default=req.draft_vocab,
                    help="train and score over the K most frequent tokens (0 = full vocabulary)")
    dr.add_argument("--epochs", type=int_arg(1), default=cfg.epochs)
    dr.add_argument("--exit-mix", type=float_arg(0.0, 1.0, high_open=True), default=None,
                    help="share of the main drafter's training inputs taken at an upper-half "
                         "exit layer instead of the last (default 0 with an exit-state drafter, "
                         f"which drafts after an exit, else {cfg.exit_mix:g})")
    dr.add_argument("--exit-state-layers", type=_exit_state_layers, default=req.exit_state_layers,
                    help="also train an exit-state drafter, which drafts after an exited token "
                         "from its exit-layer state, on the states at these layers, e.g. "
                         "3,6,9,12,15,18,21, or 'auto': every L//8-th layer from L//8 (default "
                         "'none'). Run train-predictors after it: their thresholds are tuned "
                         "on the candidates it drafts (0.5B model, HumanEval: 1.30x ar "
                         "against 1.26x without it; docs/results/specee)")
    dr.add_argument("--exit-state-only", action="store_true", default=req.exit_state_only,
                    help="keep the file's drafter (and the predictors trained on its "
                         "candidates) and add only an exit-state drafter")
    _add_compute_dtype_arg(dr)
    _add_data_args(dr)
    dr.set_defaults(func=_cmd_train_drafter)


def _add_search_skip_parser(sub: argparse._SubParsersAction) -> None:
    """``selfspec heads search-skip`` (SWIFT's offline skip-set search)."""
    from selfspec.training.skip_search import SkipSearchRequest
    from selfspec.training.skip_set_search import SearchSettings

    req, cfg = SkipSearchRequest(), SearchSettings()
    k = sub.add_parser(
        "search-skip", help="search the sub-layer skip set of --method swift (SWIFT §3)",
        description="Search a fixed set of attention/MLP sub-layers to skip while drafting "
                    "(SWIFT): random skip sets of --skip-ratio of the sub-layers, then swaps "
                    "of one skipped and one kept sub-layer, keeping the set whose greedy "
                    "tokens most often equal the full model's (matchness) on the model's own "
                    "continuations of calibration prompts. Saves a small JSON file (default: "
                    "$SELFSPEC_HOME/heads/<model>/swift-skip.json, what --method swift reads).")
    _add_model_args(k, required=False)
    g = k.add_argument_group("calibration text")
    g.add_argument("--data", default=req.data,
                   help="comma-separated datasets whose calibration-split prompts are used "
                        f"(default: {req.data}; the file records every prompt used, "
                        "and selfspec bench drops those prompts from its runs)")
    g.add_argument("--prompts", type=int_arg(1), default=req.prompts, help="calibration prompts")
    g.add_argument("--max-new-tokens", type=int_arg(1), default=req.max_new_tokens,
                   help="greedy continuation per prompt: the scored positions")
    g.add_argument("--window", type=int_arg(1), default=req.window,
                   help="positions scored per read-only window (the draft length mirrored)")
    s = k.add_argument_group("search")
    s.add_argument("--skip-ratio", type=float_arg(0.0, 1.0, low_open=True, high_open=True),
                   default=cfg.skip_ratio,
                   help="share of the sub-layers skipped (first and last layer always kept)")
    s.add_argument("--trials", type=int_arg(1), default=cfg.trials, help="random skip sets first")
    s.add_argument("--refine-steps", type=int_arg(0), default=cfg.refine_steps,
                   help="stop the local search after this many swaps in a row without a gain")
    s.add_argument("--max-evaluations", type=int_arg(1), default=cfg.max_evaluations,
                   help="skip sets scored in all")
    s.add_argument("--seed", type=int_arg(SEED_MIN, SEED_MAX), default=cfg.seed)
    k.add_argument("--out", default=req.out,
                   help=".json file or directory "
                        "(default: $SELFSPEC_HOME/heads/<model>/swift-skip.json)")
    k.set_defaults(func=_cmd_search_skip)


# ------------------------------------------------------------------------------ helpers
def _load_engine(args: argparse.Namespace, model: str | None, dtype: str | None):
    import torch

    import selfspec

    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    return selfspec.load(model, dtype=dtype or "bf16", show_progress=not args.quiet,
                         device=getattr(args, "device", "auto"),
                         cuda_graphs=getattr(args, "cuda_graphs", "auto"))


def _data_request(args: argparse.Namespace, default):
    """``default`` (a :class:`~selfspec.training.pipeline.DataRequest`) with ``--data``,
    ``--tokens``, ``--max-new-tokens`` and ``--seed`` applied.

    Raises:
        InvalidArgumentError: ``--tokens`` below 1; DatasetNotInstalledError: a dataset's
            package is missing (both before seconds are spent loading the model).
    """
    from selfspec.data.packages import require_dataset
    from selfspec.training.corpus import dataset_of, parse_data_spec

    if args.tokens is not None and args.tokens < 1:
        raise InvalidArgumentError(f"--tokens must be >= 1, got {args.tokens}")
    data = args.data or default.data
    for source in parse_data_spec(data):
        require_dataset(dataset_of(source))
    return dataclasses.replace(default, data=data, tokens=args.tokens or default.tokens,
                               max_new_tokens=args.max_new_tokens, seed=args.seed)


def _card_data_request(args: argparse.Namespace, card):
    """``None`` (the corpus the heads were trained on, the same held-out problems) unless
    ``--data`` or ``--tokens`` is given; then :func:`_data_request` over the card's data and
    token count."""
    from selfspec.training.pipeline import DataRequest

    if not (args.data or args.tokens):
        return None
    info, default = card.training, DataRequest()
    if info is not None:
        default = dataclasses.replace(default, data=",".join(info.data),
                                      tokens=info.requested_tokens or info.train_tokens)
    return _data_request(args, default)


_ROW_COST_NUMBER = float_arg(0.0, 1.0)


def _row_cost_arg(text: str) -> float | None:
    """``--row-cost``: ``auto`` (``None``: this machine's) or a number in [0, 1]."""
    return None if text.strip().lower() == "auto" else _ROW_COST_NUMBER(text)


_OUTPUT_COST_NUMBER = float_arg(0.0, None, low_open=True)


def _output_cost_arg(text: str) -> float | str:
    """``--output-cost``: ``auto``, ``bytes`` or a number > 0."""
    word = text.strip().lower()
    return word if word in ("auto", "bytes") else _OUTPUT_COST_NUMBER(text)


def _source(source: str) -> str:
    return f" ({source})" if source else ""


def _f(x: float, digits: int = 3) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _print_card(card, metric: str = "entropy", out=None) -> None:
    out = out or sys.stdout  # looked up per call (tests and callers may swap sys.stdout)
    print(f"model {card.model} (fingerprint {card.fingerprint.short()}), {card.num_layers} layers, "
          f"d={card.hidden_size}, V={card.vocab_size}", file=out)
    if card.kind:
        print(f"{card.kind} heads at layers {card.layers}", file=out)
    tr = card.training
    if tr:
        print(f"trained: loss {tr.loss}"
              + (f" ({tr.kl_direction}; {tr.loss_vocabulary()})" if tr.loss != "ce" else "")
              + f", data {','.join(tr.data)}, {tr.train_tokens} train / {tr.eval_tokens} held-out "
              f"tokens, {tr.epochs} epochs, lr {tr.lr:g}, {tr.compute_dtype} matmuls on "
              f"{tr.feature_dtype} features, {tr.seconds:.0f} s", file=out)
        if tr.cpu:
            print(f"trained on: {tr.cpu}", file=out)
    if card.heads:
        print("\nlayer  agreement before → after   KL before → after   conf>0.8: share @ agreement",
              file=out)
        for h in card.heads:
            print(f"{h.layer:5d}  {_f(h.agreement_before):>16} → {_f(h.agreement_after):5}   "
                  f"{_f(h.kl_before, 2):>9} → {_f(h.kl_after, 2):5}   "
                  f"{_f(h.confident_fraction, 2)} @ {_f(h.confident_agreement)}", file=out)
    if card.calibration:
        metrics = card.calibration_metrics
        print("\ncalibration (held-out problems)   ROC AUC cal / test", file=out)
        print("layer  tokens  accuracy  " + "  ".join(f"{m:>15}" for m in metrics), file=out)
        for c in card.calibration:
            aucs = "  ".join(f"{_f(c.metric(m).auc):>7}/{_f(c.metric(m).test_auc):<7}"
                             for m in metrics)
            print(f"{c.layer:5d}  {c.tokens:6d}  {_f(c.accuracy):>8}  {aucs}", file=out)
        print(f"\nthresholds τ_k(ε), metric {metric} (exit when confidence >= τ; entropy: "
              "confidence = -H in nats)", file=out)
        print("layer  " + "  ".join(f"{'ε=' + format(e, 'g'):>24}"
                                     for e in card.calibration_epsilons
                                     if _shown(e, card.calibration_epsilons)), file=out)
        for c in card.calibration:
            m = c.metric(metric)
            if m is None:
                continue
            cells = [f"τ={_f(r.value):>6} cov {_f(r.coverage, 2)} test {_f(r.test_precision, 2)}"
                     for r in m.thresholds if _shown(r.epsilon, card.calibration_epsilons)]
            print(f"{c.layer:5d}  " + "  ".join(f"{x:>24}" for x in cells), file=out)
    if card.calibration_draft_vocabs:
        print("\nthresholds also calibrated on reduced draft vocabularies of K = "
              + ", ".join(map(str, card.calibration_draft_vocabs)) + " tokens", file=out)
    for p in card.probes:
        if p.mode == "greedy":
            quality = f"accuracy {_f(p.accuracy)} (base rate {_f(p.base_rate)})"
        else:
            quality = (f"sampled decoding (temperature {p.temperature:g}, top-p {p.top_p:g}): "
                       f"mean abs. error {_f(p.accuracy)} (mean expected acceptance "
                       f"{_f(p.base_rate)})")
        print(f"\nprobe at layer {p.exit_layer} ({p.draft_head} drafts): {quality}, AUC "
              f"{_f(p.auc)} vs max-prob AUC {_f(p.max_prob_auc)}, BCE {_f(p.bce)}, "
              f"{p.train_tokens} train / {p.eval_tokens} held-out tokens, {p.seconds:.1f} s",
              file=out)
    _print_drafter(card, out=out)
    _print_predictors(card, out=out)
    _print_adadecode(card.adadecode, card.num_layers, out=out)
    _print_prompts(card, out)


def _print_prompts(card, out) -> None:
    """Which prompts each stage saw (what ``selfspec bench`` holds out)."""
    by_use: dict[str, list[str]] = {}
    for u in card.prompts:
        by_use.setdefault(u.use, []).append(f"{u.dataset} {len(u.ids)}")
    print("\nprompts seen (selfspec bench drops train/calibration/probe-train/predictor prompts):",
          file=out)
    for use, parts in by_use.items():
        print(f"  {use:12s} " + ", ".join(parts), file=out)


def _shown(eps: float, all_eps: list[float]) -> bool:
    return len(all_eps) <= 6 or any(abs(eps - e) < 1e-9 for e in _EPS_SHOWN)


def _plots(args: argparse.Namespace, heads, path: Path) -> list[Path]:
    from selfspec.extras import BENCH_INSTALL, is_installed
    from selfspec.training.plots import plot_epsilon_sweep, plot_roc

    if not args.plots or not heads.calibration:
        return []
    if not is_installed("matplotlib"):  # plots are optional, the card is not
        print(f"no plots: matplotlib is not installed; install it with: {BENCH_INSTALL} "
              "(or pass --no-plots)", file=sys.stderr)
        return []
    return [plot_roc(heads, path.parent / "roc.png"),
            plot_epsilon_sweep(heads, path.parent / "epsilon.png")]


def _print_times(times) -> None:
    parts = [f"{name[:-2]} {getattr(times, name):.0f} s" for name in
             ("corpus_s", "features_s", "train_s", "calibrate_s", "probe_s", "predictors_s")
             if getattr(times, name)]
    print("wall time: " + ", ".join(parts))


def _add_compute_dtype_arg(parser: argparse.ArgumentParser) -> None:
    """``--compute-dtype``: ``auto`` (resolved for this CPU by :func:`_compute_dtype`) or one
    of :data:`~selfspec.training.train.COMPUTE_DTYPES`."""
    from selfspec.training.train import COMPUTE_DTYPES

    parser.add_argument("--compute-dtype", default="auto", choices=["auto", *COMPUTE_DTYPES],
                        help="dtype of the training matmuls (parameters stay fp32); auto = bf16 "
                             "on a CPU with native bf16 (avx512_bf16/AMX), else fp32 (emulated "
                             "bf16 matmuls are 5-8x slower)")


def _compute_dtype(args: argparse.Namespace) -> str:
    """``--compute-dtype``, with ``auto`` resolved for this CPU."""
    from selfspec.executor.cpu import fast_matmul_dtype

    return fast_matmul_dtype() if args.compute_dtype == "auto" else args.compute_dtype


# ----------------------------------------------------------------------------- commands
def _cmd_train(args: argparse.Namespace) -> int:
    from selfspec.training.train import TrainConfig, TrainRequest, train

    config = TrainConfig(kind=args.kind, init=args.init, loss=args.loss,
                         kl_direction=args.kl_direction, alpha=args.alpha, epochs=args.epochs,
                         lr=args.lr, batch_tokens=args.batch_tokens,
                         compute_dtype=_compute_dtype(args),
                         seed=args.seed, loss_vocab=args.loss_vocab)
    request = TrainRequest(layers=args.layers, train=config,
                           data=_data_request(args, TrainRequest().data), out=args.out,
                           calibrate=args.calibrate,
                           epsilons=args.epsilon or TrainRequest().epsilons,
                           draft_vocabs=tuple(args.draft_vocab))
    engine = _load_engine(args, args.model, args.dtype)
    outcome = train(engine, request, progress=not args.quiet)
    return _report(args, outcome)


def _report(args: argparse.Namespace, outcome) -> int:
    """Print a trained or calibrated file's card, plots, step times and path."""
    _print_card(outcome.heads.card)
    for plot in _plots(args, outcome.heads, outcome.path):
        print(f"plot: {plot}")
    _print_times(outcome.times)
    print(f"saved {outcome.path}")
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from selfspec.heads.files import read_head_file
    from selfspec.models.registry import DEFAULT_MODEL
    from selfspec.training.calibration import DEFAULT_EPSILONS, calibrate_file

    head_file = read_head_file(args.path, args.model or DEFAULT_MODEL)
    path, card = head_file.path, head_file.card
    dtype = args.dtype or (card.training.feature_dtype if card.training else None)
    engine = _load_engine(args, args.model or card.model, dtype)
    request = _card_data_request(args, card)
    outcome = calibrate_file(engine, str(path), request, epsilons=args.epsilon or DEFAULT_EPSILONS,
                             progress=not args.quiet, draft_vocabs=args.draft_vocab)
    return _report(args, outcome)


def _cmd_tune_adadecode(args: argparse.Namespace) -> int:
    from selfspec.heads.files import read_head_file
    from selfspec.models.registry import DEFAULT_MODEL
    from selfspec.training.adadecode_tuning import DEFAULT_TUNE_VOCABS, tune_adadecode_file
    from selfspec.training.corpus import parse_data_spec

    sources = parse_data_spec(args.data) if args.data else None  # refused before loading
    head_file = read_head_file(args.path, args.model or DEFAULT_MODEL)
    path, card = head_file.path, head_file.card
    dtype = args.dtype or (card.training.feature_dtype if card.training else None)
    engine = _load_engine(args, args.model or card.model, dtype)
    outcome = tune_adadecode_file(engine, str(path), sources,
                                  args.draft_vocab or DEFAULT_TUNE_VOCABS, args.max_early,
                                  progress=not args.quiet)
    print(outcome.path)
    _print_adadecode(outcome.card, card.num_layers)
    print(f"({outcome.seconds:.0f} s; use it with --method adadecode:tuned=true)")
    return 0


def _print_adadecode(ac, num_layers: int, out=None) -> None:
    if ac is None:
        return
    vocab = f"the {ac.draft_vocab} most frequent tokens" if ac.draft_vocab else "every token"
    print(f"\nAdaDecode tuned by replay on {', '.join(ac.data)} (heads score {vocab}; at most "
          f"{ac.max_early} early predictions): "
          + ", ".join(f"layer {layer} γ {g:g}"
                      for layer, g in zip(ac.layers, ac.gammas, strict=False)),
          file=out)
    print(f"replayed speedup over autoregressive decoding: calibration {_f(ac.speedup)} "
          f"({ac.tokens} tokens, acceptance {_f(ac.acceptance)}, "
          f"{_f(ac.drafts_per_token)} early predictions / token); test {_f(ac.test_speedup)} "
          f"({ac.test_tokens} tokens, acceptance {_f(ac.test_acceptance)}); the paper's "
          f"γ 0.75 at every head on the test text: {_f(ac.paper_test_speedup)}", file=out)
    print(f"cost model (single-position layer calls of {num_layers}): one more position "
          f"{ac.row_cost:g}, head check {ac.head_cost:.3f}, output layer {ac.output_cost:.2f}; "
          "best per draft vocabulary: " + ", ".join(
              f"{k or 'all'} {_f(v)}"
              for k, v in zip(ac.draft_vocabs, ac.vocab_speedups, strict=False)),
          file=out)


def _cmd_show(args: argparse.Namespace) -> int:
    import json

    from selfspec.heads.files import read_head_file
    from selfspec.models.registry import DEFAULT_MODEL

    if args.path.endswith(".json"):  # a skip-set file (selfspec heads search-skip)
        from selfspec.heads.skip_set import read_skip_set

        skip_set = read_skip_set(args.path)
        if args.json:
            print(json.dumps(skip_set.to_dict(), indent=1))
        else:
            print(args.path)
            _print_skip_set(skip_set)
        return 0
    head_file = read_head_file(args.path, args.model or DEFAULT_MODEL)
    path, card = head_file.path, head_file.card
    if args.json:
        print(json.dumps(card.to_dict(), indent=1))
    else:
        print(f"{path}")
        _print_card(card, args.metric)
    return 0


def _cmd_search_skip(args: argparse.Namespace) -> int:
    from selfspec.training.skip_search import (
        SkipSearchRequest,
        check_request,
        search_skip,
    )
    from selfspec.training.skip_set_search import SearchSettings

    settings = SearchSettings(skip_ratio=args.skip_ratio, trials=args.trials,
                              refine_steps=args.refine_steps,
                              max_evaluations=args.max_evaluations, seed=args.seed)
    request = SkipSearchRequest(data=args.data, prompts=args.prompts,
                                max_new_tokens=args.max_new_tokens, window=args.window,
                                settings=settings, out=args.out)
    check_request(request)  # bad options and missing dataset packages: before the model
    engine = _load_engine(args, args.model, args.dtype)
    outcome = search_skip(engine, request, progress=not args.quiet)
    _print_skip_set(outcome.skip_set)
    result = outcome.result
    print(f"{len(result.evaluations)} skip sets scored on {outcome.calibration_tokens} "
          f"positions in {result.seconds:.0f} s (+ {outcome.prepare_s:.0f} s of continuations "
          "and full-model passes)"
          + ("; the best is a local optimum (no swap improves it)" if result.local_optimum else ""))
    print(f"saved {outcome.path}")
    return 0


def _print_skip_set(skip_set, out=None) -> None:
    """A skip-set file's contents (``search-skip``, ``show FILE.json``)."""
    out = out or sys.stdout
    card, plan = skip_set.card, skip_set.plan
    print(f"model {card.model} (fingerprint {card.fingerprint.short()}), {card.num_layers} "
          f"layers, searched in {card.dtype}", file=out)
    skipped = len(plan.skip_attention) + len(plan.skip_mlp)
    print(f"skip set: {skipped} of {2 * card.num_layers} sub-layers, matchness "
          f"{_f(card.score)} on the calibration text", file=out)
    print(f"  attention skipped in layers {sorted(plan.skip_attention)}", file=out)
    print(f"  MLP skipped in layers       {sorted(plan.skip_mlp)}", file=out)
    _print_prompts(card, out)


def _cmd_train_predictors(args: argparse.Namespace) -> int:
    from selfspec.training.predictors import (
        PredictorRequest,
        PredictorTrainConfig,
        train_predictors,
    )

    if args.epochs is not None and args.epochs < 1:
        raise InvalidArgumentError(f"--epochs must be >= 1, got {args.epochs}")
    data = _data_request(args, PredictorRequest().data)
    make = PredictorTrainConfig.state_reading if args.state else PredictorTrainConfig
    config = make(**({} if args.epochs is None else {"epochs": args.epochs}))
    request = PredictorRequest(heads=args.heads, candidate_layer=args.candidate_layer,
                               num_candidates=args.k, draft_vocab=args.draft_vocab,
                               offline=args.offline, candidates=args.candidates, data=data,
                               config=config, include_head_train=args.include_head_train,
                               head_lens=args.head_lens, row_cost=args.row_cost,
                               output_cost=args.output_cost)
    engine = _load_engine(args, args.model, args.dtype)
    outcome = train_predictors(engine, request, progress=not args.quiet)
    _print_predictors(outcome.heads.card)
    _print_times(outcome.times)
    print(f"saved {outcome.path}")
    return 0


def _cmd_train_drafter(args: argparse.Namespace) -> int:
    from selfspec.heads.files import read_head_file
    from selfspec.models.registry import DEFAULT_MODEL
    from selfspec.training.drafter import DrafterRequest, DrafterTrainConfig, train_drafter

    exit_mix = args.exit_mix
    if exit_mix is None:  # the exit-state drafter reads the exit states
        exit_mix = 0.0 if args.exit_state_layers != () else DrafterTrainConfig().exit_mix
    config = DrafterTrainConfig(epochs=args.epochs, exit_mix=exit_mix,
                                compute_dtype=_compute_dtype(args))
    head_file = read_head_file(args.path, args.model or DEFAULT_MODEL)
    path, card = head_file.path, head_file.card
    data = _card_data_request(args, card)
    dtype = args.dtype or (card.training.feature_dtype if card.training else None)
    engine = _load_engine(args, args.model or card.model, dtype)
    outcome = train_drafter(engine, DrafterRequest(str(path), args.draft_vocab, data, config,
                                                   args.exit_state_layers, args.exit_state_only),
                            progress=not args.quiet)
    _print_drafter(outcome.heads.card)
    _print_times(outcome.times)
    print(f"saved {outcome.path}")
    return 0


def _print_drafter(card, out=None) -> None:
    dc = card.drafter
    if dc is None:
        return
    vocab = f"the {dc.draft_vocab} most frequent tokens" if dc.draft_vocab else "every token"
    print(f"\nSpecEE drafter (last hidden state + token embedding → next token, over {vocab}): "
          f"{dc.train_tokens} train positions, {dc.epochs} epochs, {dc.seconds:.0f} s, "
          f"{dc.exit_mix:.0%} of inputs from layers {dc.exit_layers}; held-out ({dc.eval_tokens} "
          f"positions): top-1 {_f(dc.top1)}, top-{dc.k} {_f(dc.topk)}", file=out)
    if dc.exit_state_layers:
        print(f"exit-state drafter (drafts after an exited token, from its exit-layer state), "
              f"trained on states at layers {dc.exit_state_layers}"
              + ("" if math.isnan(dc.exit_state_seconds) else f" ({dc.exit_state_seconds:.0f} s)")
              + f": held-out top-{dc.k} from "
              f"those states {_f(dc.exit_state_topk)} (the main drafter's: "
              f"{_f(dc.exit_state_topk_main)})", file=out)


def _print_predictors(card, out=None) -> None:
    pc = card.predictors
    if pc is None:
        return
    vocab = f"top-{pc.num_candidates} of {pc.draft_vocab} tokens" if pc.draft_vocab else \
        f"top-{pc.num_candidates} of the full vocabulary"
    if pc.candidates.endswith("+ngram"):
        vocab += " (prompt lookup's token in the last slot when missing)"
    source = ("the drafter's" if pc.candidates.startswith("drafter")
              else f"the layer-{pc.candidate_layer} head's")
    print(f"\nSpecEE predictors: candidates = {source} {vocab}; "
          f"MLP {3 * pc.num_candidates}{f'+{pc.state_dim} (the state)' if pc.state_dim else ''}"
          f"→{pc.hidden}→1 at layers {pc.layers[0]}..{pc.layers[-1]}; "
          f"{pc.train_tokens} train / {pc.eval_tokens} held-out tokens, {pc.epochs} epochs, "
          f"{pc.seconds:.0f} s", file=out)
    print(f"candidate recall (final token among the candidates): {pc.candidate_recall:.3f}",
          file=out)
    print("layer  label rate  accuracy  precision  exit share", file=out)
    for i, layer in enumerate(pc.layers):
        print(f"{layer:5d}  {_f(pc.base_rate[i]):>10}  {_f(pc.accuracy[i]):>8}  "
              f"{_f(pc.precision[i]):>9}  {_f(pc.exit_frequency[i]):>10}", file=out)
    if pc.lens_layers:
        print(f"head lens (features read through the exit head) at layers {pc.lens_layers}",
              file=out)
    print(f"offline schedule (most frequent exits first): {pc.offline_layers}", file=out)
    if pc.thresholds:
        print("held-out, every predictor active: threshold → token accuracy, mean layers of "
              f"{card.num_layers}", file=out)
        for t, acc, layers in zip(pc.thresholds, pc.token_accuracy, pc.mean_layers, strict=False):
            print(f"  {t:.3f} → {_f(acc)}, {_f(layers, 2)}", file=out)
    tu = pc.tuning
    if tu is not None:
        print(f"verified SpecEE tuned by replay on {', '.join(tu.data)} (at most "
              f"{tu.max_early} exited tokens outstanding; specee:verify=true,tuned=true): "
              + ", ".join(f"layer {x} {t:g}"
                          for x, t in zip(tu.layers, tu.thresholds, strict=False)),
              file=out)
        print(f"replayed speedup over autoregressive decoding: tuning half {_f(tu.speedup)} "
              f"({tu.tokens} tokens, acceptance {_f(tu.acceptance)}, "
              f"{_f(tu.drafts_per_token)} exits / token); check half {_f(tu.check_speedup)} "
              f"({tu.check_tokens} tokens, acceptance {_f(tu.check_acceptance)}); the best "
              f"single threshold {tu.single_threshold:g} there: {_f(tu.single_check_speedup)}; "
              f"perfect predictors there (every layer, exiting exactly where the top "
              f"candidate is the final token): {_f(tu.ceiling_check_speedup)}", file=out)
        if tu.inner_layers:
            print(f"inside a draft replayed with the {tu.inner_drafter} drafter's candidates "
                  f"from the previous position's exit-layer state (exit layers "
                  f"{', '.join(map(str, tu.inner_layers))}, the nearest for the others)",
                  file=out)
        else:
            print("inside a draft replayed as at a draft's start (last-layer states)", file=out)
        print(f"cost model (single-position layer calls of {card.num_layers}): one more "
              f"position {tu.row_cost:.3g}{_source(tu.row_cost_source)}, "
              f"drafter {tu.scan_cost:.3f}, output layer "
              f"{tu.output_cost:.2f}{_source(tu.output_cost_source)}, predictor checks "
              f"{min(tu.check_costs, default=0):.4f}-{max(tu.check_costs, default=0):.4f}",
              file=out)


def _cmd_train_probe(args: argparse.Namespace) -> int:
    from selfspec.decoding.core.sampling import SamplingConfig
    from selfspec.training.probe import ProbeRequest, train_probe

    sampling, greedy = None, SamplingConfig()
    if args.temperature != greedy.temperature or args.top_p != greedy.top_p:
        if args.temperature <= 0:
            raise InvalidArgumentError("--top-p needs --temperature > 0 (a sampled probe)")
        sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p)
    request = ProbeRequest(exit_layer=args.exit_layer, heads=args.heads, out=args.out,
                           data=_data_request(args, _default(ProbeRequest, "data")),
                           sampling=sampling)
    engine = _load_engine(args, args.model, args.dtype)
    outcome = train_probe(engine, request, progress=not args.quiet)
    _print_card(outcome.heads.card)
    _print_times(outcome.times)
    print(f"saved {outcome.path}")
    return 0
