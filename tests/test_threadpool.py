"""Tests of the native thread pool (csrc/threadpool.c) through _kernels' self-test task.

The task records, for every index of [0, n), how often it was visited and by which
thread; a correct parallel_for visits each index exactly once, in chunks no larger than
the grain, with thread ids in range -- whatever the grain, the thread count, nesting,
concurrent callers or a fork.
"""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from ellm._native import _kernels as K


@pytest.fixture(autouse=True)
def restore_threads():
    before = K.num_threads()
    yield
    K.set_num_threads(before)


def check_once(n: int, grain: int, **kw) -> np.ndarray:
    counts, tids, _, _, bad = K.pool_selftest(n, grain, **kw)
    assert counts.shape == (n,)
    assert not bad, "a chunk exceeded the grain or a thread id was out of range"
    assert (counts == 1).all(), f"indices visited {counts.min()}..{counts.max()} times"
    return tids


@pytest.mark.parametrize("n", [0, 1, 2, 7, 64, 1000, 100_003])
@pytest.mark.parametrize("grain", [0, 1, 2, 3, 64, 999, 10**12])
def test_every_index_once(n: int, grain: int) -> None:
    K.set_num_threads(2)
    tids = check_once(n, grain)
    assert ((tids >= 0) & (tids < 2)).all()
    # the sum of the visited indices, as a plain arithmetic check
    counts = K.pool_selftest(n, grain)[0]
    assert int((np.arange(n) * counts).sum()) == n * (n - 1) // 2


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_thread_ids_stay_below_the_count(threads: int) -> None:
    K.set_num_threads(threads)
    assert K.num_threads() == threads
    tids = check_once(4000, 7, work_ns=2000)
    assert tids.max() < threads
    if threads == 1:
        assert (tids == 0).all()


def test_max_threads_limits_ids() -> None:
    K.set_num_threads(4)
    for limit in (1, 2, 3):
        tids = check_once(500, 1, work_ns=5000, max_threads=limit)
        assert tids.max() < limit


def test_set_num_threads_default_is_affinity() -> None:
    K.set_num_threads(0)
    assert K.num_threads() == K.cpu_count() == len(os.sched_getaffinity(0))


def test_workers_take_chunks() -> None:
    """Chunks long enough for a worker to wake are shared (retried: the box is shared)."""
    K.set_num_threads(2)
    for _ in range(5):
        tids = check_once(400, 1, work_ns=50_000)
        if (tids != 0).any():
            return
    pytest.fail("no chunk ever ran on a worker thread")


def test_nested_call_runs_serially_in_place() -> None:
    K.set_num_threads(3)
    counts, tids, nested_counts, nested_ok, bad = K.pool_selftest(2000, 37, nested=True, work_ns=1000)
    assert not bad and (counts == 1).all()
    assert (nested_counts == 1).all(), "the nested parallel_for missed or repeated indices"
    assert (nested_ok == 1).all(), "a nested call left its thread or ran outside a region"


def test_concurrent_callers() -> None:
    """Several Python threads (GIL released inside) call parallel_for at once."""
    K.set_num_threads(2)
    errors: list[str] = []

    def worker(seed: int) -> None:
        for i in range(5):
            n = 20_000 + seed * 1000 + i
            counts, tids, _, _, bad = K.pool_selftest(n, 1 + (seed + i) % 50, work_ns=0 if i % 2 else 200)
            if bad or not (counts == 1).all():
                errors.append(f"thread {seed} call {i}: bad={bad} counts {counts.min()}..{counts.max()}")

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_changing_thread_count_while_running() -> None:
    stop = threading.Event()

    def flip() -> None:
        k = 0
        while not stop.is_set():
            K.set_num_threads(1 + k % 3)
            k += 1

    flipper = threading.Thread(target=flip)
    flipper.start()
    try:
        for i in range(30):
            # max_threads pins the id bound while the count changes underneath
            check_once(3000 + i, 1 + i % 5, work_ns=500, max_threads=2)
    finally:
        stop.set()
        flipper.join()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_after_fork() -> None:
    K.set_num_threads(2)
    check_once(1000, 3, work_ns=1000)  # the parent's workers exist now
    pid = os.fork()
    if pid == 0:  # child: the pool must start fresh workers (or run serially), never hang
        code = 1
        try:
            for _ in range(3):
                counts, tids, _, _, bad = K.pool_selftest(5000, 7, work_ns=500)
                if bad or not (counts == 1).all():
                    break
            else:
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    check_once(1000, 3)  # and the parent's pool still works


def test_dispatch_overhead_is_small() -> None:
    """An empty parallel_for with warm workers costs microseconds, not milliseconds."""
    K.set_num_threads(2)
    times = K.pool_dispatch_ns(500)
    assert np.median(times) < 50_000, f"median dispatch {np.median(times)} ns"


if __name__ == "__main__":
    # Dispatch overhead, printed (see benchmarks/bench_attention.py for the full set).
    for work in (0, 5000):
        hot = K.pool_dispatch_ns(2000, work_ns=work)
        cold = K.pool_dispatch_ns(200, work_ns=work, sleep_us=2000)
        print(f"threads {K.num_threads()} chunk work {work} ns: spinning median {np.median(hot):.0f} ns, "
              f"asleep median {np.median(cold):.0f} ns")


# ------------------------------ regions (threadpool.h) ------------------------------


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("n", [0, 1, 2, 7, 64, 1000, 100_003])
@pytest.mark.parametrize("grain", [0, 1, 3, 64, 10**12])
def test_regions_visit_every_index_once(threads: int, n: int, grain: int) -> None:
    """parallel_for_regions: every index once, chunks within the grain, ids below the
    thread count, whatever n, grain and threads (a region may be empty or stolen whole)."""
    K.set_num_threads(threads)
    counts, tids, _, _, bad = K.pool_selftest(n, grain, regions=True)
    assert not bad, "a chunk exceeded the grain or a thread id was out of range"
    assert (counts == 1).all(), f"indices visited {counts.min() if n else 0}..{counts.max() if n else 0} times"
    if threads == 1:
        assert (tids == 0).all()


def test_regions_give_each_thread_its_own_part_first() -> None:
    """With two threads and chunks that take a while, the first chunk of each half is run
    by that half's owner (thread 0 the front, thread 1 the back half) unless its owner was
    late and lost the whole half; over several calls the owner wins at least once."""
    K.set_num_threads(2)
    owned = 0
    for _ in range(5):
        counts, tids, _, _, bad = K.pool_selftest(64, 1, work_ns=200_000, regions=True)
        assert not bad and (counts == 1).all()
        owned += int(tids[0] == 0 and tids[32] == 1)
    assert owned >= 1, "no call gave the back half's first chunk to thread 1"


def test_regions_nested_in_a_task_run_serially() -> None:
    """A parallel_for_regions inside a pool task runs on that thread, like parallel_for."""
    K.set_num_threads(2)
    counts, _, nested, ok, bad = K.pool_selftest(200, 10, nested=True, regions=True)
    assert not bad and (counts == 1).all() and (nested == 1).all() and ok.all()
