"""DraftBackoff: stop paying for drafts a request keeps rejecting, and try again later.

A decode with k drafts costs more than one without (k more rows in its pass: on a small model
on two cores, a 4-row pass measured 1.8x a 1-row pass). When the n-gram guesses do not
predict a request's text (free writing rather than copying), every drafted step is that
cost for nothing. After a decode whose drafts were all rejected, the request drafts nothing
for its next 1 decode; after another such decode (when it drafts again), 2; then 4, up to
`max_backoff_steps`. One accepted draft ends the backoff.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class DraftBackoff:
    """One request's backoff state (owned by the scheduler, kept across preemption)."""

    length: int = 0  # decodes skipped after the latest fully rejected draft
    left: int = 0  # of those, still to skip

    def skips(self) -> bool:
        """True (and one skip used up) while this decode must not draft."""
        if self.left:
            self.left -= 1
            return True
        return False

    def record(self, num_drafts: int, num_accepted: int, max_backoff_steps: int) -> bool:
        """After a decode that carried num_drafts drafts; True when it starts a backoff."""
        if num_drafts == 0:
            return False
        if num_accepted:
            self.length = 0
            return False
        self.length = min(max(1, 2 * self.length), max_backoff_steps)
        self.left = self.length
        return self.length > 0
