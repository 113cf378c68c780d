"""Try bad inputs against the CLI and API; classify each outcome.

clear   = SelfSpecError / argparse usage error (one line, rc != 0)
trace   = uncaught exception (raw traceback)
silent  = accepted without an error although the input is bad
"""
import io, os, subprocess, sys, json, contextlib, traceback
import torch
import selfspec
from selfspec.errors import SelfSpecError

MODEL = os.environ.get("HOSTILE_MODEL", "smollm2-135m-instruct")
rows = []

def cli(label, args, env=None):
    cmd = [sys.executable, "-m", "selfspec.cli"] + args
    p = subprocess.run(cmd, capture_output=True, env={**os.environ, **(env or {})})
    err = p.stderr.decode(errors="replace").strip().splitlines()
    tb = any("Traceback" in l for l in err)
    if p.returncode == 0:
        kind = "silent"
    elif tb:
        kind = "trace"
    else:
        kind = "clear"
    rows.append((label, kind, p.returncode, (err[-1] if err else "")[:150]))

engine = selfspec.load(MODEL, dtype="bf16", show_progress=False)

def api(label, fn):
    try:
        fn()
        kind, msg = "silent", "accepted"
    except SelfSpecError as e:
        kind, msg = "clear", f"{type(e).__name__}: {e}"
    except Exception as e:
        kind, msg = "trace", f"{type(e).__name__}: {e}"
    rows.append((label, kind, "-", msg[:150]))

g = lambda p, **k: engine.generate(p, max_new_tokens=k.pop("max_new_tokens", 2), **k)
V = engine.executor.vocab_size
api("api float tensor prompt", lambda: g(torch.tensor([1.5, 2.0])))
api("api ids >= vocab", lambda: g([1, V + 5]))
api("api negative id", lambda: g([1, -3]))
api("api None prompt", lambda: g(None))
api("api int prompt", lambda: g(5))
api("api bytes prompt", lambda: g(b"hello"))
api("api [2,T] tensor", lambda: g(torch.tensor([[1, 2], [3, 4]])))
api("api [1,1,T] tensor", lambda: g(torch.tensor([[[1, 2]]])))
api("api bool list prompt", lambda: g([True, False]))
api("api float list prompt", lambda: g([1.0, 2.5]))
api("api str with lone surrogate", lambda: g("abc\udcff"))
api("api max_new_tokens=2.5", lambda: g("hi", max_new_tokens=2.5))
api("api max_new_tokens='3'", lambda: g("hi", max_new_tokens="3"))
api("api max_new_tokens=True", lambda: g("hi", max_new_tokens=True))
api("api temperature='0.5'", lambda: g("hi", temperature="0.5"))
api("api temperature=inf", lambda: g("hi", temperature=float("inf")))
api("api temperature=1e-45", lambda: g("hi", temperature=1e-45, seed=1))
api("api top_k=2.5", lambda: g("hi", temperature=1.0, top_k=2.5))
api("api top_k=True", lambda: g("hi", temperature=1.0, top_k=True))
api("api seed=2**70", lambda: g("hi", temperature=1.0, seed=2**70))
api("api seed='x'", lambda: g("hi", temperature=1.0, seed="x"))
api("api seed=1.5", lambda: g("hi", temperature=1.0, seed=1.5))
api("api exit_layer=True", lambda: g("hi", method="layerskip", exit_layer=True))
api("api stop=5", lambda: g("hi", stop=5))
api("api stop=[None]", lambda: g("hi", stop=[None]))
api("api chat='yes'", lambda: g("hi", chat="yes"))
api("api method=None", lambda: g("hi", method=None))
api("api method=5", lambda: g("hi", method=5))
api("api unknown method", lambda: g("hi", method="nope"))
api("api dtype='int8' load", lambda: selfspec.load(MODEL, dtype="int8"))
api("api load(5)", lambda: selfspec.load(5))
api("api heads default exit_layer=20 (no head)", lambda: g("hi", method="layerskip", heads="default", exit_layer=20))
api("api heads=model.safetensors", lambda: g("hi", method="layerskip", heads=str(engine_path / "model.safetensors"))) if (engine_path := __import__("selfspec.models.provision", fromlist=["x"]).entry_dir(MODEL, "bf16")) else None
api("api very long prompt", lambda: g("hello " * 10000))

cli("cli invalid utf-8 prompt", ["generate", "--max-new-tokens", "2", os.fsdecode(b"abc\xff\xfe")])
cli("cli --threads -2", ["generate", "--max-new-tokens", "2", "--threads", "-2", "hi"])
cli("cli --threads 0", ["generate", "--max-new-tokens", "2", "--threads", "0", "hi"])
cli("cli --seed 2**70", ["generate", "--max-new-tokens", "2", "--temperature", "1", "--seed", str(2**70), "hi"])
cli("cli --temperature 1e-45", ["generate", "--max-new-tokens", "2", "--temperature", "1e-45", "hi"])
cli("cli --temperature inf", ["generate", "--max-new-tokens", "2", "--temperature", "inf", "hi"])
cli("cli --temperature nan", ["generate", "--max-new-tokens", "2", "--temperature", "nan", "hi"])
cli("cli --top-p 0", ["generate", "--max-new-tokens", "2", "--temperature", "1", "--top-p", "0", "hi"])
cli("cli --max-new-tokens 0", ["generate", "--max-new-tokens", "0", "hi"])
cli("cli --max-new-tokens -1", ["generate", "--max-new-tokens", "-1", "hi"])
cli("cli empty prompt", ["generate", "--max-new-tokens", "2", ""])
cli("cli --draft-len 100", ["generate", "--method", "layerskip", "--max-new-tokens", "2", "--draft-len", "100", "hi"])
cli("cli --exit-layer 99", ["generate", "--method", "layerskip", "--max-new-tokens", "2", "--exit-layer", "99", "hi"])
cli("cli --exit-layer 0", ["generate", "--method", "layerskip", "--max-new-tokens", "2", "--exit-layer", "0", "hi"])
cli("cli --heads default --exit-layer 20", ["generate", "--method", "layerskip", "--max-new-tokens", "2", "--heads", "default", "--exit-layer", "20", "hi"])
cli("cli --heads model.safetensors", ["generate", "--method", "layerskip", "--max-new-tokens", "2", "--heads", str(engine_path / "model.safetensors"), "hi"])
cli("cli --heads /nonexistent", ["generate", "--method", "layerskip", "--max-new-tokens", "2", "--heads", "/nonexistent/x.safetensors", "hi"])
cli("cli --model nope", ["generate", "--model", "nope", "hi"])
cli("cli --model /etc", ["generate", "--model", "/etc", "hi"])
cli("cli models fetch nope", ["models", "fetch", "nope"])
cli("cli --method nope", ["generate", "--method", "nope", "hi"])
cli("cli --chat on model w/o template?", ["generate", "--max-new-tokens", "2", "--chat", "hi"])
cli("cli --stop ''", ["generate", "--max-new-tokens", "2", "--stop", "", "hi"])
cli("cli --top-k -1", ["generate", "--max-new-tokens", "2", "--temperature", "1", "--top-k", "-1", "hi"])
cli("cli --gamma 2 dv", ["generate", "--method", "dv", "--max-new-tokens", "2", "--gamma", "2", "hi"])
cli("cli bench --n 0", ["bench", "--methods", "ar", "--n", "0", "--out", "/tmp/hb0"])
cli("cli bench --n -3", ["bench", "--methods", "ar", "--n", "-3", "--out", "/tmp/hb1"])
cli("cli bench --max-new-tokens 0", ["bench", "--methods", "ar", "--n", "1", "--max-new-tokens", "0", "--out", "/tmp/hb2"])
cli("cli bench --threads 0", ["bench", "--methods", "ar", "--n", "1", "--threads", "0", "--out", "/tmp/hb3"])
cli("cli bench --out /proc/x", ["bench", "--methods", "ar", "--n", "1", "--out", "/proc/x"])
cli("cli bench --methods ''", ["bench", "--methods", "", "--n", "1", "--out", "/tmp/hb4"])
cli("cli bench --dataset nope", ["bench", "--methods", "ar", "--dataset", "nope", "--n", "1", "--out", "/tmp/hb5"])
cli("cli bench --prompts /nonexistent", ["bench", "--methods", "ar", "--prompts", "/nonexistent.jsonl", "--n", "1", "--out", "/tmp/hb6"])
cli("cli heads show /nonexistent", ["heads", "show", "/nonexistent"])
cli("cli bench-cpu --threads 0", ["bench-cpu", "--threads", "0", "--lengths", "8", "--decode-tokens", "2", "--train-steps", "0", "--out", "/tmp/hb7"])
cli("cli bench-cpu --lengths -5", ["bench-cpu", "--lengths", "-5", "--out", "/tmp/hb8"])

w = max(len(r[0]) for r in rows)
for r in rows:
    print(f"{r[0]:<{w}}  {r[1]:<6} {r[2]!s:<4} {r[3]}")
from collections import Counter
print(Counter(r[1] for r in rows))
