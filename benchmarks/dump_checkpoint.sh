#!/usr/bin/env bash
# The dump's prefill checkpoints (`--checkpoint-every`): what they cost, and a real interrupt and resume.
#
#   benchmarks/dump_checkpoint.sh                                   # SmolLM2, 8,192 tokens (every layer global)
#   MODEL=gemma3-270m TOKENS=32768 DECODE_TOKENS=16 STOP_AFTER=230 benchmarks/dump_checkpoint.sh
#
# 1. cost: the same dump with no checkpoint (--checkpoint-every 0) and with one after every chunk but the last
#    (--checkpoint-every 1e-9: the most a prefill can pay), alternated ROUNDS times; the prefill's seconds (wall and
#    CPU) from each manifest, the peak RSS from GNU time;
# 2. resume: the dump stopped by SIGINT STOP_AFTER seconds in (checkpoints every EVERY s), run again, and compared
#    array for array with the uninterrupted dump of step 1 (the same settings: it must be the same, bit for bit).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-smollm2}
TOKENS=${TOKENS:-8192}
DECODE_TOKENS=${DECODE_TOKENS:-64}
CHUNK=${CHUNK:-2048}
ROUNDS=${ROUNDS:-2}
STOP_AFTER=${STOP_AFTER:-70}
EVERY=${EVERY:-15}
OUT=${OUT:-results/dump-checkpoint}
A=${ANNS_LAB:-anns-lab}
mkdir -p "$OUT"
dump() {  # dump FOLDER EVERY [timeout args...]
    local folder=$1 every=$2
    shift 2
    /usr/bin/time -f "peak RSS %M KB" "$@" "$A" dump --model "$MODEL" --tokens "$TOKENS" \
        --decode-tokens "$DECODE_TOKENS" --chunk "$CHUNK" --out "$folder" --checkpoint-every "$every" >"$folder.out" 2>"$folder.err"
}
prefill() {  # the manifest's prefill seconds, wall and CPU
    python - "$1" <<'PY'
import json, sys
t = json.load(open(f"{sys.argv[1]}/manifest.json"))["timing"]
print(f"prefill {t['prefill_s']:.1f} s wall, {t['prefill_cpu_s']:.1f} s CPU")
PY
}
for round in $(seq "$ROUNDS"); do
    for every in 0 1e-9; do
        rm -rf "$OUT/cost"
        dump "$OUT/cost" "$every"
        echo "round $round, --checkpoint-every $every: $(prefill "$OUT/cost"), $(tail -1 "$OUT/cost.err")"
    done
done
rm -rf "$OUT/plain" "$OUT/resumed"
dump "$OUT/plain" 0
dump "$OUT/resumed" "$EVERY" timeout -s INT "$STOP_AFTER" || echo "stopped after $STOP_AFTER s (status $?)"
tr '\r' '\n' <"$OUT/resumed.err" | grep -a "interrupted" | tail -1
dump "$OUT/resumed" "$EVERY"
grep -a "resuming\|resumed" "$OUT/resumed.out" || true
python - "$OUT/plain" "$OUT/resumed" <<'PY'
import sys
import numpy as np
from anns_lab import open_dump
a, b = open_dump(sys.argv[1]), open_dump(sys.argv[2])
assert a.layers == b.layers and a.tokens().tolist() == b.tokens().tolist()
for layer in a.layers:
    for g in range(a.n_kv_heads):
        assert np.array_equal(a.keys(layer, g), b.keys(layer, g)) and np.array_equal(a.values(layer, g), b.values(layer, g))
    for h in range(a.n_heads):
        assert np.array_equal(a.queries(layer, h, "all"), b.queries(layer, h, "all"))
at = b.manifest["timing"].get("prefill_resumed_at")
print(f"resumed at token {at}: every query, key and value of layers {a.layers} equal to the uninterrupted dump's")
PY
