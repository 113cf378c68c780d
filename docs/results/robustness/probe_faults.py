"""Integrity and benchmark faults through the CLI, on a copy of the real cache."""
import os, shutil, signal, subprocess, sys, time, json
from pathlib import Path

SRC = Path.home() / ".cache/selfspec/models/smollm2-135m-instruct/bfloat16"
rows = []

def cli(label, args, home, expect_ok=False, timeout=600):
    env = {**os.environ, "SELFSPEC_HOME": str(home)}
    p = subprocess.run([sys.executable, "-m", "selfspec.cli", *args], capture_output=True, env=env, timeout=timeout)
    err = p.stderr.decode(errors="replace").strip().splitlines()
    kind = "trace" if any("Traceback" in l for l in err) else ("ok" if p.returncode == 0 else "clear")
    rows.append((label, kind, p.returncode, (err[-1] if err else p.stdout.decode()[-150:].strip())[:170]))
    return p

def fresh(name):
    home = Path("/tmp/hostile2") / name
    shutil.rmtree(home, ignore_errors=True)
    dst = home / "models/smollm2-135m-instruct/bfloat16"
    dst.parent.mkdir(parents=True)
    shutil.copytree(SRC.resolve(), dst)
    return home, dst

home, entry = fresh("flip")
with open(entry / "model.safetensors", "r+b") as f:
    f.seek(50_000_000); b = f.read(1); f.seek(50_000_000); f.write(bytes([b[0] ^ 0xFF]))
cli("flipped byte in weights: generate", ["generate", "--max-new-tokens", "4", "hi"], home)
cli("flipped byte: models list", ["models", "list"], home)
cli("flipped byte: models verify", ["models", "verify"], home)

home, entry = fresh("trunc")
with open(entry / "model.safetensors", "r+b") as f:
    f.truncate(1000)
cli("truncated weights: generate", ["generate", "--max-new-tokens", "4", "hi"], home)

home, entry = fresh("notok")
(entry / "tokenizer.json").unlink()
cli("missing tokenizer.json: generate", ["generate", "--max-new-tokens", "4", "hi"], home)

home, entry = fresh("cfg")
(entry / "config.json").write_text("{not json")
cli("corrupt config.json: generate", ["generate", "--max-new-tokens", "4", "hi"], home)

home, entry = fresh("ok")
cli("intact copy: generate", ["generate", "--max-new-tokens", "4", "hi"], home)
cli("intact copy: models verify", ["models", "verify", "smollm2-135m-instruct", "--dtype", "bf16"], home)
stale = home / "models" / ".tmp-smollm2-135m-instruct-bfloat16-dead"
stale.mkdir(); (stale / "big").write_bytes(b"0" * 1000)
cli("stale .tmp folder: models verify", ["models", "verify"], home)
rows.append(("stale .tmp folder removed?", "ok" if not stale.exists() else "LEFT", "-", str(stale.exists())))

real_home = Path.home() / ".cache/selfspec"
out = Path("/tmp/hostile2/bench")
shutil.rmtree(out, ignore_errors=True)
args = ["bench", "--methods", "ar", "--dataset", "humaneval", "--n", "3", "--max-new-tokens", "8",
        "--bandwidth-mib", "0", "--no-plots", "--threads", "2"]
cli("bench complete run", args + ["--out", str(out)], real_home)
cli("bench rerun into same --out", args + ["--out", str(out)], real_home)
(out / "notes.txt").write_text("mine")
cli("bench --overwrite with a foreign file", args + ["--out", str(out), "--overwrite"], real_home)
(out / "notes.txt").unlink()
cli("bench --overwrite", args + ["--out", str(out), "--overwrite"], real_home)
# Interrupt after the first record lands in the journal
out2 = Path("/tmp/hostile2/bench-int"); shutil.rmtree(out2, ignore_errors=True)
env = {**os.environ}
p = subprocess.Popen([sys.executable, "-m", "selfspec.cli", *args[:6], "6", *args[7:], "--out", str(out2)],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
t0 = time.time()
while time.time() - t0 < 300:
    j = out2 / "journal.jsonl"
    if j.exists() and len(j.read_text().splitlines()) >= 2:
        break
    time.sleep(0.2)
p.send_signal(signal.SIGINT)
so, se = p.communicate(timeout=120)
n = len((out2 / "journal.jsonl").read_text().splitlines()) if (out2 / "journal.jsonl").exists() else 0
rows.append(("bench Ctrl-C after 2 generations", "clear" if p.returncode == 130 else "?", p.returncode,
             f"journal lines kept: {n}; " + se.decode().strip().splitlines()[-1][:120]))
cli("bench --resume after Ctrl-C", [*args[:6], "6", *args[7:], "--resume", str(out2)], real_home)

w = max(len(r[0]) for r in rows)
for r in rows:
    print(f"{r[0]:<{w}}  {r[1]:<6} {r[2]!s:<4} {r[3]}")
