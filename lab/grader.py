"""The grader of `python -m lab.exercises grade NAME`: that core's checks on the learner's version.

    grade(name)                     the command: load yours/<lesson>.py, run every check, print PASS / FAIL lines
    evaluate({P: [(name, path)]})   many versions of many cores, ONE spawned group of P ranks per world size (the
                                    tests grade the reference, the blank and seeded bugs of every exercise this way)

In each grading rank the collectives are watched first (lab/collective_watch.py: a mismatch across ranks is one
message within seconds, never a hang), then for each version the learner's core is put in place of the
reference's — every name bound to the reference function in the course's modules, or the class attribute of a
method (so subclasses use it too: fsdp's FlatUnit, expert_parallel's layer) — its checks run, and it is taken out
again. Each check runs one small float64 job (`run`, on every rank) and judges it in the grading process against
the single process (lab.baseline.single_process, here with SGD, so that a wrong gradient's pattern — P× too large, a sign,
one rank's slice — shows unchanged in the parameters) and against the formula the core exists for (`judge`).
A failure says on which rank, which tensor, how far off and in what pattern, or which formula broke and by how much.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import itertools
import math
import os
import signal
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from lab import collective_watch as watch
from lab.workbook import BY_NAME, EXERCISES, ROOT, WORKSPACE, Exercise, Refusal, core_source, exercise, is_blank, \
    learner_text, marker, record_pass, yours

F64 = torch.float64
LR = 0.5          # SGD's learning rate: an update is -LR·g, the gradient's pattern unchanged
B, S = 8, 8       # global batch, sequence length of the data-parallel checks
TOL = 1e-9        # float64: equal to one process means equal to rounding
PATIENCE = float(os.environ.get("COURSE_GRADE_PATIENCE", "10"))   # seconds a rank waits for a missing peer
CHECK_SECONDS = float(os.environ.get("COURSE_GRADE_CHECK_SECONDS", "60"))  # one check's limit (an endless loop)


@dataclass(frozen=True)
class Check:
    """title: what it proves (with the formula); run(P) -> dict on every rank (None: a check without ranks, whose
    judge gets the learner's module); judge(P, [each rank's dict]) -> failure lines, [] for a pass."""
    title: str
    run: Callable | None
    judge: Callable
    worlds: tuple = (1, 2, 4)


class Count:
    """with Count() as c: the collectives this rank made inside, from the watch's log, read as instruments.CommCounter
    reads them (calls, API bytes, ring wire bytes) — without its dispatch mode, whose first use imports torch._dynamo
    (10 s and more per group of ranks on a busy 2-core machine)."""

    def __enter__(self):
        self.start, self.events = len(watch.events), []
        return self

    def __exit__(self, *exc):
        self.events = list(watch.events[self.start:])

    def _sel(self, op=None):
        return [e for e in self.events if op is None or e["op"] == op]

    def calls(self, op=None) -> int:
        return len(self._sel(op))

    def bytes(self, op=None) -> int:
        return sum(e["bytes"] for e in self._sel(op))

    @staticmethod
    def wire(e) -> float:
        P, n = len(e["group"]), e["bytes"]
        if e["op"] == "all_reduce":
            return 2 * (P - 1) / P * n
        if e["op"] == "all_to_all" and e.get("send"):
            return float(sum(s for j, s in enumerate(e["send"]) if j != e["index"]) * e["row_bytes"])
        if e["op"] in ("all_gather", "reduce_scatter", "all_to_all"):
            return (P - 1) / P * n
        return 0.0 if e["op"] == "recv" or P == 1 else float(n)

    def summary(self) -> dict:
        out = {}
        for e in self.events:
            s = out.setdefault(e["op"], dict(calls=0, bytes=0, wire_bytes=0.0))
            s["calls"], s["bytes"], s["wire_bytes"] = s["calls"] + 1, s["bytes"] + e["bytes"], s["wire_bytes"] + self.wire(e)
        return out

    def groups(self) -> list:
        return sorted({tuple(e["group"]) for e in self.events})


CHECKS: dict[str, list[Check]] = {}
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


# ---- diagnoses: what is wrong with a tensor -------------------------------------------------------------------------

def close(got, want, tol=TOL) -> bool:
    return tuple(got.shape) == tuple(want.shape) and bool(
        ((got.double() - want.double()).abs() <= tol * max(1.0, want.double().abs().max().item() if want.numel() else 1)).all())


def pattern(got, want, scales=(), candidates=()) -> str:
    """The shape of the difference, in words a learner can act on. scales: [(factor, explanation)];
    candidates: [(label, tensor)] — what a typical mistake would give."""
    if tuple(got.shape) != tuple(want.shape):
        if got.dim() == 2 and tuple(got.shape) == tuple(want.shape)[::-1]:
            return f"shape {tuple(got.shape)} where {tuple(want.shape)} is expected: transposed"
        return f"shape {tuple(got.shape)} where {tuple(want.shape)} is expected"
    g, w = got.double().flatten(), want.double().flatten()
    bad = ~torch.isfinite(g)
    if bad.any():
        return f"{int(bad.sum())} of {g.numel()} values are NaN or infinite (an overflow, or 0/0)"
    for label, cand in candidates:
        if cand is not None and close(got, cand, 1e-8):
            return label
    scale = w.abs().max().item()
    if scale == 0:
        return "nonzero where zeros are expected"
    if g.abs().max().item() <= 1e-12 * scale:
        return "all zeros where values are expected: nothing arrived, or nothing was written"
    c = (g @ w / (w @ w)).item()
    if (g - c * w).abs().max().item() <= 1e-6 * scale:
        for factor, why in scales:
            if abs(c - factor) <= 1e-6 * abs(factor):
                return why
        if abs(c + 1) < 1e-6:
            return "the expected with its sign flipped"
        return f"{c:.4g}× the expected"
    if got.dim() == 2 and got.shape[0] == got.shape[1] and close(got, want.T, 1e-8):
        return "the transpose of the expected"
    wrong = ~torch.isclose(g, w, rtol=1e-7, atol=1e-9 * scale)
    k = int(wrong.sum())
    if k < g.numel():
        idx = wrong.nonzero().flatten()
        return f"wrong in {k} of {g.numel()} elements (flat indices {idx[0].item()} to {idx[-1].item()}), right elsewhere"
    return "wrong everywhere, in no simple pattern (not a multiple, sign or transpose of the expected)"


def data_scales(P: int) -> list:
    return [(P, f"{P}× the expected ({P} = P, the group's size): the sum was not divided by P"),
            (1 / P, f"1/{P} of the expected: divided by P once too often")] if P > 1 else []


def compare_named(P, results, key, want_of, *, what="", scales=(), candidates_of=None, tol=TOL, before_of=None,
                  reverse=False) -> list[str]:
    """Every rank's tensors results[r][key][name] against want_of(r, name): the first failure in full, then how many
    more. candidates_of(r, name) -> [(label, tensor)]; before_of(r, name): the value before the step, so that the
    pattern is read on the update (got − before against want − before); reverse: look from the last tensor (the one
    nearest the loss) back."""
    fails = []
    for r, res in enumerate(results):
        for name, got in (reversed if reverse else iter)(list(res[key].items())):
            want = want_of(r, name)
            if want is None or close(got, want, tol):
                continue
            diff = (got.double() - want.double()).abs().max().item() if got.shape == want.shape else float("nan")
            cands = candidates_of(r, name) if candidates_of else ()
            if before_of is not None and got.shape == want.shape:
                b0 = before_of(r, name)
                why = pattern(got - b0, want - b0, scales, [(label, c - b0) for label, c in cands])
            else:
                why = pattern(got, want, scales, cands)
            fails.append((r, name, diff, why))
    if not fails:
        return []
    r, name, diff, why = fails[0]
    n = sum(len(res[key]) for res in results)
    lines = [f"rank {r}, {name}{what}: off by {diff:.2e} — {why}"]
    same = sum(f[3] == why for f in fails)
    ranks = sorted({f[0] for f in fails})
    if len(fails) > 1:
        lines.append(f"{len(fails)} of the {n} tensors of all ranks differ, on rank(s) {ranks}" +
                     ("; all the same way" if same == len(fails) else f"; {same} of them the same way" if same > 1 else ""))
    return lines


def formula_line(what: str, want, got, why: str = "") -> list[str]:
    return [] if want == got else [f"{what}: expected {_n(want)}, measured {_n(got)}" + (f" — {why}" if why else "")]


def _n(x):
    return f"{x:,}" if isinstance(x, int) else str(x)


# ---- the data and the one-process references ---------------------------------------------------------------------------

@functools.cache
def _tokens():
    from lab.data import load_corpus
    return load_corpus()


def _batch(step, B=B, S=S, seed=0, rank=0, size=1):
    from lab.data import get_batch
    return get_batch(_tokens(), step, B, S, seed, rank, size)


def _snap(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _grads(model):
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


@functools.cache
def one_process(seed=0, steps=2, cfg="tiny", B=B, S=S, m=1):
    """THE single-process run (lab.baseline.single_process, with SGD): states [before, after step 1, ...], each
    step's gradients, losses. m > 1: a batch's loss is the mean of its m micro-batches' means (a pipeline's)."""
    from lab.baseline import single_process, snapshot
    from lab.model import build_model
    batches = [_batch(s, B, S, seed) for s in range(steps)]

    def loss_fn(model, batch):
        return sum(model(a, b) for a, b in zip(batch[0].chunk(m), batch[1].chunk(m))) / m
    model = build_model(cfg, seed=0, dtype=F64)
    states, out = [snapshot(model)], None
    for k in range(1, steps + 1):   # (the loop returns the last state: one call per prefix of the batches)
        out = single_process(model, batches[:k], lr=LR, optimizer=SGD, loss_fn=loss_fn, keep_grads=True)
        states.append(snapshot(out["model"]))
    grads = [{n: g if g is not None else torch.zeros_like(states[0][n]) for n, g in step.items()}
             for step in out["grads"]]
    return states, grads, out["losses"]


class SGD:
    """p ← p − lr·g, nothing else: torch.optim's optimizers import torch._dynamo when first made (10 s and more on a
    busy 2-core machine, in every rank and in the grading process)."""

    def __init__(self, params, lr=LR):
        self.param_groups, self.state = [dict(params=list(params), lr=lr)], {}

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.sub_(p.grad, alpha=g["lr"])

    def zero_grad(self, set_to_none=True):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.zero_()


def _sgd(params):
    return SGD(params, lr=LR)


# ---- 0. mesh: rows_along (no ranks) ----------------------------------------------------------------------------------

def _grids():
    """(shape, names, along) of every 5-D mesh of 1-16 ranks with sizes 1, 2, 3 or 4 (at most three axes > 1), along
    every dimension, flattened dimension and expert group."""
    from mesh import DIMS, FLAT
    cases = []
    for shape in itertools.product((1, 2, 3, 4), repeat=5):
        if math.prod(shape) > 16 or sum(s > 1 for s in shape) > 3:
            continue
        for along in [(d,) for d in DIMS] + list(FLAT.values()):
            cases.append((shape, DIMS, along))
        dp = shape[1] * shape[2]
        for ep in (2, 4):
            if dp % ep == 0 and ep < dp:
                eshape = (shape[0], dp // ep, ep, shape[3], shape[4])
                for along in (("e_i",), ("e_out",), ("e_out", "cp")):
                    cases.append((eshape, ("pp", "e_out", "e_i", "cp", "tp"), along))
    return cases


def _rows_diagnosis(got, want, grid, names, along, ref) -> str:
    others = tuple(n for n in names if n not in along)
    size = math.prod(grid.shape[names.index(n)] for n in along)
    if not isinstance(got, list) or not all(isinstance(g, list) for g in got):
        return f"a {type(got).__name__}, not a list of lists of ranks (.tolist() at the end)"
    if sorted(map(sorted, got)) == sorted(map(sorted, want)):
        if sorted(got) == sorted(want):
            return ("the right groups in another order: every rank must build the groups in the same order — the "
                    "other axes in grid order, first axis slowest")
        return "the right members, out of grid order inside a group: keep the `along` axes in their grid order"
    if got and len(got[0]) != size:
        return (f"groups of {len(got[0])} ranks where {size} are expected: a group's size is the product of the sizes "
                f"of all the `along` axes")
    if got == grid.reshape(-1, size).tolist():
        return "the grid's rows without moving the `along` axes last: consecutive ranks, whatever the axes"
    if others and got == ref(grid, names, others):
        return "the groups along the OTHER axes: move the `along` axes last, not first"
    return "other groups than these axes have"


def judge_rows(mine, ref):
    import torch as t
    for shape, names, along in _grids():
        grid = t.arange(math.prod(shape)).view(*shape)
        want = ref(grid, names, along)
        got = mine(grid, names, along)
        if got != want:
            label = ", ".join(f"{n}={s}" for n, s in zip(names, shape) if s > 1) or "one rank"
            return [f"grid [{label}] along {list(along)}: {_short(got)} where {_short(want)} is expected — "
                    f"{_rows_diagnosis(got, want, grid, names, along, ref)}"]
    return []


def _short(groups):
    s = str(groups)
    return s if len(s) < 80 else s[:76] + " ...]"


def judge_rows_partition(mine, ref):
    import torch as t
    for shape, names, along in _grids():
        grid = t.arange(math.prod(shape)).view(*shape)
        size = math.prod(shape[names.index(n)] for n in along)
        got = mine(grid, names, along)
        flat = sorted(r for g in got for r in g)
        label = ", ".join(f"{n}={s}" for n, s in zip(names, shape) if s > 1) or "one rank"
        if len(got) != grid.numel() // size or any(len(g) != size for g in got) or flat != list(range(grid.numel())):
            return [f"grid [{label}] along {list(along)}: {len(got)} groups of sizes {sorted({len(g) for g in got})}"
                    f" covering {len(set(flat))} distinct ranks ({len(flat)} places); expected world/∏ = "
                    f"{grid.numel() // size} groups of ∏ = {size} ranks, every rank of {grid.numel()} exactly once"]
    return []


CHECKS["rows"] = [
    Check("the groups along every dimension, flattened dimension and expert group of every 5-D grid of 1-16 ranks "
          "equal the reference's (members and groups in grid order)", None, judge_rows),
    Check("each list is a partition: world/∏ groups of ∏ ranks (∏ the sizes along the axes), every rank once",
          None, judge_rows_partition),
]


# ---- 1. ddp: average_gradients ------------------------------------------------------------------------------------------

def _dp_train(P, seed=0, group=None, dp_rank=None, dp_size=None):
    """The tiny float64 model on this rank's rows, average_gradients after backward, 2 SGD steps."""
    from ddp import average_gradients
    from lab.model import build_model
    r, n = (dist.get_rank(), P) if dp_rank is None else (dp_rank, dp_size)
    model = build_model("tiny", seed=0, dtype=F64)
    opt = _sgd(model.parameters())
    out = dict(states=[])
    for s in range(2):
        model(*_batch(s, seed=seed, rank=r, size=n)).backward()
        if s == 0:
            out["local"] = _grads(model)
        with Count() as c:
            average_gradients(model.parameters(), group)
        if s == 0:
            out.update(grads=_grads(model), calls=c.calls("all_reduce"), bytes=c.bytes("all_reduce"),
                       groups=c.groups())
        opt.step()
        opt.zero_grad()
        out["states"].append(_snap(model))
    out["numel"] = sum(p.numel() for p in model.parameters())
    return out


def run_dp(P):
    return _dp_train(P)


def run_dp_groups(P):
    """4 ranks as Mesh(dp_shard=2, cp=2): dp groups [0, 2] and [1, 3], the pair at cp index c on data seed c."""
    from mesh import Mesh
    mesh = Mesh(dp_shard=2, cp=2)
    res = _dp_train(P, seed=mesh.coords["cp"], group=mesh, dp_rank=mesh.rank("dp"), dp_size=2)
    res.update(seed=mesh.coords["cp"], dp=mesh.ranks("dp"))
    return res


def _dp_candidates(res, step_grads_world=None):
    def cands(r, name):
        c = [("this rank's own gradient, not averaged: no all-reduce reached it", res[r]["local"][name])]
        if step_grads_world is not None:
            c.append(step_grads_world(name))
        return c
    return cands


def judge_dp_equal(P, res, seeds=None, groups_note="", when="after average_gradients"):
    lines = []
    seed_of = (lambda r: 0) if seeds is None else seeds
    world = None
    if seeds is not None:  # what averaging over the whole world would give
        g0, g1 = one_process(0)[1][0], one_process(1)[1][0]
        world = lambda n: (f"the average over ALL {P} ranks, not over this rank's group: all-reduce over the group "  # noqa: E731
                           f"you are given", (g0[n] + g1[n]) / 2)
    lines += compare_named(P, res, "grads", lambda r, n: one_process(seed_of(r))[1][0][n], what=f" (gradient {when}, "
                           f"step 1)", scales=data_scales(len(res) if seeds is None else 2),
                           candidates_of=lambda r, n: [("this rank's own gradient, not averaged: no all-reduce reached "
                                                        "it", res[r]["local"][n])] + ([world(n)] if world else []))
    if lines:
        return lines + [f"(expected: the one-process gradient of the global batch{groups_note})"]
    for s in range(2):
        lines = compare_named(P, [dict(x=r_["states"][s]) for r_ in res], "x",
                              lambda r, n: one_process(seed_of(r))[0][s + 1][n], what=f" (parameter after step {s + 1})",
                              before_of=lambda r, n: one_process(seed_of(r))[0][s][n])
        if lines:
            return lines
    return []


def judge_dp_formula(P, res):
    for r, x in enumerate(res):
        want = (1, x["numel"] * 8)
        if (x["calls"], x["bytes"]) != want:
            why = ("one per parameter tensor: pack them into ONE flat buffer (mesh.all_reduce_flat)" if x["calls"] > 1
                   else "no all-reduce at all" if x["calls"] == 0 else "another size than all the gradients")
            return [f"rank {r}: one all-reduce of Ψ·b = {x['numel']:,}·8 = {want[1]:,} bytes per step expected, "
                    f"measured {x['calls']} all-reduce(s) of {x['bytes']:,} bytes in all — {why}"]
    return []


def judge_dp_groups(P, res):
    for r, x in enumerate(res):
        if x["groups"] != [tuple(x["dp"])]:
            return [f"rank {r}: the all-reduce ran over ranks {[list(g) for g in x['groups']]}, expected only over its "
                    f"group {x['dp']} (Mesh(dp_shard=2, cp=2)'s dp group; resolve_group(group, 'dp'))"]
    return judge_dp_equal(P, res, seeds=lambda r: res[r]["seed"], groups_note=" of its own group's data")


def run_dp_divide(P):
    """Three parameters; rank r's gradients r+1, none on rank 0 for the second, r for the third; divide_by=3."""
    from ddp import average_gradients
    r = dist.get_rank()
    ps = [torch.nn.Parameter(torch.zeros(3, 2, dtype=F64)), torch.nn.Parameter(torch.zeros(4, dtype=F64)),
          torch.nn.Parameter(torch.zeros(5, dtype=F64))]
    ps[0].grad = torch.full((3, 2), r + 1.0, dtype=F64)
    ps[1].grad = None if r == 0 else torch.full((4,), 2.0 * (r + 1), dtype=F64)
    ps[2].grad = torch.full((5,), float(r), dtype=F64)
    average_gradients(iter(ps), None, divide_by=3)   # an iterator, as model.parameters() is: read it once
    return dict(g={f"p{i}": (p.grad if p.grad is not None else torch.full_like(p, float("nan"))) for i, p in enumerate(ps)})


def judge_dp_divide(P, res):
    want = {"p0": torch.full((3, 2), sum(r + 1.0 for r in range(P)) / 3, dtype=F64),
            "p1": torch.full((4,), sum(2.0 * (r + 1) for r in range(1, P)) / 3, dtype=F64),
            "p2": torch.full((5,), sum(float(r) for r in range(P)) / 3, dtype=F64)}
    return compare_named(P, res, "g", lambda r, n: want[n], what=" (sum ÷ divide_by = 3; p1 has no gradient on rank 0)",
                         scales=[(3 / P, f"the sum ÷ {P} (the group's size): divide_by=3 was ignored")])


CHECKS["average"] = [
    Check("equal to one process in float64: every gradient after average_gradients, and the parameters after 2 SGD "
          "steps, on every rank", run_dp, judge_dp_equal),
    Check("one all-reduce of Ψ·b bytes per step (Ψ gradient elements, b = 8 bytes): g = (1/P)·Σ_r g_r in one call",
          run_dp, judge_dp_formula),
    Check("over the group it is given: Mesh(dp_shard=2, cp=2)'s dp groups [0, 2] and [1, 3], each on its own data, "
          "equal to one process on that data", run_dp_groups, judge_dp_groups, worlds=(4,)),
    Check("divide_by, and a parameter with no gradient on one rank: zeros sent, the sum ÷ divide_by everywhere",
          run_dp_divide, judge_dp_divide, worlds=(2, 4)),
]


# ---- 1. ddp: the bucket ------------------------------------------------------------------------------------------------

def _bucket_train(P, seed=0, mesh=None):
    from ddp import BucketedDDP
    from lab.model import build_model
    model = build_model("tiny", seed=0, dtype=F64)
    arrived, local = [0], {}
    names = {p: n for n, p in model.named_parameters()}

    def count(p):   # registered before the wrapper's hooks: runs first, sees this rank's own gradient
        arrived[0] += 1
        local[names[p]] = p.grad.detach().clone()
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(count)
    ddp = BucketedDDP(model, group=mesh, bucket_cap_mb=0.1, first_bucket_mb=0.05)
    dp_rank, dp_size = (mesh.rank("dp"), mesh.size("dp")) if mesh is not None else (dist.get_rank(), P)
    opt = _sgd(model.parameters())
    out = dict(states=[], buckets=[len(b.params) for b in ddp.buckets], n=len(ddp.params),
               numel=sum(p.numel() for p in ddp.params))
    for s in range(2):
        arrived[0] = 0
        watch.set_probe(lambda e: e.update(arrived=arrived[0]))
        loss = ddp(*_batch(s, seed=seed, rank=dp_rank, size=dp_size))
        with Count() as c:
            loss.backward()
        watch.set_probe(None)
        if s == 0:
            out.update(grads=_grads(model), local=dict(local), calls=c.calls("all_reduce"),
                       bytes=c.bytes("all_reduce"), groups=c.groups(),
                       launches=[(e["arrived"], e["asynchronous"], e["in_backward"]) for e in watch.events
                                 if e["op"] == "all_reduce" and e["dtype"] == "float64"])
        opt.step()
        opt.zero_grad(set_to_none=False)
        out["states"].append(_snap(model))
    return out


def run_bucket(P):
    return _bucket_train(P)


def judge_bucket_equal(P, res):
    return judge_dp_equal(P, res, when="when backward returns")


def run_bucket_groups(P):
    from mesh import Mesh
    mesh = Mesh(dp_shard=2, cp=2)
    res = _bucket_train(P, seed=mesh.coords["cp"], mesh=mesh)
    res.update(seed=mesh.coords["cp"], dp=mesh.ranks("dp"))
    return res


def judge_bucket_formula(P, res):
    for r, x in enumerate(res):
        nb = len(x["buckets"])
        want = (nb + 1, x["numel"] * 8 + x["n"])
        if (x["calls"], x["bytes"]) != want:
            why = ("more calls than buckets: one all-reduce per bucket" if x["calls"] > nb + 1 else
                   "fewer: a bucket never all-reduced?")
            return [f"rank {r}: {nb} buckets + the used-flags = {nb + 1} all-reduces of Ψ·b + n = {want[1]:,} bytes "
                    f"expected, measured {x['calls']} of {x['bytes']:,} bytes — {why}"]
    return []


def judge_bucket_launch(P, res):
    for r, x in enumerate(res):
        full = list(itertools.accumulate(x["buckets"]))
        got = x["launches"]
        if len(got) != len(full):
            return [f"rank {r}: {len(full)} bucket all-reduces expected in backward, measured {len(got)}"]
        for b, ((arrived, asynchronous, inside), when) in enumerate(zip(got, full)):
            if not asynchronous:
                return [f"rank {r}: bucket {b}'s all-reduce was synchronous: it must run while backward goes on "
                        f"(dist.all_reduce(..., async_op=True), the work kept in bucket.work)"]
            if not inside or arrived != when:
                return [f"rank {r}: bucket {b} ({x['buckets'][b]} gradient(s)) started after gradient #{arrived} of "
                        f"{x['n']} arrived; it was full after #{when}: start a bucket's all-reduce the moment its "
                        f"last gradient arrives, in bucket order"]
    return []


def judge_bucket_groups(P, res):
    for r, x in enumerate(res):
        bad = [list(g) for g in x["groups"] if list(g) != x["dp"]]
        if bad:
            return [f"rank {r}: all-reduces over ranks {bad}, expected only over its group {x['dp']} (bucket.group)"]
    return judge_dp_equal(P, res, seeds=lambda r: res[r]["seed"], groups_note=" of its own group's data",
                          when="when backward returns")


CHECKS["bucket"] = [
    Check("equal to one process in float64: every gradient when backward returns, and the parameters after 2 SGD "
          "steps, on every rank (3 buckets)", run_bucket, judge_bucket_equal),
    Check("one all-reduce per bucket (+ one of the used-flags): calls = buckets + 1, bytes Ψ·b + n",
          run_bucket, judge_bucket_formula, worlds=(2, 4)),
    Check("overlap: each bucket's all-reduce starts asynchronously inside backward the moment its last gradient "
          "arrives, in bucket order", run_bucket, judge_bucket_launch, worlds=(2, 4)),
    Check("over the wrapper's group: Mesh(dp_shard=2, cp=2)'s dp groups [0, 2] and [1, 3], each on its own data",
          run_bucket_groups, judge_bucket_groups, worlds=(4,)),
]


# ---- 2. fsdp: zero_step, gather_when_used -------------------------------------------------------------------------------

def _units(model):
    return [("tok_embeddings", model.tok_embeddings)] + [(f"layers.{i}", m) for i, m in enumerate(model.layers)] + \
        [("norm", model.norm), ("output", model.output)]


def _zero_train(P, stage):
    """fsdp's core on the tiny float64 model, one FlatParameter per module, SGD over the shards, 2 steps."""
    from fsdp import FlatParameter, gather_when_used, zero_step
    from lab.model import build_model
    model = build_model("tiny", seed=0, dtype=F64)
    units = _units(model)
    flats = [FlatParameter(m.parameters()) for _, m in units]
    opt = _sgd([f.shard for f in flats])
    gathered = [0]
    if stage == 3:
        for (_, m), f in zip(units, flats):
            gather_when_used(m, f)
            f.free()
        _watch_gathered(units, flats, gathered)
    out = dict(flats=[], names=[[f"{u}.{n}" for n, _ in m.named_parameters()] for u, m in units],
               labels=[u for u, _ in units],
               N=[f.flat_numel for f in flats], n=[f.shard_numel for f in flats])
    for s in range(2):
        with Count() as c:
            model(*_batch(s, rank=dist.get_rank(), size=P)).backward()
            if s == 0:
                out["peak_forward"] = gathered[0]
            with Count() as step:
                zero_step(flats, opt)
        if s == 0:
            out.update(comm=step.summary(), comm_all=c.summary(),
                       full_grads=sum(p.grad.numel() for f in flats for p in f.params if p.grad is not None),
                       shard_grads=sum(f.shard.grad.numel() for f in flats if f.shard.grad is not None))
        out["at_rest"] = sum(f.buf.untyped_storage().nbytes() for f in flats)
        for f in flats:
            f.shard.grad = None
        if stage == 3:
            for f in flats:
                f.unshard()
        out["flats"].append([f.buf.clone() for f in flats])
        if stage == 3:
            for f in flats:
                f.free()
    return out


def _watch_gathered(units, flats, gathered):
    """Hooks registered AFTER gather_when_used's, so they run after its gather and its free: in forward, the most
    units holding their whole buffer at once."""
    def after(*_):
        gathered[0] = max(gathered[0], sum(f.buf.untyped_storage().size() > 0 for f in flats))
    for _, m in units:
        m.register_forward_pre_hook(after)
        m.register_forward_hook(after)


def run_zero2(P):
    return _zero_train(P, 2)


def run_zero3(P):
    return _zero_train(P, 3)


def _ref_flats(names, N, step):
    """The one-process parameters after `step` steps as the units' flat buffers (zero padding to N)."""
    state = one_process(steps=2, B=B)[0][step]
    out = []
    for ns, n in zip(names, N):
        v = torch.cat([state[k].flatten() for k in ns])
        out.append(torch.cat([v, v.new_zeros(n - len(v))]))
    return out


def _slice_pattern(got, want, before, n, P, rank) -> str:
    dg, dw = got - before, want - before
    moves = [bool(dw[j * n:(j + 1) * n].abs().max() > 0) for j in range(P)]
    parts = []
    for j in range(P):
        g, w = dg[j * n:(j + 1) * n], dw[j * n:(j + 1) * n]
        if close(g, w):
            parts.append("ok")
            continue
        other = [k for k in range(P) if k != j and moves[k] and close(g, dw[k * n:(k + 1) * n])]
        if other:
            parts.append(f"slice {other[0]}")
        elif moves[j] and g.abs().max() == 0:
            parts.append("stale")
        else:
            parts.append(pattern(g, w, data_scales(P)))
    if P > 1 and parts[rank] == "ok" and all(p == "stale" for j, p in enumerate(parts) if j != rank):
        return (f"only this rank's slice [{rank * n}, {(rank + 1) * n}) was updated, the other ranks' slices are as "
                f"before the step: their new values never arrived (the all-gather after the step is missing)")
    if all(p == "stale" for j, p in enumerate(parts) if moves[j]):
        return ("no slice changed, this rank's own neither: the new slices never reached the flat buffer the model "
                "computes with (the all-gather after the step is missing)")
    if parts[rank].startswith("slice "):
        k = int(parts[rank].split()[1])
        return (f"this rank's slice [{rank * n}, {(rank + 1) * n}) got the update of slice {k}: the wrong shard — rank r "
                f"owns [r·n, (r+1)·n) of the flat buffer")
    bad = [(j, p) for j, p in enumerate(parts) if p != "ok"]
    if len({p for _, p in bad}) == 1 and len(bad) == sum(moves):
        return f"every slice: {bad[0][1]}"
    return "; ".join(f"slice {j} (rank {j}'s): {p}" for j, p in bad)


def judge_zero_equal(P, res):
    for s in range(2):
        for r, x in enumerate(res):
            want, before = _ref_flats(x["names"], x["N"], s + 1), _ref_flats(x["names"], x["N"], s)
            failing = [u for u, (got, w) in enumerate(zip(x["flats"][s], want)) if not close(got, w)]
            if not failing:
                continue
            # read the pattern on a unit whose every slice changes (the embedding's rows of unused bytes do not)
            n_ = x["n"]
            whole = [u for u in failing if all((want[u] - before[u])[j * n_[u]:(j + 1) * n_[u]].abs().max() > 0
                                               for j in range(P))]
            u = (whole or failing)[0]
            got, w, b0 = x["flats"][s][u], want[u], before[u]
            return [f"rank {r}, unit {u} ({x['labels'][u]}), step {s + 1}: off by {(got - w).abs().max().item():.2e} "
                    f"— {_slice_pattern(got, w, b0, n_[u], P, r)}"] + (
                [f"{len(failing)} of {len(want)} units differ on rank {r}"] if len(failing) > 1 else [])
    return []


def judge_zero_bytes(P, res):
    for r, x in enumerate(res):
        N, units = sum(x["N"]), len(x["N"])
        c = x["comm"]
        rs, ag, ar = (c.get(op, dict(calls=0, bytes=0, wire_bytes=0)) for op in ("reduce_scatter", "all_gather",
                                                                               "all_reduce"))
        lines = formula_line(f"rank {r}: reduce-scatters (8Ψ bytes, one per unit)", (units, 8 * N),
                             (rs["calls"], rs["bytes"]))
        if lines and ar["calls"]:
            lines[0] += (f"; instead {ar['calls']} all-reduce(s) of {ar['bytes']:,} bytes, whose ring sends "
                         f"2(P−1)/P of them, {ar['wire_bytes']:,.0f}, twice a reduce-scatter's (P−1)/P: an all-reduce "
                         f"where a reduce-scatter belongs")
        if not lines and ar["calls"]:
            lines = [f"rank {r}: no all-reduce expected in ZeRO's step, measured {ar['calls']} of {ar['bytes']:,} bytes"]
        lines = lines or formula_line(f"rank {r}: all-gathers after the step (8Ψ bytes, one per unit: stage 2)",
                                      (units, 8 * N), (ag["calls"], ag["bytes"]),
                                      "every rank needs every new slice before the next forward")
        if lines:
            return lines
    return []


def judge_zero_memory(P, res):
    for r, x in enumerate(res):
        n = sum(x["n"])
        if x["full_grads"] or x["shard_grads"] != n:
            return [f"rank {r}: after the step, gradients held: whole parameters {x['full_grads']:,} elements "
                    f"(expected 0: set p.grad = None), slices {x['shard_grads']:,} (expected Ψ/P = {n:,})"]
    return []


CHECKS["zero_step"] = [
    Check("stage 2: equal to one process in float64 after each of 2 SGD steps, on every rank (one FlatParameter per "
          "module)", run_zero2, judge_zero_equal),
    Check("stage 3 (buffers freed between uses): equal to one process after each of 2 steps", run_zero3,
          judge_zero_equal),
    Check("per step one reduce-scatter of 8Ψ bytes and one all-gather of 8Ψ per unit after the step, no all-reduce "
          "(ZeRO §7: 2Ψ elements)", run_zero2, judge_zero_bytes, worlds=(2, 4)),
    Check("after the step only the slices hold gradients: Ψ/P elements, none on the whole parameters", run_zero2,
          judge_zero_memory),
]


def run_gather(P):
    return _zero_train(P, 3)


def judge_gather_bytes(P, res):
    for r, x in enumerate(res):
        N, units = sum(x["N"]), len(x["N"])
        ag = x["comm_all"].get("all_gather", dict(calls=0, bytes=0))
        lines = formula_line(f"rank {r}: all-gathers per step (each unit before its forward and before its backward: "
                             f"2·8Ψ bytes)", (2 * units, 2 * 8 * N), (ag["calls"], ag["bytes"]))
        if lines:
            return lines
    return []


def judge_gather_memory(P, res):
    for r, x in enumerate(res):
        if x["peak_forward"] != 1:
            return [f"rank {r}: in forward, up to {x['peak_forward']} units held their whole buffer at once; expected 1 "
                    f"(free a unit right after its forward)"]
        if x["at_rest"]:
            return [f"rank {r}: after the step the flat buffers hold {x['at_rest']:,} bytes, expected 0 (free each "
                    f"unit right after its backward)"]
    return []


CHECKS["gather_when_used"] = [
    Check("stage 3 equal to one process in float64 after each of 2 SGD steps, on every rank", run_gather,
          judge_zero_equal),
    Check("per step each unit all-gathered twice, before its forward and before its backward: 2·8Ψ bytes (ZeRO §7's "
          "3Ψ with the reduce-scatter)", run_gather, judge_gather_bytes, worlds=(2, 4)),
    Check("a unit whole only while it runs: one unit gathered at a time in forward, 0 bytes gathered at rest",
          run_gather, judge_gather_memory),
]


# ---- 3. hsdp: across_replicas ----------------------------------------------------------------------------------------

def run_hsdp(P):
    from hsdp import shard_hybrid
    from lab.model import build_model
    from mesh import Mesh
    mesh = Mesh(dp_replicate=2, dp_shard=P // 2)
    model = build_model("tiny", seed=0, dtype=F64)
    opt = shard_hybrid(model, mesh, optimizer_cls=SGD, lr=LR)
    out = dict(states=[], rep=mesh.ranks("dp_replicate"), shard=mesh.ranks("dp_shard"), S=P // 2,
               numel=sum(u.flat_numel for u in opt.units), k=sum(len(u.params) for u in opt.units))
    for s in range(2):
        with Count() as c:
            model(*_batch(s, rank=dist.get_rank(), size=P)).backward()
            opt.step()
        opt.zero_grad()
        if s == 0:
            out["events"] = [(e["op"], tuple(e["group"]), e["bytes"]) for e in c.events]
        out["states"].append(opt.full_state_dict())
    return out


def judge_hsdp_equal(P, res):
    R = 2
    for s in range(2):
        lines = compare_named(P, [dict(x={k: v for k, v in r_["states"][s].items() if k in one_process()[0][0]})
                                  for r_ in res], "x",
                              lambda r, n: one_process()[0][s + 1][n], what=f" (parameter after step {s + 1})",
                              before_of=lambda r, n: one_process()[0][s][n],
                              scales=[(1 / R, f"1/{R} of the expected update: divided by R once too often "
                                       f"(shard_hybrid divides the sum by S·R afterwards)"),
                                      (R, f"{R}× the expected update: summed across replicas twice")],
                              candidates_of=(lambda r, n: [(f"this replica's own gradient ÷ {R}: the shards were never "
                                                            f"summed across the replicas", _replica_alone(P, r)[n])])
                              if s == 0 else None)
        if lines:
            return lines
    return []


@functools.cache
def _replica_alone(P, rank):
    """What step 1 leaves when a replica's gradient is never summed across replicas: the mean over its own ranks'
    rows, divided by all S·R ranks."""
    from lab.model import build_model
    S_, R = P // 2, 2
    first = rank - rank % S_   # the shard group: consecutive ranks
    model = build_model("tiny", seed=0, dtype=F64)
    for q in range(first, first + S_):
        (model(*_batch(0, rank=q, size=P)) / S_).backward()
    return {n: p.detach() - LR * p.grad / R for n, p in model.named_parameters()}


def judge_hsdp_bytes(P, res):
    for r, x in enumerate(res):
        rep, shard = tuple(x["rep"]), tuple(x["shard"])
        other = sorted({(op, g) for op, g, _ in x["events"] if g not in (rep, shard) and len(g) > 1})
        if other:
            op, g = other[0]
            return [f"rank {r}: a {op} over ranks {list(g)}: only the shard group {list(shard)} and the replicate group "
                    f"{list(rep)} may talk (across replicas, the replicate group alone)"]
        got = sum(b for op, g, b in x["events"] if g == rep and op == "all_reduce")
        want = 8 * x["numel"] // x["S"] + 4 * x["k"]
        crossing = [op for op, g, _ in x["events"] if g == rep and op != "all_reduce"]
        if crossing:
            return [f"rank {r}: a {crossing[0]} across replicas: only the reduced shards and the flags cross them"]
        lines = formula_line(f"rank {r}: all-reduce bytes across replicas {list(rep)} per step (the reduced shards "
                             f"8Ψ/S + the used-flags 4k)", want, got,
                             "nothing crossed: the shards were not summed across replicas" if got == 0 else "")
        if lines:
            return lines
    return []


CHECKS["across_replicas"] = [
    Check("HSDP equal to one process in float64 after each of 2 SGD steps, on every rank: 2 replicas × 1 shard "
          "(2 ranks), 2 × 2 (4 ranks)", run_hsdp, judge_hsdp_equal, worlds=(2, 4)),
    Check("across replicas only the reduced shards and the used-flags: 8Ψ/S + 4k bytes all-reduced over the "
          "replicate group per step, nothing else crosses", run_hsdp, judge_hsdp_bytes, worlds=(2, 4)),
]


# ---- 4. tensor parallel: f and g, the column/row pair ----------------------------------------------------------------

TP_B, TP_S = 2, 8


@functools.cache
def _tp_reference():
    from lab.baseline import single_process
    from lab.model import build_model
    one = single_process(build_model("tiny", seed=0, dtype=F64), [_batch(0, TP_B, TP_S, seed=3)], lr=LR,
                         optimizer=SGD, keep_grads=True)
    return one["losses"][0], one["grads"][0]


def _tp(P, sp):
    import tensor_parallel as tp
    from lab.model import build_model
    x, y = _batch(0, TP_B, TP_S, seed=3)
    model = tp.apply_tensor_parallel(build_model("tiny", seed=0, dtype=F64), None, sequence_parallel=sp)
    with Count() as fwd:
        loss = model(x, y)
    with Count() as bwd:
        loss.backward()
    tp.finish_grads(model)
    return dict(loss=loss.detach(), grads={n: p.grad.detach().clone() for n, p in model.named_parameters()},
                slices={n: getattr(p, "tp_slice", None) for n, p in model.named_parameters()},
                fwd=fwd.summary(), bwd=bwd.summary(), sp=sp)


def run_tp(P):
    return _tp(P, False)


def run_sp(P):
    return _tp(P, True)


def judge_tp_equal(P, res):
    loss, grads = _tp_reference()
    for r, x in enumerate(res):
        if not close(x["loss"], torch.tensor(loss, dtype=F64)):
            return [f"rank {r}: the loss {x['loss'].item():.10f} where one process has {loss:.10f}: the forward "
                    f"already differs — a pair's output must be the SUM of the ranks' partial outputs (g's forward), "
                    f"its input the same x on every rank (f's forward: the identity)"]

    def want(r, n):
        sl = res[r]["slices"][n]
        full = grads[n]
        return full if sl is None else full.narrow(sl[0], sl[1], sl[2] - sl[1])
    L = 2 * 2 + 2
    scales = [(float(P) ** k, f"{P ** k}× the expected (= t^{k}, t = tp size {P}: summed over tp {k} time(s) where "
               f"it was whole — a backward that should be the identity all-reduces)") for k in range(1, L + 1)]
    lines = compare_named(P, res, "grads", want, what=" (gradient of this rank's slice)", reverse=True,
                          scales=scales + [(1 / P, f"1/{P} of the expected: a partial gradient never summed over tp")])
    return lines + (["(the loss is right: the backward differs — f's backward sums x's gradient over tp, every rank "
                     "having used all of x; g's backward is the identity)"] if lines else [])


def judge_tp_formula(P, res):
    from lab import tensor_parallel_demo as tp_demo
    from lab.model import get_config
    cfg = get_config("tiny")
    L = cfg.n_layers
    for r, x in enumerate(res):
        sp = x["sp"]
        want = tp_demo.comm_formula(cfg, TP_B, TP_S, 8, P, sp)
        ops = ("all_gather", "reduce_scatter") if sp else ("all_reduce",)
        for op in ops:
            f, b = x["fwd"].get(op, {}).get("calls", 0), x["bwd"].get(op, {}).get("calls", 0)
            wf, wb = 2 * L + 1 + (3 if op == "all_reduce" else 0), 2 * L + 1
            if (f, b) != (wf, wb):
                return [f"rank {r}: {op} calls in forward / backward: expected {wf} / {wb} (Megatron: f and g, 2 per "
                        f"layer + the embedding's g forward, the head's f backward{', + the loss 3' if op == 'all_reduce' else ''}"
                        f"), measured {f} / {b}" + (" — an all-reduce in backward where g's is the identity"
                                                     if b > wb else " — f's backward all-reduce missing" if b < wb else "")]
        for op, (calls, nbytes) in want.items():
            got = (x["fwd"].get(op, {}).get("calls", 0) + x["bwd"].get(op, {}).get("calls", 0),
                   x["fwd"].get(op, {}).get("bytes", 0) + x["bwd"].get(op, {}).get("bytes", 0))
            if got != (calls, nbytes):
                return [f"rank {r}: {op} per step: expected {calls} calls, {nbytes:,} bytes (4L + 2 of B·S·H·b), "
                        f"measured {got[0]} calls, {got[1]:,} bytes"]
    return []


CHECKS["f_and_g"] = [
    Check("tensor parallel equal to one process in float64: the loss and every gradient of every rank's slice",
          run_tp, judge_tp_equal, worlds=(2, 4)),
    Check("Megatron's collectives: 2L + 1 all-reduces of B·S·H·b in forward (+3 for the loss), 2L + 1 in backward",
          run_tp, judge_tp_formula, worlds=(2, 4)),
]
CHECKS["pair"] = [
    Check("tensor parallel equal to one process in float64: the loss and every gradient of every rank's slice",
          run_tp, judge_tp_equal),
    Check("sequence parallel equal to one process: the loss and every gradient", run_sp, judge_tp_equal,
          worlds=(2, 4)),
    Check("Megatron's collectives: 2L + 1 in forward and in backward (TP: all-reduces; SP: all-gathers and "
          "reduce-scatters of the same wire bytes)", run_tp, judge_tp_formula, worlds=(2, 4)),
    Check("sequence parallel's collectives: 2L + 1 all-gathers and 2L + 1 reduce-scatters each way", run_sp,
          judge_tp_formula, worlds=(2, 4)),
]


# ---- 5. pipeline: 1F1B ------------------------------------------------------------------------------------------------

PIPE_MS = {1: (2,), 2: (1, 4), 4: (2, 4)}


def run_pipe(P):
    from lab.model import get_config
    from pipeline import PipeGroup, one_f_one_b_plain
    cfg, out = get_config("tiny", n_layers=4), {}
    pipe = PipeGroup.from_ranks(list(range(P)))
    x, y = _batch(0, B, S)
    for m in PIPE_MS[P]:
        stage = _stage(cfg, pipe.r, P)
        log = []

        def fwd_hook(mod, args, output, log=log):
            i = sum(a == "F" for a, _ in log)
            log.append(("F", i))
            if output.requires_grad:
                output.register_hook(lambda g, i=i: log.append(("B", i)))
        stage.register_forward_hook(fwd_hook)
        with Count() as c:
            loss = one_f_one_b_plain(stage, pipe, x, y, m)
        out[m] = dict(grads=_grads(stage), loss=None if loss is None else float(loss), log=log,
                      sent=(c.calls("send"), c.bytes("send")))
    return out


def _stage(cfg, r, p):
    """pipeline.Stage r of p, cut from the whole float64 model (the same values: every parameter's initial value
    depends on its name alone) — not built on the meta device, whose first use imports torch._dynamo (seconds)."""
    from lab.model import build_model
    from pipeline import Stage, split_layers
    full = build_model(cfg, seed=0, dtype=F64)
    stage = Stage.__new__(Stage)
    torch.nn.Module.__init__(stage)
    stage.cfg, stage.v, stage.is_first, stage.is_last = cfg, 1, r == 0, r == p - 1
    stage.chunks = [list(split_layers(cfg.n_layers, p)[r])]
    stage.tok_embeddings = full.tok_embeddings if stage.is_first else None
    stage.layers = torch.nn.ModuleDict({str(i): full.layers[i] for i in stage.chunks[0]})
    if stage.is_last:
        stage.norm, stage.output, stage.loss_fn = full.norm, full.output, full.loss_fn
    stage.positions = None
    return stage


def judge_pipe_equal(P, res):
    for m in PIPE_MS[P]:
        _, grads, losses = one_process(steps=1, cfg=_pipe_cfg(), m=m)
        lines = compare_named(P, [x[m] for x in res], "grads", lambda r, n: grads[0][n],
                              what=f" (m = {m} micro-batches)",
                              scales=[(m, f"{m}× the expected ({m} = m, the micro-batches): each micro-batch's loss "
                                       f"must be scaled by 1/m")] if m > 1 else [])
        if lines:
            return lines
        got = res[-1][m]["loss"]
        if got is None or abs(got - losses[0]) > 1e-9:
            return [f"rank {P - 1} (the last stage), m = {m}: loss {got} where one process has {losses[0]:.10f}"]
    return []


@functools.cache
def _pipe_cfg():
    from lab.model import get_config
    return get_config("tiny", n_layers=4)


def _order(P, m, r):
    from pipeline import SCHEDULES
    return [f"{a.op}{a.mb}" for a in SCHEDULES["1f1b"](P, m)[r] if a.op in ("F", "B")]


def judge_pipe_order(P, res):
    for m in PIPE_MS[P]:
        for r, x in enumerate(res):
            got = [f"{a}{i}" for a, i in x[m]["log"]]
            want = _order(P, m, r)
            if got != want:
                w = min(P - r - 1, m)
                at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                return [f"rank {r} of {P}, m = {m}: {' '.join(got)} where 1F1B is {' '.join(want)} (first difference at "
                        f"action {at + 1}; warm-up min(p−r−1, m) = {w} forward(s), then F and B in turn, then {w} "
                        f"backward(s), the oldest micro-batch first)"]
    return []


def judge_pipe_memory(P, res):
    for m in PIPE_MS[P]:
        for r, x in enumerate(res):
            held = peak = 0
            for a, _ in x[m]["log"]:
                held += 1 if a == "F" else -1
                peak = max(peak, held)
            want = min(P - r, m)
            if peak != want:
                return [f"rank {r}, m = {m}: up to {peak} micro-batches' activations held at once, 1F1B holds min(p−r, m)"
                        f" = {want}" + (" — more forwards before the first backward than the warm-up's"
                                        if peak > want else "")]
    return []


def judge_pipe_sends(P, res):
    H = _pipe_cfg().dim
    for m in PIPE_MS[P]:
        for r, x in enumerate(res):
            k = (r < P - 1) + (r > 0)
            want = (k * m, k * m * (B // m) * S * H * 8)
            lines = formula_line(f"rank {r}, m = {m}: sends (m activations forward, m gradients back per boundary, "
                                 f"[B/m, S, H]·8 bytes each)", want, x[m]["sent"])
            if lines:
                return lines
    return []


CHECKS["one_f_one_b"] = [
    Check("every stage's gradients, and the last stage's loss, equal one process on the whole batch in float64 (m < p "
          "and m ≥ p)", run_pipe, judge_pipe_equal),
    Check("the order of F and B on each rank is 1F1B's: warm-up min(p−r−1, m) forwards, one F one B, cool-down",
          run_pipe, judge_pipe_order),
    Check("activations held: at most min(p−r, m) micro-batches on rank r (1F1B's memory, Narayanan et al. §2.2)",
          run_pipe, judge_pipe_memory, worlds=(2, 4)),
    Check("per boundary m activations forward and m gradients back, each [B/m, S, H]·b bytes", run_pipe,
          judge_pipe_sends, worlds=(2, 4)),
]


# ---- 6. ring attention: merge (no ranks), the ring ---------------------------------------------------------------------

def _blocks(n, seed=0, scale=1.0, B_=2, H=3, c=5, D=4):
    from ring_attention import block_forward
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B_, H, c, D, generator=g, dtype=F64) * scale
    ks = [torch.randn(B_, H, c, D, generator=g, dtype=F64) for _ in range(n)]
    vs = [torch.randn(B_, H, c, D, generator=g, dtype=F64) for _ in range(n)]
    parts = [block_forward(q, k, v, 1.0, False) for k, v in zip(ks, vs)]
    whole = block_forward(q, torch.cat(ks, 2), torch.cat(vs, 2), 1.0, False)
    return parts, whole


def _merge_wrong(o, l, bo, bl):
    return [("the correction's sign flipped: out' = out − sigmoid(lse_b − lse)·(out − out_b)",
             o + torch.sigmoid(bl - l)[..., None] * (o - bo)),
            ("the running output unchanged: the block was not folded in", o),
            ("the block's output alone: the running output was dropped", bo),
            ("the plain average of the two outputs: weight each by its share e^lse/(e^lse + e^lse_b)", (o + bo) / 2),
            ("each output weighted by the OTHER block's share: sigmoid's argument reversed",
             (torch.sigmoid(bl - l)[..., None] * o + torch.sigmoid(l - bl)[..., None] * bo))]


def _lse_wrong(l, bl):
    return [("the running lse unchanged", l), ("the block's lse alone", bl),
            ("the larger of the two: lse' = log(e^lse + e^lse_b), not the max", torch.maximum(l, bl)),
            ("lse + lse_b: log of a product, not of a sum", l + bl)]


def _judge_merge_pairs(mine, cases):
    for label, (o, l, bo, bl), (wo, wl) in cases:
        go, gl = mine(o, l, bo, bl)
        for what, got, want, cands in (("out", go, wo, _merge_wrong(o, l, bo, bl) if o is not None else []),
                                       ("lse", gl, wl, _lse_wrong(l, bl) if l is not None else [])):
            if not close(got, want, 1e-10):
                diff = (got - want).abs().max().item() if got.shape == want.shape else float("nan")
                return [f"{label}: {what} off by {diff:.2e} — {pattern(got, want, (), cands)}"]
    return []


def judge_merge_two(mine, ref):
    (a, b), whole = _blocks(2)
    return _judge_merge_pairs(mine, [("two blocks merged", (*a, *b), whole), ("the same two, the other way round",
                                                                              (*b, *a), whole)])


def judge_merge_start(mine, ref):
    (a,), _ = _blocks(1)
    got = mine(None, None, *a)
    if got[0] is None or not (close(got[0], a[0]) and close(got[1], a[1])):
        return ["merge(None, None, out_b, lse_b) must return the block itself (out_b, lse_b): the empty start"]
    return []


def judge_merge_four(mine, ref):
    parts, whole = _blocks(4, seed=1)
    for order in ((0, 1, 2, 3), (3, 1, 0, 2)):
        o = l = None
        for i in order:
            o, l = (parts[i] if o is None else mine(o, l, *parts[i]))
        if not (close(o, whole[0], 1e-10) and close(l, whole[1], 1e-10)):
            what, got, want = ("out", o, whole[0]) if not close(o, whole[0], 1e-10) else ("lse", l, whole[1])
            return [f"four blocks folded in the order {order}: {what} off by {(got - want).abs().max().item():.2e} — "
                    f"{pattern(got, want)}"]
    return []


def judge_merge_overflow(mine, ref):
    (a, b), whole = _blocks(2, seed=2, scale=300.0)   # scores in the thousands: e^lse overflows float64
    return _judge_merge_pairs(mine, [(f"scores up to {whole[1].abs().max().item():,.0f} (e^lse overflows)", (*a, *b),
                                      whole)])


CHECKS["merge"] = [
    Check("two blocks' (out, lse) merged equal attention over both blocks' keys, in either order (float64)", None,
          judge_merge_two),
    Check("(None, None) is the empty start: the first block comes back as it is", None, judge_merge_start),
    Check("four blocks folded in any order equal attention over all their keys", None, judge_merge_four),
    Check("no overflow: with scores in the thousands (e^lse beyond float64) the merge stays finite and exact", None,
          judge_merge_overflow),
]

RING_CASES = [("contiguous", True), ("zigzag", True), ("zigzag", False)]
RING_SHAPE = dict(B=1, S=16, H=4, Hkv=2, D=8)


def run_ring(P):
    """Each case: this rank's shard of the seeded q, k, v through RingAttention, forward and backward."""
    from lab.ring_attention_demo import seeded_inputs
    from ring_attention import RingAttention, shard_sequence
    out, r, world = {}, dist.get_rank(), dist.group.WORLD
    sh = RING_SHAPE
    for layout, causal in RING_CASES:
        q, k, v, dout = (shard_sequence(t, P, r, layout, dim=2).requires_grad_(i < 3) for i, t in
                         enumerate(seeded_inputs(sh["B"], sh["S"], sh["H"], sh["Hkv"], sh["D"], F64, 0)))
        with Count() as c:
            o = RingAttention.apply(q, k, v, world, layout, causal)
        o.backward(dout)
        out[(layout, causal)] = dict(out=o.detach(), dq=q.grad, dk=k.grad, dv=v.grad,
                                     sends=(c.calls("send"), c.bytes("send")))
    return out


@functools.cache
def _ring_reference(P, layout, causal):
    from lab.ring_attention_demo import seeded_inputs
    from ring_attention import shard_sequence
    q, k, v, dout = seeded_inputs(RING_SHAPE["B"], RING_SHAPE["S"], RING_SHAPE["H"], RING_SHAPE["Hkv"],
                                  RING_SHAPE["D"], F64, 0)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    out.backward(dout)
    full = dict(out=out.detach(), dq=q.grad, dk=k.grad, dv=v.grad)
    return [{n: shard_sequence(t, P, r, layout, dim=2) for n, t in full.items()} for r in range(P)]


@functools.cache
def _ring_alone(P, r, causal):
    """A contiguous shard's attention over its own keys only: what a ring that never passes its blocks gives."""
    from lab.ring_attention_demo import seeded_inputs
    from ring_attention import shard_sequence
    sh = RING_SHAPE
    q, k, v, _ = (shard_sequence(t, P, r, "contiguous", dim=2) for t in
                  seeded_inputs(sh["B"], sh["S"], sh["H"], sh["Hkv"], sh["D"], F64, 0))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def _judge_ring(P, res, names):
    for layout, causal in RING_CASES:
        want = _ring_reference(P, layout, causal)

        def cands(r, n):
            if n != "out" or layout != "contiguous" or P == 1:
                return []
            return [("this rank's queries against its own keys only: the other ranks' blocks were never folded in (the "
                     "ring stops short)", _ring_alone(P, r, causal))] + (
                [("its own block seen without the causal mask: a query reads the keys after it (a diagonal pair needs "
                  "the mask: block_forward(..., diagonal))", _ring_alone(P, r, False))] if causal and r == 0 else [])
        lines = compare_named(P, [{"t": {n: x[(layout, causal)][n] for n in names}} for x in res], "t",
                              lambda r, n: want[r][n], what=f" ({layout}, {'causal' if causal else 'not causal'})",
                              candidates_of=cands)
        if lines:
            return lines
    return []


def judge_ring_forward(P, res):
    return _judge_ring(P, res, ("out",))


def judge_ring_backward(P, res):
    return _judge_ring(P, res, ("dq", "dk", "dv"))


def judge_ring_bytes(P, res):
    c = RING_SHAPE["S"] // P
    block = RING_SHAPE["B"] * c * RING_SHAPE["Hkv"] * RING_SHAPE["D"] * 8
    for layout, causal in RING_CASES:
        for r, x in enumerate(res):
            got = x[(layout, causal)]["sends"]
            want = (2 * (P - 1), 2 * (P - 1) * block)
            lines = formula_line(f"rank {r} ({layout}): sends in forward ((cp−1)·2 blocks k, v of B·c·d_kv·b = "
                                 f"{block:,} bytes)", want, got,
                                 "one pass too many: the last step needs no next block" if got[0] > want[0] else
                                 "k and v must travel all the way round the ring" if got[0] < want[0] else "")
            if lines:
                return lines
    return []


CHECKS["ring"] = [
    Check("ring attention's output equals whole-sequence attention (SDPA) in float64 on every rank: contiguous and "
          "zigzag, causal and not, GQA", run_ring, judge_ring_forward),
    Check("the lesson's backward, from what your forward saved (out, lse), gives SDPA's dq, dk, dv", run_ring,
          judge_ring_backward),
    Check("forward passes each k, v block cp−1 times: (cp−1)·2 sends of B·c·d_kv·b bytes per rank", run_ring,
          judge_ring_bytes, worlds=(2, 4)),
]


# ---- 7. expert parallel: the all-to-all, dispatch and combine ---------------------------------------------------------

EP_SIZES = {1: [10], 2: [7, 12], 4: [7, 12, 5, 9]}   # tokens per rank: uneven, so the splits are too


def _ep_case(P, capacity):
    from copy import deepcopy
    from types import SimpleNamespace
    from expert_parallel import parallelize_experts, sync_gradients
    from lab.model import build_model, get_config
    from mesh import Mesh
    mesh = Mesh(dp_shard=P, ep=P)
    cfg = get_config("tiny", n_experts=4, top_k=2, capacity_factor=capacity)
    ref = build_model(cfg, seed=0, dtype=F64).layers[0].mlp
    holder = SimpleNamespace(layers=[SimpleNamespace(mlp=deepcopy(ref))])
    parallelize_experts(holder, mesh)
    layer = holder.layers[0].mlp
    sizes, D = EP_SIZES[P], P
    N = sum(sizes)
    g = torch.Generator().manual_seed(1)
    x_all = torch.randn(N, 1, cfg.dim, generator=g, dtype=F64)
    dy = torch.randn(x_all.shape, generator=g, dtype=F64)
    x_ref = x_all.clone().requires_grad_()
    out_ref = ref(x_ref)
    ((out_ref * dy).sum() / N + ref.aux_loss).backward()
    r = dist.get_rank()
    sl = slice(sum(sizes[:r]), sum(sizes[:r + 1]))
    x = x_all[sl].clone().requires_grad_()
    with Count() as c:
        out = layer(x)
        ((out * dy[sl]).sum() * D / N + layer.aux_loss).backward()
        sync_gradients(layer, mesh.group("dp_cp"), mesh.group("edp_cp"), D)
    lo, n = layer.first, layer.n_local
    pairs = dict(out=(out, out_ref[sl]), x_grad=(x.grad / D, x_ref.grad[sl]),
                 router_grad=(layer.router.weight.grad, ref.router.weight.grad))
    for name, p, q in zip(("w1", "w3", "w2"), layer.expert_parameters(), (ref.w1, ref.w3, ref.w2)):
        pairs[name + "_grad"] = (p.grad, q.grad[lo:lo + n])
    _, weights, experts, _ = ref.route(x_all.view(-1, cfg.dim))
    unweighted = None
    if capacity is None:   # what a combine that forgets the router's weights gives: the k experts' outputs summed
        with torch.no_grad():
            xs = x_all.view(-1, cfg.dim)
            unweighted = sum(torch.stack([ref.expert(int(e), xs[t]) for t, e in enumerate(experts[:, j])])
                             for j in range(cfg.top_k))[sl].view_as(out)
    return dict(got={k: a.detach().clone() for k, (a, _) in pairs.items()},
                want={k: b.detach().clone() for k, (_, b) in pairs.items()}, unweighted=unweighted,
                a2a=[(e["bytes"], c.wire(e)) for e in c.events if e["op"] == "all_to_all"],
                rows=_expected_rows(experts, ref.capacity(N), sizes, n, P), dropped=layer.dropped,
                ref_dropped=ref.dropped, n_local=n)


def _expected_rows(experts, cap, sizes, n_local, ep):
    """rows[d][j]: rank d's assignments kept by the experts of rank j, every expert taking its first `cap` in token
    order over the group's tokens (rank order)."""
    rows, taken, bounds = [[0] * ep for _ in sizes], {}, list(itertools.accumulate(sizes))
    for t, chosen in enumerate(experts.tolist()):
        d = next(i for i, b in enumerate(bounds) if t < b)
        for e in chosen:
            if cap is None or taken.get(e, 0) < cap:
                taken[e] = taken.get(e, 0) + 1
                rows[d][e // n_local] += 1
    return rows


def run_ep(P):
    return {"dropless": _ep_case(P, None), "capacity 1.0": _ep_case(P, 1.0)}


def judge_ep_equal(P, res):
    for case in ("dropless", "capacity 1.0"):
        lines = compare_named(P, [x[case] for x in res], "got", lambda r, n: res[r][case]["want"][n],
                              what=f" ({case})", scales=[(P, f"{P}× the expected ({P} = ep)")] if P > 1 else [],
                              candidates_of=lambda r, n: [("the k experts' outputs summed without the router's weights: "
                                                           "weight each result by weights[t, slot] before summing it "
                                                           "into its token", res[r][case]["unweighted"])]
                              if n == "out" and res[r][case]["unweighted"] is not None else [])
        if lines:
            return lines + ["(expected: the single-device MoE of lab/model.py on all the ranks' tokens)"]
    return []


def judge_ep_bytes(P, res):
    for case in ("dropless", "capacity 1.0"):
        for r, x in enumerate(res):
            x = x[case]
            rows, El, rb = x["rows"], x["n_local"], 32 * 8
            sent, got = sum(rows[r]), sum(rows[s][r] for s in range(P))
            own = rows[r][r]
            want = [(P * (El + 1) * 8, (P - 1) * (El + 1) * 8)]
            if case != "dropless":
                want.append((P * El * 8, (P - 1) * El * 8))
            want += [(sent * rb, (sent - own) * rb), (got * rb, (got - own) * rb)] * 2
            if x["a2a"] != want:
                names = ["counts"] + (["verdicts"] if case != "dropless" else []) + \
                    ["dispatch", "combine", "combine's backward", "dispatch's backward"]
                gotb = [a for a, _ in x["a2a"]]
                wantb = [a for a, _ in want]
                return [f"rank {r} ({case}): all-to-all API bytes {gotb} where {wantb} is expected ("
                        + ", ".join(names) + f"; a row is H·b = {rb} bytes: dispatch sends my {sent} kept assignments, "
                        f"combine returns the {got} rows I received)"]
    return []


def judge_ep_dropped(P, res):
    for case in ("dropless", "capacity 1.0"):
        total = sum(x[case]["dropped"] for x in res)
        want = res[0][case]["ref_dropped"]
        if total != want:
            return [f"{case}: the ranks dropped {total} assignments in all, the single device drops {want}"]
    return []


CHECKS["all_to_all"] = [
    Check("the expert-parallel layer equals the single-device MoE in float64: output, and the gradients of the tokens, "
          "the router and every expert, dropless and with a capacity, uneven tokens per rank", run_ep, judge_ep_equal),
    Check("all-to-all bytes: counts, dispatch (my kept rows·H·b), combine (the rows I received), and backward both "
          "again with the splits swapped", run_ep, judge_ep_bytes, worlds=(2, 4)),
]
CHECKS["dispatch_combine"] = CHECKS["all_to_all"] + [
    Check("drops: the ranks' dropped assignments add up to the single device's (capacity C = ⌈T·k/E·cf⌉ per expert)",
          run_ep, judge_ep_dropped),
]

assert set(CHECKS) == set(BY_NAME), set(BY_NAME) ^ set(CHECKS)
