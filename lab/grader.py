"""The grader of `python -m lab.exercises grade NAME`: the machinery that runs an exercise's checks on the learner's
version and says what it found.

    grade(name)                     the command: load yours/<lesson>.py, run every check, print PASS / FAIL lines
    evaluate({P: [(name, path)]})   many versions of many cores, ONE spawned group of P ranks per world size (the
                                    tests grade the reference, the blank and seeded bugs of every exercise this way)

In each grading rank the collectives are watched first (lab/collective_watch.py: a mismatch across ranks is one
message within seconds, never a hang), then for each version the learner's core is put in place of the
reference's — every name bound to the reference function in the course's modules, or the class attribute of a
method (so subclasses use it too: fsdp's FlatUnit, expert_parallel's layer) — its checks run, and it is taken out
again. Each check's run is guarded on every rank: an error, a collective mismatch, a deadlock or an endless loop
(CHECK_SECONDS) becomes one line naming the rank and the learner's line, and every rank stays in step for the next
check. A wait inside gloo gives up after PATIENCE + 5 s (gloo's timeout while grading). Each run's result is kept in
a file as soon as it is done; a rank that dies (a signal, an exit) fails the check it was in, named with how and the
likely cause (an asynchronous collective dropped in flight, with its line; the crash's Python stack), and a fresh
group of ranks grades the jobs after it — as after a check in which gloo itself failed. The grading process then
judges each check from every rank's results, or reports the first failed run.

What each exercise is graded on — its runs, judges, checks and seeded bugs — is lab/exercise_checks.py's, one block
per exercise; this module reads its CHECKS and holds nothing of any exercise.
Imports: lab/diagnosis.py <- lab/exercise_checks.py <- this module <- lab/exercises.py (the command).
"""
from __future__ import annotations

import contextlib
import datetime
import faulthandler
import importlib
import importlib.util
import io
import json
import linecache
import os
import re
import signal
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lab import collective_watch as watch
from lab.exercise_checks import CHECKS, Check
from lab.workbook import BY_NAME, EXERCISES, ROOT, WORKSPACE, Exercise, Refusal, core_source, exercise, is_blank, \
    learner_text, marker, record_pass, yours

PATIENCE = float(os.environ.get("COURSE_GRADE_PATIENCE", "10"))   # seconds a rank waits for a missing peer
CHECK_SECONDS = float(os.environ.get("COURSE_GRADE_CHECK_SECONDS", "60"))  # one check's limit (an endless loop)
TIMES: dict = {}   # (exercise, run, P) -> seconds its run took on the slowest rank (the last evaluate's)


# ---- putting a learner's core in place (in the ranks) ---------------------------------------------------------------

def load(path: str, lesson: str):
    """The file at `path` as a module under a private name (yours_<lesson>_<n>): it never replaces the lesson."""
    name = f"yours_{lesson}_{abs(hash(path)) % 10 ** 8}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


_LESSONS = ("mesh", "ddp", "fsdp", "hsdp", "tensor_parallel", "pipeline", "ring_attention", "expert_parallel", "train")


def learner_module(ex: Exercise, path: str):
    """The learner's file loaded, its cores of `ex` present; cores of the lesson's OTHER exercises still blank in it
    are taken from the reference, so only this exercise is graded. Raises what loading raised (the file does not
    load)."""
    ref = importlib.import_module(ex.lesson)
    with open(path) as f:
        text = f.read()
    mine = load(path, ex.lesson)
    for other in EXERCISES:
        if other.lesson == ex.lesson and other is not ex:
            for q in other.cores:
                if "." not in q and is_blank(text, other, q):
                    setattr(mine, q, getattr(ref, q))
    for q in ex.cores:
        cls_name, _, attr = q.rpartition(".")
        if not hasattr(mine, cls_name or attr) or cls_name and attr not in vars(getattr(mine, cls_name)):
            raise LookupError(f"it has no {q}")
    return mine


@contextlib.contextmanager
def patched(ex: Exercise, mine):
    """The learner's cores of `ex` (from the module `mine`, learner_module's) in place of the reference's while
    inside: every name bound to the reference function in the course's modules, or the class attribute of a method;
    None: the reference itself."""
    if mine is None:
        yield
        return
    ref = importlib.import_module(ex.lesson)
    undo = []
    try:
        for q in ex.cores:
            if "." in q:
                cls_name, attr = q.split(".")
                cls = getattr(ref, cls_name)
                old, new = cls.__dict__[attr], getattr(mine, cls_name).__dict__[attr]
                setattr(cls, attr, new)
                undo.append((cls, attr, old))
            else:
                old, new = getattr(ref, q), getattr(mine, q)
                for m in watch.course_modules():
                    for k, v in list(vars(m).items()):
                        if v is old:
                            setattr(m, k, new)
                            undo.append((m, k, old))
        yield
    finally:
        for obj, attr, old in reversed(undo):
            setattr(obj, attr, old)


# ---- the ranks ------------------------------------------------------------------------------------------------------

class CheckTimeout(BaseException):
    """A check ran longer than CHECK_SECONDS (an endless loop?)."""


def _alarm(*_):
    raise CheckTimeout(f"the check ran longer than {_NOW['check']:.0f} s: an endless loop?")


def _rel(fn: str) -> str:
    return os.path.relpath(fn, ROOT) if fn.startswith(ROOT) else fn


def _where(frames, path: str | None = None) -> str:
    """' (at yours/ddp.py line 74, in f: <code>)': the innermost frame of the learner's file (`path`, or any in
    yours/), else of a lesson. frames: a traceback, or a list of (file, line, function, code) innermost last."""
    if frames is None or not isinstance(frames, list):
        frames = traceback.extract_tb(frames)
    mine = os.path.abspath(path) if path else None
    for want in ("path", "yours", "lesson"):
        for fn, line, func, code in reversed([tuple(f) for f in frames]):
            if (want == "path" and mine and os.path.abspath(fn) == mine
                    or want == "yours" and ("yours_" in fn or WORKSPACE + os.sep in fn)
                    or want == "lesson" and os.path.basename(fn)[:-3] in _LESSONS):
                code = code or linecache.getline(fn, line).strip()
                return f" (at {_rel(fn)} line {line}, in {func}: {code})"
    return ""


def _timed_out(e: BaseException, path: str | None) -> str:
    """Where the alarm found this rank (or the peer it waited for, whose alarm rang first): waiting for a peer in a
    collective or a transfer (in the watch, or in gloo after it), or anywhere else -- looping."""
    frames = traceback.extract_tb(e.__traceback__)
    waiting = next((f for f in frames if f.filename == watch.__file__), None)
    if waiting is None:
        return f"{e}{_where(frames, path)}"
    call = next((f for f in reversed(frames[:frames.index(waiting)]) if f.filename != watch.__file__), None)
    at = "" if call is None else f" at {_rel(call.filename)} line {call.lineno}: {call.line}"
    return f"the check ran longer than {_NOW['check']:.0f} s, waiting for a peer{at}{_where(frames, path)}"


def _guarded(run, P: int, path: str | None = None) -> dict:
    """One check's run on this rank: its result, or the error in words (kind: blank, mismatch, timeout, error, gloo,
    peer), agreed with every rank (end_check), and whether it left the process group unusable (dirty)."""
    watch.begin_check()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, _NOW["check"])
    out, error, kind, t0 = None, None, None, time.perf_counter()
    try:
        try:
            out = run(P)
        finally:   # the alarm off before any handler below runs: a peer's failure met at the limit (its own alarm
            signal.setitimer(signal.ITIMER_REAL, 0)   # rang first) is told, not cut short by this rank's alarm
    except NotImplementedError as e:
        error, kind = str(e), "blank" if "not implemented yet: exercise" in str(e) else "error"
    except watch.PeerLeft as e:
        if "it raised the check ran longer than" in str(e):   # its alarm rang first: this rank was waiting for it
            error, kind = _timed_out(e, path), "timeout"
        else:
            error, kind = str(e), "peer"
    except watch.CollectiveMismatch as e:
        error, kind = str(e), "mismatch"
    except CheckTimeout as e:
        error, kind = _timed_out(e, path), "timeout"
    except SystemExit as e:
        error, kind = (f"the core ended the process (sys.exit({e.code!r})): a core returns, it never exits"
                       f"{_where(e.__traceback__, path)}"), "error"
    except Exception as e:  # noqa: BLE001 - the learner's error, named with where it happened
        if watch.is_gloo_error(e):   # gloo's or the store's: said in words, and the group is not used again
            error, kind = f"{watch.explain(e)}{_where(e.__traceback__, path)}", "gloo"
        else:
            first = (str(e).strip().splitlines() or [""])[0][:300]
            error, kind = f"{type(e).__name__}: {first}{_where(e.__traceback__, path)}", "error"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    never = _unwaited(path) if kind is None else None   # (after an error: the works it left behind as it unwound)
    if never:   # the cause of wrong values, or of right ones by luck
        error, kind = never, "error"
    try:   # a rank in an endless loop is stopped by its alarm
        errors = watch.end_check(error, wait=_NOW["check"] + 5, broken=error if kind == "gloo" else None)
        dirty = watch.unusable()
    except Exception as e:  # noqa: BLE001 - the job's store is gone with rank 0: the group is done for
        errors, dirty = {dist.get_rank(): error}, {dist.get_rank(): watch.explain(e)}
    failed = [(r, e) for r, e in sorted(errors.items()) if e]
    if failed and not error:
        error, kind = f"another rank failed: rank {failed[0][0]}: {failed[0][1]}", "elsewhere"
    stuck = any(e.startswith(("the check ran longer", "never finished")) for _, e in failed)
    return dict(out=out, error=error, kind=kind, seconds=time.perf_counter() - t0, stuck=stuck, dirty=dirty)


def runs_of(name: str, P: int) -> list:
    """The distinct runs of exercise `name`'s checks on P ranks, in order (two checks of one run share its result)."""
    return list(dict.fromkeys(c.run for c in CHECKS[name] if c.run is not None and P in c.worlds))


_NOW: dict = {}   # what this rank is grading: outdir, rank, check (its seconds), job, run, path


def _file(*parts) -> str:
    return os.path.join(_NOW["outdir"], ".".join(str(p) for p in parts))


def _write(name: str, data: bytes) -> None:
    """Whole or not at all: the grading process may read it after this rank was killed."""
    with open(name + ".tmp", "wb") as f:
        f.write(data)
    os.replace(name + ".tmp", name)


def _progress(job: int, run: int | None) -> None:
    _NOW.update(job=job, run=run)
    _write(_file("now", _NOW["rank"]), json.dumps(dict(job=job, run=run)).encode())


def _save(job: int, k: int, res: dict) -> None:
    buf = io.BytesIO()
    try:
        torch.save(res, buf)
    except Exception as e:  # noqa: BLE001 - e.g. the core returned something that cannot be pickled
        buf = io.BytesIO()
        torch.save(dict(out=None, kind="error", error=f"its result could not be kept: {type(e).__name__}: {e}"), buf)
    _write(_file(job, k, _NOW["rank"], "pt"), buf.getvalue())


def _dropped(rec: dict) -> None:
    """The watch's drop hook: a work dropped unwaited, noted at once (the rank may crash soon after, when gloo writes
    into its freed tensors)."""
    with open(_file("dropped", _NOW["rank"]), "a") as f:
        f.write(json.dumps(dict(job=_NOW.get("job"), run=_NOW.get("run"), what=rec["what"],
                                where=_where(rec["site"], _NOW.get("path")))) + "\n")


def _unwaited(path: str | None) -> str | None:
    """A work this check posted and never waited, said with where it was posted; None if every one was waited."""
    never = watch.unwaited()
    if not never:
        return None
    rec = never[0]
    how = "dropped unwaited" if rec["dropped"] else "never waited"
    more = f" (and {len(never) - 1} more)" if len(never) > 1 else ""
    return (f"an asynchronous {rec['what']} was {how}{_where(rec['site'], path)}{more}: its result may be read before "
            f"it arrives, and its tensors freed while gloo still writes into them — keep each work and wait() on it "
            f"before using or freeing its tensors")


def _grade_job(j: int, name: str, path: str | None, P: int) -> bool:
    """Every run of exercise `name` for one version, on this rank, each result saved; False when a run left the
    process group unusable (the grading process starts a fresh one for the next job)."""
    runs, ex = runs_of(name, P), BY_NAME[name]
    _progress(j, None)
    _NOW["path"] = path
    try:
        mine = None if path is None else learner_module(ex, path)
    except Exception as e:  # noqa: BLE001 - the learner's file does not load
        err = f"{_rel(path)} does not load: {type(e).__name__}: {e}{_where(e.__traceback__, path)}"
        for k in range(len(runs)):
            _save(j, k, dict(out=None, error=err, kind="load"))
        return True
    skip, usable, judged = None, True, {}
    with patched(ex, mine):
        for k, run in enumerate(runs):
            _progress(j, k)
            res = dict(out=None, kind="skipped", error=skip) if skip else _guarded(run, P, path)
            _save(j, k, res)
            if path in _NOW["first"] and not skip and not res.get("dirty") and _failed_yet(j, name, k, P, judged):
                skip = "not run: graded up to its first failing check"
            if res.get("dirty"):   # (the same on every rank: end_check's)
                why = sorted(res["dirty"].items())[0]
                skip, usable = (f"not run: an earlier check of this exercise left the ranks unable to go on (rank "
                                f"{why[0]}: {why[1]}); fix that one first"), False
            elif res.get("stuck") and not skip:
                skip = (f"not run: an earlier check of this exercise ran longer than {_NOW['check']:.0f} s on a rank "
                        f"(an endless loop?)")
    return usable


def _failed_yet(j: int, name: str, k: int, P: int, judged: dict) -> bool:
    """After run k of job j (first_failure): has a check failed that comes before every check not judged yet? Rank 0
    judges, as the grading process will, once every rank's result is saved, and tells the others through the store;
    judged {check index: ok} carries over from run to run."""
    store, me, key = dist.distributed_c10d._get_default_store(), dist.get_rank(), f"course/first/{j}/{k}"
    store.add(key + "/saved", 1)
    if me != 0:
        store.wait([key + "/verdict"], datetime.timedelta(seconds=600))
        return store.get(key + "/verdict") == b"stop"
    deadline = time.monotonic() + _NOW["check"] + 30
    while store.add(key + "/saved", 0) < P and time.monotonic() < deadline:   # (a rank that died ends the group)
        time.sleep(0.002)
    runs, stop = runs_of(name, P), False
    for i, c in enumerate(CHECKS[name]):
        if c.run is None or P not in c.worlds:
            continue
        if runs.index(c.run) > k:   # a check not run yet comes first: the first failing one is not known
            break
        if i not in judged:
            judged[i] = _judge(c, P, [_result(_NOW["outdir"], j, runs.index(c.run), r) for r in range(P)]).ok
        if not judged[i]:
            stop = True
            break
    store.set(key + "/verdict", "stop" if stop else "go")
    return stop


def rank_main(jobs, patience: float | None = None, outdir: str | None = None,
              check_seconds: float | None = None, first_failure: frozenset = frozenset()) -> int:
    """On every rank: for each (exercise name, path or None) the learner's cores in place, every run for this world
    size, each result saved in `outdir` as <job>.<run>.<rank>.pt (what the rank is at: now.<rank>; a crash's stacks:
    crash.<rank>; its stderr: stderr.<rank>). Returns how many jobs it graded: fewer than all when a check left the
    group unusable. patience, check_seconds: PATIENCE and CHECK_SECONDS as this rank's environment says, if None.
    first_failure: the paths whose grading stops at their first failing check (the later ones "not run")."""
    me, P = dist.get_rank(), dist.get_world_size()
    patience = PATIENCE if patience is None else patience
    _NOW.update(outdir=outdir or tempfile.mkdtemp(prefix="course-grade-"), rank=me,
                check=CHECK_SECONDS if check_seconds is None else check_seconds, first=first_failure)
    watch.install(patience, busy=_NOW["check"] + patience)   # a peer still computing: its check's alarm stops it
    # a wait the watch let through has every side posted: gloo may give up soon after (the groups checks build too)
    c10d, bound = dist.distributed_c10d, datetime.timedelta(seconds=patience + 5)
    c10d._set_pg_timeout(bound)
    c10d.default_pg_timeout = bound
    watch.set_drop_hook(_dropped)
    crash = open(_file("crash", me), "w")
    faulthandler.enable(crash, all_threads=True)
    real_exit = os._exit

    def _exit(code):   # a core that ends its process: where, for the grading process (it cannot say it otherwise)
        faulthandler.dump_traceback(crash, all_threads=False)
        crash.flush()
        real_exit(code)
    os._exit = _exit
    # gloo's and the store's C++ warnings when a peer dies, and their stack dumps: kept out of the grade's output
    # (read back for a rank that died)
    sys.stderr.flush()
    stderr = os.dup(2)
    os.dup2(os.open(_file("stderr", me), os.O_WRONLY | os.O_CREAT | os.O_APPEND), 2)
    # the watch checks every collective; the lessons' own announcements (mesh.agree, lesson 2) would wait on the store
    # outside it, where a mismatch the watch stops on one rank would keep a peer waiting the full collective timeout
    os.environ["COURSE_CHECK_COLLECTIVES"] = "0"
    # stage 3's hooks on the embedding, whose inputs need no gradient: PyTorch says when its backward hook fires
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    try:
        for lesson in _LESSONS[:-1]:
            importlib.import_module(lesson)   # after install: the names they bind are the watched ones
        for j, (name, path) in enumerate(jobs):
            if not _grade_job(j, name, path, P):
                return j + 1
        return len(jobs)
    finally:
        os._exit = real_exit
        faulthandler.disable()
        crash.close()
        sys.stderr.flush()
        os.dup2(stderr, 2)
        watch.uninstall()


# ---- the grading process ---------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    P: int | None
    title: str
    ok: bool
    lines: list
    kind: str | None = None   # the run failed (one of _KINDS), or None: judged


# the run failed: the first kind is told first (a rank's own error before what its peers met because of it)
_KINDS = ["blank", "load", "died", "mismatch", "timeout", "error", "gloo", "peer", "elsewhere", "skipped"]
_ECHOES = ("peer", "elsewhere", "skipped")   # what a rank meets because of another's failure, never told apart


def _order(res) -> float:
    looping = res["kind"] == "timeout" and "an endless loop?" in res["error"]
    return _KINDS.index("died") + 0.5 if looping else _KINDS.index(res["kind"])


def _judge(check: Check, P, results) -> Outcome:
    failed = [(r, res) for r, res in enumerate(results) if res["error"]]
    if failed:
        # the first by kind; a rank in an endless loop before the peers that gave up waiting for it (rank 1 loops while
        # rank 0 waits in the all-reduce: rank 1's line is the one to read, rank 0's follows)
        r, res = min(failed, key=lambda f: (_order(f[1]), f[0]))
        raised = [(r2, x) for r2, x in failed if x["kind"] == "error"]
        if res["kind"] == "mismatch" and res["error"].startswith("deadlock") and raised:
            # a rank that raised never posts what its peers wait for: the wait the watch saw first among those peers
            # (a race with that rank's error) is its consequence — the error is the cause
            r, res = raised[0]
        alike = len(failed) == len(results) > 1 and all(x["error"] == res["error"] for _, x in failed)
        who = "every rank" if alike else f"rank {r}"
        if res["kind"] in ("mismatch",):
            who = "a hang, stopped" if res["error"].startswith("deadlock") else "collectives do not match"
        lines = [f"{who}: {res['error']}"]
        others = {}   # what the other ranks met, when it is something else (a wait beside an endless loop)
        for r2, res2 in failed:
            key = res2["kind"] if res2["kind"] != res["kind"] else res2["error"]
            if res2["kind"] not in _ECHOES and res2["error"] != res["error"] and key not in others and not (
                    res["kind"] == "mismatch" and res2["kind"] == "mismatch" or res["kind"] == "died"):
                others[key] = f"rank {r2}: {res2['error']}"
        return Outcome(P, check.title, False, lines + list(others.values()), res["kind"])
    try:
        lines = check.judge(P, [res["out"] for res in results])
    except Exception as e:  # noqa: BLE001 - something the judge did not expect: still a failure, said plainly
        lines = [f"the results could not be judged ({type(e).__name__}: {e})"]
    return Outcome(P, check.title, not lines, lines)


def evaluate(jobs: dict, timeout: float = 600, patience: float | None = None, check_seconds: float | None = None,
             first_failure=()) -> dict:
    """jobs {P: [(exercise name, path or None)]} -> {(name, path, P): [Outcome per check]}: one group of P ranks per
    world size for all the jobs — a fresh one after a check that left it unusable or a rank that died (checks
    without ranks run here, once per (name, path)). patience, check_seconds: the ranks' PATIENCE and CHECK_SECONDS
    (None: as their environment says). first_failure: paths graded only up to their first failing check (its
    diagnosis the same; what a seeded bug's test reads), the checks after it "not run"."""
    out, first_failure = {}, frozenset(first_failure)
    for P, todo in sorted(jobs.items()):
        ranked = [(n, p) for n, p in todo if runs_of(n, P)]
        results = _in_ranks(ranked, P, timeout, patience, check_seconds, first_failure) if ranked else []
        for (name, path), per_rank in zip(ranked, results):
            runs = runs_of(name, P)
            for k, run in enumerate(runs):
                TIMES[(name, run.__name__, P)] = max(rr[k].get("seconds", 0) for rr in per_rank)
            outcomes, told = [], set()
            for c in CHECKS[name]:
                if c.run is None or P not in c.worlds:
                    continue
                o = _judge(c, P, [rr[runs.index(c.run)] for rr in per_rank])
                if o.kind is not None and c.run in told:   # one failed run, several checks: say it once
                    o.lines = ["the same run as above failed (see there)"]
                told.add(c.run)
                outcomes.append(o)
            out[(name, path, P)] = outcomes
    pure = {(n, p) for todo in jobs.values() for n, p in todo if any(c.run is None for c in CHECKS[n])}
    for name, path in sorted(pure, key=str):
        out[(name, path, None)] = pure_outcomes(name, path)
    return out


def _in_ranks(ranked: list, P: int, timeout: float, patience, check_seconds, first_failure=frozenset()) -> list:
    """[per job: [per rank: [per run: result]]]: the jobs graded in a group of P ranks, and in a fresh group for the
    jobs after one that left it unusable or during which a rank died (that job's run then says how it died)."""
    from lab.launch import RankError, run_ranks
    results = []
    with tempfile.TemporaryDirectory(prefix="course-grade-") as tmp:
        while len(results) < len(ranked):
            start, outdir = len(results), os.path.join(tmp, str(len(results)))
            os.mkdir(outdir)
            failure = None
            try:
                run_ranks(rank_main, P, ranked[start:], patience, outdir, check_seconds, first_failure,
                          timeout=timeout)
            except (RankError, TimeoutError) as e:
                failure = e
            for j, (name, _) in enumerate(ranked[start:]):
                got = [[_result(outdir, j, k, r) for k in range(len(runs_of(name, P)))] for r in range(P)]
                if all(x is not None for rr in got for x in rr):
                    results.append(got)
                    continue
                if failure is not None or any(x is not None for rr in got for x in rr) or len(results) == start:
                    results.append(_lost(outdir, j, got, failure, ranked[start + j][1], timeout))
                break
    return results


def _result(outdir: str, j: int, k: int, r: int):
    f = os.path.join(outdir, f"{j}.{k}.{r}.pt")
    return torch.load(f, weights_only=False) if os.path.exists(f) else None


def _lost(outdir: str, j: int, got: list, failure, path, timeout) -> list:
    """A job the ranks did not finish: each rank's saved runs, then the run a rank died in (or ran out of time in),
    then "not run" for the rest."""
    P = len(got)
    now = {}
    for r in range(P):
        f = os.path.join(outdir, f"now.{r}")
        now[r] = json.load(open(f)) if os.path.exists(f) else None
    dead = getattr(failure, "rank", None)
    at = next((now[r]["run"] for r in ([dead] if dead is not None else []) + list(range(P))
               if now.get(r) and now[r]["job"] == j), None)
    if isinstance(failure, TimeoutError):
        what, kind = f"the ranks did not finish it within {timeout:.0f} s (stopped)", "timeout"
    elif failure is None:
        what, kind = "the ranks stopped without its results", "died"
    elif dead is not None and now.get(dead) is None:   # before rank_main began: not the learner's doing
        what, kind = (f"the ranks could not start: rank {dead} ended before grading began (exit code "
                      f"{getattr(failure, 'exitcode', None)}): {' '.join(_tail(outdir, dead)[-1:]) or failure}"), "died"
    else:
        what, kind = _died(failure, outdir, j, path, at), "died"
    loading = at is None
    if loading and kind == "died" and now.get(dead) is not None:
        what = f"{what} — while loading {_rel(path) if path else 'the lesson'}"
    out = []
    for r, runs in enumerate(got):
        mine = []
        for k, res in enumerate(runs):
            if res is not None:
                mine.append(res)
            elif loading or k <= at:
                mine.append(dict(out=None, kind=kind, error=what) if r == dead or dead is None else
                            dict(out=None, kind="peer", error=f"another rank died: rank {dead}: {what}"))
            else:
                mine.append(dict(out=None, kind="skipped", error=f"not run: rank {dead} died in an earlier check of "
                                 f"this exercise" if dead is not None else f"not run: {what}"))
        out.append(mine)
    return out


def _died(e, outdir: str, j: int, path, at) -> str:
    """How rank e.rank died, and the likeliest cause: a signal (its Python stack from faulthandler names the
    learner's line), an exit, or an error outside the check."""
    r, code, tb = e.rank, getattr(e, "exitcode", None), getattr(e, "traceback", None)
    dropped = []
    f = os.path.join(outdir, f"dropped.{r}")
    if os.path.exists(f):
        dropped = [d for d in map(json.loads, open(f)) if d["job"] == j]
    sig = signal.Signals(-code).name if code is not None and code < 0 and -code in signal.valid_signals() else None
    if tb:
        last = (tb.strip().splitlines() or [""])[-1][:300]
        frames = [(fn, int(n), func, "") for fn, n, func in re.findall(r'File "(.+?)", line (\d+), in (\S+)', tb)]
        return f"died in this check, raising outside it: {last}{_where(frames, path)}"
    how = f"killed by {sig}" if sig else f"the process exited with code {code}"
    site = _crash_site(outdir, r, path)
    if dropped:
        d = dropped[-1]
        cause = (f"an asynchronous {d['what']} was dropped unwaited{d['where']}: gloo still wrote into its tensors "
                 f"once they were freed — keep the work and wait() on it before using or freeing them")
        site = "" if site == d["where"] else f" — the crash itself came later{site}" if site else ""
    elif sig in ("SIGSEGV", "SIGBUS"):
        cause = ("memory used after it was freed: most likely an asynchronous collective or transfer never waited (its "
                 "work dropped while gloo still wrote into its tensors) — keep each work and wait() on it before "
                 "using or freeing its tensors")
    elif sig == "SIGABRT":
        said = [line.strip() for line in _tail(outdir, r) if "what():" in line or "terminate called" in line]
        cause = "a C++ abort" + (f" ({said[-1][:200]})" if said else "") + (
            ": most likely gloo received more bytes than a collective or transfer posted room for (sizes that "
            "differ across ranks)" if not said or "size" in said[-1] else "")
    elif sig:
        cause = "a signal ended the process"
    else:
        cause = "the core ended the process (os._exit, or an abort): a core returns, it never exits"
    return f"died in this check ({how}): {cause}{site}"


def _tail(outdir: str, r: int) -> list:
    """The last lines rank r wrote to its stderr (gloo's and torch's own messages go there, not to the learner)."""
    f = os.path.join(outdir, f"stderr.{r}")
    return open(f, errors="replace").read()[-4000:].splitlines() if os.path.exists(f) else []


def _crash_site(outdir: str, r: int, path) -> str:
    """Where faulthandler found the threads when the rank crashed: the learner's innermost line, else a lesson's."""
    f = os.path.join(outdir, f"crash.{r}")
    text = open(f).read() if os.path.exists(f) else ""
    blocks = re.split(r"\n(?=\S)", text)   # one block per thread; the crashing one is "Current thread"
    blocks.sort(key=lambda b: not b.startswith("Current thread"))
    for b in blocks:
        frames = [(fn, int(n), func, "") for fn, n, func in re.findall(r'File "(.+?)", line (\d+) in (\S+)', b)]
        where = _where(frames[::-1], path)   # (faulthandler lists the innermost first)
        if where:
            return where
    return ""


def pure_outcomes(name: str, path: str | None) -> list[Outcome]:
    ex = BY_NAME[name]
    ref = importlib.import_module(ex.lesson)
    try:
        mod = ref if path is None else load(path, ex.lesson)
    except Exception as e:  # noqa: BLE001
        return [Outcome(None, c.title, False, [f"{path} does not load: {type(e).__name__}: {e}"], "load")
                for c in CHECKS[name] if c.run is None]
    outs = []
    for c in CHECKS[name]:
        if c.run is not None:
            continue
        try:
            lines, kind = c.judge(getattr(mod, ex.cores[0]), getattr(ref, ex.cores[0])), None
        except NotImplementedError as e:
            lines, kind = [str(e)], "blank"
        except Exception as e:  # noqa: BLE001
            lines, kind = [f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}{_where(e.__traceback__)}"], \
                "error"
        outs.append(Outcome(None, c.title, not lines, lines, kind))
    return outs


def worlds_of(name: str) -> list:
    return sorted({P for c in CHECKS[name] if c.run is not None for P in c.worlds})


def format_outcome(o: Outcome) -> list[str]:
    where = "no ranks" if o.P is None else f"{o.P} rank" + ("s" if o.P > 1 else "")
    return [f"  {'PASS' if o.ok else 'FAIL'}  {where:<8} {o.title}"] + [f"          {line}" for line in o.lines]


def grade(name: str, root: str = ROOT, out=print) -> bool:
    """The command: every check of exercise `name` on yours/<lesson>.py, one world size after another (stopping after
    one where the core is still blank). Prints one line per check; True if all passed."""
    ex = exercise(name)
    text = learner_text(ex, root)
    path = yours(ex, root)
    rel = os.path.relpath(path, root)
    for q in ex.cores:
        if core_source(text, q) is None:
            raise Refusal(f"{rel} has no {q} any more: write it back (python -m lab.exercises solution {name} prints "
                          f"the reference's), or start over: python -m lab.exercises start {name} --over")
    try:
        load(path, ex.lesson)
    except Exception as e:  # noqa: BLE001
        raise Refusal(f"{rel} does not load: {type(e).__name__}: {e}") from None
    out(f"grading exercise {name} (lesson {ex.number}, {ex.file}: {', '.join(ex.cores)}) from {rel}")
    passed = total = 0
    start = time.monotonic()
    steps = ([None] if any(c.run is None for c in CHECKS[name]) else []) + worlds_of(name)
    for i, P in enumerate(steps):
        outcomes = pure_outcomes(name, path) if P is None else evaluate(
            {P: [(name, path)]}, patience=PATIENCE, check_seconds=CHECK_SECONDS)[(name, path, P)]
        for o in outcomes:
            for line in format_outcome(o):
                out(line)
        passed += sum(o.ok for o in outcomes)
        total += len(outcomes)
        rest = ", ".join(f"{p} ranks" if p else "no ranks" for p in steps[i + 1:])
        if rest and any(o.kind == "blank" for o in outcomes):
            out(f"  (not run on {rest}: write the core first — {marker(ex)})")
            break
        if rest and any(o.kind == "timeout" for o in outcomes):   # each world size would wait as long again
            out(f"  (not run on {rest}: a check above ran longer than {CHECK_SECONDS:.0f} s — fix that first)")
            break
    took = time.monotonic() - start
    if passed == total:
        record_pass(ex, text, root)
        out(f"exercise {name}: all {total} checks passed ({took:.0f} s). Compare with the reference: "
            f"python -m lab.exercises compare {name}")
        return True
    out(f"exercise {name}: {passed} of {total} checks passed ({took:.0f} s). Fix the first FAIL and grade again; "
        f"python -m lab.exercises compare {name} shows your core beside the reference.")
    return False
