"""Verifying draft tokens (speculative decoding) with the ordinary sampler.

A decode with drafts d_1..d_k computes logits at its last known token and at each draft in one
pass: row j predicts the token after d_1..d_j. Each row is sampled exactly as a plain decode
would be with those drafts as its outputs so far (penalties, min_tokens, logit bias and
logprobs see them), giving t_0..t_k. The drafts are kept while d_{j+1} == t_j; the first t_j
that differs (or t_k, when every draft is kept) is the request's next token.

For greedy rows this is the argmax chain non-speculative decoding would follow. For sampled
rows it is rejection sampling with a draft distribution that puts all its mass on d_{j+1}:
accepting d_{j+1} with probability p_j(d_{j+1}), and on rejection sampling from p_j without
d_{j+1}, renormalised, is the same as drawing t_j ~ p_j and keeping d_{j+1} iff t_j equals it.
So every emitted token is drawn from the distribution the target model gives it after the
tokens actually emitted, and the output's distribution is that of plain decoding.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from scheduler.output import ScheduledChunk, TokenLogprobs


@dataclass(slots=True)
class Verified:
    """One chunk's verdict: the drafts kept, then the token sampled after them."""

    accepted: list[int]
    token_id: int
    accepted_logprobs: list[TokenLogprobs | None]
    logprobs: TokenLogprobs | None


def sample_row_chunks(chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
    """One chunk per sampled row, in row order (forward_batch's sample_rows): a chunk with k
    drafts becomes k + 1 views whose outputs so far include the drafts before their row."""
    rows: list[ScheduledChunk] = []
    for chunk in chunks:
        if not chunk.draft_token_ids:
            rows.append(chunk)
            continue
        for j in range(chunk.num_sample_rows):
            outputs = chunk.output_token_ids + chunk.draft_token_ids[:j]
            rows.append(dataclasses.replace(chunk, output_token_ids=outputs, draft_token_ids=[]))
    return rows


def verify(
    chunks: list[ScheduledChunk],
    token_ids: list[int],
    logprobs: list[TokenLogprobs | None],
) -> list[Verified]:
    """Per chunk, the verdict from its rows' sampled tokens (token_ids and logprobs in the row
    order of sample_row_chunks)."""
    verdicts: list[Verified] = []
    row = 0
    for chunk in chunks:
        drafts = chunk.draft_token_ids
        sampled = token_ids[row : row + chunk.num_sample_rows]
        row_logprobs = logprobs[row : row + chunk.num_sample_rows]
        row += chunk.num_sample_rows
        kept = 0
        while kept < len(drafts) and sampled[kept] == drafts[kept]:
            kept += 1
        verdicts.append(
            Verified(drafts[:kept], sampled[kept], row_logprobs[:kept], row_logprobs[kept])
        )
    return verdicts
