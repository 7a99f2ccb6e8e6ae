#!/usr/bin/env bash
# Wheels for a GPU machine that cannot reach a package registry: run here (where pip works), then carry the
# folder to the GPU machine; bench/gpu_checks.sh installs what it finds there before anything imports shardwise.
#
#   bash bench/gpu_wheels.sh [DIR]    # default .whl (ignored by git); about 6 MB
#
# The packages are those shardwise needs that the lent H200 image lacks (its package list of 2026-11-17 holds
# torch, numpy, pyyaml, safetensors, tokenizers, tqdm, jinja2, tensorboard and matplotlib, but neither pydantic
# nor torchao): pydantic with its own dependencies, torchao for optimize.float8 and adamw_8bit, and
# bitsandbytes for the paged AdamW (a fixed version: the tests do not need it). Each other one is
# taken at the version this checkout's .venv runs its tests with (torchao 0.18 loads its kernels on torch >= 2.11,
# the image's torch), built for the image's Python (3.12, x86-64 Linux); PY_VERSION changes that.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
dir=${1:-.whl}
py=.venv/bin/python
[[ -x $py ]] || { echo "no .venv here: run ./scripts/test once first (it sets up .venv)" >&2; exit 2; }
packages=(pydantic pydantic_core annotated-types typing-inspection typing_extensions torchao)
pins=()
for name in "${packages[@]}"; do
  pins+=("$name==$("$py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")")
done
pins+=("bitsandbytes==${BITSANDBYTES_VERSION:-0.50.2}")  # train.optimizer paged_adamw_8bit (not a test dependency)
mkdir -p "$dir"
rm -f "$dir"/*.whl  # one version of each: two of one package stop the install there
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  platforms+=(--platform "$p")
done
"$py" -m pip download --quiet --no-deps --only-binary=:all: --implementation cp --python-version "${PY_VERSION:-3.12}" \
  "${platforms[@]}" -d "$dir" "${pins[@]}"
ls -l "$dir"
