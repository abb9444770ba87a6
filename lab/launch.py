"""How a run starts and ends: N ranks from Python (tests, notebooks), and a torchrun entry point's end.

    results = run_ranks(fn, world_size, *args, timeout=60)   # [fn's return value on each rank]
    run_in_turn((fn, args), ...)                             # several rank functions, one spawn
    main(fn)        a demo's entry point: fn(argv) -> exit code; bad input is one line per rank, exit 2
    parse(ap, argv) a demo's command line, with --watch and --patience (lab/collective_watch.py)
    finish(ok)      the one clean end of a run on every rank (barrier, groups torn down; --watch's cost said)

- Ranks are fresh processes on gloo (CPU), forked from one server process that imported torch once
  (multiprocessing's forkserver: a group starts in a fraction of a second, not the seconds N imports of torch
  take on 2 cores; torch._dynamo too, which torch imports at a rank's first model built under a device context
  -- its random init goes through a function dynamo must skip -- 3 s of CPU a rank) — spawned afresh instead
  while the environment, working directory or sys.path differs from the server's (a rank starts with what a
  spawned one would). Every call gets a fresh free port.
- An exception on any rank fails the call with *that* rank's traceback; a rank that dies (a signal, an exit) fails
  it naming the rank and its exit code — that rank, not a peer whose error its death caused (RankError's rank,
  exitcode, traceback).
- A rank that hangs (a collective nobody answers) fails the call after `timeout`
  seconds, and every rank is killed: nothing stalls.
`fn` must be a module-level function of an importable module (it is pickled into the
child processes), and its return value picklable (tensors are).
"""
from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist

from lab import collective_watch as watch


def free_port() -> int:
    """A TCP port nobody listens on now (the rendezvous of a new group of ranks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankError(RuntimeError):
    """A rank failed: `rank`, and its `exitcode` (negative: the signal that killed it) or the `traceback` it raised."""

    def __init__(self, message: str, rank: int | None = None, exitcode: int | None = None,
                 traceback: str | None = None):
        super().__init__(message)
        self.rank, self.exitcode, self.traceback = rank, exitcode, traceback


def _child(fn, rank, world_size, port, args, kwargs, results, collective_timeout):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), COURSE_TIMEOUT=str(collective_timeout))
    torch.set_num_threads(1)  # N ranks share 2 cores: one thread each avoids thrashing
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=collective_timeout))
        out = fn(*args, **kwargs)
        # Serialise here: tensors put on a queue travel as shared memory that vanishes when
        # this process exits, before the parent may have read them.
        buf = io.BytesIO()
        torch.save(out, buf)
        report = (rank, True, buf.getvalue())
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit
        report = (rank, False, traceback.format_exc())

    def send():
        results.put(report)
        results.close()
        results.join_thread()  # the report is in the pipe before the process goes

    if not report[1]:   # a failure is reported before its group closes, so it reaches the harness before
        send()          # any peer's "connection closed by peer" it causes: the harness names the cause
    try:
        if dist.is_initialized() and report[1]:
            dist.barrier()  # every rank is done: no collective of a peer is cut off below
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a peer already failed; its report says why
        pass
    if report[1]:
        send()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without interpreter finalisation, as main does (see there): a gloo thread of a
    # group still referenced by fn's objects must never meet a finalising interpreter.
    os._exit(0)


def run_ranks(fn, world_size: int, *args, timeout: float = 90, **kwargs) -> list:
    """Run fn(*args, **kwargs) on `world_size` gloo ranks; return the per-rank results."""
    for attempt in range(3):
        try:
            return _run_once(fn, world_size, args, kwargs, timeout)
        except RankError as e:
            # The free port we picked can be taken by another job before rank 0 binds it:
            # a race of a shared machine, not a failure of fn. Try again on a new port.
            if "EADDRINUSE" not in str(e) and "Address already in use" not in str(e) or attempt == 2:
                raise


_SERVER = {}  # the forkserver context, and the environment, directory and sys.path it started with


def _environment():
    """What a spawned rank would start with: the environment, the working directory and sys.path — less the
    name of the test pytest runs now, and inductor's cache directory (importing torch._dynamo sets it to the
    default a rank would compute for itself)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR")}
    return env, os.getcwd(), list(sys.path)


def _context():
    """The forkserver's context; "spawn" while the environment, working directory or sys.path differs from
    what the server started with (e.g. a variable the ranks' C library reads at start: a forked rank would not
    see it). The server starts at the first call made with the environment and directory this module was
    imported with — not inside a caller's temporary change, which would send every later call to spawn.
    Nothing of the calling process comes with a forked rank either."""
    now = _environment()
    if not _SERVER and now[:2] == _AT_IMPORT[:2]:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "lab.launch"])
        _SERVER.update(ctx=ctx, started=now)
    return _SERVER["ctx"] if _SERVER and now == _SERVER["started"] else mp.get_context("spawn")


_AT_IMPORT = _environment()


def _run_once(fn, world_size, args, kwargs, timeout):
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    # A collective gives up a little before the harness does, so a hang usually ends in a
    # traceback that names the stuck collective rather than in a bare kill.
    coll_timeout = max(5, int(timeout * 0.8))
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, args, kwargs, results, coll_timeout),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    got, deadline = {}, time.monotonic() + timeout
    try:
        while len(got) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(got))
                raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout}s "
                                   f"(a hang: a collective that some rank never joined?)")
            try:
                rank, ok, out = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                _raise_if_dead(procs, got)
                continue
            if not ok:
                # a peer's death makes its neighbours fail too ("Connection closed by peer"): blame the dead one
                if any(s in out for s in _PEER_GONE + ("DistNetworkError", "Broken pipe")):
                    _raise_if_dead(procs, got | {rank: None}, grace=1.0)
                raise RankError(f"rank {rank} of {world_size} raised:\n{out}", rank=rank, traceback=out)
            got[rank] = torch.load(io.BytesIO(out), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=0.5 if len(got) < world_size else 10)
            if p.is_alive():
                p.kill()
                p.join()
    return [got[r] for r in range(world_size)]


def _raise_if_dead(procs, got, grace: float = 0.0) -> None:
    """RankError for a rank that exited without reporting (looking for `grace` seconds)."""
    end = time.monotonic() + grace
    while True:
        dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode not in (None, 0)]
        if dead:
            code = procs[dead[0]].exitcode
            raise RankError(f"rank {dead[0]} died with exit code {code} before reporting", rank=dead[0],
                            exitcode=code) from None
        if time.monotonic() >= end:
            return
        time.sleep(0.05)


def run_in_turn(*calls):
    """[fn(*args) for (fn, args) in calls] on every rank: several measurements, one spawn of ranks."""
    return [fn(*args) for fn, args in calls]


# ---- a torchrun entry point's one clean end --------------------------------------------------------

def parse(parser, argv=None):
    """A lesson's command line (argparse), with --watch and --patience: parsed, and under --watch the watch started
    for the whole run (start_watch)."""
    watch.add_flags(parser)
    args = parser.parse_args(argv)
    start_watch(args)
    return args


def start_watch(args) -> None:
    """--watch: every collective and transfer checked before it runs (lab/collective_watch.py), from the first on;
    kill -USR1 answered in every run. Not with --compare: its round trips would be timed with the run (ValueError, on every rank alike)."""
    if getattr(args, "watch", False):
        if getattr(args, "compare", False):
            raise ValueError("--watch checks every collective through the store, which a timing run would time too: "
                             "leave --compare out (or --watch), and run them one after the other")
        watch.start(args.patience)
    else:
        watch.answer_usr1()   # (kill -USR1 still says where each rank is: the guard's last collective, the stack)


def finish(ok: bool = True) -> int:
    """End a run the same way on every rank: wait until every rank is done, then tear the process
    groups down. Returns the exit code (0 if ok). `main` then leaves the process (see there)."""
    if dist.is_initialized() and watch.watching():
        watch.report()
    if dist.is_initialized():
        dist.barrier()  # after it no rank has a collective in flight: nothing is torn down under a peer
        dist.destroy_process_group()
    return 0 if ok else 1


_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Connection refused")  # gloo's words


def _innermost(e) -> str:
    """file:line of the innermost frame of e's traceback outside torch."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if os.sep + "torch" + os.sep not in f.filename]
    return f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else "torch"


def main(fn, argv=None) -> None:
    """Run a demo, `fn(argv) -> exit code`, as a lesson's `__main__`, and leave the process.

    Bad input raises ValueError on every rank alike, before any collective (each lesson checks its
    arguments by arithmetic first): it is printed as one line per rank, not a traceback, and the
    run exits with code 2. Under torchrun a rank lingers a moment before exiting, so that torchrun
    (which stops every rank once one has exited) does not cut the slower ranks off before they say it.

    Why the process is left with os._exit: a process group's backend threads (gloo's) live as long
    as the group object, and a model wrapper whose hooks refer back to it keeps it alive until the
    interpreter itself shuts down. A backend thread that then drops the last reference to a Python
    object (a tensor's wrapper, a future's callback) must take the GIL from a finalising
    interpreter, which ends the thread in a way C++ cannot unwind: `terminate called without an
    active exception`, SIGABRT, in a few runs out of a hundred. After `finish` every collective is
    done, so nothing is lost by skipping finalisation — and no backend thread can meet it.
    """
    try:
        code = fn(argv)
    except watch.CollectiveMismatch as e:   # the ranks' collectives differ (mesh.agree, or --watch): one line each
        print(f"[rank {os.environ.get('RANK', '0')}] {e}", file=sys.stderr, flush=True)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            time.sleep(1.5)   # (a peer waiting inside a collective reads the verdict from the store this rank may serve)
        code = 1
    except ValueError as e:
        print(f"[rank {os.environ.get('RANK', '0')}] error: {e}", file=sys.stderr, flush=True)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            time.sleep(3)
        code = 2
    except RuntimeError as e:
        if watch.is_gloo_error(e) and not any(s in str(e) for s in _PEER_GONE):   # gloo gave up: said in words
            print(f"[rank {os.environ.get('RANK', '0')}] {watch.explain(e)} ({type(e).__name__} in "
                  f"{_innermost(e)}; --watch names the collective each rank waits in)", file=sys.stderr, flush=True)
        elif not any(s in str(e) for s in _PEER_GONE):
            traceback.print_exc()
        else:  # another rank died (a crash, --fail-at, or it stopped at the guard's verdict): one line
            said = watch.verdict()
            print(f"[rank {os.environ.get('RANK', '0')}] " + (said if said else "a peer rank is gone: "
                                                                 + str(e).splitlines()[0][:160]),
                  file=sys.stderr, flush=True)
        code = 1
    except SystemExit as e:  # argparse's --help and usage errors
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - a crash: report it, and still leave without finalisation
        traceback.print_exc()
        code = 1
    watch.leave(code or 0)   # (a peer still waiting for this rank is told, not left to its timeout)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
