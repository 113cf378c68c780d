#!/bin/bash
# A/B of issue 74: the same prompts on the code before (e5cc16d) and after, both planning from
# one latency table. Usage: BEFORE=/path/to/e5cc16d-tree AFTER=/path/to/main-tree OUT=/tmp/ab \
#   bash bench_ab.sh   (run it twice for two pairs; run once first so the after table exists)
set -e
: "${BEFORE:?checkout of e5cc16d}" "${AFTER:?checkout of main}" "${OUT:=/tmp/ab}"
L=~/.cache/selfspec/latency
A=$(ls $L/smollm2-135m-instruct-*-2513276f-*.json)
cp "$A" "${A/2513276f/51e8864a}" && sed -i 's/2513276f/51e8864a/' "${A/2513276f/51e8864a}"
M='ar,auto,ngram,knapspec,layerskip:exit_layer=24,draft_len=3'
ARGS="--n 10 --max-new-tokens 64 --threads 2 --no-plots --no-accuracy --overwrite"
for side in after before; do
  if [ $side = after ]; then dir=$AFTER; else dir=$BEFORE; fi
  (cd "$dir" && PYTHONPATH="$dir/src" python -m selfspec.cli bench --methods "$M" $ARGS \
    --out "$OUT/$side") > "$OUT/$side.log" 2>&1
done
