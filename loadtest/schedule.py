"""Load schedules as plain functions of time, used by loadtest/shapes.py (which imports locust)
and unit-tested without it: steady users, a step ramp, and Poisson arrivals for a fixed rate."""

from __future__ import annotations

import math
import random


def steady_users(elapsed_s: float, users: int) -> int:
    return users


def ramp_users(elapsed_s: float, step_users: int, step_s: float, max_users: int) -> int:
    """step_users at t=0, step_users more every step_s seconds, capped at max_users.

    users
      max ┤         ┌────
          ┤     ┌───┘
     step ┼─────┘
          0   step_s  2·step_s  → t
    """
    steps_done = math.floor(elapsed_s / step_s)
    return min(max_users, step_users * (steps_done + 1))


class PoissonArrivals:
    """One user's share of an open-loop Poisson arrival process.

    N users each running this at rate R/N superpose to a Poisson process of rate R, as long as
    a user is never still busy when its next arrival is due (the pool must exceed R × latency).
    Arrival times are scheduled from the previous arrival, not from when the request ended, so
    slow responses do not slow the offered load (pacing, not think time).
    """

    def __init__(self, rate_per_s: float, rng: random.Random, start: float) -> None:
        if rate_per_s <= 0:
            raise ValueError("rate must be positive")
        self.rate_per_s = rate_per_s
        self.rng = rng
        self.next_at = start + rng.expovariate(rate_per_s)
        self.num_late = 0  # arrivals that found this user still busy

    def delay(self, now: float) -> float:
        """Seconds to wait until the next arrival, then schedule the one after it."""
        wait = self.next_at - now
        if wait < 0:
            self.num_late += 1
        self.next_at += self.rng.expovariate(self.rate_per_s)
        return max(0.0, wait)
