# Run from the repository root: python docs/results/gguf/dense-prefill-2026-11-29/determinism.py
# (greedy texts of two HumanEval prompts against the two Qwen runs, with llama.cpp loaded in the process).
# It reads the two runs' records.jsonl, which are not kept in the tree: rerun each run's command
# (its report.md header) into its folder first.
import json, sys, torch, selfspec
from selfspec.data.prompts import load_prompts
torch.set_num_threads(2)
eng = selfspec.load("qwen2.5-coder-1.5b-instruct", show_progress=False)
import llama_cpp, os
from selfspec.models.gguf_cache import fetch_gguf
path = str(fetch_gguf("qwen2.5-coder-1.5b-instruct"))
print(llama_cpp.__file__, flush=True)
llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_threads=2, verbose=False)
print(llm("def f(x):", max_tokens=4)["choices"][0]["text"], flush=True)
ps = {p.id: p for p in load_prompts("humaneval", 20)}
def recs(path):
    out = {}
    for l in open(path):
        r = json.loads(l); out[(r['method'], r['question_id'])] = r['token_ids']
    return out
A = recs('docs/results/gguf/cells-2026-11-29/passat1/qwen2.5-coder-1.5b-humaneval-20/records.jsonl')
B = recs('docs/results/gguf/dense-prefill-2026-11-29/qwen2.5-coder-1.5b-humaneval/records.jsonl')
for kernel, meth in (("gguf", "ar:decode_kernel=gguf"), ("auto", "ar")):
    eng.executor.set_decode_kernel(kernel)
    for q in ("HumanEval/6", "HumanEval/9", "HumanEval/6"):
        p = ps[q]
        ids = eng.encode(p.text, chat=p.chat)
        t = eng.generate(ids, "ar", max_new_tokens=24).token_ids
        print(kernel, q, len(ids), "=A" if t == A[(meth, q)][:24] else "!=A", "=B" if t == B[(meth, q)][:24] else "!=B", flush=True)
