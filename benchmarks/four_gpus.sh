#!/usr/bin/env bash
# The runs of the four-GPU issue, on one nvidia-h200-x4 machine, in two device calls of at most
# 10 minutes each (`bash benchmarks/four_gpus.sh 1`, then `... 2`). Results go to $OUT (the device
# tool's output folder) or to benchmarks/results. Needs Ray on PYTHONPATH and its `ray` command on
# PATH (../shared/gpu/README.md). Each run uses the real-size Qwen3-VL-8B tower with random weights.
set -u
out="${OUT:-benchmarks/results}"
cd "$(dirname "$0")"
nvidia-smi --query-gpu=name --format=csv,noheader
case "${1:-}" in
  1)
    # 1. data-parallel scaling: saturated with 1, 2, 4 actors, busy fraction per actor
    timeout 330 python3 pool_throughput.py --actors 1,2,4 --seconds 12 --out "$out/pool_throughput_4gpu.json" 2>&1 | tail -25
    # 2. small calls under load on 4 actors (70% of saturated), per size class: the default, and
    #    small batches that interrupt large runs (which met small <= 3x at 70% on 2 H200s)
    timeout 250 python3 pool_throughput.py --actors 4 --seconds 12 --small-first 256,256-stream --out "$out/pool_throughput_small_first_4gpu.json" 2>&1 | tail -12
    ;;
  2)
    # 3. delivery to tensor-parallel ranks on GPUs the encoder does not use: RDT (NCCL), object store
    tower=$(python3 -c "import tempfile; from common import save_random_tower; print(save_random_tower(tempfile.mkdtemp()))" | tail -1)
    for transport in rdt object_store; do
      timeout 150 python3 ../examples/tp_llm.py --device cuda --model "$tower" --encoder own-gpu --transport "$transport" \
        --benchmark 50 2>&1 | tail -6
    done
    # 4. the autoscaled detached pool, 1 -> 4 -> 1 actors, 2 caller processes per GPU
    timeout 480 python3 pool_autoscale.py --max-actors 4 --phases low:20,high:180,low:230 --out "$out/pool_autoscale_4gpu.json" 2>&1 | tail -30
    ;;
  *)
    echo "usage: bash benchmarks/four_gpus.sh 1|2" >&2; exit 2 ;;
esac
