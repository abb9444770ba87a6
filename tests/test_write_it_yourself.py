"""Write it yourself (lab/exercises.py, lab/grader.py, lab/exercise_checks.py, lab/collective_watch.py): the grader is
proven, not assumed.

For every exercise the reference core passes every check on every world size it is graded on, and so does each of at
least two correct variants written differently (VARIANTS: another loop shape, in place, another legal order, an
equivalent formula); the blank fails with "not implemented yet: exercise NAME"; and at least five seeded bugs typical
of learners (BUGS, beside each exercise's checks in lab/exercise_checks.py, covering the situations the exercise's
block lists) each fail with the diagnosis the grader promises in the first line of the first failing check (a mutant
the grader lets pass, or one it blames on something else, is a defect of the grader). All versions of all cores are
graded in ONE spawned group of ranks per world size (lab.grader.evaluate), as the grader itself does for one version
(a seeded bug and a blank only up to their first failing check, whose diagnosis is what their tests read).
Then the command line as a learner runs it, in a copy of the repository: start (the blanked core shown before the
lesson is read), grade the blank, a wrong attempt, a right one, compare, and the refusals.
"""
import os
import re
import shutil
import tempfile
import time

import pytest

from harness import _copy_repository, run_command
from lab import grader
from lab import workbook as exercises
from lab.exercise_checks import BUGS, VARIANTS


def variant_files(tmp: str, names=None) -> dict:
    """{(exercise, label): path or None}: "reference" (None: the lesson itself), "blank", each bug's file (its label)
    and each correct variant's ("variant: " + its label)."""
    out = {}
    for ex in exercises.EXERCISES:
        if names is not None and ex.name not in names:
            continue
        text = exercises.reference_text(ex)
        out[(ex.name, "reference")] = None
        out[(ex.name, "blank")] = _write(tmp, f"{ex.name}-blank", exercises.blank(text, ex))
        for kind, edits in (("bug", BUGS[ex.name]), ("variant", VARIANTS.get(ex.name, []))):
            for i, edit in enumerate(edits):
                for old, _ in edit.pairs():
                    at = text[:text.index(old) + len(old) - len(old.lstrip())].count("\n") + 1, \
                        text[:text.index(old) + len(old.rstrip())].count("\n") + 1
                    assert any(a <= at[0] and at[1] <= b for a, b in (exercises.core_lines(text, q) for q in ex.cores)),\
                        f"{ex.name}: the {kind} {edit.label!r} is not inside the core"
                label = edit.label if kind == "bug" else f"variant: {edit.label}"
                out[(ex.name, label)] = _write(tmp, f"{ex.name}-{kind}{i}", edit.apply(text))
    return out


def _write(tmp, name, text):
    path = os.path.join(tmp, name + ".py")
    with open(path, "w") as f:
        f.write(text)
    return path


def _worlds(name, label):
    worlds = grader.worlds_of(name)
    if label == "reference" or label.startswith("variant: "):
        return worlds or [None]
    if label == "blank":
        return worlds[:1] or [None]
    bug = next(b for b in BUGS[name] if b.label == label)
    return [bug.world if worlds else None]


def grade_files(files: dict) -> tuple[dict, float]:
    """{(exercise, label): path} graded: ({(exercise, label): {P: [Outcome]}}, seconds), one group of ranks per world
    size for all of them."""
    jobs = {}
    for (name, label), path in files.items():
        for P in _worlds(name, label):
            if P is not None:
                jobs.setdefault(P, []).append((name, path))
    pure = [(name, path) for (name, label), path in files.items() if not grader.worlds_of(name)]
    start = time.monotonic()
    # a seeded bug or a blank is graded up to its first failing check, whose first line is what its test reads
    first = {path for (name, label), path in files.items() if label == "blank" or label in {b.label for b in BUGS[name]}}
    out = grader.evaluate({**jobs, 0: pure} if pure else jobs, timeout=600, first_failure=first)
    took = time.monotonic() - start
    by_label = {}
    for (name, label), path in files.items():
        by_label[(name, label)] = {P: out[(name, path, P)] for P in _worlds(name, label) if (name, path, P) in out}
        if not grader.worlds_of(name):
            by_label[(name, label)] = {None: out[(name, path, None)]}
    return by_label, took


@pytest.fixture(scope="module")
def graded():
    """Every version of every exercise, graded: one group of ranks per world size."""
    tmp = tempfile.mkdtemp()
    try:
        yield grade_files(variant_files(tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _report(outcomes):
    return "\n".join(line for os_ in outcomes.values() for o in os_ for line in grader.format_outcome(o))


@pytest.mark.parametrize("name", list(exercises.BY_NAME))
def test_the_reference_passes_every_check(name, graded):
    res, _ = graded
    outcomes = res[(name, "reference")]
    worlds = grader.worlds_of(name) or [None]
    assert sorted(outcomes, key=str) == sorted(worlds, key=str), outcomes.keys()
    assert all(o.ok for os_ in outcomes.values() for o in os_), _report(outcomes)
    assert sum(len(os_) for os_ in outcomes.values()) >= 2


@pytest.mark.parametrize("name, label", [(n, v.label) for n, vs in VARIANTS.items() for v in vs])
def test_a_correct_variant_passes_every_check(name, label, graded):
    """A core written differently from the reference -- another loop shape, in place, another legal order, an
    equivalent formula -- passes every check on every world size (a correct core failed is a defect of the grader)."""
    res, _ = graded
    outcomes = res[(name, f"variant: {label}")]
    assert sorted(outcomes, key=str) == sorted(grader.worlds_of(name) or [None], key=str), outcomes.keys()
    assert all(o.ok for os_ in outcomes.values() for o in os_), _report(outcomes)


@pytest.mark.parametrize("name", list(exercises.BY_NAME))
def test_the_blank_fails_with_the_not_implemented_message(name, graded):
    res, _ = graded
    outcomes = [o for os_ in res[(name, "blank")].values() for o in os_]
    assert outcomes and not any(o.ok for o in outcomes), _report(res[(name, "blank")])
    first = next(o for o in outcomes if not o.ok)
    assert f"not implemented yet: exercise {name}" in first.lines[0], first.lines


@pytest.mark.parametrize("name, label", [(n, b.label) for n, bugs in BUGS.items() for b in bugs])
def test_a_seeded_bug_fails_with_its_diagnosis(name, label, graded):
    res, _ = graded
    bug = next(b for b in BUGS[name] if b.label == label)
    outcomes = [o for os_ in res[(name, label)].values() for o in os_]
    failed = [o for o in outcomes if not o.ok]
    assert failed, f"the grader lets this mutant pass (a defect of the grader):\n{_report(res[(name, label)])}"
    first = failed[0].lines[0]
    assert re.search(bug.expect, first), f"{name}, {label}:\n{_report(res[(name, label)])}"
    assert "not implemented yet" not in first


def test_every_exercise_has_five_seeded_bugs_two_variants_and_the_proof_is_cheap(graded):
    _, took = graded
    assert set(BUGS) == set(VARIANTS) == set(exercises.BY_NAME)
    assert all(len(b) >= 5 for b in BUGS.values()), {n: len(b) for n, b in BUGS.items()}
    assert all(len(v) >= 2 for v in VARIANTS.values()), {n: len(v) for n, v in VARIANTS.items()}
    assert len(exercises.EXERCISES) >= 12 and {e.lesson for e in exercises.EXERCISES} >= {
        "mesh", "ddp", "fsdp", "hsdp", "tensor_parallel", "pipeline", "ring_attention", "expert_parallel"}
    print(f"every version graded in {took:.0f} s")
    with open(os.path.join(exercises.ROOT, "README.md")) as f:   # the README counts what is here
        readme = " ".join(f.read().split())
    assert f"({sum(map(len, VARIANTS.values()))} in all) pass every check" in readme
    assert f"{sum(map(len, BUGS.values()))} seeded mistakes" in readme


def test_hints_say_the_moves_in_words():
    """A hint describes the idea and the moves, not the calls to type: no call, no torch or dist function named."""
    for ex in exercises.EXERCISES:
        assert not re.search(r"\w\(|\b(dist|torch|F)\.\w", ex.hint), (ex.name, ex.hint)


def test_a_deadlock_is_named_within_seconds(graded):
    """Two ranks each sending before receiving: the diagnosis names both transfers, found well within the patience."""
    res, _ = graded
    outcomes = [o for os_ in res[("one_f_one_b", "sends and receives posted one after the other (a deadlock)")].values()
                for o in os_]
    found = [float(m) for o in outcomes if not o.ok for m in re.findall(r"found after ([\d.]+) s", o.lines[0])]
    assert found and max(found) < 5, [o.lines for o in outcomes]


@pytest.mark.parametrize("who", ["every rank", "rank 1"])
def test_an_endless_loop_is_stopped_and_named(who, tmp_path, monkeypatch):
    """A core that never returns -- on every rank, or on one while its peer waits in the all-reduce -- ends the check
    after COURSE_GRADE_CHECK_SECONDS (4 s here, which a correct check stays under on a busy machine; 60 by default)
    with the learner's line named, the exercise's later checks are not run, and the grade comes back: nothing hangs."""
    monkeypatch.setenv("COURSE_GRADE_CHECK_SECONDS", "4")   # read by the ranks (spawned: the environment changed)
    text = exercises.reference_text(exercises.BY_NAME["average"])
    old = "    all_reduce_flat([p.grad for p in params], group, divide_by or dist.get_world_size(group))"
    loop = "    while True:\n        pass" if who == "every rank" else \
        "    while dist.get_rank(group) == 1:\n        pass\n" + old
    path = _write(str(tmp_path), "yours_average", text.replace(old, loop))   # (a learner's file: yours/ddp.py)
    start = time.monotonic()
    outcomes = grader.evaluate({2: [("average", path)]}, timeout=120)[("average", path, 2)]
    assert not any(o.ok for o in outcomes) and time.monotonic() - start < 60, [o.lines for o in outcomes]
    first = outcomes[0].lines
    assert re.match(r"(every rank|rank 1): the check ran longer than 4 s: an endless loop\? \(at \S*yours_average.py "
                    r"line \d+, in average_gradients: (while .*|pass)\)$", first[0]), first
    if who == "rank 1":   # and what its peer was doing meanwhile: waiting in the all-reduce
        assert first[0].startswith("rank 1") and re.match(
            r"rank 0: the check ran longer than 4 s, waiting for a peer at mesh.py line \d+: dist.all_reduce\(.*\) "
            r"\(at \S*yours_average.py line \d+, "
            r"in average_gradients: all_reduce_flat\(", first[1]), first
    assert all("not run: an earlier check of this exercise ran longer than 4 s" in o.lines[0] for o in outcomes[2:])


# ---- the command line, as a learner runs it ---------------------------------------------------------------------------

WRONG = """    group = resolve_group(group, "dp")
    all_reduce_flat([p.grad for p in params if p.grad is not None], group)"""
RIGHT = """    group = resolve_group(group, "dp")
    params = [p for p in params if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)   # this rank adds nothing, and receives the others' average
    P = divide_by or dist.get_world_size(group)
    all_reduce_flat([p.grad for p in params], group, P)"""


def _attempt(path, body):
    """The learner's file with the exercise's `raise NotImplementedError(...)` line (or their last attempt) replaced."""
    text = open(path).read()
    start = text.index('    raise NotImplementedError("not implemented yet: exercise average') if "exercise average —" in \
        text else text.index(WRONG)
    end = text.index("\n", start) if "exercise average —" in text else start + len(WRONG)
    with open(path, "w") as f:
        f.write(text[:start] + body + text[end:])


def test_a_learner_session_on_the_command_line():
    """start, grade the blank, a wrong attempt, a right one; compare, list; the next exercise of the same lesson keeps
    the learner's work; bad input is one line naming the fix — in a copy of the repository."""
    with tempfile.TemporaryDirectory() as tmp:
        _copy_repository(tmp)
        reference = open(os.path.join(tmp, "ddp.py")).read()

        def cli(*args, fail=False):
            return run_command(["-m", "lab.exercises", *args], cwd=tmp, timeout=300, expect_fail=fail)
        out = cli("start", "average")
        assert "average_gradients blanked in yours/ddp.py (a copy of ddp.py)" in out and "grade average" in out
        # the exercise before the answer: write it before reading ddp.py; the blanked core shown, where it is
        assert "Write it there BEFORE you read it in ddp.py" in out, out
        assert re.search(r"yours/ddp.py, line \d+:\n    @torch.no_grad\(\)\n    def average_gradients\(", out), out
        assert 'raise NotImplementedError("not implemented yet: exercise average' in out, out
        mine = os.path.join(tmp, "yours", "ddp.py")
        out = cli("grade", "average", fail=True)
        assert "FAIL  1 rank" in out and "rank 0: not implemented yet: exercise average" in out, out
        assert "(not run on 2 ranks, 4 ranks: write the core first" in out, out
        _attempt(mine, WRONG)
        out = cli("grade", "average", fail=True)
        assert "PASS  1 rank" in out and "2× the expected (2 = P, the group's size): the sum was not divided by P" in out
        assert "4× the expected (4 = P" in out and "checks passed" in out, out
        _attempt(mine, RIGHT)
        out = cli("grade", "average")
        assert "exercise average: all 9 checks passed" in out and "FAIL" not in out, out
        out = cli("compare", "average")
        assert "--- reference ddp.py: average_gradients" in out and "+++ yours/ddp.py: average_gradients" in out
        assert "# hint" not in out, out
        assert re.search(r"average +lesson 1 +ddp.py +passed", cli("list"))
        assert "def average_gradients" in cli("solution", "average")
        # bad input: one line, exit code 2, naming the fix
        assert "is started already" in cli("start", "average", fail=True)
        assert "exercise bucket is not started: run python -m lab.exercises start bucket" in cli("grade", "bucket",
                                                                                                   fail=True)
        assert "no exercise 'averag' — did you mean 'average'?" in cli("start", "averag", fail=True)
        # the next core of the same lesson is blanked in the learner's own file; the reference is never written
        out = cli("start", "bucket")
        assert "your own file, which keeps your earlier work" in out
        text = open(mine).read()
        assert RIGHT in text and "not implemented yet: exercise bucket" in text
        assert open(os.path.join(tmp, "ddp.py")).read() == reference
        out = cli("start", "bucket", "--over")
        assert os.path.exists(os.path.join(tmp, "yours", ".ddp.bucket.before-over.py"))
