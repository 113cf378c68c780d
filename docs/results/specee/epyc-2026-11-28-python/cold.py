import time, torch, selfspec, statistics as S
torch.set_num_threads(2)
m = selfspec.load("qwen2.5-coder-0.5b-instruct", "bf16", show_progress=False)
ex = m.executor; fused = ex.fused_layers()
cache = ex.new_cache(1, 1024)
ids = torch.randint(0, 1000, (1, 150))
ex.run_layers(ex.embed(ids), torch.arange(150).unsqueeze(0), 0, ex.num_layers, cache)
x = ex.embed(torch.tensor([[5]])); pos = 150
def one_token():
    cache.truncate(pos); h = x
    for L in range(24): h = ex.run_layers_at(h, pos, L, L + 1, cache)
def one_call():
    cache.truncate(pos); ex.run_layers_at(x, pos, 0, 24, cache)
fa, fm = fused._attention_fn, fused._mlp_fn
kt = [0.0]
def wa(a):
    t = time.perf_counter(); fa(a); kt[0] += time.perf_counter() - t
def wm(a):
    t = time.perf_counter(); fm(a); kt[0] += time.perf_counter() - t
fused._attention_fn, fused._mlp_fn = wa, wm
res = {"per": [], "one": []}; kk = {"per": [], "one": []}
for it in range(40):
    for k, f in (("per", one_token), ("one", one_call)):
        kt[0] = 0; t = time.perf_counter(); f(); w = time.perf_counter() - t
        res[k].append(w); kk[k].append(kt[0])
for k in res:
    print(f"{k}: wall {1e3*S.median(res[k]):.2f} ms, kernels {1e3*S.median(kk[k]):.2f} ms, rest {1e3*S.median([a-b for a,b in zip(res[k],kk[k])]):.2f} ms")
