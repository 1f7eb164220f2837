#!/usr/bin/env bash
# One call on a GPU machine that has no Ray / FastAPI: install carried wheels, run the GPU tests of the committed
# tree, then the colocated loop with an engine killed at rollout 2 (bench/gpu_smoke.py --fault-tolerance).
#
# Prepare on the workstation (the .whl/ folder is git-ignored and travels as a carried path):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl ray==2.60.0 fastapi uvicorn starlette pydantic pydantic-core \
#       annotated-types typing-inspection jsonschema jsonschema-specifications referencing rpds-py ...
#   python bench/strip_wheel.py .whl/ray-*.whl ray/jars/     # Ray's Java jar (32 MB) is not needed
#   git archive --format=tar HEAD | gzip > .whl/src.tgz      # the committed tree, whatever the working tree holds
#   cp bench/gpu_round.sh .whl/
# On the GPU machine, from the repository root:  bash .whl/gpu_round.sh   (results under $OUT)
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/src && tar xzf .whl/src.tgz -C /tmp/src && cd /tmp/src || exit 1
export PYTHONPATH=$PWD:/tmp/site RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1
python3 -c "import ray, fastapi, torch; print('ray', ray.__version__, 'torch', torch.__version__)" || exit 1
timeout 260 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/unit/test_models_attention.py \
  tests/unit/test_trainer_logprobs_lowp.py tests/unit/test_trainer_offload.py tests/unit/test_algo_kl_entropy.py \
  tests/unit/test_triton_ops.py tests/unit/test_trainer_triton_logprobs.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
timeout 300 python3 bench/gpu_smoke.py --fault-tolerance --out "$OUT/smoke_ft" 2>&1 | grep -v "logging.cc" > "$OUT/smoke_ft.log"
echo "smoke rc=$?"; grep -v "^  File\|^Thread\|^$" "$OUT/smoke_ft.log" | tail -45
