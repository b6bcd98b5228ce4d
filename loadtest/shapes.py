"""Locust load shapes: steady users, a step ramp, and a fixed request rate (open loop).

Locust uses the first LoadTestShape it finds in a locustfile, so the locustfile imports only
`SelectedShape`, which reads `--shape` (and --users, --spawn-rate, --run-time, --ramp-*) from the
parsed options and delegates to one of the shapes below. The time math lives in
loadtest/schedule.py, which is unit-tested without locust. This module imports locust: only
locust loads it.
"""

from __future__ import annotations

import time

from locust import LoadTestShape

from loadtest.schedule import ramp_users, steady_users


class SteadyShape:
    """--users users (started at --spawn-rate per second) until --run-time."""

    def users(self, elapsed_s: float, options) -> int:
        return steady_users(elapsed_s, options.num_users)


class StepRampShape:
    """--ramp-step-users more users every --ramp-step-seconds, up to --users."""

    def users(self, elapsed_s: float, options) -> int:
        return ramp_users(
            elapsed_s, options.ramp_step_users, options.ramp_step_seconds, options.num_users
        )


class RateShape:
    """A pool of --users users pacing Poisson arrivals at --rate requests/s in total (the
    pacing is the users' wait_time; this shape only holds the pool steady)."""

    def users(self, elapsed_s: float, options) -> int:
        return options.num_users


SHAPES = {"steady": SteadyShape, "ramp": StepRampShape, "rate": RateShape}


class SelectedShape(LoadTestShape):
    """The shape named by --shape, stopped after --run-time (with a shape class, locust's own
    --run-time is not enforced, so this class does it).

    The clock starts when the first user is running, not when locust starts the shape: the
    first tick's spawn also runs the test_start listeners (loading the workload's tokenizer),
    which may take seconds that must not be taken out of the run time.
    """

    use_common_options = True
    users_since: float | None = None

    def tick(self) -> tuple[int, float] | None:
        options = self.runner.environment.parsed_options
        now = time.monotonic()
        if self.users_since is None and self.get_current_user_count() > 0:
            self.users_since = now
        elapsed = 0.0 if self.users_since is None else now - self.users_since
        if options.run_time and elapsed >= options.run_time:
            return None
        shape = SHAPES[options.shape]()
        return shape.users(elapsed, options), float(options.spawn_rate or 1)
