"""A hang is a diagnosis: --watch (lab/collective_watch.py) names each hang shape on every rank within its patience,
and the default guard (mesh.agree, mesh.agree_step) keeps its promise.

- The five shapes a learner's edit gives a run — a collective on some ranks only, a different order, a size mismatch
  (of a collective, and of a transfer's two sides), a send without its receive, a rank that exits — each in its own
  scope of one watched run (watch.start, as `--watch` starts it), one group of ranks for all of them, on 2 and on 4
  ranks. Each rank records its message and the seconds from the shape's start to it; the last shape's rank really
  leaves its process. In the same run, `kill -USR1` on a waiting rank prints its pending collective and its stack.
- `--watch` as a learner types it: train.py with a gradient clip only rank 0 makes stops every rank with the same
  message, each saying where it stopped; a lesson's clean run under --watch prints the watch's cost per collective.
- The default guard: the same clip on rank 0 from step 3 ends in one error on every rank, and no rank applies step 3.
"""
import io
import json
import os
import re
import sys
import tempfile
import threading
import time

import pytest

from harness import Exercise, run_exercise

PATIENCE = 2.0   # the watch's patience in the shapes' run; the watched waits below end within a fraction of it

SHAPES = ("some ranks only", "a different order", "a collective's sizes", "a transfer's sizes",
          "a send without its receive", "a rank that exits")


def _shape(name, me, P):
    """One hang shape, as a learner's code would make it (every rank runs this with its own rank)."""
    import torch
    import torch.distributed as dist
    x, y = torch.ones(4), torch.ones(6)
    if name == "some ranks only":                      # rank 0 broadcasts first; its peers go on to the all-reduce
        if me == 0:
            dist.broadcast(y, src=0)
        dist.all_reduce(x)
    elif name == "a different order":                  # odd ranks make the same two collectives the other way round
        out = torch.empty(4 * P)
        for op in ((lambda: dist.all_reduce(x)), (lambda: dist.all_gather_into_tensor(out, x)))[::1 - 2 * (me % 2)]:
            op()
    elif name == "a collective's sizes":               # the last rank all-reduces 6 elements, its peers 4
        dist.all_reduce(y if me == P - 1 else x)
    elif name == "a transfer's sizes":                 # each even rank sends 4 elements; its odd peer has room for 6
        if me % 2 == 0:
            dist.send(x, me + 1)
        else:
            dist.recv(y, me - 1)
    elif name == "a send without its receive":         # rank 0 sends to rank 1, which goes on to the all-reduce
        if me == 0:
            dist.send(x, 1)
        dist.all_reduce(x)
    elif name == "a rank that exits":                  # the last rank leaves its process; its peers all-reduce
        if me == P - 1:
            from lab import collective_watch as watch
            watch.leave(3)   # (what lab.launch.main does for a process that ends)
            os._exit(3)
        dist.all_reduce(x)


def _usr1(me, P):
    """Rank 1 waits at an all-reduce rank 0 reaches 1 s late; meanwhile rank 1 is sent SIGUSR1: what it prints."""
    import signal
    import torch
    import torch.distributed as dist
    said, err = io.StringIO(), sys.stderr
    if me == 1:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        sys.stderr = said
    else:
        time.sleep(1.0)
    try:
        dist.all_reduce(torch.ones(4))
    finally:
        sys.stderr = err
    return said.getvalue()


def _rank(rank, P, port, out_dir):
    """One rank of the shapes' run: the watch started for the run, each shape in its own scope."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(P), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import datetime

    import torch
    import torch.distributed as dist

    from lab import collective_watch as watch
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    watch.start(PATIENCE)
    got, path = {}, os.path.join(out_dir, f"{rank}.json")
    for i, name in enumerate(("usr1",) + SHAPES):
        if i:
            watch.begin_check()
        t0, error = time.perf_counter(), None
        try:
            if name == "usr1":
                got[name] = _usr1(rank, P)
                continue
            _shape(name, rank, P)
        except watch.CollectiveMismatch as e:
            error = str(e)
        finally:
            if name != "usr1":
                got[name] = [error, time.perf_counter() - t0]
                with open(path, "w") as f:   # (written as it goes: a rank that leaves keeps what it said)
                    json.dump(got, f)
        t1 = time.perf_counter()
        watch.end_check(error)
        got.setdefault("ends", []).append(time.perf_counter() - t1)
    with open(path, "w") as f:
        json.dump(got, f)
    store = dist.distributed_c10d._get_default_store()   # rank 0 serves the store: it leaves last
    store.set(f"test/bye/{rank}", "")
    if rank == 0:
        store.wait([f"test/bye/{r}" for r in range(P - 1)])
    os._exit(0)


def _run_shapes(P):
    from lab import launch
    ctx, port = launch._context(), launch.free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [ctx.Process(target=_rank, args=(r, P, port, out_dir), daemon=True) for r in range(P)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 90
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
        got = {}
        for r in range(P):
            path = os.path.join(out_dir, f"{r}.json")
            got[r] = json.load(open(path)) if os.path.exists(path) else {}
        return got, [p.exitcode for p in procs]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda P: f"{P} ranks")
def shapes(request):
    P = request.param
    t = time.perf_counter()
    got, codes = _run_shapes(P)
    print(f"\nthe shapes on {P} ranks: one run, {time.perf_counter() - t:.1f} s; end_check: {got[0].get('ends')}")
    for name in SHAPES:
        for r in range(P):
            msg, s = got[r].get(name, [None, None]) if name in got[r] else (None, None)
            print(f"  {name}, rank {r}: {'-' if s is None else f'{s:.2f} s'}: {msg}")
    return P, got, codes


EXPECT = {   # shape: (the ranks that name it, pieces of their message: a string, or a regex)
    "some ranks only": (lambda P: range(P), [
        re.compile(r"disagree on their collective #1 there — rank 0: broadcast of 6 float32 elements from rank 0; "
                   r"rank 1: all_reduce \(sum\) of 4 float32 elements"), "different collectives"]),
    "a different order": (lambda P: range(P), [
        re.compile(r"rank 0: all_reduce \(sum\) of 4 float32 elements; rank 1: all_gather of 4 float32 elements "
                   r"per rank into"), "in a different order"]),
    "a collective's sizes": (lambda P: range(P), [
        re.compile(r"rank 0: all_reduce \(sum\) of 4 float32 elements; .*rank (\d): all_reduce \(sum\) of 6 float32"),
        "the same collective with different sizes"]),
    "a transfer's sizes": (lambda P: range(P), [
        re.compile(r"rank (0|2) sends 4 float32 elements \(4,\) to rank (1|3) \(send #1 from \d to \d\), but rank \d's "
                   r"receive #1 from rank \d has room for 6 float32 elements \(6,\)"), "must agree on its size"]),
    "a send without its receive": (lambda P: range(P), [
        "deadlock: every rank here waits for a peer that waits elsewhere", "rank 0 waits to send 4 float32 elements "
        "(4,) to rank 1 (send #1 from 0 to 1; rank 1 has posted 0 receives from rank 0)",
        re.compile(r"rank 1 waits at all_reduce \(sum\) of 4 float32 elements over ranks \[0, 1[\], ]")]),
    "a rank that exits": (lambda P: range(P - 1), [
        re.compile(r"rank \d waits at all_reduce \(sum\) of 4 float32 elements over ranks \[.*\] \(its collective #1 "
                   r"there\), but rank (\d) left without it \(it left the run, exit code 3\)")]),
}


@pytest.mark.parametrize("name", SHAPES)
def test_watch_names_each_hang_shape_on_every_rank_within_its_patience(shapes, name):
    P, got, codes = shapes
    ranks, pieces = EXPECT[name][0](P), EXPECT[name][1]
    said = {r: got[r].get(name, [None, None]) for r in ranks}
    for r, (msg, seconds) in said.items():
        assert msg is not None, f"{name}: rank {r} went on without an error: {got[r]}"
        for p in pieces:
            assert (p.search(msg) if hasattr(p, "search") else p in msg), f"{name}: rank {r} said {msg!r}; not {p}"
        assert seconds < PATIENCE, f"{name}: rank {r} took {seconds:.2f} s (its patience: {PATIENCE} s)"
    if name != "a transfer's sizes":   # (there each pair stops on its own: two pairs, two messages)
        assert len({m for m, _ in said.values()}) == 1, f"{name}: the ranks said different things: {said}"
    if name == "a collective's sizes":
        assert f"rank {P - 1}: all_reduce (sum) of 6" in said[0][0], said[0][0]
    if name == "a rank that exits":
        assert f"but rank {P - 1} left" in said[0][0] and codes[P - 1] == 3, (said, codes)
        assert codes[:P - 1] == [0] * (P - 1), f"every other rank finished the run: exit codes {codes}"


def test_kill_usr1_prints_the_pending_collective_and_the_python_stack(shapes):
    P, got, _ = shapes
    out = got[1].get("usr1", "")
    assert f"kill -USR1: waits at all_reduce (sum) of 4 float32 elements over ranks {list(range(P))} (its " \
           "collective #" in out, out
    assert "Its Python stack, innermost last:" in out and "in _usr1" in out and "dist.all_reduce(torch.ones(4))" \
        in out, out


# ---- --watch and the guard as a learner runs them: torchrun train.py / a lesson ------------------------------------

CLIP_ON_RANK_0 = ("train.py", "        if a.grad_clip:\n", "        if a.grad_clip and dist.get_rank() == 0:\n")
CLIP_ON_RANK_0_FROM_STEP_3 = ("train.py", "        if a.grad_clip:\n",
                              "        if a.grad_clip and (step < 2 or dist.get_rank() == 0):\n")


def _lines(out, r):
    return [line for line in out.splitlines() if line.startswith(f"[rank {r}] ")]


def test_watch_on_train_py_stops_every_rank_with_one_message_and_where_it_was():
    t = time.perf_counter()
    out = run_exercise(Exercise("torchrun --nproc_per_node 2 train.py --dp-shard 2 --steps 2 --watch --patience 3",
                                None, edits=(CLIP_ON_RANK_0,), fails=True, timeout=90))
    print(f"\n--watch on train.py, a clip on rank 0 only, 2 ranks: {time.perf_counter() - t:.1f} s")
    verdict = ("the ranks of group [0, 1] disagree on their collective #1 there — rank 0: all_reduce (sum) of 1 "
               "float64 elements — all-reduces the gradients' squared norm (clipping) (step 1); rank 1: all_reduce "
               "(sum) of 1 float64 elements")
    for r in (0, 1):
        assert any(line.startswith(f"[rank {r}] {verdict}") for line in _lines(out, r)), out[-4000:]
        assert any(" stops: " in line for line in _lines(out, r)), f"rank {r} did not say where it stopped: " + out
    assert "Its Python stack, innermost last:" in out and "in clip_grad_norm_" in out, out[-4000:]
    assert re.search(r"^step +1 ", out, flags=re.M) is None, "no rank applied the step that differed"


def test_watch_on_a_lesson_prints_its_cost_per_collective():
    out = run_exercise(Exercise("torchrun --nproc_per_node 2 fsdp.py --stage 3 --steps 2 --watch", None, timeout=90))
    for r in (0, 1):
        said = [line for line in _lines(out, r) if "--watch: " in line]
        assert said, out[-3000:]
        m = re.search(r"--watch: (\d+) collectives and transfers watched, ([\d.]+) store round trips and ([\d.]+) ms "
                      r"each on average", said[0])
        assert m and int(m.group(1)) > 0 and float(m.group(3)) > 0, said[0]
        print(f"\n{said[0]}")


def test_the_default_guard_stops_every_rank_and_applies_no_update():
    out = run_exercise(Exercise("torchrun --nproc_per_node 2 train.py --dp-shard 2 --steps 4", None,
                                edits=(CLIP_ON_RANK_0_FROM_STEP_3,), fails=True, timeout=90))
    for r in (0, 1):
        assert any("rank 0 all-reduces the gradients' squared norm (clipping) (its collective #1 over ranks [0, 1] in "
                   "step 3), but rank 1 reached the optimizer step after 0 collectives there: a collective some ranks "
                   "make and others skip. No update was applied." in line for line in _lines(out, r)), out[-4000:]
    steps = [int(s) for s in re.findall(r"^step +(\d+) ", out, flags=re.M)]
    assert steps and max(steps) == 2, f"steps 1-2 ran, step 3 was applied by no rank: {steps}"
    assert "Traceback" not in out, out[-3000:]
