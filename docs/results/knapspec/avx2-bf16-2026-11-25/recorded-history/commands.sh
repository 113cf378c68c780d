#!/bin/bash
# KnapSpec with recorded history on the AVX2 EPYC (bf16), 2026-11-25 session 36.
set -x
cd /work/main
B="selfspec -v bench --threads 2 --no-accuracy --bandwidth-mib 0 --no-plots"
S=smollm2-135m-instruct; Q=qwen2.5-coder-1.5b-instruct; O=/work/runs/s36/final
$B --model $S --dtype bf16 --dataset humaneval --n 5 --max-new-tokens 96 --methods ar,knapspec,knapspec:record_history=false --out $O/smollm2-humaneval
$B --model $S --dtype bf16 --dataset sharegpt-summarize --n 3 --max-new-tokens 96 --methods ar,knapspec --out $O/smollm2-sharegpt
$B --model $Q --dtype bf16 --dataset humaneval --n 3 --max-new-tokens 96 --methods ar,knapspec:draft_weights=int4,qspec:draft_weights=int4,knapspec,knapspec:draft_weights=int4,record_history=false --out $O/qwen-humaneval
# CLaSp before (a17376c, read-only pass every re-optimisation) and after (recorded history), same flags:
# git worktree add /tmp/cc_old a17376c; cd /tmp/cc_old; PYTHONPATH=src python -c "import sys; from selfspec.cli import main; sys.exit(main(sys.argv[1:]))" $C --out $O/clasp-old
C="bench --threads 2 --no-accuracy --bandwidth-mib 0 --no-plots --model $S --dtype bf16 --dataset humaneval --n 4 --max-new-tokens 64 --methods ar,clasp,clasp:reoptimize_every=4"
selfspec $C --out $O/clasp-new
