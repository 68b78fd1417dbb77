#!/usr/bin/env bash
# Source on the GPU machine (no package index there): installs the carried wheels
# (.whl, from ../shared/tools/device-wheels.sh) and this project, editable.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} \
  && python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null \
  || { echo "install failed"; exit 1; }
export PYTHONUNBUFFERED=1 MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR=false
