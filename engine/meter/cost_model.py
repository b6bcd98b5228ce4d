"""CostModel: analytic FLOPs and bytes moved for one engine step (pure Python, no torch).

Counts follow the decoder layer of the llama family (Llama, SmolLM2, Mistral, Qwen2, Qwen3):
per new token and per layer

    QKV projection     2 * hidden * (q_dim + 2 * kv_dim)       q_dim = heads * head_dim
    attention scores   2 * q_dim * ctx                         ctx = tokens the token attends,
    weighted sum       2 * q_dim * ctx                         (causal: token i of a chunk
    output projection  2 * q_dim * hidden                       starting at s attends s+i+1,
                                                               at most W in a layer with a
                                                               sliding window of W)
    gated MLP          2 * 3 * hidden * intermediate

A mixture-of-experts layer (Qwen3-MoE, Mixtral: ModelShape.num_moe_layers of the layers)
replaces the gated MLP with

    router             2 * hidden * num_experts
    k experts          k * 2 * 3 * hidden * moe_intermediate   k = num_experts_per_tok

so FLOPs count the active parameters: twice ModelShape.active_linear_params per token. They
are exact: every token runs exactly k experts.

plus the LM head, 2 * hidden * vocab, once per row that produces logits: the last row of each
chunk that samples (and each draft's row, for a decode verifying drafts), and each
prompt-logprob row (the rows of a prefill chunk whose next prompt token's logprob is reported).
A multiply-add counts as 2 FLOPs. Norms, rotary embeddings, softmax and activations are
elementwise and left out: they are < 1% of the matmuls for these models.

Bytes moved per step: every weight matrix is read once per step however many tokens share
it (that is what batching buys), in the format the kernel that runs it reads (WeightBytes:
a GGUF model's Q4_1/Q8_0 blocks for matvecs of a few rows, bf16 matrices for larger
batches), plus each chunk's KV read over its context (in a windowed layer, from its first
query's first visible key: the kernels load no key before it) and KV written for its new
tokens, plus one embedding row per new token. Prompt-logprob rows run the LM head in passes of
their own (at most LOGIT_ROWS_PER_PASS rows each, apart from the sampling rows' pass), each
reading the head's weights once more. Activations are not counted (they stay in cache).

A MoE layer's experts are read per expert run: WeightBytes.body_* leave them out, and a step
adds WeightBytes.expert bytes per distinct (layer, expert) pair it ran, known only at run time:
the engine passes the bytes of the experts the runner ran, layer by layer (exact, also where a
GGUF's layers store their experts in different formats, as Q4_K_M files do); given a count
instead (num_experts_run), that many of WeightBytes.expert; given neither, the count is
modelled as its upper bound, min(num_experts, num_tokens * k) per MoE layer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from engine.sliding_windows import first_visible_key, layer_windows

# Prompt-logprob rows go through the LM head (and a float32 log-softmax) this many at a time,
# which bounds the logits held at once; each such pass reads the head's weights.
LOGIT_ROWS_PER_PASS = 256


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The numbers of a llama-family decoder that the cost model needs."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_params: int  # every parameter, the tied embedding counted once
    dtype_bytes: int  # of weights and KV cache at run time
    tie_word_embeddings: bool
    # Mixture of experts (0 for a dense model): num_moe_layers of the layers run a router and
    # num_experts_per_tok of num_experts experts (gated MLPs of moe_intermediate_size) per
    # token in place of the dense MLP of intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_moe_layers: int = 0
    # Per layer: its sliding window in tokens, or None for full attention (engine/
    # sliding_windows.py); () = every layer full.
    layer_windows: tuple[int | None, ...] = ()

    @classmethod
    def from_hf_config(
        cls, config: Any, dtype_bytes: int, num_params: int | None = None
    ) -> ModelShape:
        """Read a transformers PretrainedConfig; count parameters when num_params is None."""
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        tie = bool(getattr(config, "tie_word_embeddings", False))
        shape = cls(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            num_params=num_params if num_params is not None else 0,
            dtype_bytes=dtype_bytes,
            tie_word_embeddings=tie,
            **_moe_fields(config),
            layer_windows=layer_windows(config),
        )
        if num_params is None:
            return replace(shape, num_params=shape.counted_params())
        return shape

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def body_params(self) -> int:
        """Parameters of the layers and final norm: everything but embedding and LM head."""
        num_tables = 1 if self.tie_word_embeddings else 2
        return self.num_params - num_tables * self.embedding_params

    def counted_params(self) -> int:
        """Parameters implied by the dimensions, without biases (Qwen2's QKV biases < 0.1%)."""
        num_dense = self.num_layers - self.num_moe_layers
        mlps = num_dense * self.dense_mlp_params + self.num_moe_layers * (
            self.router_params + self.num_experts * self.expert_params
        )
        layers = self.num_layers * (self.attention_params + 2 * self.hidden_size)  # 2 RMSNorms
        num_tables = 1 if self.tie_word_embeddings else 2
        return layers + mlps + self.hidden_size + num_tables * self.embedding_params

    @property
    def attention_params(self) -> int:
        """One layer's q/k/v and output projections."""
        return self.hidden_size * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.hidden_size

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def expert_params(self) -> int:
        """One expert's gate, up and down projections (0 for a dense model)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def router_params(self) -> int:
        return self.hidden_size * self.num_experts

    @property
    def num_active_params(self) -> int:
        """Parameters one token runs: num_params less, in each MoE layer, the experts it does
        not pick (num_experts - num_experts_per_tok of them). num_params for a dense model."""
        idle = self.num_moe_layers * (self.num_experts - self.num_experts_per_tok)
        return self.num_params - idle * self.expert_params

    @property
    def active_linear_params(self) -> int:
        """The weights of the layers' matmuls one token runs (num_active_params without the
        embedding, LM head, norms and biases): per token, the layers cost twice this in FLOPs."""
        num_dense = self.num_layers - self.num_moe_layers
        moe = self.router_params + self.num_experts_per_tok * self.expert_params
        return (
            self.num_layers * self.attention_params
            + num_dense * self.dense_mlp_params
            + self.num_moe_layers * moe
        )

    def num_experts_run(self, num_tokens: int) -> int:
        """The modelled distinct (layer, expert) pairs a step of num_tokens runs, when the
        runner does not say: each MoE layer at most min(num_experts, num_tokens * k)."""
        per_layer = min(self.num_experts, num_tokens * self.num_experts_per_tok)
        return self.num_moe_layers * per_layer

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all layers."""
        return 2 * self.num_layers * self.kv_dim * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class WeightBytes:
    """Bytes of weights one forward pass reads, by the kernel path its rows take.

    A linear layer given at most `small_batch_rows` rows runs a matvec kernel that streams the
    weight as stored for it (a GGUF model's 4/8-bit blocks, else bf16 tiles); more rows run the
    bf16 matmuls (AMX tiles, AVX512-BF16 over the tiles, or oneDNN) or float32 ones. The body runs once per step over all
    new tokens; the LM head runs over the sampling rows only. small_batch_rows = 0: no
    small-batch path (plain torch), every pass reads the *_large bytes. A decode-only step of
    at most `decode_stack_rows` rows runs the body in the decode stack, on the small-batch
    layouts (engine/models/decode_stack.py); 0: no decode stack. `expert`: bytes of one
    expert's weights, read once per step for each (layer, expert) pair the step runs; the
    body_* figures leave the experts out (0: a dense model). GGUF linears on an AMX CPU read
    their blocks up to `tile_rows` rows (gguf_linear's tiles), past small_batch_rows: their
    bytes are body_tiled_* rather than body_*, and a head among them has head_rows = tile_rows.
    """

    body_small: float  # every layer (linears, norms) but the embedding and LM head
    body_large: float
    head_small: float  # the LM head
    head_large: float
    embedding_row: float  # one row of the embedding table, gathered per new token
    small_batch_rows: int = 0
    decode_stack_rows: int = 0
    expert: float = 0.0
    tile_rows: int = 0
    body_tiled_small: float = 0.0
    body_tiled_large: float = 0.0
    head_rows: int | None = None  # the head's small-layout limit; None: small_batch_rows

    def body(self, num_rows: int, decode_only: bool = False) -> float:
        limit = max(self.small_batch_rows, self.decode_stack_rows if decode_only else 0)
        small = 0 < num_rows <= limit
        tiled_small = 0 < num_rows <= max(limit, self.tile_rows)
        return (self.body_small if small else self.body_large) + (
            self.body_tiled_small if tiled_small else self.body_tiled_large
        )

    def head(self, num_rows: int) -> float:
        if num_rows == 0:
            return 0.0
        limit = self.small_batch_rows if self.head_rows is None else self.head_rows
        return self.head_small if num_rows <= limit else self.head_large

    @property
    def small_total(self) -> float:
        """Bytes of a one-row pass: every weight on its small-batch layout."""
        return self.body_small + self.body_tiled_small + self.head_small

    @property
    def large_total(self) -> float:
        """Bytes of a pass past every small-batch limit."""
        return self.body_large + self.body_tiled_large + self.head_large

    @classmethod
    def dense(cls, shape: ModelShape) -> WeightBytes:
        """Every weight in the run-time dtype on every path (plain torch, or no runner)."""
        experts = shape.num_moe_layers * shape.num_experts * shape.expert_params
        body = float((shape.body_params - experts) * shape.dtype_bytes)
        head = float(shape.embedding_params * shape.dtype_bytes)
        row = float(shape.hidden_size * shape.dtype_bytes)
        return cls(
            body, body, head, head, row, expert=float(shape.expert_params * shape.dtype_bytes)
        )


@dataclass(frozen=True, slots=True)
class ChunkWork:
    """One request's share of a step, as the cost model sees it.

    context_len = tokens in the KV cache after the chunk = start_position + num_new_tokens.
    num_prompt_logprob_rows = rows whose logits are computed for prompt logprobs, beyond the
    sampling row (ScheduledChunk.num_prompt_logprob_rows).
    """

    num_new_tokens: int
    context_len: int
    samples: bool
    is_decode: bool
    num_prompt_logprob_rows: int = 0
    num_draft_tokens: int = 0  # of num_new_tokens: drafts verified (each also samples a row)

    @property
    def num_sample_rows(self) -> int:
        """LM-head rows of the sampling pass: the last known token's, and one per draft."""
        return 1 + self.num_draft_tokens if self.samples else 0

    @property
    def num_logit_rows(self) -> int:
        """Rows that run through the LM head: the sampling rows, plus prompt-logprob rows."""
        return self.num_sample_rows + self.num_prompt_logprob_rows


@dataclass(frozen=True, slots=True)
class StepCost:
    """FLOPs and bytes of one step, by phase and per chunk (aligned with the input chunks)."""

    prefill_flops: float
    decode_flops: float
    prefill_bytes: float
    decode_bytes: float
    chunk_flops: list[float]
    chunk_bytes: list[float]

    @property
    def total_flops(self) -> float:
        return self.prefill_flops + self.decode_flops

    @property
    def total_bytes(self) -> float:
        return self.prefill_bytes + self.decode_bytes


class CostModel:
    """Turns a step's chunks into FLOPs and bytes moved for one model shape. Stateless."""

    def __init__(
        self,
        shape: ModelShape,
        weight_bytes: WeightBytes | None = None,
        rows_as_decodes: bool = False,  # the batch-invariant mode: every row attends alone
    ) -> None:
        self.shape, self.rows_as_decodes = shape, rows_as_decodes
        self.weight_bytes = weight_bytes if weight_bytes is not None else WeightBytes.dense(shape)
        # FLOPs per new token of the matmuls of the parameters it runs (a MoE layer's router and
        # k experts), attention over the context aside.
        self._dense_flops_per_token = 2 * shape.active_linear_params
        # FLOPs per (token, attended position) pair in one layer: QK^T and the weighted sum of V.
        self._attention_flops_per_pair = 4 * shape.q_dim
        # Layers by window: (window or None, number of layers with it).
        windows = shape.layer_windows or (None,) * shape.num_layers
        self._windows = [(w, windows.count(w)) for w in dict.fromkeys(windows)]
        self._lm_head_flops = 2 * shape.hidden_size * shape.vocab_size

    def chunk_flops(self, chunk: ChunkWork) -> float:
        n, ctx = chunk.num_new_tokens, chunk.context_len
        start = ctx - n
        attended_pairs = sum(count * attended(start, n, window) for window, count in self._windows)
        flops = n * self._dense_flops_per_token + attended_pairs * self._attention_flops_per_pair
        flops += chunk.num_logit_rows * self._lm_head_flops
        return float(flops)

    def _kv_read_tokens(self, chunk: ChunkWork) -> int:
        """Cached positions read over all layers: a windowed layer starts at its first query's
        first visible key (the kernels never load keys before it). A decode verifying drafts,
        and every chunk under rows_as_decodes, runs as one-token decodes, each reading its own."""
        if chunk.num_new_tokens > 1 and (self.rows_as_decodes or chunk.num_draft_tokens):
            return sum(
                self._kv_read_tokens(ChunkWork(1, chunk.context_len - j, True, True))
                for j in range(chunk.num_new_tokens)
            )
        start = chunk.context_len - chunk.num_new_tokens
        return sum(
            count * (chunk.context_len - first_visible_key(start, window))
            for window, count in self._windows
        )

    def step_cost(
        self,
        chunks: list[ChunkWork],
        num_experts_run: int | None = None,
        expert_bytes_run: int | None = None,
    ) -> StepCost:
        """FLOPs and bytes of one step. The body's weight bytes (with the experts it ran:
        expert_bytes_run bytes, as the runner counted them layer by layer; else num_experts_run
        distinct (layer, expert) pairs of WeightBytes.expert; neither: modelled) are split between
        chunks by new-token share, the sampling pass's LM head equally between the chunks that
        sample, the prompt-logprob passes' by prompt-logprob row share."""
        flops = [self.chunk_flops(chunk) for chunk in chunks]
        num_tokens = sum(chunk.num_new_tokens for chunk in chunks)
        num_sampling = sum(chunk.num_sample_rows for chunk in chunks)
        num_prompt_rows = sum(chunk.num_prompt_logprob_rows for chunk in chunks)
        weights = self.weight_bytes
        decode_only = all(chunk.is_decode for chunk in chunks)  # drafts' rows are decode rows
        body, head = weights.body(num_tokens, decode_only), weights.head(num_sampling)
        if expert_bytes_run is not None:
            body += expert_bytes_run
        elif weights.expert:
            if num_experts_run is None:
                num_experts_run = self.shape.num_experts_run(num_tokens)
            body += num_experts_run * weights.expert
        prompt_head = self._prompt_logprob_head_bytes(num_prompt_rows)
        kv_per_token = self.shape.kv_bytes_per_token
        kv_per_layer_token = kv_per_token // self.shape.num_layers
        num_bytes = []
        for chunk in chunks:
            share = body * chunk.num_new_tokens / num_tokens if num_tokens else 0.0
            if chunk.samples:
                share += head * chunk.num_sample_rows / num_sampling
            if chunk.num_prompt_logprob_rows:
                share += prompt_head * chunk.num_prompt_logprob_rows / num_prompt_rows
            kv_read = self._kv_read_tokens(chunk) * kv_per_layer_token
            kv_written = chunk.num_new_tokens * kv_per_token
            embedding = chunk.num_new_tokens * weights.embedding_row
            num_bytes.append(float(share + kv_read + kv_written + embedding))
        return StepCost(
            prefill_flops=float(sum(f for f, c in zip(flops, chunks) if not c.is_decode)),
            decode_flops=float(sum(f for f, c in zip(flops, chunks) if c.is_decode)),
            prefill_bytes=float(sum(b for b, c in zip(num_bytes, chunks) if not c.is_decode)),
            decode_bytes=float(sum(b for b, c in zip(num_bytes, chunks) if c.is_decode)),
            chunk_flops=flops,
            chunk_bytes=num_bytes,
        )

    def _prompt_logprob_head_bytes(self, num_rows: int) -> float:
        """LM-head weight bytes of the passes over `num_rows` prompt-logprob rows."""
        full, rest = divmod(num_rows, LOGIT_ROWS_PER_PASS)
        head = self.weight_bytes.head
        return full * head(LOGIT_ROWS_PER_PASS) + head(rest)


def with_added_work(
    cost: StepCost, chunks: list[ChunkWork], flops: list[float], num_bytes: list[float]
) -> StepCost:
    """`cost` with more FLOPs and bytes on each chunk (aligned with chunks), in its phase."""
    chunk_flops = [f + extra for f, extra in zip(cost.chunk_flops, flops, strict=True)]
    chunk_bytes = [b + extra for b, extra in zip(cost.chunk_bytes, num_bytes, strict=True)]
    decode = [c.is_decode for c in chunks]
    return StepCost(
        prefill_flops=sum(f for f, d in zip(chunk_flops, decode) if not d),
        decode_flops=sum(f for f, d in zip(chunk_flops, decode) if d),
        prefill_bytes=sum(b for b, d in zip(chunk_bytes, decode) if not d),
        decode_bytes=sum(b for b, d in zip(chunk_bytes, decode) if d),
        chunk_flops=chunk_flops,
        chunk_bytes=chunk_bytes,
    )


def _moe_fields(config: Any) -> dict[str, int]:
    """ModelShape's mixture-of-experts fields from an HF config; none for a dense model. Which
    layers are sparse follows transformers (as engine/models/moe.py's moe_layer_indices; this
    module is torch-free): Mixtral every layer; Qwen3-MoE layer i unless i is in
    mlp_only_layers or (i + 1) % decoder_sparse_step."""
    model_type = getattr(config, "model_type", None)
    if model_type == "mixtral":
        num_experts, size = config.num_local_experts, config.intermediate_size
    elif model_type == "qwen3_moe":
        num_experts, size = config.num_experts, config.moe_intermediate_size
    else:
        return {}
    if not num_experts:
        return {}
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", None) or 1
    layers = range(config.num_hidden_layers)
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "moe_intermediate_size": size,
        "num_moe_layers": sum(1 for i in layers if i not in dense and (i + 1) % step == 0),
    }


def attended(start: int, num_new: int, window: int | None) -> int:
    """(token, key) pairs a chunk's queries attend in one layer: query i (0-based) sits at
    position start + i and sees start + i + 1 keys, at most window of them."""
    first, last = start + 1, start + num_new
    if window is None or last <= window:
        return (first + last) * num_new // 2
    if first > window:
        return num_new * window
    return (first + window) * (window - first + 1) // 2 + (last - window) * window
