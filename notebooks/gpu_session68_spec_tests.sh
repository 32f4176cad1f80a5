#!/bin/bash
# Session 68: tests/test_draft_model.py and tests/test_speculative.py (both float32 now) on an H200.
#   bash notebooks/gpu_session68_spec_tests.sh     # on nvidia-h200
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export JAX_PLATFORMS=cuda PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
timeout 500 python3 -m pytest -q -p no:cacheprovider tests/test_draft_model.py tests/test_speculative.py 2>&1 | grep -E "passed|failed|Error|^E  |^FAILED" | tail -25
