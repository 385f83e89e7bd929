"""A slowed device for engine tests on the CPU: the overlap scheduler forced on, and each step's result ready only
`step_s` after its launch (the CPU computes a step at once), so the loop meets steps in flight as on a GPU."""

from __future__ import annotations

import time

from splitserve.engine.engine import Engine


class SlowDevice:
    """A step's completion event that the device signals `step_s` after the launch."""

    def __init__(self, step_s: float) -> None:
        self.at = time.monotonic() + step_s

    def query(self) -> bool:
        return time.monotonic() >= self.at

    def synchronize(self) -> None:
        time.sleep(max(0.0, self.at - time.monotonic()))


def slow_down(engine: Engine, step_s: float) -> None:
    """Forces `engine`'s overlap scheduler on and makes each of its steps take `step_s` on the "device"."""
    engine.overlap = True
    launch = engine.runner.launch

    def slow_launch(chunks, page_table):
        pending = launch(chunks, page_table)
        pending.done = SlowDevice(step_s)
        return pending

    engine.runner.launch = slow_launch
