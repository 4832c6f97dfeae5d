"""Our own CPU kernels for int4, int8 and fp32 linears (cpu_kernels.cpp), built on the machine that runs them.

Why hand-written: on x86 CPUs with AVX2 but no AVX-512 (many edge boxes), torch's
`_weight_int4pack_mm_for_cpu` moves weights at 2-5 GB/s and `_weight_int8pack_mm` at about 8, so an
int4 SmolLM2 decoded at a third of llama.cpp's speed on the same two cores (its int8 output head
alone took 3.7 ms a token); inductor's generated int4 GEMV was slower still. No well-kept library
gives torch weight-only int4/int8 matmuls on such CPUs (llama.cpp's ggml has them, but not as torch
ops). The kernels do what ggml's Q4_1 x Q8_1 and Q8_0 x Q8_0 dots do (quantized activations, one
multiply-add instruction per 16 weights), on weights repacked into one stream per thread. For fp32
at one token a step, MKL and oneDNN read the weights at 4-6 GB/s on those CPUs against 10 for a
plain row-streaming dot product.

They are C++ against torch's own headers and runtime (`sits::int4_linear`, `sits::int8_linear`,
`sits::fp32_linear`: ops the dispatcher, eager code and inductor's compiled graphs call alike), so
they must be compiled against the torch that loads them. The first use on a machine compiles them with the
system C++ compiler (about 35 s on two cores) into `core.kernel_cache.kernel_cache_dir()` (an
agent's store, or the machine's cache for a local fleet), keyed by the source, torch's version and
the build flags; later loads take the cached library, with or without a compiler. A device without
one (the usual case) gets the library from the controller when it can run the controller's builds
(push/bootstrap.py, through `python -m deployer.agent.engines.torch.native --library`). On a CPU with
AVX-512 (where torch's kernels are fast), without the library and a compiler, or when the build
fails, `cpu_kernels` says why and the layers keep torch's kernels.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from deployer.core.kernel_cache import kernel_cache_dir

__all__ = [
    "BLOCK",
    "ROWS",
    "CpuKernels",
    "built_kernels",
    "cpu_kernels",
    "library_path",
    "pack_int4",
    "pack_int8",
]

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
ROWS = 4  # output rows packed together (ROWS in the source)
BLOCK = 32  # columns per activation block and per scale (BLOCK in the source)
FLAGS = ("-O3", "-std=c++17", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared")
BUILD_TIMEOUT_S = 600
_log = logging.getLogger("sits.agent")
_lock = threading.Lock()


@dataclass(frozen=True)
class CpuKernels:
    """The loaded ops: int4(x, packed, n), int8(x, packed, scale, n) (x fp32 or bf16 [rows, in])
    and fp32(x, w) (both fp32, w [out, in] as stored)."""

    int4: Callable[..., torch.Tensor]
    int8: Callable[..., torch.Tensor]
    fp32: Callable[..., torch.Tensor]


_loaded: tuple[CpuKernels | None, str] | None = None


def cpu_kernels() -> tuple[CpuKernels | None, str]:
    """The ops the layers should use on this CPU, or (None, why not): ours on AVX2 CPUs without
    AVX-512 (see built_kernels), torch's elsewhere."""
    capability = torch.backends.cpu.get_cpu_capability()
    machine = platform.machine()
    if machine not in ("x86_64", "AMD64"):  # an Arm board: torch's NEON/SVE kernels, never ours
        return None, f"ours are x86-64 (AVX2) code; on {machine} torch's own kernels serve ({capability})"
    if capability != "AVX2":
        # With AVX-512 torch's own kernels were fast already (compiled int4 at 1.26x llama.cpp).
        return None, f"torch's own kernels serve this CPU ({capability}); ours are for AVX2 without AVX-512"
    return built_kernels()


def built_kernels() -> tuple[CpuKernels | None, str]:
    """(the ops, "") once they are built and loaded in this process, on any CPU with AVX2 and FMA
    (AVX-512 CPUs have both: the tests run the kernels there too), else (None, why not). Builds on
    first use (see the module docstring); thread-safe, and tried once per process."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _load()
            if _loaded[0] is None:
                _log.info("quantized layers keep torch's CPU kernels: %s", _loaded[1])
        return _loaded


def pack_int4(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """The stored int4 layout (U8 [out, in/2], low nibble the even column; scale and zero per
    group of `group_size` columns) repacked for the kernel: per ROWS output rows and per BLOCK
    columns, the rows' nibbles, then each row's (scale, scale * zero) as float32."""
    out, half = weight.shape
    blocks = half * 2 // BLOCK
    per = group_size // BLOCK
    scale = scale.float().repeat_interleave(per, dim=1)
    shifted = scale * zero.float().repeat_interleave(per, dim=1)
    nibbles = weight.reshape(out // ROWS, ROWS, blocks, BLOCK // 2).transpose(1, 2)
    factors = torch.stack((scale, shifted), dim=-1).reshape(out // ROWS, ROWS, blocks, 2).transpose(1, 2)
    factor_bytes = factors.contiguous().view(torch.uint8).reshape(out // ROWS, blocks, ROWS * 8)
    return torch.cat(
        (nibbles.reshape(out // ROWS, blocks, ROWS * BLOCK // 2), factor_bytes), dim=-1
    ).contiguous()


def pack_int8(weight: torch.Tensor) -> torch.Tensor:
    """int8 weights [out, in] (scaled per output row) repacked for the kernel: per ROWS output
    rows and per BLOCK columns, the rows' BLOCK bytes."""
    out, n_in = weight.shape
    blocks = weight.reshape(out // ROWS, ROWS, n_in // BLOCK, BLOCK).transpose(1, 2)
    return blocks.contiguous().view(torch.uint8).reshape(out // ROWS, -1)


def _load() -> tuple[CpuKernels | None, str]:
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):  # torch says AVX2 only where FMA is there too
        return None, f"this CPU ({capability}) has no AVX2 and FMA for our kernels"
    try:
        library = _built()
        torch.ops.load_library(str(library))
        torch.library.register_fake("sits::int4_linear")(_int4_shape)
        torch.library.register_fake("sits::int8_linear")(_int8_shape)
        torch.library.register_fake("sits::fp32_linear")(_fp32_shape)
    except _NoCompiler:
        return None, "no C++ compiler to build our AVX2 kernels, and none built for this torch (install g++)"
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return None, f"our AVX2 kernels did not build or load: {str(exc).strip()[-300:]}"
    ops = torch.ops.sits
    return CpuKernels(ops.int4_linear, ops.int8_linear, ops.fp32_linear), ""


def _int4_shape(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """What the op returns, for torch.compile's tracing."""
    return x.new_empty((x.shape[0], n))


def _int8_shape(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
    """What the op returns, for torch.compile's tracing."""
    return x.new_empty((x.shape[0], n))


def _fp32_shape(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What the op returns, for torch.compile's tracing."""
    return x.new_empty((x.shape[0], w.shape[0]))


class _NoCompiler(Exception):
    """The library is not cached and there is no C++ compiler to build it."""


def _abi() -> str:
    return f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"


def library_path() -> Path:
    """Where this source built for this torch lies in the kernel cache. The name carries a hash of
    both and of the flags, not of the compiler: any compiler's build serves, so one built on a
    controller serves a device that has none (same CPU architecture, Python and libc)."""
    key = hashlib.sha256("\0".join((SOURCE.read_text(), torch.__version__, _abi(), *FLAGS)).encode())
    return kernel_cache_dir() / f"sits_cpu_kernels-{key.hexdigest()[:16]}.so"


def _built() -> Path:
    """The compiled library, from the cache or built into it now. Raises _NoCompiler."""
    from torch.utils import cpp_extension

    library = library_path()
    if library.exists():
        return library
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise _NoCompiler()
    cache = library.parent
    cache.mkdir(parents=True, exist_ok=True)
    # One build per machine: the agents of a local fleet start together and would each compile.
    with (cache / ".build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if library.exists():  # built while this process waited
            return library
        includes = [f"-I{path}" for path in cpp_extension.include_paths()]
        libraries = [f"-L{path}" for path in cpp_extension.library_paths()]
        with tempfile.TemporaryDirectory(dir=cache) as scratch:
            built = Path(scratch) / library.name
            command = [compiler, *FLAGS, _abi(), *includes, str(SOURCE), "-o", str(built), *libraries]
            command += ["-lc10", "-ltorch_cpu", "-ltorch"]
            done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            if done.returncode != 0:
                raise RuntimeError(done.stderr)
            built.replace(library)  # atomic: a reader never sees half a library
    return library


def _main(argv: list[str]) -> int:
    """scripts/setup.sh: build the kernels once, before agents or tests need them. `--library`
    (the controller, for its devices): build them whatever this CPU is, print the library's path."""
    if argv == ["--library"]:
        try:
            print(_built())
        except (_NoCompiler, OSError, RuntimeError, subprocess.SubprocessError) as exc:
            print(
                f"our CPU kernels did not build: {type(exc).__name__} {str(exc).strip()[-300:]}",
                file=sys.stderr,
            )
            return 1
        return 0
    found, why = built_kernels()
    print("our AVX2 CPU kernels:", f"built in {kernel_cache_dir()}" if found else f"not built: {why}")
    print("layers on this CPU use:", "ours" if cpu_kernels()[0] else f"torch's ({cpu_kernels()[1]})")
    return 0  # not built is no failure: the layers keep torch's kernels


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
