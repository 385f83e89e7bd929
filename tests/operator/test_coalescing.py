"""Triggers of one object's reconcile while it runs fold into one more run; other objects run in parallel."""

from __future__ import annotations

import threading
import time

import pytest

from splitserve.operator.coalescing import Coalescer


def test_triggers_during_a_run_fold_into_one_rerun_and_other_keys_are_not_held() -> None:
    coalescer, runs, started, release = Coalescer(), [], threading.Event(), threading.Event()

    def slow() -> None:
        runs.append("a")
        started.set()
        release.wait(5)

    first = threading.Thread(target=coalescer.run, args=("a", slow))
    first.start()
    assert started.wait(5)
    # Ten triggers while "a" runs: each returns at once, folded.
    assert [coalescer.run("a", slow) for _ in range(10)] == [False] * 10
    assert coalescer.run("b", lambda: runs.append("b")) is True  # another object is not held
    release.set()
    first.join(5)
    assert runs == ["a", "b", "a"]  # "a" ran once more for all ten triggers
    assert coalescer.busy() == 0


def test_a_failed_run_frees_its_key() -> None:
    coalescer = Coalescer()

    def fail() -> None:
        raise RuntimeError("api down")

    with pytest.raises(RuntimeError):
        coalescer.run("a", fail)
    assert coalescer.busy() == 0
    done = []
    assert coalescer.run("a", lambda: done.append(time.monotonic())) is True and done
