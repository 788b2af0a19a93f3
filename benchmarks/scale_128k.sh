#!/usr/bin/env bash
# The paper's scale (issue 13): Gemma-3-270M at 128K tokens, end to end, each step's time and peak memory.
#
#   benchmarks/scale_128k.sh                                   # 131,072 tokens: a bigger machine or a GPU
#   MODEL=smollm2 TOKENS=2048 LAYERS=2,15 QUICK=1 benchmarks/scale_128k.sh   # the same steps at small size
#   ROPE=linear:4 OUT=results/scale-rope4 benchmarks/scale_128k.sh
#       # the decodes with the global layers' RoPE positions scaled (full attention then answers at 128K), each
#       # index mode's search raised per layer to weight recall 0.95 on the prompt's newest queries (the decoder's
#       # default `--calibrate`: roargraph L, IVF nprobe; BENCHMARKS "A target of 0.95": the fixed L 100 is short at 128K)
#   ROPE=linear:4 MODES=full,window,flat,ivf,roargraph,snapkv,infllm,quest OUT=results/scale-baselines benchmarks/scale_128k.sh
#       # the paper's 128K comparison: StreamingLLM (window), SnapKV, InfLLM, Quest, flat and IVF beside roargraph
#       # (BENCHMARKS "The paper's baselines at 128K in one decode"; plugins/ installed, as `make setup` does)
#
# 1. `anns-lab dump` beyond the 32K training length (--allow-extrapolation: the results say so), chunked
#    prefill (CHUNK tokens; the memory estimate refuses a chunk that cannot fit and names one that does);
# 2. the sweep (benchmarks/bench_query_aware.py: IVF, roargraph, robust-vamana, hnsw side by side, every head
#    of the global layers, scanned fraction at recall 0.95 and build s per head);
# 3. `anns-lab decode` on niah and passkey, every mode on one shared prefill per sample (--build-after-prefill
#    --shared-prefill: a prefill per index mode, or one more for full, would cost tens of minutes each at 128K for ~1%
#    of TTFT hidden; full's TTFT then carries the queries kept for the indexes; time to first token, retrieval per
#    token against flat and IVF).
# Each step writes under OUT; "peak RSS" lines come from GNU time. Steps already done are skipped (the dump and
# the sweep resume; a decode whose JSON is complete is skipped: delete OUT/decode-*.json to rerun it).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-gemma3-270m}
TOKENS=${TOKENS:-131072}
CHUNK=${CHUNK:-1024}
DECODE_TOKENS=${DECODE_TOKENS:-16}
SAMPLES=${SAMPLES:-2}
JOBS=${JOBS:-2}
LAB=${LAB:-.venv/bin/anns-lab}
PY=${PY:-.venv/bin/python}
DUMP=${DUMP:-dumps/$MODEL-text-$TOKENS}
OUT=${OUT:-results/scale-$MODEL-$TOKENS}
INDEXES=${INDEXES:-ivf,roargraph,robust-vamana,hnsw}
MODES=${MODES:-full,flat,ivf,roargraph}
ROPE=${ROPE:-}                # e.g. linear:4: --rope-scaling of the decodes
DECODE_ARGS=${DECODE_ARGS:-}  # more `anns-lab decode` options, e.g. "--calibrate 0.97" or "--param nprobe=128"
if [ -z "${LAYERS:-}" ]; then
  case "$MODEL" in gemma3-270m) LAYERS=5,11,17 ;; *) LAYERS=2,15,28 ;; esac
fi
mkdir -p "$OUT"
timed() {  # timed NAME CMD...: run CMD, keep its output and GNU time's report in OUT/NAME.log
  local name=$1; shift
  echo "== $name: $*"
  /usr/bin/time -v "$@" 2>&1 | tee "$OUT/$name.log"
  grep -E "Maximum resident set size|Elapsed \(wall clock\)|User time|System time" "$OUT/$name.log" \
    | sed "s/^\s*/$name: /"
}
timed dump "$LAB" dump --model "$MODEL" --tokens "$TOKENS" --decode-tokens "$DECODE_TOKENS" --chunk "$CHUNK" \
  --allow-extrapolation --out "$DUMP"
timed sweep "$PY" benchmarks/bench_query_aware.py --dump "$DUMP" --indexes "$INDEXES" --layers "$LAYERS" \
  --jobs "$JOBS" --out "$OUT/sweep" ${QUICK:+--quick}
# every mode on one prefill, the builds after it: options of the index modes, refused where MODES names none
SHARED="--build-after-prefill --shared-prefill"
case ",$MODES," in ,full,|,window,|,full,window,|,window,full,) SHARED= ;; esac
for task in niah passkey; do
  # done = written and not partial (a decode stopped midway leaves "partial": true)
  [ -f "$OUT/decode-$task.json" ] && ! grep -q '"partial": true' "$OUT/decode-$task.json" && continue
  timed "decode-$task" "$LAB" decode --model "$MODEL" --task "$task" --context "$TOKENS" --samples "$SAMPLES" \
    --mode "$MODES" --chunk "$CHUNK" $SHARED --allow-extrapolation ${ROPE:+--rope-scaling "$ROPE"} $DECODE_ARGS \
    --json "$OUT/decode-$task.json" --overwrite  # only a partial one is left to replace (the check above)
done
echo "results in $OUT"
