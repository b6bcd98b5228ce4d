"""A GGUF file served natively (engine/gguf_checkpoint.py, engine/models/gguf_linear.py).

Tiny random Llama, Qwen2 and Qwen3 files written as llama.cpp writes them (tests/unit/
gguf_models.py: block formats of every family, q/k interleaved for llama, SmolLM2's tokenizer
keys): greedy output in float32 equals Hugging Face `generate` on the weights the file's blocks
dequantize to, token for token; the served layers hold the file's blocks, un-interleaved, one
copy; an unsupported architecture or tensor type is a one-line error naming it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFWriter
from gguf_models import EOS, T, write_tiny_gguf
from tiny_models import assert_greedy_equals_oracle

from engine.attention import make_backend
from engine.gguf_header import read_header
from engine.gguf_tensors import GGUFBlocks
from engine.loader import ModelLoadError, load_checkpoint
from engine.models.gguf_linear import GGUFEmbedding, GGUFLinear
from engine.models.llama import LlamaForCausalLM

# arch -> (formats by GGUF tensor role, tied LM head). Llama mixes formats inside q|k|v (Q4_K
# q and k, Q6_K v: two parts) and keeps a Q8_0 embedding as its tied head; Qwen2 has q/k/v
# biases, an F16 embedding and its own Q6_K head; Qwen3 is all Q4_K/Q5_K with q/k norms.
CASES = {
    "llama": (
        {
            "token_embd": T.Q8_0,
            "attn_q": T.Q4_K,
            "attn_k": T.Q4_K,
            "attn_v": T.Q6_K,
            "attn_output": T.Q8_0,
            "ffn_gate": T.Q4_0,
            "ffn_up": T.Q4_0,
            "ffn_down": T.Q5_K,
        },
        True,
    ),
    "qwen2": (
        {
            "token_embd": T.F16,
            "output": T.Q6_K,
            "attn_q": T.Q8_0,
            "attn_k": T.Q8_0,
            "attn_v": T.Q8_0,
            "attn_output": T.Q5_1,
            "ffn_gate": T.Q4_1,
            "ffn_up": T.Q4_1,
            "ffn_down": T.Q5_0,
        },
        False,
    ),
    "qwen3": (
        {
            "token_embd": T.Q4_K,
            "attn_q": T.Q4_K,
            "attn_k": T.Q4_K,
            "attn_v": T.Q4_K,
            "attn_output": T.Q5_K,
            "ffn_gate": T.Q4_K,
            "ffn_up": T.Q4_K,
            "ffn_down": T.Q6_K,
        },
        True,
    ),
}


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """arch -> (the file, its float32 HF oracle)."""
    root = tmp_path_factory.mktemp("gguf")
    files = {}
    for arch, (formats, tied) in CASES.items():
        path = root / f"tiny-{arch}.gguf"
        files[arch] = (path, write_tiny_gguf(path, arch, formats, tied))
    return files


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch) -> None:
    monkeypatch.setenv("METERSERVE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.mark.parametrize("arch", sorted(CASES))
def test_greedy_equals_hugging_face_float32(gguf_files, arch: str) -> None:
    path, oracle = gguf_files[arch]
    assert_greedy_equals_oracle(path, oracle, arch, cpu_kernels=False)


def test_metadata_gives_config_tokenizer_and_chat_template(gguf_files) -> None:
    path, _ = gguf_files["qwen2"]
    checkpoint = load_checkpoint(str(path))
    config = checkpoint.config
    assert config.model_type == "qwen2"
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (256, 2, 2)
    assert not config.tie_word_embeddings
    tokenizer = checkpoint.tokenizer
    assert tokenizer.eos_token_id == EOS and tokenizer.convert_ids_to_tokens(EOS) == "<|im_end|>"
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat.startswith("<|im_start|>system") and chat.endswith("<|im_start|>assistant\n")
    # Read again: from the metadata cache now, the same config.
    assert load_checkpoint(str(path)).config.to_dict() == config.to_dict()


def _loaded_model(path: Path, dtype: torch.dtype) -> LlamaForCausalLM:
    checkpoint = load_checkpoint(str(path))
    model = LlamaForCausalLM(checkpoint.config, make_backend("batched", None), 64, dtype)
    model.load_weights(checkpoint.weights)
    return model


def test_layers_hold_the_files_blocks_unpermuted(gguf_files) -> None:
    path, oracle = gguf_files["llama"]
    model = _loaded_model(path, torch.float32)
    weights = dict(oracle.named_parameters())
    attention = model.layers[0].self_attn
    qkv = attention.qkv_proj
    assert isinstance(qkv, GGUFLinear)
    assert [(p.kind, p.rows) for p in qkv.parts] == [(T.Q4_K, 256 + 128), (T.Q6_K, 128)]
    want = torch.cat([weights[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(torch.cat([p.dequantize() for p in qkv.parts]), want)
    # The stored bytes, as the file holds them, for a part that is not interleaved.
    reader = GGUFReader(str(path))
    stored = {t.name: np.array(t.data) for t in reader.tensors}
    assert torch.equal(qkv.parts[1].blocks, torch.from_numpy(stored["blk.0.attn_v.weight"]))
    gate_up = model.layers[1].mlp.gate_up_proj
    assert [(p.kind, p.rows) for p in gate_up.parts] == [(T.Q4_0, 1024)]  # fused: one buffer
    # One copy: the tied head reads the embedding's own blocks.
    assert isinstance(model.embed_tokens, GGUFEmbedding)
    assert model.lm_head.parts[0].blocks is model.embed_tokens.table.blocks
    x = torch.randn(5, 256)
    expected = torch.nn.functional.linear(x, want)
    torch.testing.assert_close(qkv.forward(x), expected, rtol=1e-5, atol=1e-5)
    ids = torch.tensor([3, 0, 511, 3])
    assert torch.equal(model.embed_tokens.forward(ids), weights["model.embed_tokens.weight"][ids])
    assert qkv.bytes_read() == sum(p.nbytes for p in qkv.parts)
    assert qkv.bytes_read() == sum(
        int(stored[f"blk.0.attn_{n}.weight"].nbytes) for n in ("q", "k", "v")
    )


def test_header_reader_agrees_with_gguf_py(gguf_files) -> None:
    path, _ = gguf_files["qwen3"]
    header = read_header(path)
    reader = GGUFReader(str(path))
    assert header.architecture == "qwen3"
    assert header.arch_value("attention.head_count_kv") == 2
    assert [(t.name, t.kind, t.shape, t.offset) for t in header.tensors] == [
        (t.name, int(t.tensor_type), tuple(int(n) for n in reversed(t.shape)), t.data_offset)
        for t in reader.tensors
    ]


def _assert_one_line(error: ModelLoadError, *fragments: str) -> None:
    message = str(error)
    assert message and "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_unsupported_architecture_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "falcon.gguf"
    writer = GGUFWriter(str(path), "falcon")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    _write(writer)
    with pytest.raises(ModelLoadError) as info:
        load_checkpoint(str(path))
    _assert_one_line(info.value, "unsupported GGUF architecture", "'falcon'", "qwen3")


def test_unsupported_tensor_type_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "q2k.gguf"
    writer = GGUFWriter(str(path), "llama")
    blocks = np.zeros((8, 84), dtype=np.uint8)  # one Q2_K block of 256 weights per row
    writer.add_tensor("blk.0.attn_q.weight", blocks, raw_dtype=T.Q2_K)
    _write(writer)
    with pytest.raises(ModelLoadError) as info:
        load_checkpoint(str(path))
    _assert_one_line(info.value, "unsupported GGUF tensor type Q2_K", "blk.0.attn_q.weight")


def test_not_a_gguf_file_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"\0" * 64)
    with pytest.raises(ModelLoadError) as info:
        load_checkpoint(str(path))
    _assert_one_line(info.value, "cannot read GGUF file")


def test_blocks_take_rows_and_dequantize() -> None:
    from gguf import quants

    weight = np.random.default_rng(0).standard_normal((6, 64)).astype(np.float32)
    blocks = GGUFBlocks(T.Q8_0, torch.from_numpy(quants.quantize(weight, T.Q8_0)), 64)
    picked = blocks.take_rows(torch.tensor([4, 1]))
    want = quants.dequantize(quants.quantize(weight, T.Q8_0), T.Q8_0)[[4, 1]]
    assert torch.equal(picked.dequantize(), torch.from_numpy(want))


def _write(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
