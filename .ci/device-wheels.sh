#!/usr/bin/env bash
# Fill .whl/ with the wheels that the GPU machine lacks, for Python 3.12 on x86-64.
# The GPU machine has no package index; its image already holds torch, torchvision,
# numpy, pandas, typer, pyyaml, rich and many more (list below). What it lacks
# (mlflow, pydantic, a build backend, ...) travels as wheels in .whl/.
#
# usage (from the project root):  bash .ci/device-wheels.sh [REQUIREMENT ...]   (then: bash .ci/gpu there, .whl carried)
#   default requirements: what the suite needs beyond the GPU machine's image (mlflow, pydantic, optuna, the build
#   backend, jsonschema, pytest-reportlog, nvidia-ml-py for the GPU's system metrics)
# `.ci/gpu` installs them into the GPU machine's own Python (not a --target folder: the suite starts
# mpsrun, mlflow and torchrun as subprocesses, which must find them).
set -euo pipefail
reqs=("$@"); [ ${#reqs[@]} -gt 0 ] || reqs=(mlflow pydantic hatchling editables optuna jsonschema pytest-reportlog nvidia-ml-py)
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$tmp" "${reqs[@]}" 2>&1 | grep -v '^WARNING' || true
# packages already on the GPU machine's image (read there on 2026-11-17)
present=" absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
 charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
 cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
 formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx humanize huggingface-hub hypothesis idna
 imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
 lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
 matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
 networkx ninja numba numba-cuda numpy numpyro onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax
 opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
 prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks
 pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
 pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy
 seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
 tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
 torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
 typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp "
mkdir -p .whl; rm -f .whl/*.whl
for f in "$tmp"/*.whl; do
  name=$(basename "$f" | cut -d- -f1 | tr 'A-Z_.' 'a-z--')
  case "$present" in *" $name "*|*" $name"$'\n'*) continue ;; esac
  cp "$f" .whl/
done
echo "$(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/ (the GPU call's tree may travel 64 MiB in all)"
