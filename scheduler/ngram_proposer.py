"""N-gram (prompt-lookup) drafts: continue a request's tokens the way they continued before.

A request copying or editing text it was given repeats runs of its own prompt; the tokens that
followed the latest earlier occurrence of its last n tokens are a cheap guess at its next ones.
The target model verifies the guess in the same pass that computes the next token, so a wrong
guess costs compute but never changes the output.
"""

from __future__ import annotations

from array import array

_WIDTH = 4  # bytes per token id in the searched buffer (array type "I")


def propose_ngram_drafts(
    token_ids: list[int], min_n: int, max_n: int, num_drafts: int
) -> list[int]:
    """Up to `num_drafts` tokens that followed the most recent earlier occurrence of the
    longest suffix of `token_ids` with a length in [min_n, max_n]; [] when none occurs.

        token_ids:  ... a b c [x y z] d e ...  a b [x y z]      (n = 3, suffix x y z)
                            match i ^   ^ i + n           end ^
        drafts:     d e ... (at most num_drafts, never past the suffix's own start)

    The search runs over the ids packed as 4-byte words with bytes.rfind (C speed); a hit that
    does not start on a word boundary is skipped.
    """
    length = len(token_ids)
    if num_drafts < 1 or length < min_n + 1:
        return []
    data = array("I", token_ids).tobytes()
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        start = _latest_earlier_start(data, length, n)
        if start is not None:
            return token_ids[start + n : start + n + num_drafts]
    return []


def _latest_earlier_start(data: bytes, length: int, n: int) -> int | None:
    """Token index of the latest occurrence of the last n tokens that ends before the last
    token (so at least one token follows it), or None."""
    pattern = data[(length - n) * _WIDTH :]
    end = (length - 1) * _WIDTH  # the occurrence lies inside token_ids[: length - 1]
    while True:
        found = data.rfind(pattern, 0, end)
        if found < 0:
            return None
        if found % _WIDTH == 0:
            return found // _WIDTH
        end = found + len(pattern) - 1  # look again, left of this misaligned hit
