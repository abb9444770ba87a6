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
check. The grading process then judges each check from every rank's results, or reports the first failed run.

What each exercise is graded on — its runs, judges, checks and seeded bugs — is lab/exercise_checks.py's, one block
per exercise; this module reads its CHECKS and holds nothing of any exercise.
Imports: lab/diagnosis.py <- lab/exercise_checks.py <- this module <- lab/exercises.py (the command).
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import signal
import sys
import time
import traceback
import warnings
from dataclasses import dataclass

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


def _course_modules():
    return [m for n, m in list(sys.modules.items()) if m is not None and (n in _LESSONS or n.startswith("lab."))]


_LESSONS = ("mesh", "ddp", "fsdp", "hsdp", "tensor_parallel", "pipeline", "ring_attention", "expert_parallel", "train")


@contextlib.contextmanager
def patched(ex: Exercise, path: str | None):
    """The learner's cores of `ex` (from the file at `path`) in place of the reference's while inside; None: the
    reference itself. Cores of the lesson's OTHER exercises still blank in that file are taken from the reference, so
    only this exercise is graded."""
    if path is None:
        yield
        return
    ref = importlib.import_module(ex.lesson)
    with open(path) as f:
        text = f.read()
    mine = load(path, ex.lesson)
    for other in EXERCISES:
        if other.lesson == ex.lesson and other is not ex:
            for q in other.cores:
                if "." not in q and is_blank(text, other, q):
                    setattr(mine, q, getattr(ref, q))
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
                for m in _course_modules():
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
    raise CheckTimeout(f"the check ran longer than {CHECK_SECONDS:.0f} s: an endless loop?")


def _where(tb) -> str:
    """The innermost frame of the learner's file, else of a lesson: 'yours/ddp.py line 74, in f: <code>'."""
    frames = traceback.extract_tb(tb)
    for want in ("yours_", WORKSPACE + os.sep, None):
        for fr in reversed(frames):
            fn = fr.filename
            if want is None and os.path.basename(fn)[:-3] in _LESSONS or want and want in fn:
                rel = os.path.relpath(fn, ROOT) if fn.startswith(ROOT) else fn
                return f" (at {rel} line {fr.lineno}, in {fr.name}: {fr.line})"
    return ""


def _timed_out(e: CheckTimeout) -> str:
    """Where the alarm found this rank: waiting for a peer in a collective or a transfer (the watch's wait), or
    anywhere else -- looping."""
    frames = traceback.extract_tb(e.__traceback__)
    waiting = next((f for f in frames if f.name == watch._wait.__name__ and f.filename == watch.__file__), None)
    if waiting is None:
        return f"{e}{_where(e.__traceback__)}"
    call = next((f for f in reversed(frames[:frames.index(waiting)]) if f.filename != watch.__file__), None)
    fn = "" if call is None else os.path.relpath(call.filename, ROOT) if call.filename.startswith(ROOT) else call.filename
    at = "" if call is None else f" at {fn} line {call.lineno}: {call.line}"
    return f"the check ran longer than {CHECK_SECONDS:.0f} s, waiting for a peer{at}{_where(e.__traceback__)}"


def _guarded(run, P: int) -> dict:
    watch.begin_check()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, CHECK_SECONDS)
    out, error, kind, t0 = None, None, None, time.perf_counter()
    try:
        out = run(P)
    except NotImplementedError as e:
        error, kind = str(e), "blank" if "not implemented yet: exercise" in str(e) else "error"
    except watch.PeerLeft as e:
        error, kind = str(e), "peer"
    except watch.CollectiveMismatch as e:
        error, kind = str(e), "mismatch"
    except CheckTimeout as e:
        error, kind = _timed_out(e), "timeout"
    except Exception as e:  # noqa: BLE001 - the learner's error, named with where it happened
        first = (str(e).strip().splitlines() or [""])[0][:300]
        error, kind = f"{type(e).__name__}: {first}{_where(e.__traceback__)}", "error"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    errors = watch.end_check(error, wait=CHECK_SECONDS + 5)   # a rank in an endless loop is stopped by its alarm
    failed = [(r, e) for r, e in sorted(errors.items()) if e]
    if failed and not error:
        error, kind = f"another rank failed: rank {failed[0][0]}: {failed[0][1]}", "peer"
    stuck = any(e.startswith(("the check ran longer", "never finished")) for _, e in failed)
    return dict(out=out, error=error, kind=kind, seconds=time.perf_counter() - t0, stuck=stuck)


def rank_main(jobs, patience: float = PATIENCE) -> list[dict]:
    """On every rank: for each (exercise name, path or None) the learner's cores in place, every check's run for this
    world size; [{run name: {out, error, kind}}] in the order of jobs."""
    watch.install(patience)
    # the watch checks every collective; the lessons' own announcements (mesh.agree, lesson 2) would wait on the store
    # outside it, where a mismatch the watch stops on one rank would keep a peer waiting the full collective timeout
    os.environ["COURSE_CHECK_COLLECTIVES"] = "0"
    P = dist.get_world_size()
    # stage 3's hooks on the embedding, whose inputs need no gradient: PyTorch says when its backward hook fires
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    try:
        for lesson in _LESSONS[:-1]:
            importlib.import_module(lesson)   # after install: the names they bind are the watched ones
        results = []
        for name, path in jobs:
            runs = {c.run.__name__: c.run for c in CHECKS[name] if c.run is not None and P in c.worlds}
            try:
                with patched(BY_NAME[name], path):
                    res = {}
                    for k, run in runs.items():
                        if any(r.get("stuck") for r in res.values()):   # (the same on every rank: end_check's)
                            res[k] = dict(out=None, kind="timeout", error=f"not run: an earlier check of this "
                                          f"exercise ran longer than {CHECK_SECONDS:.0f} s on a rank (an endless loop?)")
                            continue
                        res[k] = _guarded(run, P)
                    results.append(res)
            except Exception as e:  # noqa: BLE001 - the learner's file does not load
                err = f"{os.path.relpath(path, ROOT)} does not load: {type(e).__name__}: {e}"
                results.append({k: dict(out=None, error=err, kind="load") for k in runs})
        return results
    finally:
        watch.uninstall()


# ---- the grading process ---------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    P: int | None
    title: str
    ok: bool
    lines: list
    kind: str | None = None   # blank, mismatch, timeout, error, peer, load: the run failed; None: judged


def _judge(check: Check, P, results) -> Outcome:
    failed = [(r, res) for r, res in enumerate(results) if res["error"]]
    if failed:
        order = ["blank", "load", "mismatch", "timeout", "error", "peer"]
        # the first by kind; of the timeouts, a rank that loops before one that waits (an endless loop on rank 1 while
        # rank 0 waits in the all-reduce: rank 1's line is the one to read, rank 0's follows)
        r, res = min(failed, key=lambda f: (order.index(f[1]["kind"]), "an endless loop?" not in f[1]["error"], f[0]))
        alike = len(failed) == len(results) > 1 and all(x["error"] == res["error"] for _, x in failed)
        who = "every rank" if alike else f"rank {r}"
        if res["kind"] in ("mismatch",):
            who = "a hang, stopped" if res["error"].startswith("deadlock") else "collectives do not match"
        lines = [f"{who}: {res['error']}"]
        others = {}   # what the other ranks met, when it is something else (a wait beside an endless loop)
        for r2, res2 in failed:
            key = res2["kind"] if res2["kind"] != res["kind"] else res2["error"]
            if res2["kind"] != "peer" and res2["error"] != res["error"] and key not in others and not (
                    res["kind"] == "mismatch" and res2["kind"] == "mismatch"):
                others[key] = f"rank {r2}: {res2['error']}"
        return Outcome(P, check.title, False, lines + list(others.values()), res["kind"])
    try:
        lines = check.judge(P, [res["out"] for res in results])
    except Exception as e:  # noqa: BLE001 - something the judge did not expect: still a failure, said plainly
        lines = [f"the results could not be judged ({type(e).__name__}: {e})"]
    return Outcome(P, check.title, not lines, lines)


def evaluate(jobs: dict, timeout: float = 600) -> dict:
    """jobs {P: [(exercise name, path or None)]} -> {(name, path, P): [Outcome per check]}: one group of P ranks per
    world size for all the jobs (checks without ranks run here, once per (name, path))."""
    from lab.launch import run_ranks
    out = {}
    for P, todo in sorted(jobs.items()):
        ranked = [(n, p) for n, p in todo if any(c.run is not None and P in c.worlds for c in CHECKS[n])]
        results = run_ranks(rank_main, P, ranked, PATIENCE, timeout=timeout) if ranked else []
        for j, (name, path) in enumerate(ranked):
            per_rank = [res[j] for res in results]
            for k in per_rank[0] if per_rank else []:
                TIMES[(name, k, P)] = max(rr[k].get("seconds", 0) for rr in per_rank)
            outcomes, told = [], set()
            for c in CHECKS[name]:
                if c.run is None or P not in c.worlds:
                    continue
                o = _judge(c, P, [rr[c.run.__name__] for rr in per_rank])
                if o.kind is not None and c.run.__name__ in told:   # one failed run, several checks: say it once
                    o.lines = ["the same run as above failed (see there)"]
                told.add(c.run.__name__)
                outcomes.append(o)
            out[(name, path, P)] = outcomes
    pure = {(n, p) for todo in jobs.values() for n, p in todo if any(c.run is None for c in CHECKS[n])}
    for name, path in sorted(pure, key=str):
        out[(name, path, None)] = pure_outcomes(name, path)
    return out


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
        outcomes = pure_outcomes(name, path) if P is None else evaluate({P: [(name, path)]})[(name, path, P)]
        for o in outcomes:
            for line in format_outcome(o):
                out(line)
        passed += sum(o.ok for o in outcomes)
        total += len(outcomes)
        if any(o.kind == "blank" for o in outcomes) and i + 1 < len(steps):
            rest = [f"{p} ranks" if p else "no ranks" for p in steps[i + 1:]]
            out(f"  (not run on {', '.join(rest)}: write the core first — {marker(ex)})")
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
