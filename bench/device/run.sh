#!/usr/bin/env bash
# One GPU job per device call, on a bare GPU host that has PyTorch, Triton and transformers:
# installs what `python -m bench.device.prepare` packed into .device/ (carry it), then runs
#
#   bash bench/device/run.sh probe                 # stack imports, UCX's CUDA support, KV transfer
#                                                  # between two processes of one GPU
#   bash bench/device/run.sh tests [PYTEST ARGS]   # the GPU-marked tests (default: serving ones)
#   bash bench/device/run.sh serving SHAPE [BENCH ARGS]   # tandem bench, colocated:1 vs disagg:1p1d
#   bash bench/device/run.sh serving2 SHAPE [BENCH ARGS]  # two GPUs: colocated:2 vs disagg:1p1d,
#                                                  # and the hand-off against a P2P copy
#   bash bench/device/run.sh handoff2 [BENCH ARGS]  # two GPUs: the stack's hand-off with KV
#                                                  # checksums on and off, lab.kv_check_peer
#   [SHAPE=NAME] bash bench/device/run.sh bench MODULE [ARGS]   # any python -m MODULE
#                                                  # (bench.gpu, ...); SHAPE writes /tmp/models/NAME
#
# Results go to $OUT (the device tool's folder; /tmp/out elsewhere).
set -euo pipefail
cd "$(dirname "$0")/../.."
D=.device
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/bin /tmp/models
# NIXL and FlashAttention 3 where carried (.device/nixl, .device/fa3: prepare.py says when not).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "$D"/wheels/*.whl $(ls "$D"/nixl/*.whl 2>/dev/null) 2>&1 \
  | grep -v "^WARNING: Target directory" || true
for f in "$D"/fa3/*.so.xz; do
  [ -e "$f" ] && python3 -c "import lzma, sys; open(sys.argv[2], 'wb').write(lzma.open(sys.argv[1]).read())" \
    "$f" "/tmp/site/$(basename "${f%.xz}")"
done
export PYTHONPATH=/tmp/site:$PWD:$PWD/proto PYTHONUNBUFFERED=1
python3 -c "import lzma; open('/tmp/bin/etcd', 'wb').write(lzma.open('$D/etcd.xz').read())"
chmod +x /tmp/bin/etcd
export PATH=/tmp/bin:$PATH TANDEM_TOKENIZER_DIR=$PWD/$D/tokenizer
# Several-GPU hosts of this workplace: NVLink multicast stays off (see the device tool's notes).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
set -o pipefail

shape() {
  python3 -m engine.shapes "$1" --out "/tmp/models/$1" --tokenizer "$TANDEM_TOKENIZER_DIR" >/dev/null
  echo "/tmp/models/$1"
}

job=${1:?job: probe, tests, serving or bench}
shift
case $job in
  probe)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
    python3 -c "import services.gateway.server, services.router.core, services.decode.core; print('stack imports ok')"
    python3 -c "from libkv.transfer.nixl_agent import ucx_cuda_problem; print('UCX CUDA support:', ucx_cuda_problem() or 'ok')"
    python3 -m bench.kv_transfer --device cuda --peer-device cuda:0 --methods cuda-ipc nixl-read \
      --total-mib 1024 --nixl-total-mib 64 --block-kib 256 2048 --repeats 2 --latency-reps 10 \
      --out "$OUT" "$@" 2>&1 | tee "$OUT/probe.log"
    ;;
  tests)
    case " $* " in *" tests/"*) ;; *) set -- tests/gpu/test_serving_gpu.py tests/gpu/test_gpu_sharing.py "$@" ;; esac
    rc=0
    python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu -rA --durations=15 "$@" 2>&1 \
      | tee "$OUT/tests.log" || rc=$?
    # The services' logs of every test stack, for whoever reads a failure.
    find /tmp/pytest-of-*/ -name '*.log' 2>/dev/null | tar czf "$OUT/stack-logs.tgz" -T - || true
    exit $rc
    ;;
  serving)
    model=$(shape "${1:?serving SHAPE}")
    shift
    python3 -m cli bench --stack colocated:1 --stack disagg:1p1d --gpus 0 \
      --model-dir "$model" --load-format dummy --no-progress --logs /tmp/logs \
      --out "$OUT/serving" "$@" 2>&1 | tee "$OUT/bench.log"
    ;;
  serving2)
    # The run of the two-GPU issue (bench/results/serving_gpu_h200x2/): GPUS=0 for a dry run
    # on one GPU. The transfer bench first: CUDA IPC and NIXL between the two GPUs against a
    # contiguous peer-to-peer copy, in the same call.
    model=$(shape "${1:?serving2 SHAPE}")
    shift
    gpus=${GPUS:-0,1}
    peer=cuda:$([ "$gpus" = 0 ] && echo 0 || echo 1)
    timeout 150 python3 -m bench.kv_transfer --device cuda --peer-device "$peer" \
      --methods cuda-ipc nixl-read --block-kib 2048 --request-mib 256 --total-mib 2048 \
      --nixl-total-mib 256 --repeats 2 --latency-reps 10 --out "$OUT" 2>&1 \
      | tee "$OUT/transfer.log" || true
    python3 -m cli bench --stack colocated:2 --stack disagg:1p1d --gpus "$gpus" \
      --model-dir "$model" --load-format dummy --no-progress --logs /tmp/logs \
      --max-model-len 8192 --max-num-batched-tokens 4096 --slo-tpot-ms 40 \
      --workload prefill-heavy:input=4096,output=256 \
      --workload decode-heavy:input=256,output=1024 \
      --workload chat --out "$OUT/serving" "$@" 2>&1 | tee "$OUT/bench.log"
    ;;
  handoff2)
    # Issue 18's checked KV between two GPUs (GPUS=0: on one). The check's cost at the
    # transport between two processes (lab.kv_check_peer), then the stack's own hand-off
    # (disagg:1p1d, 8B shape, fixed 2,048- and 4,096-token prompts) with checksums on and off,
    # then that cost as a share of the hand-off the stack measured with checksums on.
    model=$(shape llama-3.1-8b)
    gpus=${GPUS:-0,1}
    dst=cuda:$([ "$gpus" = 0 ] && echo 0 || echo 1)
    timeout 150 python3 -m lab.kv_check_peer --src cuda:0 --dst "$dst" \
      --tokens 1024 2048 4096 --pairs 200 --out "$OUT/peer" 2>&1 | tee "$OUT/peer.log" || true
    for arm in on off; do
      flags=()
      [ "$arm" = on ] || flags=(--worker-arg=--no-kv-checksums)
      timeout 200 python3 -m cli bench --stack disagg:1p1d --gpus "$gpus" --model-dir "$model" \
        --load-format dummy --workload random:input=2048,input_spread=0,output=16,output_spread=0 \
        --workload random:input=4096,input_spread=0,output=16,output_spread=0 \
        --num-requests 30 --rate 2 --concurrency 1 --warmup 3 --no-plots --no-progress \
        "${flags[@]}" --logs "/tmp/logs_$arm" --out "$OUT/stack_$arm" "$@" 2>&1 \
        | tee "$OUT/stack_$arm.log" || true
    done
    python3 -m lab.kv_check_peer shares "$OUT/peer/kv_check_peer.json" \
      "$OUT/stack_on/results.json" "$OUT/stack_off/results.json" | tee "$OUT/shares.md"
    ;;
  bench)  # SHAPE=NAME first writes /tmp/models/NAME (engine.shapes) for the module's flags
    [ -z "${SHAPE:-}" ] || shape "$SHAPE" >/dev/null
    python3 -m "$@" 2>&1 | tee "$OUT/bench.log"
    ;;
  *) echo "unknown job $job" >&2; exit 2 ;;
esac
