"""Native CPU kernels (C++ in csrc/), compiled on first use and cached.

load_cpu_kernels() returns the compiled module, or None when this CPU or machine cannot build
or run them (no AVX512-BF16, no C++ compiler, METERSERVE_CPU_KERNELS=0); callers then use the
plain-torch path, which is also the reference every kernel is tested against.

The build runs once per source version and CPU, in $METERSERVE_CACHE_DIR/kernels (default
~/.cache/meterserve/kernels), guarded by torch's file lock so concurrent processes wait for one
build (~40 s on two cores) instead of racing.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
SOURCES = [
    "bindings.cpp",
    "decode_stack_binding.cpp",
    "decode_stack.cpp",
    "small_batch_linear.cpp",
    "tile_matvec.cpp",
    "gguf_binding.cpp",
    "gguf_linear.cpp",
    "gguf_panel.cpp",
    "amx_linear.cpp",
    "int8_linear.cpp",
    "int8_linear_binding.cpp",
    "argmax.cpp",
    "sampling.cpp",
    "elementwise.cpp",
    "paged_attention.cpp",
    "prefill_attention.cpp",
]
HEADERS = [
    "amx.h",
    "binding_checks.h",
    "decode_stack.h",
    "decode_stack_binding.h",
    "gguf_binding.h",
    "gguf_blocks.h",
    "gguf_linear.h",
    "int8_linear_binding.h",
    "kernels.h",
    "numeric.h",
    "paged_attention_amx.h",
    "paged_attention_common.h",
    "paged_attention_scores.h",
    "vec.h",
]
# -march=native is safe: the module is built on the machine that runs it.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512_bf16")
ENV_SWITCH = "METERSERVE_CPU_KERNELS"


@functools.cache
def load_cpu_kernels():
    """The compiled kernels module, or None (reason logged once)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        log.info("CPU kernels disabled by %s=0", ENV_SWITCH)
        return None
    missing = [flag for flag in REQUIRED_CPU_FLAGS if flag not in _cpu_flags()]
    if missing:
        log.info("CPU kernels unavailable: this CPU lacks %s", ", ".join(missing))
        return None
    try:
        return _build()
    except Exception as exc:  # noqa: BLE001 - no compiler or ninja, a broken toolchain: fall back
        log.warning("CPU kernels failed to build, using plain torch: %s", str(exc)[-500:])
        return None


def _build():
    _put_ninja_on_path()
    from torch.utils.cpp_extension import load

    from engine.loader import cache_root

    build_dir = cache_root() / "kernels" / _source_digest()
    build_dir.mkdir(parents=True, exist_ok=True)
    return load(
        name="meterserve_cpu_kernels",
        sources=[str(SOURCE_DIR / name) for name in SOURCES],
        extra_cflags=CFLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        verbose=False,
    )


def _source_digest() -> str:
    digest = hashlib.sha256(" ".join(CFLAGS).encode())
    for name in SOURCES + HEADERS:
        digest.update((SOURCE_DIR / name).read_bytes())
    digest.update(_cpu_flags().encode())
    return digest.hexdigest()[:16]


@functools.cache
def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _put_ninja_on_path() -> None:
    """torch builds with the `ninja` executable; the pip package's lives in the venv's bin."""
    try:
        import ninja
    except ImportError:
        return
    bin_dir = str(Path(ninja.BIN_DIR))
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
