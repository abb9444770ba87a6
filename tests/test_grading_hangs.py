"""Every grade ends, in bounded time, with a true first line (lab/grader.py, lab/collective_watch.py, lab/launch.py).

Learners' versions written as small text edits of the reference cores (as lab/exercise_checks.py's seeded bugs are),
graded on 4 ranks in ONE call of lab.grader.evaluate, as the tests of "write it yourself" grade theirs (the default
patience and check limit: none of these waits for them):

- correct cores the watch must let through: 1F1B with its warm-up written min(p − r, m) − 1 and each send and receive
  posted in its own batch before both are waited; a ring written with isend/irecv;
- hangs: a received activation without requires_grad_ (its next stage would never send its gradient back: named at
  its forward, before any wait), a ring that skips its empty steps (fewer transfers on some ranks), a collective on
  some ranks only;
- deaths: os._exit on one rank, a SIGSEGV on one rank, an asynchronous all-gather never waited (the rank crashes, or
  its values are wrong: either way the dropped work is named with its line);
- an asynchronous all-gather never waited whose process survives, a file that does not load.

Each asserts the first line of the first failing check: which rank, waiting for what from whom, or which rank died
in which check and why, with the learner's line; the versions graded after a death still pass. Then the two shapes
only a limit ends, with short limits: a rank blocked inside a collective the watch cannot see (gloo's timeout, patience
+ 5 s, frees it), and an endless loop, through the command, which then stops before the next world size.
"""
import os
import re
import shutil
import tempfile
import time

import pytest

from lab import grader
from lab import workbook as exercises

PATIENCE, CHECK = 2.0, 8.0   # COURSE_GRADE_PATIENCE and COURSE_GRADE_CHECK_SECONDS where a limit is the point

# ---- the versions: (exercise, [(text in the reference, its replacement)]) -----------------------------------------

P2P_ONE_BATCH = "        for work in dist.batch_isend_irecv(ops) if ops else []:\n            work.wait()\n"
P2P_TWO_BATCHES = """        works = []
        if send is not None and to is not None:
            works += dist.batch_isend_irecv([dist.P2POp(dist.isend, send, to)])
        if buf is not None:
            works += dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, recv_from)])
        for work in works:
            work.wait()
"""
WARMUP = """    w = min(pipe.p - pipe.r - 1, m)
    inp = xs[0] if stage.is_first else p2p(recv_from=pipe.prev)
    for i in range(w):                                            # warm-up
        p2p(forward(i, inp), pipe.next)
        if i + 1 < m:
            inp = xs[i + 1] if stage.is_first else p2p(recv_from=pipe.prev)
"""
WARMUP_ONE_LESS = """    w = min(pipe.p - pipe.r, m) - 1      # warm-up: the steady loop's first forward not among them
    inp = xs[0] if stage.is_first else p2p(recv_from=pipe.prev)
    for i in range(w):
        p2p(forward(i, inp), pipe.next)
        inp = xs[i + 1] if stage.is_first else p2p(recv_from=pipe.prev)
"""
RING_PASS = ("            nxt = RingPass([kb, vb], group) if t < cp - 1 else None      # the next block moves while we "
             "compute\n")
RING_ISEND = """            reqs, nxt = [], None
            if t < cp - 1:                     # the next block moves while we compute: isend and irecv, waited below
                to, frm = (dist.get_global_rank(group, (rank + s) % cp) for s in (1, -1))
                kc, vc = kb.contiguous(), vb.contiguous()
                nxt = [torch.empty_like(kc), torch.empty_like(vc)]
                reqs = [dist.irecv(nxt[0], frm, group), dist.isend(kc, to, group), dist.irecv(nxt[1], frm, group),
                        dist.isend(vc, to, group)]
"""
RING_WAIT = "            if nxt is not None:\n                kb, vb = nxt.wait()\n        out, lse ="
RING_WAIT_ALL = ("            for req in reqs:\n                req.wait()\n            if nxt is not None:\n"
                 "                kb, vb = nxt\n        out, lse =")
RING_STEPS = "        for t, src, pairs in ring_schedule(cp, rank, layout, causal):\n"
AVG = "    all_reduce_flat([p.grad for p in params], group, divide_by or dist.get_world_size(group))"


def _on(rank, line):
    return f"    if dist.get_rank() == {rank}:\n        {line}\n" + AVG


VERSIONS = {
    "1F1B, warm-up min(p-r, m)-1, two batches": ("one_f_one_b", [(P2P_ONE_BATCH, P2P_TWO_BATCHES),
                                                                  (WARMUP, WARMUP_ONE_LESS)]),
    "ring with isend/irecv": ("ring", [(RING_PASS, RING_ISEND), (RING_WAIT, RING_WAIT_ALL)]),
    "1F1B, received activation without requires_grad_": (
        "one_f_one_b", [("return buf if buf is None else buf.requires_grad_(recv_from == pipe.prev)", "return buf")]),
    "ring skipping its empty steps": ("ring", [(RING_STEPS, RING_STEPS + "            if not pairs:\n"
                                                "                continue\n")]),
    "all-reduce on ranks 0-2 only": ("average", [(AVG, "    if dist.get_rank() != 3:\n    " + AVG)]),
    "os._exit on rank 2": ("average", [(AVG, _on(2, "__import__('os')._exit(3)"))]),
    "SIGSEGV on rank 1": ("average", [(AVG, _on(1, "__import__('os').kill(__import__('os').getpid(), 11)"))]),
    "stage 3's gather never waited": ("gather_when_used", [("        flat.unshard()",
                                                             "        flat.unshard(async_op=True)")]),
    "the step's all-gather never waited": ("zero_step", [("            f.all_gather()",
                                                          "            f.all_gather(async_op=True)")]),
    "a file that does not load": ("average", [(AVG, AVG + "\n    )")]),
}
AROUND = ("average", [(AVG, _on(0, "dist.distributed_c10d.all_reduce(torch.ones(1))   # (not torch.distributed's)"))])
LOOP = ("average", [(AVG, "    while dist.get_rank() == 1:\n        pass\n" + AVG)])
SLOW = ("average", [(AVG, "    if dist.get_rank() == 1 and not globals().get('_slept'):   # once, 2.5 patiences\n"
                          "        globals()['_slept'] = __import__('time').sleep(5) or True\n" + AVG)])

# the first line of the first failing check (None: every check passes)
EXPECT = {
    "1F1B, warm-up min(p-r, m)-1, two batches": None,
    "ring with isend/irecv": None,
    "1F1B, received activation without requires_grad_":
        r"^rank \d: RuntimeError: the activation stage 1 received does not require grad: its gradient could never "
        r"be sent back — .*requires_grad_\(\) on a received activation",
    "ring skipping its empty steps": r"^rank \d: RuntimeError: forward \(contiguous, causal\): ring step\(s\) \[[\d, ]+\] "
                                     r"passed nothing on — this rank has no pair to compute there",
    "all-reduce on ranks 0-2 only": r"^rank 0: rank 0 waits at all_reduce \(sum\) of [\d,]+ float64 elements over "
                                    r"ranks \[0, 1, 2, 3\] .* but rank 3 left without it \(it finished the check\)",
    "os._exit on rank 2": r"^rank 2: died in this check \(the process exited with code 3\): the core ended the process "
                          r".*\(at \S*\.py line \d+, in average_gradients: __import__\('os'\)\._exit\(3\)\)$",
    "SIGSEGV on rank 1": r"^rank 1: died in this check \(killed by SIGSEGV\): memory used after it was freed: .*\(at "
                         r"\S*\.py line \d+, in average_gradients: __import__\('os'\)\.kill\(",
    # the rank crashes when gloo writes into the freed buffer, or computes with a half-gathered one: the drop is named
    "stage 3's gather never waited": r"^(rank \d: died in this check \(killed by SIG[A-Z]+\): |rank \d: |every rank: )"
                                     r"an asynchronous all_gather of [\d,]+ float64 elements per rank into [\d,]+ over "
                                     r"ranks \[0, 1, 2, 3\] was dropped unwaited \(at \S*\.py line \d+, in gather: "
                                     r"flat\.unshard\(async_op=True\)\)",
    "the step's all-gather never waited": r"^every rank: an asynchronous all_gather of .* was dropped unwaited \(at "
                                          r"\S*\.py line \d+, in zero_step: f\.all_gather\(async_op=True\)\)",
    "a file that does not load": r"^every rank: \S*\.py does not load: SyntaxError",
}


def _text(name, edits):
    text = exercises.reference_text(exercises.BY_NAME[name])
    for old, new in edits:
        assert text.count(old) == 1, (name, old)
        text = text.replace(old, new)
    return text


def _file(folder, stem, version):
    path = os.path.join(folder, f"yours_{stem}.py")
    with open(path, "w") as f:
        f.write(_text(*version))
    return path


@pytest.fixture(scope="module")
def graded():
    """Every version graded on 4 ranks in one call: {label: [Outcome]}, and the seconds it took. The deaths come
    first, so that the versions after them are graded by the fresh groups that replace the dead ones."""
    with tempfile.TemporaryDirectory() as tmp:
        jobs = {label: (version[0], _file(tmp, i, version)) for i, (label, version) in enumerate(VERSIONS.items())}
        order = sorted(jobs, key=lambda label: EXPECT[label] is None)
        start = time.monotonic()
        out = grader.evaluate({4: [jobs[label] for label in order]}, timeout=300)
        took = time.monotonic() - start
        yield {label: out[(*jobs[label], 4)] for label in jobs}, took


def _report(outcomes):
    return "\n".join(line for o in outcomes for line in grader.format_outcome(o))


@pytest.mark.parametrize("label", list(VERSIONS))
def test_a_version_is_graded_with_a_true_first_line(label, graded):
    res, _ = graded
    outcomes = res[label]
    failed = [o for o in outcomes if not o.ok]
    if EXPECT[label] is None:
        assert outcomes and not failed, _report(outcomes)
        return
    assert failed, _report(outcomes)
    assert re.search(EXPECT[label], failed[0].lines[0]), _report(outcomes)
    assert "RankError" not in _report(outcomes) and "Traceback" not in _report(outcomes)
    if label != "a file that does not load":
        assert "does not load" not in _report(outcomes)


def test_the_later_checks_of_a_dead_ranks_exercise_say_why_they_did_not_run(graded):
    res, _ = graded
    later = [o for o in res["os._exit on rank 2"][1:] if o.lines[0] != "the same run as above failed (see there)"]
    assert later and all(o.lines[0].endswith("not run: rank 2 died in an earlier check of this exercise")
                         for o in later), _report(res["os._exit on rank 2"])


def test_the_versions_are_graded_in_bounded_time(graded):
    """10 versions, 3 of them killing a rank (each a fresh group of 4), and hangs found without waiting out the
    patience: well within a minute on 2 cores."""
    _, took = graded
    print(f"{len(VERSIONS)} versions on 4 ranks graded in {took:.0f} s")
    assert took < 120, took


def test_a_rank_blocked_inside_gloo_is_freed_by_glooss_timeout(tmp_path):
    """A collective the watch cannot see (torch's own module function, not torch.distributed's), made by rank 0 alone:
    for its peers it is a rank still computing (not at a watched collective), and rank 0 — inside gloo, where no alarm
    reaches — is freed by gloo's timeout while grading (patience + 5 s), its line named first."""
    path = _file(str(tmp_path), "around", AROUND)
    start = time.monotonic()
    outcomes = grader.evaluate({4: [("average", path)]}, timeout=120, patience=PATIENCE)[("average", path, 4)]
    took = time.monotonic() - start
    lines = outcomes[0].lines
    assert re.match(r"rank 0: gloo gave up after 7 s: .*\(at \S*yours_around\.py line \d+, in average_gradients: "
                    r"dist\.distributed_c10d\.all_reduce", lines[0]), _report(outcomes)
    assert took < 60, took


def test_a_rank_still_computing_is_waited_for_not_called_lost(tmp_path):
    """A correct core on a slow rank (5 s before its first all-reduce, 2.5 times the patience, within the check's
    limit): its peers, waiting at the collective, see it computing and wait; every check passes."""
    path = _file(str(tmp_path), "slow", SLOW)
    outcomes = grader.evaluate({4: [("average", path)]}, timeout=120, patience=PATIENCE,
                               check_seconds=CHECK)[("average", path, 4)]
    assert outcomes and all(o.ok for o in outcomes), _report(outcomes)


def test_the_grade_command_stops_after_an_endless_loop(tmp_path, monkeypatch, capsys):
    """`grade`: the loop (rank 1 only: 1 rank passes) fails on 2 ranks after COURSE_GRADE_CHECK_SECONDS with its
    line, and 4 ranks are not tried — each world size would wait as long again."""
    monkeypatch.setattr(grader, "CHECK_SECONDS", CHECK)
    ex = exercises.BY_NAME["average"]
    shutil.copy(os.path.join(exercises.ROOT, ex.file), tmp_path)
    exercises.start("average", root=str(tmp_path))   # (yours/ddp.py, the exercise marked started)
    (tmp_path / exercises.WORKSPACE / ex.file).write_text(_text(*LOOP))
    start = time.monotonic()
    assert not grader.grade("average", root=str(tmp_path))
    out = capsys.readouterr().out
    assert time.monotonic() - start < 60, out
    assert re.search(r"FAIL  2 ranks .*\n +rank 1: the check ran longer than 8 s: an endless loop\? \(at "
                     r"\S*yours/ddp\.py line \d+, in average_gradients: (while .*|pass)\)\n", out), out
    assert "(not run on 4 ranks: a check above ran longer than 8 s — fix that first)" in out, out
    assert "RankError" not in out and "Traceback" not in out, out


def test_the_watch_leaves_torch_as_it_found_it():
    """install() and uninstall() twice: torch.distributed's functions and the process group's send and recv are the
    very objects they were (a training run may watch a step and then run unwatched)."""
    import torch.distributed as dist

    from lab import collective_watch as watch
    before = dict(vars(dist.ProcessGroup)), {n: getattr(dist, n) for n in watch.COLLECTIVES if hasattr(dist, n)}
    for _ in range(2):
        watch.install()
        assert dist.ProcessGroup.send.__name__ == "send" and dist.all_reduce is not before[1]["all_reduce"]
        watch.uninstall()
    assert all(vars(dist.ProcessGroup)[k] is before[0][k] for k in ("send", "recv"))
    assert all(getattr(dist, n) is f for n, f in before[1].items())
