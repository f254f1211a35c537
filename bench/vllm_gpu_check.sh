#!/usr/bin/env bash
# The vLLM plugin on a CUDA machine (issue 26, item 7): install the CUDA build of vLLM 0.32.0 into its own venv, then
# run the vLLM test tier and the benchmark there. NOT RUN YET: no GPU was available while the plugin was written.
#
#     bash bench/vllm_gpu_check.sh            # from the repository root, on a machine with one NVIDIA GPU
#
# What to expect with this revision: the plugin runs its eviction rounds inside its own wrap of vLLM's CPU attention
# backend (CPU_ATTN); it wraps no CUDA backend (FlashAttention) yet, so randattn.vllm.checks refuses a 'randattn'
# config on CUDA before the engine starts, naming what is missing. This script checks exactly that (the refusal is
# the expected outcome, not a failure), and runs the full-attention arm of the benchmark so the CUDA numbers of the
# unmodified engine are on record. When a CUDA backend exists, drop --arms and the refusal check.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-vllm-cuda}
OUT=${OUT:-data/results/bench/vllm_cuda.json}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# vllm==0.32.0 pulls its own CUDA torch; randattn itself without dependencies (its core needs nothing vLLM lacks but
# gguf for the embedded model, installed for the conversion below).
"$VENV/bin/pip" install -q "vllm==0.32.0" gguf
"$VENV/bin/pip" install -q --no-deps -e .
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
# The embedded model's converted HF folder (~/.cache/randattn/smollm2-135m).
MODEL=$("$VENV/bin/python" -c "import randattn.models as m; print(m.converted_embedded(m.DEFAULT_MODEL))")
# 1. The refusal on CUDA names the platform and the missing backend.
"$VENV/bin/python" - "$MODEL" <<'EOF'
import sys
from vllm.engine.arg_utils import EngineArgs
from randattn.vllm import checks
cfg = EngineArgs(model=sys.argv[1], enforce_eager=True, enable_prefix_caching=False,
                 additional_config={"randattn": {"budget": 256, "buffer": 32}}).create_engine_config()
problems = checks.engine_problems(cfg)
print("\n".join(problems) or "no problem reported")
assert any("FlashAttention" in p for p in problems), "expected the CUDA refusal"
EOF
# 2. The vLLM test tier with this venv (tests that need the CPU backend skip or fail here; their output is the record).
RANDATTN_VLLM_PYTHON="$VENV/bin/python" python -m pytest -q -m vllm tests/test_vllm_engine.py tests/test_vllm_memory.py || true
# 3. The benchmark's full-attention arm on the GPU in bf16 (FlashAttention takes no fp32; the random arm is refused
#    on CUDA, see 1; the HF arm is left out: it would run on the CPU).
"$VENV/bin/python" -m bench.vllm --arms "vllm full" --dtype bfloat16 --out "$OUT"
echo "wrote $OUT"
