"""The harness itself: results per rank, a raising rank, a hanging rank."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from harness import RankError, run_ranks


def _rank_and_sum():
    x = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(x)
    return dist.get_rank(), dist.get_world_size(), x.item()


def _big_tensors():
    return {"rank": dist.get_rank(), "t": torch.full((1000, 100), float(dist.get_rank()))}


def _rank1_raises():
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 waits for a rank that is gone: the harness must not wait for it


def _rank1_hangs():
    if dist.get_rank() == 1:
        time.sleep(1000)
    return "done"


def test_results_in_rank_order():
    assert run_ranks(_rank_and_sum, 3, timeout=60) == [(0, 3, 6.0), (1, 3, 6.0), (2, 3, 6.0)]


def test_a_raising_rank_fails_with_its_traceback():
    t = time.monotonic()
    with pytest.raises(RankError, match=r"(?s)rank 1 of 2 raised.*ValueError: boom on purpose"):
        run_ranks(_rank1_raises, 2, timeout=60)
    assert time.monotonic() - t < 50


def test_a_hanging_rank_fails_within_the_timeout():
    t = time.monotonic()
    # rank 0 finishes at once; rank 1 never does (only rank 1 is named, unless the machine is so
    # loaded that rank 0 did not even start within the timeout)
    with pytest.raises(TimeoutError, match=r"ranks \[(0, )?1\] of 2 did not finish within 8"):
        run_ranks(_rank1_hangs, 2, timeout=8)
    assert time.monotonic() - t < 20


def test_tensors_survive_the_ranks_exiting():
    out = run_ranks(_big_tensors, 2, timeout=60)
    assert [o["rank"] for o in out] == [0, 1]
    assert all(torch.equal(o["t"], torch.full((1000, 100), float(r))) for r, o in enumerate(out))


def _env_and_state(name):
    import lab.launch
    return os.environ.get(name), getattr(lab.launch, "_SET_BY_THE_TEST", None)


def test_ranks_start_as_fresh_processes(monkeypatch):
    import lab.launch
    # forked from the server: nothing of this process comes with a rank
    monkeypatch.setattr(lab.launch, "_SET_BY_THE_TEST", 1, raising=False)
    assert lab.launch._context().get_start_method() == "forkserver"
    assert run_ranks(_env_and_state, 2, "COURSE_TEST_VARIABLE", timeout=60) == [(None, None)] * 2
    # a variable the server did not start with: the ranks are spawned, and see it
    monkeypatch.setenv("COURSE_TEST_VARIABLE", "set after the server started")
    assert lab.launch._context().get_start_method() == "spawn"
    assert run_ranks(_env_and_state, 2, "COURSE_TEST_VARIABLE", timeout=60) == \
        [("set after the server started", None)] * 2
    # a caller's temporary change never becomes the server's: a first call made inside one spawns, starting nothing
    monkeypatch.setattr(lab.launch, "_SERVER", {})
    assert lab.launch._context().get_start_method() == "spawn" and not lab.launch._SERVER


def test_a_quiet_test_waits_for_the_running_ones_and_the_next_ones_wait_for_it(tmp_path, monkeypatch):
    """conftest's machine lock, as two workers use it: tests share the machine; one that reads timings takes it
    alone once the running ones end, and a test that starts meanwhile waits for it (no starving it)."""
    import threading

    import conftest
    monkeypatch.setattr(conftest, "_LOCKS", [str(tmp_path / "machine.lock"), str(tmp_path / "turnstile.lock")])
    events, lock = [], threading.Lock()

    def log(*what):
        with lock:
            events.append(what)

    def test(name, alone=False, start=0.0):
        time.sleep(start)
        log(name, "wants")
        with conftest.machine(alone=alone):
            log(name, "in")
            time.sleep(0.3)
            log(name, "out")
    threads = [threading.Thread(target=test, args=a) for a in
               (("a",), ("b",), ("quiet", True, 0.1), ("c", False, 0.2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    at = {e: i for i, e in enumerate(events)}
    assert at["a", "in"] < at["b", "out"] and at["b", "in"] < at["a", "out"]             # shared
    assert at["a", "out"] < at["quiet", "in"] and at["b", "out"] < at["quiet", "in"]      # alone, after them
    assert at["quiet", "wants"] < at["c", "wants"] and at["quiet", "out"] < at["c", "in"]  # the later one waits
