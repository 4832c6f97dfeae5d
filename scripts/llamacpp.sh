#!/usr/bin/env bash
# llama.cpp as this project runs it: llama-cpp-python's sdist with scripts/llama-cpp-*.patch
# applied to the llama.cpp it vendors, built once and cached by content hash.
#
#   scripts/llamacpp.sh wheel [ARCH]   the path of the llama-cpp-python wheel for CPU architecture
#                                      ARCH (default: this machine's), built if missing; another
#                                      ARCH (aarch64) is cross-compiled here
#   scripts/llamacpp.sh server         the path of llama.cpp's llama-server from the same patched
#                                      sources and CMake flags (bench/serve.py's peer; built if missing)
#
# The cache key is the version, the architecture, the CMake flags and the patches, so a changed
# patch builds anew. The wheel's version carries the key as a local label (0.3.36+sits.<key>), so
# pip tells it from PyPI's, and it is also put where the device wheelhouse finds it
# (deployer/push/wheelhouse.py): <cache>/llama-cpp/wheels for this machine's architecture,
# <cache>/llama-cpp/wheels-<ARCH> for another.
#
# CMAKE_ARGS (default -DGGML_NATIVE=OFF): the wheel goes to devices, which may lack this CPU's
# extensions; see scripts/setup.sh for what other flags measured.
#
# Cross-compiling for arm64 (aarch64) devices: Debian's g++-aarch64-linux-gnu (installed here when
# missing and we are root, else named) with scripts/aarch64-linux-gnu.cmake. llama-cpp-python
# loads libllama through ctypes, so no Python of the target is needed, only its tag on the wheel.
# The ARM baseline is armv8.2-a with dotprod and fp16 (SITS_ARM_ARCH to change it): Jetson Orin,
# Raspberry Pi 5 and RK3588 boards all have them, and sdot is what Q8_0 and K-quant decode runs
# on; a Raspberry Pi 4 (armv8.0) needs SITS_ARM_ARCH=armv8-a. Our patches are x86 code (AVX2
# prefetch in llamafile's sgemm): they are applied to x86-64 builds only.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${SITS_VENV:-$ROOT/.venv}/bin/python"
VERSION=0.3.36  # the patches are made against this version's vendored llama.cpp
HOST_ARCH="$(uname -m)"
ARCH="${2:-$HOST_ARCH}"
CACHE="${SITS_CACHE_DIR:-$HOME/.cache/sits-deployer}/llama-cpp"
PATCHES=()
WHEELS="$CACHE/wheels"  # where the wheelhouse looks for our builds (deployer/push/wheelhouse.py)
case "$ARCH" in
    "$HOST_ARCH")
        CMAKE_FLAGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF}"
        [ "$ARCH" = x86_64 ] && PATCHES=("$ROOT"/scripts/llama-cpp-*.patch)
        ;;
    aarch64)
        TOOLCHAIN="$ROOT/scripts/aarch64-linux-gnu.cmake"
        CMAKE_FLAGS="-DCMAKE_TOOLCHAIN_FILE=$TOOLCHAIN -DGGML_NATIVE=OFF"
        CMAKE_FLAGS+=" -DGGML_CPU_ARM_ARCH=${SITS_ARM_ARCH:-armv8.2-a+dotprod+fp16} ${CMAKE_ARGS:-}"
        WHEELS="$CACHE/wheels-$ARCH"
        ;;
    *) echo "llamacpp.sh: cannot build for $ARCH here (this machine's $HOST_ARCH, or aarch64)" >&2; exit 2 ;;
esac

# A cross build's key has the toolchain's text, not its path (which names this checkout).
KEY="$({ echo "$VERSION ${CMAKE_FLAGS//$ROOT/}"; cat ${PATCHES[@]+"${PATCHES[@]}"} ${TOOLCHAIN:-}; } \
    | sha256sum | cut -c1-12)"
DIR="$CACHE/$KEY"
SRC="$DIR/llama_cpp_python-$VERSION"

log() { printf '\033[1m[llamacpp]\033[0m %s\n' "$*" >&2; }

# The cross compiler for $ARCH: installed when missing (root with apt-get), else named.
need_cross_toolchain() {
    local packages="gcc-$ARCH-linux-gnu g++-$ARCH-linux-gnu"
    command -v "$ARCH-linux-gnu-g++" >/dev/null && return 0
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        log "installing the $ARCH cross compilers ($packages) to build for $ARCH devices"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $packages >/dev/null
    else
        log "building llama-cpp-python for $ARCH devices needs a cross compiler: sudo apt-get install $packages"
        exit 1
    fi
}

# The sdist unpacked into $SRC with the patches applied and the local version set (once).
prepare_source() {
    [ -f "$SRC/.sits-patched" ] && return 0
    rm -rf "$SRC" "$DIR/sdist"
    mkdir -p "$DIR/sdist"
    "$PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$DIR/sdist" "llama-cpp-python==$VERSION" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2) >&2
    tar -xzf "$DIR/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$DIR"
    for patch in ${PATCHES[@]+"${PATCHES[@]}"}; do
        patch -s -p1 -d "$SRC" < "$patch"
    done
    sed -i "s/^__version__ = \"$VERSION\"$/__version__ = \"$VERSION+sits.$KEY\"/" "$SRC/llama_cpp/__init__.py"
    grep -q "+sits.$KEY" "$SRC/llama_cpp/__init__.py"
    touch "$SRC/.sits-patched"
}

# A cross-built wheel retagged manylinux_2_<N>_$ARCH, N the newest glibc symbol its libraries
# need (what auditwheel reads; Debian 12's cross glibc makes 2.34), so a device with an older glibc
# (JetPack 5's 2.31) is refused by the wheelhouse, not by the loader on the device. Prints its path.
glibc_tag() {
    local wheel="$1" libs minor
    libs="$(mktemp -d)"
    unzip -q "$wheel" '*.so*' -d "$libs"
    minor="$(find "$libs" -type f -exec "$ARCH-linux-gnu-objdump" -T {} + | grep -o 'GLIBC_2\.[0-9]*' \
        | cut -d. -f2 | sort -n | tail -1)"
    rm -rf "$libs"
    "$PYTHON" - "$wheel" "manylinux_2_${minor}_$ARCH" <<'PY'
import base64, hashlib, os, sys, zipfile
src, tag = sys.argv[1], sys.argv[2]
old = src.rsplit("-", 1)[1].removesuffix(".whl")
dest = src.removesuffix(f"{old}.whl") + f"{tag}.whl"
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest + ".tmp", "w", zipfile.ZIP_DEFLATED) as zout:
    names = zin.namelist()
    wheel_file = next(n for n in names if n.endswith(".dist-info/WHEEL"))
    meta = zin.read(wheel_file).decode().replace(f"-{old}\n", f"-{tag}\n").encode()
    digest = base64.urlsafe_b64encode(hashlib.sha256(meta).digest()).rstrip(b"=").decode()
    for name in names:
        data = meta if name == wheel_file else zin.read(name)
        if name.endswith(".dist-info/RECORD"):  # the WHEEL file's hash and size as they are now
            data = "".join(
                f"{wheel_file},sha256={digest},{len(meta)}\n" if line.startswith(f"{wheel_file},") else line
                for line in data.decode().splitlines(keepends=True)
            ).encode()
        zout.writestr(zin.getinfo(name), data)
os.replace(dest + ".tmp", dest)
os.remove(src)
print(dest)
PY
}

build_wheel() {
    local wheel
    wheel="$(ls "$DIR"/wheels/llama_cpp_python-*.whl 2>/dev/null | head -1 || true)"
    if [ -z "$wheel" ]; then
        [ "$ARCH" = "$HOST_ARCH" ] || need_cross_toolchain
        prepare_source
        log "compiling llama.cpp into a llama-cpp-python wheel for $ARCH (5-10 minutes, silent)"
        local started=$SECONDS
        rm -rf "$DIR/wheels.tmp"
        # _PYTHON_HOST_PLATFORM: the platform tag scikit-build-core gives the wheel (the target's).
        CMAKE_ARGS="$CMAKE_FLAGS" _PYTHON_HOST_PLATFORM="linux-$ARCH" \
            "$PYTHON" -m pip wheel -q --no-deps --wheel-dir "$DIR/wheels.tmp" "$SRC" >&2
        mv "$DIR/wheels.tmp" "$DIR/wheels"
        log "compiled in $((SECONDS - started)) s"
        wheel="$(ls "$DIR"/wheels/llama_cpp_python-*.whl)"
    fi
    case "$wheel" in *-linux_"$ARCH".whl) [ -n "${TOOLCHAIN:-}" ] && wheel="$(glibc_tag "$wheel")" ;; esac
    # The one llama-cpp-python wheel for $ARCH the device wheelhouse may pick up: this build's.
    mkdir -p "$WHEELS"
    find "$WHEELS" -name 'llama_cpp_python-*.whl' ! -name "$(basename "$wheel")" -delete
    cp -n "$wheel" "$WHEELS/"
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
# One build at a time (setup and a bench may ask at once); a cross build shares no folder with
# this machine's, so it has a lock of its own.
exec 9> "$CACHE/.lock${TOOLCHAIN:+-$ARCH}"
flock 9

case "${1:-}" in
    wheel) build_wheel ;;
    server) build_server ;;
    *) echo "usage: $0 wheel|server" >&2; exit 2 ;;
esac
