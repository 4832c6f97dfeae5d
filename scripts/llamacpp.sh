#!/usr/bin/env bash
# llama.cpp as this project runs it: llama-cpp-python's sdist with scripts/llama-cpp-*.patch
# applied to the llama.cpp it vendors, built once and cached by content hash.
#
#   scripts/llamacpp.sh wheel    the path of the llama-cpp-python wheel (built if missing)
#   scripts/llamacpp.sh server   the path of llama.cpp's llama-server from the same patched
#                                sources and CMake flags (bench/serve.py's peer; built if missing)
#
# The cache key is the version, the CMake flags and the patches, so a changed patch builds anew.
# The wheel's version carries the key as a local label (0.3.36+sits.<key>), so pip tells it from
# PyPI's, and it is also put in <cache>/llama-cpp/wheels, where the device wheelhouse finds it
# (deployer/push/wheelhouse.py).
#
# CMAKE_ARGS (default -DGGML_NATIVE=OFF): the wheel goes to devices, which may lack this CPU's
# extensions; see scripts/setup.sh for what other flags measured.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${SITS_VENV:-$ROOT/.venv}/bin/python"
VERSION=0.3.36  # the patches are made against this version's vendored llama.cpp
CMAKE_FLAGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF}"
CACHE="${SITS_CACHE_DIR:-$HOME/.cache/sits-deployer}/llama-cpp"
PATCHES=("$ROOT"/scripts/llama-cpp-*.patch)

KEY="$({ echo "$VERSION $CMAKE_FLAGS"; cat "${PATCHES[@]}"; } | sha256sum | cut -c1-12)"
DIR="$CACHE/$KEY"
SRC="$DIR/llama_cpp_python-$VERSION"

log() { printf '\033[1m[llamacpp]\033[0m %s\n' "$*" >&2; }

# The sdist unpacked into $SRC with the patches applied and the local version set (once).
prepare_source() {
    [ -f "$SRC/.sits-patched" ] && return 0
    rm -rf "$SRC" "$DIR/sdist"
    mkdir -p "$DIR/sdist"
    "$PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$DIR/sdist" "llama-cpp-python==$VERSION" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2) >&2
    tar -xzf "$DIR/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$DIR"
    for patch in "${PATCHES[@]}"; do
        patch -s -p1 -d "$SRC" < "$patch"
    done
    sed -i "s/^__version__ = \"$VERSION\"$/__version__ = \"$VERSION+sits.$KEY\"/" "$SRC/llama_cpp/__init__.py"
    grep -q "+sits.$KEY" "$SRC/llama_cpp/__init__.py"
    touch "$SRC/.sits-patched"
}

build_wheel() {
    local wheel
    wheel="$(ls "$DIR"/wheels/llama_cpp_python-*.whl 2>/dev/null | head -1 || true)"
    if [ -z "$wheel" ]; then
        prepare_source
        log "compiling llama.cpp into a llama-cpp-python wheel (5-10 minutes, silent)"
        local started=$SECONDS
        CMAKE_ARGS="$CMAKE_FLAGS" "$PYTHON" -m pip wheel -q --no-deps --wheel-dir "$DIR/wheels.tmp" "$SRC" >&2
        mv "$DIR/wheels.tmp" "$DIR/wheels"
        log "compiled in $((SECONDS - started)) s"
        wheel="$(ls "$DIR"/wheels/llama_cpp_python-*.whl)"
    fi
    # The one llama-cpp-python wheel the device wheelhouse may pick up: this build's.
    mkdir -p "$CACHE/wheels"
    find "$CACHE/wheels" -name 'llama_cpp_python-*.whl' ! -name "$(basename "$wheel")" -delete
    cp -n "$wheel" "$CACHE/wheels/"
    echo "$wheel"
}

build_server() {
    local server="$SRC/vendor/llama.cpp/build/bin/llama-server"
    if [ ! -x "$server" ]; then
        prepare_source
        log "compiling llama-server from the same sources (5 minutes, once)"
        # shellcheck disable=SC2086  # the flags are separate words
        cmake -S "$SRC/vendor/llama.cpp" -B "$SRC/vendor/llama.cpp/build" -DCMAKE_BUILD_TYPE=Release \
            -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF $CMAKE_FLAGS > "$DIR/server-build.log" 2>&1
        cmake --build "$SRC/vendor/llama.cpp/build" --target llama-server -j2 >> "$DIR/server-build.log" 2>&1 \
            || { log "llama-server failed to build: see $DIR/server-build.log"; exit 1; }
    fi
    echo "$server"
}

mkdir -p "$CACHE"
exec 9> "$CACHE/.lock"
flock 9  # one build at a time (setup and a bench may ask at once)

case "${1:-}" in
    wheel) build_wheel ;;
    server) build_server ;;
    *) echo "usage: $0 wheel|server" >&2; exit 2 ;;
esac
