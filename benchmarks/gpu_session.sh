#!/usr/bin/env bash
# Runs the GPU checks and benchmarks on a CUDA machine that has PyTorch, Triton and cuda-python
# but not this project installed (no network needed): `eaas` is made importable from the source
# tree through a link tree, then each step runs with its log under $OUT (default: ./gpu-out).
#
#   bash benchmarks/gpu_session.sh STEP...
#   steps: env probe tests kernels kernels-quick autotune rtt nixl nixl-tests nixl-mem-events warmup host
#   (NIXL_ROWS: the raw NIXL rows of the nixl step, comma-separated; default all three)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-out}
mkdir -p "$OUT"
SITE=$(mktemp -d)/site
mkdir -p "$SITE/eaas"
for part in runtime kernels operator; do ln -s "$ROOT/$part" "$SITE/eaas/$part"; done
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then  # wheels carried for what the image lacks
    ${PYTHON:-python3} -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl
fi
export PYTHONPATH="$SITE:$ROOT/benchmarks:$ROOT/tests/runtime${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

step() {  # step NAME TIMEOUT_S COMMAND...: runs one step, its output to the console and $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "=== $name ($(date -u +%H:%M:%S))"
    timeout "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1
    echo "=== $name exit $?"
}

for what in "$@"; do
    case $what in
    env)
        step env 60 bash -c "nvidia-smi; $PY -c 'import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name(0))'; $PY -m pip list 2>/dev/null | grep -i -E 'cuda|nvshmem|triton|torch|pydantic|hypothesis'"
        ;;
    probe)
        step probe 120 $PY benchmarks/gpu_mechanisms.py --json-out "$OUT/gpu_mechanisms.json"
        ;;
    tests)
        step tests ${TESTS_TIMEOUT:-240} $PY -m pytest -q -p no:cacheprovider -o addopts="" --timeout 90 -rA $(ls tests/kernels/test_gpu.py tests/runtime/test_gpu_*.py 2>/dev/null)
        ;;
    kernels)
        step kernels ${KERNELS_TIMEOUT:-420} $PY benchmarks/moe_kernels.py --json-out "$OUT/moe_kernels.json"
        ;;
    autotune)
        step autotune 240 $PY benchmarks/autotune_moe.py --quick
        cp kernels/tuned_configs.json "$OUT/tuned_configs.json"
        ;;
    kernels-quick)
        step kernels-quick 150 $PY benchmarks/moe_kernels.py --quick --json-out "$OUT/moe_kernels_quick.json"
        ;;
    rtt)
        step rtt 150 $PY benchmarks/gpu_rtt.py --json-out "$OUT/gpu_rtt.json"
        ;;
    nixl)  # needs the NIXL wheel among the carried ones (.whl/nixl_cu13-*.whl)
        # A preflight finds UCX settings under which two agents reach each other here (UCX's
        # defaults first, with its debug log under $OUT), then the benchmark runs with them.
        chosen=none
        for candidate in UCX_DEFAULTS=1 UCX_NET_DEVICES=lo UCX_TLS=^cma UCX_TLS=tcp,cuda_copy,cuda_ipc; do
            extra=()
            [ "$candidate" = UCX_DEFAULTS=1 ] && extra=(UCX_LOG_LEVEL=debug "UCX_LOG_FILE=$OUT/ucx-%p.log" UCX_LOG_FILE_SIZE=8m)
            echo "--- nixl preflight with $candidate" | tee -a "$OUT/nixl-preflight.log"
            if timeout 120 env "$candidate" "${extra[@]}" $PY benchmarks/nixl_gpu_rtt.py --host-check --quick \
                --rows dram,vram >>"$OUT/nixl-preflight.log" 2>&1; then
                chosen=$candidate
                break
            fi
            tail -5 "$OUT/nixl-preflight.log"
        done
        echo "--- nixl preflight chose: $chosen"
        [ "$chosen" = none ] || step nixl ${NIXL_TIMEOUT:-240} env "$chosen" $PY benchmarks/nixl_gpu_rtt.py \
            --rows "${NIXL_ROWS:-vram,vram-staged,dram}" --json-out "$OUT/nixl_gpu_rtt.json"
        ;;
    nixl-tests)  # the nixl GPU tests alone (``tests`` runs them with the others)
        step nixl-tests 200 $PY -m pytest -q -p no:cacheprovider -o addopts="" --timeout 90 -rA \
            tests/runtime/test_gpu_nixl.py
        ;;
    nixl-mem-events)  # the nixl GPU tests with UCX's memory hooks on (our default turns them off)
        step nixl-mem-events 200 env UCX_MEM_EVENTS=yes $PY -m pytest -q -p no:cacheprovider -o addopts="" \
            --timeout 90 -rA tests/runtime/test_gpu_nixl.py
        ;;
    host)  # the CPU data-path benchmarks on this machine's cores (host memory; needs the NIXL wheel)
        for run in 1 2 3; do
            step transport-rtt-$run ${HOST_RTT_TIMEOUT:-150} $PY benchmarks/transport_rtt.py --json-out "$OUT/transport_rtt_$run.json"
        done
        step e2e-decode ${HOST_DECODE_TIMEOUT:-200} $PY benchmarks/e2e_decode.py --compare tcp,nixl --json-out "$OUT/e2e_decode.json"
        ;;
    warmup)
        step warmup ${WARMUP_TIMEOUT:-300} $PY benchmarks/warm_up.py --json-out "$OUT/warm_up.json"
        ;;
    *)
        echo "unknown step $what" >&2
        exit 2
        ;;
    esac
done
