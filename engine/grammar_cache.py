"""GrammarCache: compiled grammars by constraint, LRU, bounded by entries and by bytes.

Two threads use it: the grammar compile worker puts what it compiled ahead of a request, the
engine thread looks a request's grammar up when it first masks a row (engine/structured_output.py).
Every method takes the one lock, and none holds it while compiling.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any


def _memory_size_bytes(grammar: Any) -> int:
    return int(grammar.memory_size_bytes)  # xgr.CompiledGrammar's own count


class GrammarCache:
    """Owns references to compiled grammars (xgr.CompiledGrammar), least recently used first.

    Invariants: len(self) <= max_entries; num_bytes == Σ size_of(entry); num_bytes <= max_bytes,
    except that the entry put last is kept even when it alone is larger (so the request that
    compiled it finds it when it reaches the engine)."""

    def __init__(
        self,
        max_entries: int,
        max_bytes: int,
        size_of: Callable[[Any], int] = _memory_size_bytes,
    ) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("a grammar cache needs room for at least one entry and one byte")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._size_of = size_of
        self._lock = threading.Lock()
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()  # -> (grammar, bytes)
        self._num_bytes = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:  # the LRU order stays as it is
        with self._lock:
            return key in self._entries

    @property
    def num_bytes(self) -> int:
        with self._lock:
            return self._num_bytes

    def keys(self) -> list[Hashable]:
        """Least recently used first."""
        with self._lock:
            return list(self._entries)

    def get(self, key: Hashable) -> Any | None:
        """The grammar of `key` (now the most recently used), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: Hashable, grammar: Any) -> None:
        """Keep `grammar` as the most recently used; evict from the other end to the bounds."""
        size = self._size_of(grammar)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._num_bytes -= old[1]
            self._entries[key] = (grammar, size)
            self._num_bytes += size
            while len(self._entries) > 1 and (
                len(self._entries) > self.max_entries or self._num_bytes > self.max_bytes
            ):
                _, (_, evicted) = self._entries.popitem(last=False)
                self._num_bytes -= evicted

    def check_invariants(self) -> None:
        with self._lock:
            assert len(self._entries) <= self.max_entries, "too many entries"
            assert self._num_bytes == sum(size for _, size in self._entries.values()), "bytes"
            assert self._num_bytes <= self.max_bytes or len(self._entries) == 1, "over max_bytes"
