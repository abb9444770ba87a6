"""Write it yourself (lab/exercises.py, lab/grader.py, lab/collective_watch.py): the grader is proven, not assumed.

For every exercise the reference core passes every check on every world size it is graded on, the blank fails with
"not implemented yet: exercise NAME", and at least three seeded bugs typical of learners each fail with the diagnosis
the grader promises (a mutant the grader lets pass is a defect of the grader). All versions of all cores are graded
in ONE spawned group of ranks per world size (lab.grader.evaluate), as the grader itself does for one version.
Then the command line as a learner runs it, in a copy of the repository: start, grade the blank, a wrong attempt, a
right one, compare, and the refusals.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import pytest

from harness import ROOT, _copy_repository, run_command
from lab import grader
from lab import workbook as exercises


@dataclass(frozen=True)
class Bug:
    """A learner's typical mistake: `old` replaced by `new` inside the core; graded on `world` ranks, it must fail with
    `expect` (a regular expression) in the first line of the first failing check's diagnosis."""
    label: str
    old: str
    new: str
    expect: str
    world: int | None = 2


BUGS = {
    "rows": [
        Bug("no permute: the grid's rows as they are",
            "return grid.permute([names.index(n) for n in others + list(along)]).reshape(-1, size).tolist()",
            "return grid.reshape(-1, size).tolist()", r"without moving the `along` axes last", None),
        Bug("the other axes in reverse order", "others = [n for n in names if n not in along]",
            "others = [n for n in reversed(names) if n not in along]", r"the right groups in another order", None),
        Bug("a group's size: the first axis's size, not the product of their sizes",
            "size = math.prod(grid.shape[names.index(n)] for n in along)", "size = grid.shape[names.index(along[0])]",
            r"groups of \d+ ranks where \d+ are expected", None),
    ],
    "average": [
        Bug("forgot to divide by P", "all_reduce_flat([p.grad for p in params], group, divide_by or "
            "dist.get_world_size(group))", "all_reduce_flat([p.grad for p in params], group)",
            r"rank 0, .*: off by .* 2× the expected \(2 = P, the group's size\): the sum was not divided by P"),
        Bug("one all-reduce per parameter", "all_reduce_flat([p.grad for p in params], group, divide_by or "
            "dist.get_world_size(group))", "for p in params:\n        dist.all_reduce(p.grad, group=group)\n"
            "        p.grad /= divide_by or dist.get_world_size(group)",
            r"one all-reduce of Ψ·b = .* measured \d+ all-reduce\(s\) .* one per parameter tensor"),
        Bug("reduced over the world, not the group it is given", 'group = resolve_group(group, "dp")\n    params = ',
            'group = resolve_group(None, "dp")\n    params = ',
            r"rank 0: the all-reduce ran over ranks \[\[0, 1, 2, 3\]\], expected only over its group \[0, 2\]", 4),
        Bug("skipped the parameters without a gradient (a collective of another size on one rank)",
            "    for p in params:\n        if p.grad is None:\n            p.grad = torch.zeros_like(p)\n",
            "    params = [p for p in params if p.grad is not None]\n",
            r"collectives do not match: the ranks of group \[0, 1\] disagree .* rank 0: all_reduce \(sum\) of 11 "
            r"float64 elements; rank 1: all_reduce \(sum\) of 15 float64 elements .* different sizes"),
    ],
    "bucket": [
        Bug("forgot to divide by P", "            bucket.flat.div_(bucket.divide_by)  # divide first: the sum is then "
            "the average\n", "", r"2× the expected \(2 = P"),
        Bug("a synchronous all-reduce", "bucket.work = dist.all_reduce(bucket.flat, group=bucket.group, async_op=True)",
            "bucket.work = dist.all_reduce(bucket.flat, group=bucket.group)", r"bucket 0's all-reduce was synchronous"),
        Bug("every bucket launched only when all are ready",
            "while self._next < len(self.buckets) and all(self.buckets[self._next].ready):",
            "while self._next < len(self.buckets) and all(all(b.ready) for b in self.buckets):",
            r"bucket 0 \(\d+ gradient\(s\)\) started after gradient #(\d+) of \1 arrived; it was full after #\d+"),
        Bug("all-reduced over the world, not the bucket's group",
            "dist.all_reduce(bucket.flat, group=bucket.group, async_op=True)",
            "dist.all_reduce(bucket.flat, async_op=True)",
            r"rank 0: all-reduces over ranks \[\[0, 1, 2, 3\]\], expected only over its group \[0, 2\]", 4),
    ],
    "zero_step": [
        Bug("forgot to divide by P", "        f.shard.grad.div_(f.group_size)               # gloo has no "
            "ReduceOp.AVG: sum, then divide\n", "", r"unit 1 \(layers.0\), step 1: .* every slice: 2× the expected"),
        Bug("an all-reduce, then this rank's slice", "f.shard.grad, _ = f.reduce_scatter(f.pack(f.shard.dtype))",
            "g = f.pack(f.shard.dtype)\n        dist.all_reduce(g, group=f.group)\n        "
            "f.shard.grad = g[f.rank * f.shard_numel:(f.rank + 1) * f.shard_numel].clone()",
            r"reduce-scatters .* expected \(5, .*\), measured \(0, 0\); instead 5 all-reduce\(s\) .* an all-reduce where "
            r"a reduce-scatter belongs"),
        Bug("the wrong rank's slice", "f.shard.grad, _ = f.reduce_scatter(f.pack(f.shard.dtype))",
            "g = f.pack(f.shard.dtype)\n        dist.all_reduce(g, group=f.group)\n        r = (f.rank + 1) % "
            "f.group_size\n        f.shard.grad = g[r * f.shard_numel:(r + 1) * f.shard_numel].clone()",
            r"rank 0, unit 1 \(layers.0\), step 1: .* got the update of slice 1: the wrong shard"),
        Bug("no all-gather after the step", "        if f.buf.untyped_storage().size():\n            f.all_gather()\n",
            "        pass\n", r"rank 0, unit 1 \(layers.0\), step 1: .* no slice changed, this rank's own neither: .*the "
            r"all-gather after the step is missing"),
    ],
    "gather_when_used": [
        Bug("never freed after forward", "    module.register_forward_hook(free)\n", "",
            r"rank 0: in forward, up to 5 units held their whole buffer at once; expected 1", 1),
        Bug("not gathered before backward", "    module.register_full_backward_pre_hook(gather)\n", "",
            r"every rank: RuntimeError: .*"),
        Bug("never freed after backward", "    module.register_full_backward_hook(free)\n", "",
            r"all-gathers per step .* expected \(10, .*\), measured \(15, "),
    ],
    "across_replicas": [
        Bug("forgot the all-reduce", "        dist.all_reduce(t, group=replicate_group)\n", "        pass\n",
            r"rank 0, .*: off by .* this replica's own gradient ÷ 2: the shards were never summed across the replicas"),
        Bug("all-reduced over the whole world", "dist.all_reduce(t, group=replicate_group)", "dist.all_reduce(t)",
            r"rank 0, .*: off by", 4),
        Bug("divided inside (shard_hybrid divides afterwards)", "        dist.all_reduce(t, group=replicate_group)\n",
            "        dist.all_reduce(t, group=replicate_group)\n        if t.is_floating_point():\n"
            "            t /= dist.get_world_size(replicate_group)\n", r"1/2 of the expected update: divided by R once too "
            r"often"),
        Bug("an all-reduce on some ranks only", "        dist.all_reduce(t, group=replicate_group)\n",
            "        if dist.get_rank() < 2:\n            dist.all_reduce(t, group=replicate_group)\n",
            r"collectives do not match|rank \d waits at all_reduce .* but rank \d left without it", 4),
    ],
    "f_and_g": [
        Bug("f and g swapped", "F_TP = (_identity,           _all_reduce)", "F_TP = (_all_reduce, _identity)",
            r"rank 0: the loss .* where one process has"),
        Bug("g's backward all-reduces too", "G_TP = (_all_reduce,         _identity)",
            "G_TP = (_all_reduce, _all_reduce)", r"rank 0, .*: off by .* 2× the expected \(= t\^1, t = tp size 2: summed "
            r"over tp 1 time\(s\) where it was whole"),
        Bug("f's backward is the identity", "F_TP = (_identity,           _all_reduce)",
            "F_TP = (_identity, _identity)", r"rank 0, .*: off by"),
    ],
    "pair": [
        Bug("the row-parallel linear never sums its partial outputs",
            "return exit_tp(self.linear(x, self.weight), self.group, self.sp)", "return self.linear(x, self.weight)",
            r"rank 0: the loss .* where one process has"),
        Bug("the column-parallel linear never enters the pair",
            "        if self.input_op is not None:\n            x = enter_tp(x, self.group, sp=self.input_op == "
            "\"gather\")\n", "", r"rank 0, .*: off by"),
        Bug("the row-parallel linear ignores sequence parallel", "exit_tp(self.linear(x, self.weight), self.group, "
            "self.sp)", "exit_tp(self.linear(x, self.weight), self.group, False)", r"every rank: RuntimeError"),
    ],
    "one_f_one_b": [
        Bug("the micro-batch losses not scaled by 1/m",
            "outputs.append(out / m if stage.is_last else out)", "outputs.append(out)",
            r"rank \d, .*: off by .* 4× the expected \(4 = m, the micro-batches\)"),
        Bug("the newest micro-batch's backward first (LIFO)", "inp, out = inputs.pop(0), outputs.pop(0)",
            "inp, out = inputs.pop(), outputs.pop()", r"rank \d, .*: off by"),
        Bug("the warm-up one forward too long (off by one)", "w = min(pipe.p - pipe.r - 1, m)",
            "w = min(pipe.p - pipe.r, m)", r"."),
        Bug("sends and receives posted one after the other (a deadlock)",
            "        for work in dist.batch_isend_irecv(ops) if ops else []:\n            work.wait()\n",
            "        for op in ops:\n            for work in dist.batch_isend_irecv([op]):\n                work.wait()\n",
            r"a hang, stopped: deadlock: every rank here waits for a peer that waits elsewhere .* rank 0 waits to send .* rank 1 waits "
            r"to send .* post each send together with the receive it waits for"),
    ],
    "merge": [
        Bug("a sign", "return out - torch.sigmoid(block_lse - lse)[..., None] * (out - block_out)",
            "return out + torch.sigmoid(block_lse - lse)[..., None] * (out - block_out)",
            r"two blocks merged: out off by .* the correction's sign flipped", None),
        Bug("sigmoid's argument reversed", "torch.sigmoid(block_lse - lse)[..., None]",
            "torch.sigmoid(lse - block_lse)[..., None]", r"each output weighted by the OTHER block's share", None),
        Bug("the textbook formula without the maximum (overflows)",
            "    return out - torch.sigmoid(block_lse - lse)[..., None] * (out - block_out), lse - F.logsigmoid(lse - "
            "block_lse)\n", "    a, b = torch.exp(lse), torch.exp(block_lse)\n    return (a[..., None] * out + "
            "b[..., None] * block_out) / (a + b)[..., None], torch.log(a + b)\n",
            r"scores up to .* out off by .* NaN or infinite", None),
        Bug("lse' the larger of the two", "lse - F.logsigmoid(lse - block_lse)", "torch.maximum(lse, block_lse)",
            r"lse off by .* the larger of the two", None),
    ],
    "ring": [
        Bug("the blocks never passed on", "nxt = RingPass([kb, vb], group) if t < cp - 1 else None      # the next",
            "nxt = None      # the next", r"rank 1, out \(contiguous, causal\): off by"),
        Bug("the last step dropped (off by one)", "for t, src, pairs in ring_schedule(cp, rank, layout, causal):\n"
            "            nxt = RingPass([kb, vb], group) if t < cp - 1 else None      # the next",
            "for t, src, pairs in ring_schedule(cp, rank, layout, causal)[:-1]:\n"
            "            nxt = RingPass([kb, vb], group) if t < cp - 1 else None      # the next",
            r"rank 1, out \(contiguous, causal\): off by .* its own keys only: the other ranks' blocks were never folded "
            r"in"),
        Bug("one pass too many", "nxt = RingPass([kb, vb], group) if t < cp - 1 else None      # the next",
            "nxt = RingPass([kb, vb], group)      # the next", r"sends in forward .* expected \(2, .* measured \(4, .* one "
            r"pass too many"),
        Bug("the diagonal block not masked", "*block_forward(qs[i], ks[j], vs[j], scale, diagonal)",
            "*block_forward(qs[i], ks[j], vs[j], scale, False)", r"rank 0, out \(contiguous, causal\): off by .* its own "
            r"block seen without the causal mask"),
        Bug("the wrong lse saved for the backward", "ctx.save_for_backward(q, k, v, out, lse)",
            "ctx.save_for_backward(q, k, v, out, lse * 0)", r"rank 0, dq \(contiguous, causal\): off by"),
    ],
    "all_to_all": [
        Bug("the backward's splits not swapped", "ctx.splits, ctx.group = (in_splits, out_splits), group",
            "ctx.splits, ctx.group = (out_splits, in_splits), group",
            r"RuntimeError: all_to_all_single: the input has \d+ rows but input_split_sizes .* add up to \d+"),
        Bug("the backward passes the gradient through", "return _all_to_all(grad, *ctx.splits, ctx.group), None, "
            "None, None", "return grad, None, None, None", r"RuntimeError: .*AllToAll"),
        Bug("the forward's splits swapped", "return _all_to_all(x, out_splits, in_splits, group)",
            "return _all_to_all(x, in_splits, out_splits, group)",
            r"RuntimeError: all_to_all_single: the input has \d+ rows but input_split_sizes .* add up to \d+"),
    ],
    "dispatch_combine": [
        Bug("the results not weighted by the router", "index_add(0, tok, back * weights.flatten()[sel, None])",
            "index_add(0, tok, back)", r"rank 0, out \(dropless\): off by .* without the router's weights"),
        Bug("the combine's splits not swapped", "back = self.all_to_all(y, send, recv, self.ep_group)",
            "back = self.all_to_all(y, recv, send, self.ep_group)",
            r"RuntimeError: all_to_all_single: the input has \d+ rows but input_split_sizes .* add up to \d+"),
        Bug("index_copy: a token's k results overwrite each other", "torch.zeros_like(x).index_add(0, tok, ",
            "torch.zeros_like(x).index_copy(0, tok, ", r"rank 0, out \(dropless\): off by"),
    ],
}


def variant_files(tmp: str) -> dict:
    """{(exercise, label): path or None}: "reference" (None: the lesson itself), "blank", and each bug's file."""
    out = {}
    for ex in exercises.EXERCISES:
        text = exercises.reference_text(ex)
        out[(ex.name, "reference")] = None
        out[(ex.name, "blank")] = _write(tmp, f"{ex.name}-blank", exercises.blank(text, ex))
        for i, bug in enumerate(BUGS[ex.name]):
            assert text.count(bug.old) == 1, (ex.name, bug.label)
            at = text[:text.index(bug.old) + len(bug.old) - len(bug.old.lstrip())].count("\n") + 1, \
                 text[:text.index(bug.old) + len(bug.old.rstrip())].count("\n") + 1
            assert any(a <= at[0] and at[1] <= b for a, b in (exercises.core_lines(text, q) for q in ex.cores)), \
                f"{ex.name}: the bug {bug.label!r} is not inside the core"
            out[(ex.name, bug.label)] = _write(tmp, f"{ex.name}-bug{i}", text.replace(bug.old, bug.new))
    return out


def _write(tmp, name, text):
    path = os.path.join(tmp, name + ".py")
    with open(path, "w") as f:
        f.write(text)
    return path


def _worlds(name, label):
    worlds = grader.worlds_of(name)
    if label == "reference":
        return worlds or [None]
    if label == "blank":
        return worlds[:1] or [None]
    bug = next(b for b in BUGS[name] if b.label == label)
    return [bug.world if worlds else None]


@pytest.fixture(scope="module")
def graded():
    """Every variant of every exercise, graded: one group of ranks per world size."""
    tmp = tempfile.mkdtemp()
    try:
        files = variant_files(tmp)
        jobs = {}
        for (name, label), path in files.items():
            for P in _worlds(name, label):
                if P is not None:
                    jobs.setdefault(P, []).append((name, path))
        pure = [(name, path) for (name, label), path in files.items() if not grader.worlds_of(name)]
        start = time.monotonic()
        out = grader.evaluate({**jobs, 0: pure} if pure else jobs, timeout=600)
        took = time.monotonic() - start
        by_label = {}
        for (name, label), path in files.items():
            by_label[(name, label)] = {P: out[(name, path, P)] for P in _worlds(name, label)
                                       if (name, path, P) in out}
            if not grader.worlds_of(name):
                by_label[(name, label)] = {None: out[(name, path, None)]}
        yield by_label, took
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


def test_every_exercise_has_three_seeded_bugs_and_the_proof_is_cheap(graded):
    _, took = graded
    assert set(BUGS) == set(exercises.BY_NAME)
    assert all(len(b) >= 3 for b in BUGS.values())
    assert len(exercises.EXERCISES) >= 12 and {e.lesson for e in exercises.EXERCISES} >= {
        "mesh", "ddp", "fsdp", "hsdp", "tensor_parallel", "pipeline", "ring_attention", "expert_parallel"}
    print(f"every variant graded in {took:.0f} s")


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
    after COURSE_GRADE_CHECK_SECONDS (2 s here, 60 by default) with the learner's line named, the exercise's later
    checks are not run, and the grade comes back: nothing hangs."""
    monkeypatch.setenv("COURSE_GRADE_CHECK_SECONDS", "2")   # read by the ranks (spawned: the environment changed)
    text = exercises.reference_text(exercises.BY_NAME["average"])
    old = "    all_reduce_flat([p.grad for p in params], group, divide_by or dist.get_world_size(group))"
    loop = "    while True:\n        pass" if who == "every rank" else \
        "    while dist.get_rank(group) == 1:\n        pass\n" + old
    path = _write(str(tmp_path), "yours_average", text.replace(old, loop))   # (a learner's file: yours/ddp.py)
    start = time.monotonic()
    outcomes = grader.evaluate({2: [("average", path)]}, timeout=120)[("average", path, 2)]
    assert not any(o.ok for o in outcomes) and time.monotonic() - start < 60, [o.lines for o in outcomes]
    first = outcomes[0].lines
    assert re.match(r"(every rank|rank 1): the check ran longer than 2 s: an endless loop\? \(at \S*yours_average.py "
                    r"line \d+, in average_gradients: (while .*|pass)\)$", first[0]), first
    if who == "rank 1":   # and what its peer was doing meanwhile: waiting in the all-reduce
        assert first[0].startswith("rank 1") and re.match(
            r"rank 0: the check ran longer than 2 s, waiting for a peer at mesh.py line \d+: dist.all_reduce\(.*\) "
            r"\(at \S*yours_average.py line \d+, "
            r"in average_gradients: all_reduce_flat\(", first[1]), first
    assert all("not run: an earlier check of this exercise ran longer than 2 s" in o.lines[0] for o in outcomes[2:])


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
