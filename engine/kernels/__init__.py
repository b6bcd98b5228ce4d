"""Native CPU kernels (C++ in csrc/), compiled on first use and cached.

load_cpu_kernels() returns the compiled module, or None when this CPU or machine cannot build
or run them (no AVX512-BF16, no C++ compiler, METERSERVE_CPU_KERNELS=0); callers then use the
plain-torch path, which is also the reference every kernel is tested against.

load_avx2_kernels() returns a second, small module (csrc_avx2/) for CPUs with AVX2 + FMA + F16C
(every x86 CPU the AVX-512 one needs, and those without AVX-512: AMD Zen 2/3, older Xeons): the
float32 GGUF path (gguf_matvec_f32, gguf_panel_f32, gguf_dequantize_f32, and gguf_matvec_int8
for gguf_activations "int8"), so such a CPU serves a GGUF from its blocks, and float32 decode
attention over the paged cache (paged_decode_attention_f32) and a decoder layer's row-wise
operations under the native module's names (rms_norm, add_rms_norm_, silu_and_mul, rotary_,
...). It is built with explicit ISA flags, not -march=native, so it computes the same sums on
every CPU.

The build runs once per source version, CPU and checkout, in $METERSERVE_CACHE_DIR/kernels
(default ~/.cache/meterserve/kernels), guarded by an flock (build_lock.py) so concurrent processes wait
for one build (~40 s on two cores) instead of racing, and a build killed midway does not leave
torch's lock file to hang every later start.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from pathlib import Path

from engine.kernels.build_lock import build_lock

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
SOURCES = [
    "bindings.cpp",
    "decode_stack_binding.cpp",
    "decode_stack.cpp",
    "small_batch_linear.cpp",
    "tile_matvec.cpp",
    "vector_linear.cpp",
    "gguf_binding.cpp",
    "gguf_linear.cpp",
    "gguf_int8.cpp",
    "gguf_panel.cpp",
    "gguf_tiles.cpp",
    "amx_linear.cpp",
    "moe_experts.cpp",
    "vector_grouped_linear.cpp",
    "moe_route.cpp",
    "moe_binding.cpp",
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
    "moe_binding.h",
    "numeric.h",
    "paged_attention_amx.h",
    "paged_attention_common.h",
    "paged_attention_scores.h",
    "tile_matvec.h",
    "vec.h",
    "vector_linear.h",
    "vector_tile.h",
]
# -march=native is safe: the module is built on the machine that runs it.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512_bf16")
ENV_SWITCH = "METERSERVE_CPU_KERNELS"
AVX2_SOURCE_DIR = Path(__file__).parent / "csrc_avx2"
AVX2_SOURCES = [
    "bindings.cpp",
    "gguf_f32.cpp",
    "gguf_formats.cpp",
    "gguf_int8.cpp",
    "layer_ops.cpp",
    "paged_attention.cpp",
]
AVX2_HEADERS = ["avx2_kernels.h", "gguf_formats.h"]
AVX2_CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-std=c++17"]
AVX2_CPU_FLAGS = ("avx2", "fma", "f16c")


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


@functools.cache
def load_avx2_kernels():
    """The AVX2 module (module docstring), or None (reason logged once)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    flags = _cpu_flags().split()
    missing = [flag for flag in AVX2_CPU_FLAGS if flag not in flags]
    if missing:
        log.info("AVX2 kernels unavailable: this CPU lacks %s", ", ".join(missing))
        return None
    try:
        return _build(
            "meterserve_avx2_kernels", AVX2_SOURCE_DIR, AVX2_SOURCES, AVX2_HEADERS, AVX2_CFLAGS
        )
    except Exception as exc:  # noqa: BLE001 - as load_cpu_kernels
        log.warning("AVX2 kernels failed to build, using plain torch: %s", str(exc)[-500:])
        return None


def _build(
    name: str = "meterserve_cpu_kernels",
    source_dir: Path = SOURCE_DIR,
    sources: list[str] = SOURCES,
    headers: list[str] = HEADERS,
    cflags: list[str] = CFLAGS,
):
    _put_ninja_on_path()
    from torch.utils.cpp_extension import load

    from engine.loader import cache_root

    build_dir = cache_root() / "kernels" / _source_digest(source_dir, sources + headers, cflags)
    build_dir.mkdir(parents=True, exist_ok=True)
    with build_lock(build_dir):
        return load(
            name=name,
            sources=[str(source_dir / s) for s in sources],
            extra_cflags=cflags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )


def _source_digest(source_dir: Path, files: list[str], cflags: list[str]) -> str:
    digest = hashlib.sha256(" ".join(cflags).encode())
    for name in files:
        digest.update((source_dir / name).read_bytes())
    digest.update(_cpu_flags().encode())
    # torch writes the sources' and the environment's absolute paths into build.ninja, so two
    # checkouts (or venvs) sharing a build directory would each rebuild over the other's build,
    # and a server starting in one would wait minutes on the other's compile: one each.
    digest.update(f"{source_dir.resolve()} {sys.prefix}".encode())
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
