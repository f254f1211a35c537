#!/usr/bin/env bash
# The vLLM plugin's CUDA path on one NVIDIA GPU (issue 39, item 3): one prepared run, about 10 minutes.
# STATUS: written, layout-tested on CPU, NOT RUN ON A GPU YET (no GPU was lent while it was written).
#
#     bash bench/vllm_gpu_check.sh                  # from the repository root; the embedded model
#     bash bench/vllm_gpu_check.sh /path/to/model   # also the headline on a larger HF model folder
#     WHEELS=/path/to/wheels bash bench/vllm_gpu_check.sh   # offline: vllm==0.32.0 and its deps as wheels
#
# Steps, each writing under $OUT (default data/results/bench/vllm_gpu/):
#   1. the GPU, and a venv with the CUDA build of vLLM 0.32.0 (randattn itself without dependencies);
#   2. the CUDA layout code (randattn.vllm.flash_backend.FlashPagedKV) on real CUDA tensors of every KVCacheLayout,
#      byte-equal to FlashAttention's own addressing (tests/test_vllm_flash_layout.py; on CPU the same file runs in
#      the main suite);
#   3. the refusal-free start: randattn.vllm.checks finds nothing to refuse on CUDA for a good config;
#   4. conformance: Random's keep records equal the HF engine's on the same GPU, record for record; the query-window
#      selectors' share of equal records (bench.vllm_gpu_conformance);
#   5. the benchmark on the embedded model in bf16 (bench.vllm: full attention vs Random at the same KV pool), and on
#      the model folder given as $1.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-vllm-cuda}
OUT=${OUT:-data/results/bench/vllm_gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
if [ -n "${WHEELS:-}" ]; then
  "$VENV/bin/pip" install -q --no-index --find-links "$WHEELS" "vllm==0.32.0" gguf
else
  "$VENV/bin/pip" install -q "vllm==0.32.0" gguf
fi
"$VENV/bin/pip" install -q --no-deps -e .
"$VENV/bin/pip" install -q pytest
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
MODEL=$("$VENV/bin/python" -c "import randattn.models as m; print(m.converted_embedded(m.DEFAULT_MODEL))")
# 2. the layout code on CUDA tensors (the cpu rows run too; nothing may be skipped for want of a GPU here)
"$VENV/bin/python" -m pytest -q -rs tests/test_vllm_flash_layout.py -m "not vllm" 2>&1 | tee "$OUT/layout.txt"
if grep -q "no CUDA GPU" "$OUT/layout.txt"; then echo "the CUDA layout tests were skipped: torch sees no GPU"; exit 1; fi
# 3. nothing refused on CUDA for a good config
"$VENV/bin/python" - "$MODEL" <<'EOF' | tee "$OUT/start.txt"
import sys
from vllm.engine.arg_utils import EngineArgs
from randattn.vllm import checks
cfg = EngineArgs(model=sys.argv[1], enforce_eager=True, enable_prefix_caching=False, dtype="bfloat16",
                 additional_config={"randattn": {"budget": 256, "buffer": 64}}).create_engine_config()
problems = checks.engine_problems(cfg)
print("\n".join(problems) or "no problem reported")
assert not problems, "a good config is refused on CUDA"
EOF
# 4. conformance with the HF engine on the same GPU (exits non-zero unless Random is exact)
"$VENV/bin/python" -m bench.vllm_gpu_conformance --model "$MODEL" --out "$OUT/conformance.json" 2>&1 | tail -n 20
# 5. the benchmark (bf16: FlashAttention takes no fp32; the HF arm is left out: bench.vllm runs it on the CPU)
"$VENV/bin/python" -m bench.vllm --arms "vllm full" "vllm random" --dtype bfloat16 --out "$OUT/bench_embedded.json"
if [ -n "${1:-}" ]; then
  "$VENV/bin/python" -m bench.vllm --model "$1" --arms "vllm full" "vllm random" --dtype bfloat16 --budget 1024 \
    --buffer 64 --out "$OUT/bench_model.json"
fi
echo "wrote $OUT"
