"""ModelRunner: owns the model weights, the KV cache tensors and the sampler.

execute(SchedulerOutput) -> RunnerOutput is the only entry point: build the forward batch,
run the model over the paged cache, compute logits only for rows that sample, sample. Rows
of a chunk that asks for prompt logprobs get logits too, in passes of their own, so a
request that does not ask pays nothing for it.
The runner never touches Request objects; it reads the scheduler's plain chunks.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from engine import batch_invariance
from engine.attention import make_backend
from engine.attention.kv_cache import KVCacheTensors
from engine.config import DEBUG_HANG_SECONDS, EngineConfig
from engine.draft_verification import sample_row_chunks, verify
from engine.forward_batch import build_lists, to_tensors
from engine.int8_calibration import input_maxima
from engine.kernels import load_avx2_kernels, load_cpu_kernels
from engine.kv_budget import available_memory_bytes
from engine.loader import LoadedCheckpoint, ModelLoadError
from engine.meter.cost_model import LOGIT_ROWS_PER_PASS, WeightBytes
from engine.models import MODEL_FAMILIES
from engine.models.decode_stack import build_decode_stack
from engine.models.gguf_linear import GGUFEmbedding, GGUFLinear, prepare_gguf_modules
from engine.models.int4_weights import quantize_linear_int4, quantize_linears_int4
from engine.models.int8_linear import Int8Linear, quantize_linear, quantize_linears
from engine.models.layer_ops import make_layer_ops
from engine.models.moe import SparseMoE
from engine.models.packed_linear import (
    SMALL_BATCH_ROWS,
    PackedLinear,
    pack_linears,
    packing_available,
)
from engine.sampler import Sampler
from engine.structured_output import StructuredOutputs
from scheduler.output import RunnerOutput, ScheduledChunk, SchedulerOutput, TokenLogprobs

log = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    """Raised on purpose (EngineConfig.debug_fault_token_id) to test fault handling."""


class InjectedCrash(BaseException):
    """Raised on purpose (EngineConfig.debug_crash_token_id): a BaseException, so no step
    handler catches it and the engine thread dies, to test that its death is reported."""


def resolve_dtype(name: str) -> torch.dtype:
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    # auto: bfloat16 where the CPU computes it natively (AVX512-BF16 / AMX), else float32.
    return torch.bfloat16 if _cpu_has_native_bf16() else torch.float32


def _cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _count_params(model) -> int:
    """Parameters of the model, a tied LM head counted once (it is the embedding). Every
    expert of a SparseMoE counts (its AMX tile layout holds exactly the expert's values); a
    GGUF layer's weight counts its logical [out, in] values, whatever its stored format."""
    tied = model.shape.tie_word_embeddings
    params = sum(
        p.numel() for name, p in model.named_parameters() if not (tied and name == "lm_head.weight")
    )
    gguf = sum(
        module.num_params
        for name, module in model.named_modules()
        if isinstance(module, GGUFLinear | GGUFEmbedding) and not (tied and name == "lm_head")
    )
    # An Int8Linear holds its weight as int8 codes, not parameters: still that many weights.
    int8 = sum(
        m.out_features * m.in_features + (0 if m.bias is None else m.bias.numel())
        for m in model.modules()
        if isinstance(m, Int8Linear)
    )
    experts = sum(m.gguf_expert_params for m in model.modules() if isinstance(m, SparseMoE))
    return params + gguf + int8 + experts


def _module_bytes(module: torch.nn.Module) -> tuple[int, int]:
    """(small-batch, large-batch) bytes of a module's own weights, not its children's."""
    if isinstance(module, PackedLinear | Int8Linear):
        return module.bytes_read(1), module.bytes_read(SMALL_BATCH_ROWS + 1)
    if isinstance(module, GGUFLinear):  # the stored blocks (large batches: its bf16 copy, if any)
        return module.bytes_read(1), module.bytes_read(module.blocks_rows() + 1)
    own = sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
    return own, own


def _tiled(module: torch.nn.Module) -> bool:
    """A GGUF linear reading its blocks past SMALL_BATCH_ROWS rows (the AMX tiles)."""
    return isinstance(module, GGUFLinear) and module.blocks_rows() > SMALL_BATCH_ROWS


class ModelRunner:
    def __init__(
        self, config: EngineConfig, checkpoint: LoadedCheckpoint, max_model_len: int
    ) -> None:
        self.dtype = resolve_dtype(config.dtype)
        if config.num_threads is not None:
            # Called on the thread that runs the steps: OpenMP's thread count is per thread,
            # and the native kernels' parallel regions follow it like torch's ops do.
            torch.set_num_threads(config.num_threads)
        self.block_size = config.block_size
        self.debug_fault_token_id = config.debug_fault_token_id
        self.debug_hang_token_id = config.debug_hang_token_id
        self.debug_crash_token_id = config.debug_crash_token_id
        self.kernels = load_cpu_kernels() if config.cpu_kernels else None
        self.batch_invariant = config.batch_invariant
        if self.batch_invariant:
            batch_invariance.check_supported(self.dtype, self.kernels, config.attention_backend)
        # Without the native kernels (a CPU without AVX-512), the AVX2 module's float32 decode
        # attention and layer operations, under the same names (its attention on any CPU when
        # asked for by name).
        wants_avx2 = self.kernels is None or config.attention_backend == "avx2"
        avx2_fallback = load_avx2_kernels() if config.cpu_kernels and wants_avx2 else None
        self.backend = make_backend(config.attention_backend, self.kernels, avx2_fallback)
        float32_avx2 = avx2_fallback if self.dtype == torch.float32 else None
        family = MODEL_FAMILIES[checkpoint.config.model_type]
        self.model = family(
            checkpoint.config,
            self.backend,
            max_model_len,
            self.dtype,
            make_layer_ops(self.kernels or float32_avx2),
        )
        self.num_int8_layers = 0  # linear layers quantized to int8 (--quantization int8)
        self.num_int4_layers = 0  # ... to Q4_1 blocks (--quantization int4)
        self.int8_input_maxima: dict[str, torch.Tensor] | None = None  # its smoothing's
        self.quantization = config.quantization
        if self.quantization != "none":  # each linear quantized as it loads: no whole bf16 model
            self._check_quantization(checkpoint)
            if self.quantization == "int8" and config.int8_smoothing:
                self.int8_input_maxima = input_maxima(Path(checkpoint.source))
            self.model.on_linear_loaded = self._quantize_loaded
        self.model.load_weights(checkpoint.weights)  # already in self.dtype
        self.model.eval()
        self.shape = self.model.shape
        self.num_params = _count_params(self.model)
        if self.quantization == "int4":  # the layers with a bias, now that it is loaded
            del self.model.on_linear_loaded
            self.num_int4_layers += quantize_linears_int4(
                self.model, self.dtype, self._kept_in_bf16()
            )
            log.info("%d linear layers quantized to int4 (Q4_1 blocks)", self.num_int4_layers)
        # A GGUF model's linear layers that read the file's blocks with the native kernels.
        gguf_kernels = self.kernels if config.gguf_matvec else None
        f32_gguf = self.dtype == torch.float32 and checkpoint.gguf_path is not None
        avx2 = (
            load_avx2_kernels() if f32_gguf and config.gguf_matvec and config.cpu_kernels else None
        )
        # int4 is for the bytes: its layers keep no bf16 copy for large batches.
        large_batch_bf16 = (
            self.quantization != "int4"
            and not self.batch_invariant  # the copy rounds the weights
            and _wants_bf16_copy(
                config.gguf_large_batch, gguf_kernels, _bf16_copy_bytes(self.model)
            )
        )
        int8_inputs = config.gguf_activations == "int8"
        self.num_gguf_matvec_layers = prepare_gguf_modules(
            self.model, gguf_kernels, self.dtype, large_batch_bf16, avx2, int8_inputs
        )
        native_gguf = gguf_kernels and self.dtype == torch.bfloat16
        if int8_inputs and not ((native_gguf or avx2) and self.num_gguf_matvec_layers):
            raise ValueError(
                "gguf_activations='int8' needs a GGUF model's blocks read by the native kernels "
                "(bfloat16 with AVX512-BF16, or float32 with AVX2); "
                f"{config.model} has no such layer here"
            )
        if self.quantization == "int8":
            del self.model.on_linear_loaded
            self.num_int8_layers += quantize_linears(
                self.model, self.kernels, self._kept_in_bf16(), self.int8_input_maxima
            )
            log.info(
                "%d linear layers quantized to int8 (LM head and routers kept in bf16)",
                self.num_int8_layers,
            )
        if self.dtype == torch.bfloat16 and packing_available():
            pack_linears(self.model, self.kernels)  # float (safetensors, F16 GGUF) layers
        if self.batch_invariant:
            batch_invariance.make_batch_invariant(self.model)
        self.sampler = Sampler(kernels=self.kernels)
        # Grammar matchers of constrained requests, beside the sampler (same lifetime rule).
        self.structured = StructuredOutputs(checkpoint.tokenizer, self.shape.vocab_size)
        self.kv_cache: KVCacheTensors | None = None
        self.num_experts_run = 0  # of the last execute() (a MoE model's expert weight reads)
        self.expert_bytes_run = 0  # their bytes

    def _check_quantization(self, checkpoint: LoadedCheckpoint) -> None:
        """--quantization int8/int4 needs bf16 activations and the kernels, and a float
        checkpoint: a GGUF file's weights are already quantized, and are served in their own
        blocks."""
        flag = f"--quantization {self.quantization}"
        if checkpoint.gguf_path is not None:
            raise ModelLoadError(
                f"{flag} applies to safetensors checkpoints; a GGUF file is served "
                "in its own quantized blocks"
            )
        if self.dtype != torch.bfloat16:
            raise ModelLoadError(
                f"{flag} needs bfloat16 activations; this model serves in {self.dtype}"
                " (--dtype bfloat16 needs a CPU with AVX512-BF16)"
            )
        if self.kernels is None:
            raise ModelLoadError(f"{flag} needs the native CPU kernels (unavailable)")

    def _kept_in_bf16(self) -> tuple[torch.nn.Module, ...]:
        """Linears --quantization leaves in bf16: the LM head (tied to the embedding), and
        each mixture-of-experts router, whose logits pick the experts: a rounding there moves
        a token to other experts, and it reads a few kilobytes a token (vLLM keeps its gates
        unquantized too)."""
        routers = (m.gate for m in self.model.modules() if isinstance(m, SparseMoE))
        return (self.model.lm_head, *routers)

    def _quantize_loaded(self, name: str) -> None:
        if self.quantization == "int4":
            self.num_int4_layers += quantize_linear_int4(self.model, name, self.dtype)
        else:
            self.num_int8_layers += quantize_linear(
                self.model, name, self.kernels, self.int8_input_maxima
            )

    def draft_step_rows(self) -> int:
        """SchedulerConfig.draft_step_rows: the rows a GGUF model's decode steps run on its
        blocks' AMX tiles, all layers in the decode stack's one native call; a step of more rows
        goes through the Python layer loop on the bf16 copy (4x the bytes) or the panels, and
        every drafted row also costs its attention and LM head row (135M, 2-core AMX Xeon,
        served: 8 clients with 12 drafts each 439 tok/s, with 3 each 522). 0 elsewhere: no
        such step in cost was measured there."""
        return max((m.tile_rows for m in self.model.modules() if _tiled(m)), default=0)

    def weight_bytes(self) -> WeightBytes:
        """Weight bytes a forward pass reads, per path, as the layers are laid out now."""
        head = self.model.lm_head
        body_small = body_large = expert = tiled_small = tiled_large = tile_rows = 0
        # A GGUF linear's bf16 copy is a child module; its bytes are its owner's large path.
        copies = {id(m.large) for m in self.model.modules() if isinstance(m, GGUFLinear)}
        for name, module in self.model.named_modules():
            if module is head or name == "embed_tokens" or id(module) in copies:
                continue
            if isinstance(module, SparseMoE):  # its own tensors are the experts; the router
                expert = module.bytes_per_expert  # is a child linear, in the body
                continue
            small, large = _module_bytes(module)
            if _tiled(module):
                tiled_small, tiled_large = tiled_small + small, tiled_large + large
                tile_rows = module.blocks_rows()
            else:
                body_small, body_large = body_small + small, body_large + large
        head_small, head_large = _module_bytes(head)
        row = self.shape.hidden_size * self.dtype_bytes
        small_rows = SMALL_BATCH_ROWS if self.kernels is not None else 0
        stack = self.model.decode_stack  # built with the KV cache: call after allocate_kv_cache
        stack_rows = 0 if stack is None else stack.max_rows
        return WeightBytes(
            body_small,
            body_large,
            head_small,
            head_large,
            row,
            small_rows,
            stack_rows,
            expert,
            tile_rows,
            tiled_small,
            tiled_large,
            head_rows=head.blocks_rows() if _tiled(head) else None,
        )

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def kv_bytes_per_block(self) -> int:
        s = self.shape
        return KVCacheTensors.bytes_per_block(
            s.num_layers, self.block_size, s.num_kv_heads, s.head_dim, self.dtype
        )

    def allocate_kv_cache(self, num_blocks: int) -> None:
        s = self.shape
        self.kv_cache = KVCacheTensors.allocate(
            s.num_layers, num_blocks, self.block_size, s.num_kv_heads, s.head_dim, self.dtype
        )
        # The stack runs the small-batch kernels, which round unlike the batch-invariant paths.
        self.model.decode_stack = None
        if not self.batch_invariant:
            self.model.decode_stack = build_decode_stack(self.model, self.kv_cache, self.kernels)

    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        self.sampler.forget(output.finished_request_ids)
        self.structured.forget(output.finished_request_ids)
        result = RunnerOutput()
        self.num_experts_run = self.expert_bytes_run = 0
        if output.is_empty:
            return result
        self._maybe_inject_fault(output)
        lists = build_lists(output.chunks, self.block_size, self.batch_invariant)
        batch = to_tensors(lists, self.block_size, self.dtype)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_cache, batch.meta)
        # Distinct (layer, expert) pairs the forward ran, for the meter (0: no experts).
        self.num_experts_run = getattr(self.model, "num_experts_run", 0)
        self.expert_bytes_run = getattr(self.model, "expert_bytes_run", 0)
        if any(c.num_prompt_logprob_rows for c in output.chunks):
            result.prompt_logprobs = self._prompt_logprobs(hidden, output.chunks)
        sampling_chunks = [c for c in output.chunks if c.samples]
        if not sampling_chunks:
            return result
        logits = self.model.compute_logits(hidden[batch.sample_rows])
        row_chunks = sample_row_chunks(sampling_chunks)  # a chunk with drafts: a row each
        bitmask = self.structured.bitmask(row_chunks)  # None: no constrained row
        token_ids, logprobs = self.sampler.sample(logits, row_chunks, bitmask)
        for chunk, verdict in zip(
            sampling_chunks, verify(sampling_chunks, token_ids, logprobs), strict=True
        ):
            result.sampled_token_ids[chunk.request_id] = verdict.token_id
            if verdict.logprobs is not None:
                result.logprobs[chunk.request_id] = verdict.logprobs
            if chunk.draft_token_ids:
                result.accepted_draft_token_ids[chunk.request_id] = verdict.accepted
                if chunk.sampling_params.logprobs is not None:
                    result.accepted_logprobs[chunk.request_id] = [
                        entry for entry in verdict.accepted_logprobs if entry is not None
                    ]
        return result

    def _prompt_logprobs(
        self, hidden: torch.Tensor, chunks: list[ScheduledChunk]
    ) -> dict[str, list[TokenLogprobs]]:
        """Each chunk's prompt logprobs: at position p in [prompt_logprobs_start,
        prompt_logprobs_end), prompt token p + 1 under log_softmax of the raw logits at p
        (float32; no penalty, bias or temperature applies to a prompt), with its rank and the
        chunk's top-k. Chunk c owns batch rows [query_start_c, query_start_c + n_c), position
        p sitting at row query_start_c + p - start_position_c (as in build_lists)."""
        rows: list[int] = []
        targets: list[int] = []
        tops: list[int] = []
        query_start = 0
        for chunk in chunks:
            positions = range(chunk.prompt_logprobs_start, chunk.prompt_logprobs_end)
            rows.extend(query_start + p - chunk.start_position for p in positions)
            targets.extend(chunk.prompt_token_ids[p + 1] for p in positions)
            tops.extend([chunk.sampling_params.prompt_logprobs or 0] * len(positions))
            query_start += len(chunk.token_ids)
        entries: list[TokenLogprobs] = []
        for first in range(0, len(rows), LOGIT_ROWS_PER_PASS):
            last = first + LOGIT_ROWS_PER_PASS
            entries.extend(
                self._logprob_entries(
                    hidden[torch.tensor(rows[first:last])], targets[first:last], tops[first:last]
                )
            )
        result: dict[str, list[TokenLogprobs]] = {}
        first = 0
        for chunk in chunks:
            if chunk.num_prompt_logprob_rows:
                result[chunk.request_id] = entries[first : first + chunk.num_prompt_logprob_rows]
                first += chunk.num_prompt_logprob_rows
        return result

    def _logprob_entries(
        self, hidden: torch.Tensor, targets: list[int], tops: list[int]
    ) -> list[TokenLogprobs]:
        """One LM-head pass: row i's logprob of targets[i], its rank, and its top tops[i]."""
        logprobs = torch.log_softmax(self.model.compute_logits(hidden).float(), dim=-1)
        chosen = logprobs.gather(1, torch.tensor(targets)[:, None])
        ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
        top_values, top_ids = torch.topk(logprobs, max(tops), dim=1)
        top_values_list, top_ids_list = top_values.tolist(), top_ids.tolist()
        return [
            TokenLogprobs(
                token_id=token_id,
                logprob=logprob,
                top_token_ids=top_ids_list[i][: tops[i]],
                top_logprobs=top_values_list[i][: tops[i]],
                rank=ranks[i],
            )
            for i, (token_id, logprob) in enumerate(
                zip(targets, chosen[:, 0].tolist(), strict=True)
            )
        ]

    def _maybe_inject_fault(self, output: SchedulerOutput) -> None:
        def holds(token_id: int | None) -> bool:
            return token_id is not None and any(token_id in c.token_ids for c in output.chunks)

        if holds(self.debug_hang_token_id):
            log.warning("injected hang: sleeping %.0f s", DEBUG_HANG_SECONDS)
            time.sleep(DEBUG_HANG_SECONDS)
        if holds(self.debug_crash_token_id):
            raise InjectedCrash(
                f"injected crash: a chunk contains token id {self.debug_crash_token_id}"
            )
        fault = self.debug_fault_token_id
        if holds(fault):
            raise InjectedFault(f"injected fault: a chunk contains token id {fault}")


# "auto" keeps a GGUF model's bf16 copy (without AMX) only while it takes at most this share of
# the memory still available: the rest is for the KV budget (a fraction of what is left) and a
# step's working memory. A 7B Q4_K_M (a 13 GB copy) on a 24 GiB machine reads its blocks.
BF16_COPY_MEMORY_SHARE = 0.5


def _wants_bf16_copy(
    gguf_large_batch: str, kernels, copy_bytes: int = 0, available: int | None = None
) -> bool:
    """EngineConfig.gguf_large_batch: "auto" keeps a bf16 copy only where the GGUF panels have
    no AMX tiles to run on, and only when the copy (copy_bytes) fits in
    BF16_COPY_MEMORY_SHARE of the available memory (kv_budget.available_memory_bytes)."""
    if gguf_large_batch != "auto":
        return gguf_large_batch == "bf16"
    if kernels is None:  # the layers become plain bf16 linears: no blocks to read
        return True
    if kernels.amx_available():
        return False
    available = available_memory_bytes() if available is None else available
    fits = copy_bytes <= BF16_COPY_MEMORY_SHARE * available
    if not fits:
        log.info(
            "GGUF large batches read the blocks: a bf16 copy (%.2f GB) would take more than "
            "%.0f%% of the %.2f GB available (--gguf-large-batch bf16 keeps one anyway)",
            copy_bytes / 1e9,
            100 * BF16_COPY_MEMORY_SHARE,
            available / 1e9,
        )
    return fits


def _bf16_copy_bytes(model: torch.nn.Module) -> int:
    """Bytes a bf16 copy of every GGUFLinear's weight would take."""
    return sum(2 * m.num_params for m in model.modules() if isinstance(m, GGUFLinear))
