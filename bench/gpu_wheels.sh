#!/usr/bin/env bash
# Wheels for the lent GPU machine (no network there), run here before the device's first call;
# `bench/gpu_check.sh` installs them there. Versions are this checkout's virtualenv's.
#   .whl/      what tokenmill imports that the machine's image lacks (msgspec, pyzmq, ...)
#   .whl/ref/  the test references CI uses: transformers and its hub stack, xgrammar (the
#              machine's transformers 5.17 gives another Gemma 2 reference than CI's); used
#              there only if they import together, else the machine's own are kept
# Usage: bash bench/gpu_wheels.sh   (then `run` with carry [".whl"]; ~30 MB)
set -eu
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
py=${PYTHON:-.venv/bin/python}
core="msgspec pyzmq gguf fastapi starlette pydantic pydantic_core annotated-types
      typing-inspection uvicorn tritonclient python-rapidjson"
ref="transformers tokenizers huggingface_hub httpx2 httpcore2 truststore hf-xet click
     safetensors regex xgrammar apache-tvm-ffi idna anyio typing_extensions"
fetch() {  # dest, names...
  local dest=$1; shift
  mkdir -p "$dest"
  for name in "$@"; do
    version=$("$py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform manylinux1_x86_64 -d "$dest" "$name==$version" 2>&1 | grep -v WARN || true
  done
}
# shellcheck disable=SC2086
fetch .whl $core
# shellcheck disable=SC2086
fetch .whl/ref $ref
du -sh .whl
