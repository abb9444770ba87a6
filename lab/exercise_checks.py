"""What each exercise of `python -m lab.exercises` is graded on: one block per exercise, in the lessons' order.

A block names the situations it grades, then holds the exercise's runs, its judges, its checks CHECKS[name] and its
seeded bugs BUGS[name]:

    run_*(P)                 on every rank of a group of P: one small float64 job of the learner's core (with the
                             collectives counted: Count), returning a dict
    judge_*(P, [dicts])      in the grading process: failure lines, [] for a pass — against the single process and
                             against the formula the core exists for; a rank-less check's judge(mine, ref) gets the
                             learner's function and the reference's
    CHECKS[name]             [Check(title, run, judge, worlds)]: what `grade NAME` runs, in order
    BUGS[name]               mistakes typical of learners, each with the diagnosis its first failing check must give
                             (tests/test_write_it_yourself.py grades every one)

Above the blocks: what a check and a seeded bug are, Count, the data, and THE single-process run the blocks compare
with (lab.baseline.single_process, here with SGD, so that a wrong gradient's pattern — P× too large, a sign, one
rank's slice — shows unchanged in the parameters). A failure says on which rank, which tensor, how far off and in
what pattern (lab/diagnosis.py), or which formula broke and by how much.

Imports: lab/diagnosis.py, lab/collective_watch.py (Count reads its log) <- this module <- lab/grader.py, which runs
the checks and knows no exercise. The lessons are imported inside the runs: a grading rank imports them after its
watch is installed.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import math
import re
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from lab import collective_watch as watch
from lab.diagnosis import TOL, close, compare_named, data_scales, formula_line, pattern, slice_pattern
from lab.workbook import BY_NAME

F64 = torch.float64
LR = 0.5          # SGD's learning rate: an update is -LR·g, the gradient's pattern unchanged
B, S = 8, 8       # global batch, sequence length of the data-parallel checks


@dataclass(frozen=True)
class Check:
    """title: what it proves (with the formula); run(P) -> dict on every rank (None: a check without ranks, whose
    judge gets the learner's module); judge(P, [each rank's dict]) -> failure lines, [] for a pass."""
    title: str
    run: Callable | None
    judge: Callable
    worlds: tuple = (1, 2, 4)


@dataclass(frozen=True)
class Edit:
    """A text edit of the reference core: `old` replaced by `new` (tuples of each: several edits, in order)."""
    label: str
    old: str | tuple
    new: str | tuple

    def pairs(self) -> list[tuple[str, str]]:
        return list(zip(self.old, self.new)) if isinstance(self.old, tuple) else [(self.old, self.new)]

    def apply(self, text: str) -> str:
        for old, new in self.pairs():
            if text.count(old) != 1:
                raise ValueError(f"{self.label!r}: {old!r} is in the text {text.count(old)} times, not once")
            text = text.replace(old, new)
        return text


@dataclass(frozen=True)
class Bug(Edit):
    """A learner's typical mistake; graded on `world` ranks (None: a check without ranks), it must fail with `expect`
    (a regular expression) in the first line of the first failing check's diagnosis."""
    expect: str
    world: int | None = 2


@dataclass(frozen=True)
class Variant(Edit):
    """A correct core written differently from the reference (another loop shape, in place rather than out of place,
    another legal order, an equivalent formula): graded on every world size of its exercise, every check passes.
    until: why it fails today although correct (a limit of the grader's machinery), '' when it must pass."""
    until: str = ""


CHECKS: dict[str, list[Check]] = {}
BUGS: dict[str, list[Bug]] = {}
VARIANTS: dict[str, list[Variant]] = {}


@contextlib.contextmanager
def explained(*rules, prefix=""):
    """An error raised inside, said with its case (prefix) and, where a rule's pattern matches its message, the
    likely cause first — re-raised with its own traceback, so the grader still names the learner's line. A mismatch
    the watch found, and the blank's NotImplementedError, pass unchanged."""
    try:
        yield
    except (NotImplementedError, watch.CollectiveMismatch):
        raise
    except (RuntimeError, TypeError, AttributeError, ValueError, IndexError) as e:
        msg = (str(e).strip().splitlines() or [""])[0]
        why = next((cause for pat, cause in rules if re.search(pat, msg)), "")
        text = f"{prefix}{why}: {msg}" if why else f"{prefix}{msg}"
        try:
            new = type(e)(text)
        except Exception:  # noqa: BLE001 - an exception class with another constructor
            new = RuntimeError(text)
        raise new.with_traceback(e.__traceback__) from None


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


# ---- 0. mesh: rows (mesh.py: rows_along) -----------------------------------------------------------------------------
# Where the course calls it: Mesh builds every process group of every lesson and of train.py from it, on every rank
# alike — each of the five dimensions, the flattened dp, dp_cp and dp_shard_cp, and the expert groups ep, edp and
# edp_cp on the grid viewed as [pp, e_out, e_i, cp, tp] — for meshes with up to all five axes > 1. A pure function
# of the grid (no ranks, dtypes, stages or overlap), graded in the grading process on every 5-D grid of 1-16 ranks
# (sizes 1-4, at most three axes > 1), along every dimension, flattened dimension and expert group:
#   - the groups equal the reference's: members in grid order, groups in grid order of the other axes, plain lists
#     of ints (each case's error said with its grid);
#   - each list is a partition: world/∏ groups of ∏ ranks, every rank once.

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


def _rows_diagnoses(got, want, grid, names, along, ref) -> list[str]:
    """What a wrong list of groups is, most specific first: (key, description) of every description that fits."""
    others = tuple(n for n in names if n not in along)
    size = math.prod(grid.shape[names.index(n)] for n in along)
    if not isinstance(got, list) or not all(isinstance(g, list) for g in got):
        return [("type", f"a {type(got).__name__}, not a list of lists of ranks (.tolist() at the end)")]
    if not all(type(r) is int for g in got for r in g):
        kinds = sorted({type(r).__name__ for g in got for r in g if type(r) is not int})
        return [("int", f"ranks of type {', '.join(kinds)}, not int (.tolist() turns a tensor into lists of ints)")]
    out = []
    if sorted(map(sorted, got)) == sorted(map(sorted, want)):
        if sorted(got) == sorted(want):
            out.append(("order", "the right groups in another order: every rank must build the groups in the same order — the "
                       "other axes in grid order, first axis slowest"))
        out.append(("members", "the right members, out of grid order inside a group: keep the `along` axes in their grid order"))
    moved = grid.permute([names.index(n) for n in others + along])
    if got == moved.reshape(size, -1).tolist():
        out.append(("size-1", f"the permuted grid read as [size, -1]: each row must be one group, reshape(-1, size)"))
    if got == grid.permute([names.index(n) for n in along + others]).reshape(-1, size).tolist():
        out.append(("first", "the `along` axes moved FIRST: move them last, so that each row of [-1, size] is one group"))
    if got == grid.reshape(-1, size).tolist():
        out.append(("rows", "the grid's rows without moving the `along` axes last: consecutive ranks, whatever the axes"))
    if others and got == ref(grid, names, others):
        out.append(("others", "the groups along the OTHER axes: move the `along` axes last, not first"))
    if got and len(got[0]) != size:
        out.append(("size", f"groups of {len(got[0])} ranks where {size} are expected: a group's size is the product of the "
                   f"sizes of all the `along` axes"))
    return out or [("other", "other groups than these axes have")]


def _case(shape, names, along) -> str:
    label = ", ".join(f"{n}={s}" for n, s in zip(names, shape) if s > 1) or "one rank"
    return f"grid [{label}] along {list(along)}"


def judge_rows(mine, ref):
    """Every grid's groups against the reference's; the first failing grid named, with the description that fits
    EVERY failing grid (one grid alone can fit two mistakes)."""
    import torch as t
    failures = []
    for shape, names, along in _grids():
        grid = t.arange(math.prod(shape)).view(*shape)
        want = ref(grid, names, along)
        with explained(prefix=f"{_case(shape, names, along)}: "):
            got = mine(grid.clone(), names, along)
        if not (isinstance(got, list) and got == want and all(type(r) is int for g in got for r in g)):
            failures.append((shape, names, along, got, want, _rows_diagnoses(got, want, grid, names, along, ref)))
    if not failures:
        return []
    shape, names, along, got, want, whys = failures[0]
    why = next((w for k, w in whys if all(k in dict(f[5]) for f in failures)), whys[0][1])
    return [f"{_case(shape, names, along)}: {_short(got)} where {_short(want)} is expected — {why}",
            f"({len(failures)} of {len(_grids())} cases wrong)"]


def _short(groups):
    s = str(groups)
    return s if len(s) < 80 else s[:76] + " ...]"


def judge_rows_partition(mine, ref):
    import torch as t
    for shape, names, along in _grids():
        grid = t.arange(math.prod(shape)).view(*shape)
        size = math.prod(shape[names.index(n)] for n in along)
        with explained(prefix=f"{_case(shape, names, along)}: "):
            got = [[int(r) for r in g] for g in mine(grid.clone(), names, along)]
        flat = sorted(r for g in got for r in g)
        if len(got) != grid.numel() // size or any(len(g) != size for g in got) or flat != list(range(grid.numel())):
            return [f"{_case(shape, names, along)}: {len(got)} groups of sizes {sorted({len(g) for g in got})}"
                    f" covering {len(set(flat))} distinct ranks ({len(flat)} places); expected world/∏ = "
                    f"{grid.numel() // size} groups of ∏ = {size} ranks, every rank of {grid.numel()} exactly once"]
    return []


CHECKS["rows"] = [
    Check("the groups along every dimension, flattened dimension and expert group of every 5-D grid of 1-16 ranks "
          "equal the reference's (members and groups in grid order)", None, judge_rows),
    Check("each list is a partition: world/∏ groups of ∏ ranks (∏ the sizes along the axes), every rank once",
          None, judge_rows_partition),
]
BUGS["rows"] = [
    Bug("no permute: the grid's rows as they are",
        "return grid.permute([names.index(n) for n in others + list(along)]).reshape(-1, size).tolist()",
        "return grid.reshape(-1, size).tolist()", r"without moving the `along` axes last", None),
    Bug("the other axes in reverse order", "others = [n for n in names if n not in along]",
        "others = [n for n in reversed(names) if n not in along]", r"the right groups in another order", None),
    Bug("a group's size: the first axis's size, not the product of their sizes",
        "size = math.prod(grid.shape[names.index(n)] for n in along)", "size = grid.shape[names.index(along[0])]",
        r"groups of \d+ ranks where \d+ are expected", None),
    Bug("no .tolist(): a tensor of groups", ".reshape(-1, size).tolist()", ".reshape(-1, size)",
        r"grid \[one rank\] along \['pp'\]: .* a Tensor, not a list of lists of ranks \(.tolist\(\) at the end\)",
        None),
    Bug("the `along` axes moved first", "for n in others + list(along)]", "for n in list(along) + others]",
        r"grid \[.*\] along .* the `along` axes moved FIRST", None),
    Bug("the permuted grid read as [size, -1]", ".reshape(-1, size).tolist()", ".reshape(size, -1).tolist()",
        r"grid \[.*\] along .* the permuted grid read as \[size, -1\]", None),
]
VARIANTS["rows"] = [
    Variant("movedim: the `along` axes to the end",
            "    others = [n for n in names if n not in along]\n    size = math.prod(grid.shape[names.index(n)] for n in "
            "along)\n    return grid.permute([names.index(n) for n in others + list(along)]).reshape(-1, size).tolist()",
            "    dims = [names.index(n) for n in along]\n    last = list(range(grid.dim() - len(dims), grid.dim()))\n"
            "    moved = grid.movedim(dims, last)\n    return moved.flatten(0, grid.dim() - len(dims) - 1).flatten(1)"
            ".tolist() if len(dims) < grid.dim() else [moved.flatten().tolist()]"),
    Variant("plain loops: every index of the grid, grouped by the other axes",
            "    others = [n for n in names if n not in along]\n    size = math.prod(grid.shape[names.index(n)] for n in "
            "along)\n    return grid.permute([names.index(n) for n in others + list(along)]).reshape(-1, size).tolist()",
            "    import itertools\n    keep = [i for i, n in enumerate(names) if n not in along]\n    groups = {}\n"
            "    for idx in itertools.product(*(range(s) for s in grid.shape)):   # in grid order\n"
            "        groups.setdefault(tuple(idx[i] for i in keep), []).append(int(grid[idx]))\n"
            "    return list(groups.values())"),
]


# ---- 1. ddp: average (ddp.py: average_gradients) ---------------------------------------------------------------------
# Where the course calls it: after backward, on model.parameters() (an iterator) over the whole world (ddp.py's
# demo), over a stage's dp group inside a pipeline (pipeline_demo), and in expert_parallel.sync_gradients over the
# dp_cp and edp groups — groups inside a larger mesh — with divide_by = D (not the group's size) and parameters
# whose gradient is None on some ranks; models with frozen parameters (requires_grad False); gradients in the
# parameters' dtype. No overlap: the plainest form runs after backward. Graded:
#   - the tiny float64 model, 2 SGD steps on 1, 2, 4 ranks: every gradient and parameter equal to one process, on
#     every rank;
#   - one all-reduce of Ψ·b bytes per step, counted on every rank;
#   - groups inside a larger mesh on 4 ranks: Mesh(dp_replicate=2, cp=2)'s dp groups [0, 2] and [1, 3], each pair on
#     its own data, and Mesh(dp_replicate=2, dp_shard=2)'s dp group, the whole world: only over the group given,
#     equal to one process on that group's data;
#   - divide_by=3 with parameters of every kind on 2 and 4 ranks: a gradient on every rank, none on rank 0, none
#     anywhere (zeros), a frozen one (None stays None), every gradient in its parameter's dtype.

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


DP_MESHES = {"Mesh(dp_replicate=2, cp=2)": dict(dp_replicate=2, cp=2),
             "Mesh(dp_replicate=2, dp_shard=2)": dict(dp_replicate=2, dp_shard=2)}


def run_dp_groups(P):
    """4 ranks as each of DP_MESHES: the dp group's ranks on the data seed of their cp index."""
    from mesh import Mesh
    out = {}
    for label, sizes in DP_MESHES.items():
        mesh = Mesh(**sizes)
        res = _dp_train(P, seed=mesh.coords["cp"], group=mesh, dp_rank=mesh.rank("dp"), dp_size=mesh.size("dp"))
        res.update(seed=mesh.coords["cp"], dp=mesh.ranks("dp"))
        out[label] = res
    return out


def judge_dp_equal(P, res, seeds=None, groups_note="", when="after average_gradients", sizes=None):
    """sizes: the group's size on each rank (when it is not the world)."""
    lines = []
    seed_of = (lambda r: 0) if seeds is None else seeds
    n = len(res) if sizes is None else sizes[0]
    world = None
    if seeds is not None:  # what averaging over the whole world would give
        g = {s: one_process(s)[1][0] for s in {seed_of(r) for r in range(len(res))}}
        world = lambda nm: (f"the average over ALL {P} ranks, not over this rank's group: all-reduce over the group "  # noqa: E731
                            f"you are given", sum(g[seed_of(r)][nm] for r in range(len(res))) / len(res))
    scales = ([(n / P, f"{n}/{P} of the expected: divided by the world's size {P}, not the group's {n} "
                f"(dist.get_world_size(group))")] if n != P else []) + data_scales(n)

    def own(r):
        return ("this rank's own gradient, not averaged: no all-reduce was made (is `params` an iterator, "
                "model.parameters(), read a second time? make it a list first)" if res[r]["calls"] == 0 else
                "this rank's own gradient, not averaged: no all-reduce reached it")
    lines += compare_named(P, res, "grads", lambda r, nm: one_process(seed_of(r))[1][0][nm], what=f" (gradient {when}, "
                           f"step 1)", scales=scales,
                           candidates_of=lambda r, nm: [(own(r), res[r]["local"][nm])] + ([world(nm)] if world else []))
    if lines:
        return lines + [f"(expected: the one-process gradient of the global batch{groups_note})"]
    for s in range(2):
        lines = compare_named(P, [dict(x=r_["states"][s]) for r_ in res], "x",
                              lambda r, nm: one_process(seed_of(r))[0][s + 1][nm], what=f" (parameter after step {s + 1})",
                              before_of=lambda r, nm: one_process(seed_of(r))[0][s][nm])
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
    for label in DP_MESHES:
        per = [x[label] for x in res]
        for r, x in enumerate(per):
            if x["groups"] != [tuple(x["dp"])]:
                return [f"{label}, rank {r}: the all-reduce ran over ranks {[list(g) for g in x['groups']]}, expected "
                        f"only over its dp group {x['dp']} (resolve_group(group, 'dp'): the dp group of a Mesh)"]
        lines = judge_dp_equal(P, per, seeds=lambda r: per[r]["seed"], groups_note=" of its own group's data",
                               sizes=[len(x["dp"]) for x in per])
        if lines:
            return [f"{label}, {lines[0]}"] + lines[1:]
    return []


def run_dp_divide(P):
    """Five parameters: a gradient r+1 on every rank; none on rank 0 (2(r+1) elsewhere); r; none anywhere; frozen.
    divide_by=3, the parameters handed over as an iterator."""
    from ddp import average_gradients
    r = dist.get_rank()
    shapes = [(3, 2), (4,), (5,), (2,), (3,)]
    ps = [torch.nn.Parameter(torch.zeros(sh, dtype=F64), requires_grad=i != 4) for i, sh in enumerate(shapes)]
    ps[0].grad = torch.full((3, 2), r + 1.0, dtype=F64)
    ps[1].grad = None if r == 0 else torch.full((4,), 2.0 * (r + 1), dtype=F64)
    ps[2].grad = torch.full((5,), float(r), dtype=F64)
    with explained((r"assign a gradient with dtype", "a gradient of another dtype than its parameter's: make the "
                    "zeros with torch.zeros_like(p) (its dtype and device)")):
        average_gradients(iter(ps), None, divide_by=3)   # an iterator, as model.parameters() is: read it once
    return dict(g={f"p{i}": (p.grad if p.grad is not None else torch.full_like(p, float("nan"))) for i, p in
                   enumerate(ps)}, none=[p.grad is None for p in ps], dtypes=[str(p.grad.dtype) if p.grad is not None
                                                                             else None for p in ps])


def judge_dp_divide(P, res):
    names = {3: "p3 (no rank has its gradient)", 4: "p4 (frozen: requires_grad=False)"}
    for r, x in enumerate(res):
        if not x["none"][4]:
            return [f"rank {r}, {names[4]}: a gradient after average_gradients where one process leaves None — skip "
                    f"the parameters that do not require grad"]
        for i, d in enumerate(x["dtypes"]):
            if d is not None and d != "torch.float64":
                return [f"rank {r}, p{i}: a {d} gradient for a torch.float64 parameter — make the zeros with "
                        f"torch.zeros_like(p) (its dtype and device)"]
    want = {"p0": torch.full((3, 2), sum(r + 1.0 for r in range(P)) / 3, dtype=F64),
            "p1": torch.full((4,), sum(2.0 * (r + 1) for r in range(1, P)) / 3, dtype=F64),
            "p2": torch.full((5,), sum(float(r) for r in range(P)) / 3, dtype=F64), "p3": torch.zeros(2, dtype=F64)}
    return compare_named(P, [dict(g={k: v for k, v in x["g"].items() if k in want}) for x in res], "g",
                         lambda r, n: want[n], what=" (sum ÷ divide_by = 3; p1 has no gradient on rank 0, p3 none "
                         "anywhere)", scales=[(3 / P, f"the sum ÷ {P} (the group's size): divide_by=3 was ignored")])


CHECKS["average"] = [
    Check("equal to one process in float64: every gradient after average_gradients, and the parameters after 2 SGD "
          "steps, on every rank", run_dp, judge_dp_equal),
    Check("one all-reduce of Ψ·b bytes per step (Ψ gradient elements, b = 8 bytes): g = (1/P)·Σ_r g_r in one call",
          run_dp, judge_dp_formula),
    Check("over the group it is given, inside a larger mesh: Mesh(dp_replicate=2, cp=2)'s dp groups [0, 2] and [1, 3] "
          "and Mesh(dp_replicate=2, dp_shard=2)'s, each on its own data, equal to one process on that data",
          run_dp_groups, judge_dp_groups, worlds=(4,)),
    Check("divide_by, and parameters without a gradient on one rank, on none, frozen: zeros sent, the sum ÷ divide_by "
          "everywhere, a frozen one left None, gradients in their parameter's dtype", run_dp_divide, judge_dp_divide,
          worlds=(2, 4)),
]
_FLAT = "all_reduce_flat([p.grad for p in params], group, divide_by or dist.get_world_size(group))"
_BODY = ('    params = [p for p in params if p.requires_grad]\n    for p in params:\n        if p.grad is None:\n'
         '            p.grad = torch.zeros_like(p)\n    ' + _FLAT + "\n")
BUGS["average"] = [
    Bug("forgot to divide by P", _FLAT, "all_reduce_flat([p.grad for p in params], group)",
        r"rank 0, .*: off by .* 2× the expected \(2 = P, the group's size\): the sum was not divided by P"),
    Bug("one all-reduce per parameter", _FLAT, "for p in params:\n        dist.all_reduce(p.grad, group=group)\n"
        "        p.grad /= divide_by or dist.get_world_size(group)",
        r"one all-reduce of Ψ·b = .* measured \d+ all-reduce\(s\) .* one per parameter tensor"),
    Bug("reduced over the world, not the group it is given", 'group = resolve_group(group, "dp")\n    params = ',
        'group = resolve_group(None, "dp")\n    params = ',
        r"Mesh\(dp_replicate=2, cp=2\), rank 0: the all-reduce ran over ranks \[\[0, 1, 2, 3\]\], expected only over "
        r"its dp group \[0, 2\]", 4),
    Bug("reduced over the dp_shard group, not dp", 'group = resolve_group(group, "dp")\n    params = ',
        'group = resolve_group(group, "dp_shard")\n    params = ', r"Mesh\(dp_replicate=2, cp=2\), rank 0: the all-reduce ran over ranks \[\[0\]\], expected "
        r"only over its dp group \[0, 2\]", 4),
    Bug("skipped the parameters without a gradient (a collective of another size on one rank)",
        "    for p in params:\n        if p.grad is None:\n            p.grad = torch.zeros_like(p)\n",
        "    params = [p for p in params if p.grad is not None]\n",
        r"collectives do not match: the ranks of group \[0, 1\] disagree .* rank 0: all_reduce \(sum\) of 11 "
        r"float64 elements; rank 1: all_reduce \(sum\) of 15 float64 elements"),
    Bug("the zeros made in the default dtype", "p.grad = torch.zeros_like(p)\n    all_reduce_flat(",
        "p.grad = torch.zeros(p.shape)\n    all_reduce_flat(",
        r"rank 0: RuntimeError: a gradient of another dtype than its parameter's: make the zeros with "
        r"torch.zeros_like\(p\)"),
    Bug("frozen parameters not skipped", "params = [p for p in params if p.requires_grad]", "params = list(params)",
        r"rank 0, p4 \(frozen: requires_grad=False\): a gradient after average_gradients where one process leaves None"),
    Bug("the parameters read twice from an iterator", _BODY,
        "    for p in params:\n        if p.requires_grad and p.grad is None:\n            p.grad = torch.zeros_like(p)"
        "\n    all_reduce_flat([p.grad for p in params if p.requires_grad], group, divide_by or "
        "dist.get_world_size(group))\n",
        r"rank 0, .*: off by .* no all-reduce was made \(is `params` an iterator"),
    Bug("divided by the world's size, not the group's", "params], group, divide_by or dist.get_world_size(group))",
        "params], group, divide_by or dist.get_world_size())",
        r"Mesh\(dp_replicate=2, cp=2\), rank 0, .*: off by .* 2/4 of the expected: divided by the world's size 4, not "
        r"the group's 2", 4),
]
VARIANTS["average"] = [
    Variant("the flat buffer written out: cat, all_reduce, divide, copy back", "    " + _FLAT + "\n",
            "    flat = torch.cat([p.grad.reshape(-1) for p in params])\n    dist.all_reduce(flat, group=group)\n"
            "    flat = flat / (divide_by or dist.get_world_size(group))\n    offset = 0\n    for p in params:\n"
            "        p.grad = flat[offset:offset + p.numel()].view_as(p).clone()\n        offset += p.numel()\n"),
    Variant("each gradient divided first, then summed in one call", _BODY,
            "    n = divide_by or dist.get_world_size(group)\n    grads = []\n    for p in params:\n"
            "        if not p.requires_grad:\n            continue\n        if p.grad is None:\n"
            "            p.grad = p.new_zeros(p.shape)\n        grads.append(p.grad.div_(n))\n"
            "    all_reduce_flat(grads, group)\n"),
]


# ---- 1. ddp: bucket (ddp.py: BucketedDDP._launch_in_order) -----------------------------------------------------------
# Where the course calls it: BucketedDDP's gradient hooks call it each time a bucket fills, and its end of backward
# once more — in ddp.py's demo over the world, in train.py (ZeRO stage 0) over dp_cp, a group inside the larger mesh,
# with reduce_dtype=float32 under bf16 (the buckets then hold copies, not views, of the gradients) and groups_of
# (experts averaged over a group of their own, divided by D, which can be a group of one); models with frozen
# parameters and parameters some ranks never use (filled with zeros at backward's end); gradients that arrive out of
# registration order, in another order on another rank. It exists for overlap: a bucket's all-reduce runs while
# backward computes the earlier layers. Graded:
#   - BucketedDDP (3 buckets) on the tiny float64 model, 2 SGD steps on 1, 2, 4 ranks: equal to one process when
#     backward returns and after each step, on every rank;
#   - buckets + 1 all-reduces of Ψ·b + n bytes, counted on every rank;
#   - overlap, judged by what is in flight: each bucket's all-reduce starts inside backward the moment its last
#     gradient arrives, in bucket order, and is still in flight (its work not waited for) when each later gradient
#     arrives and when backward ends;
#   - arrival orders on 2 ranks: two layers applied in the opposite order on the two ranks (their gradients arrive
#     in another order there), a frozen layer, a layer only rank 1 uses; one bucket per parameter: every gradient
#     Σ_r g_r / P, per rank (the frozen one None);
#   - groups_of and reduce_dtype on 2 ranks: the output layer averaged over a group of one and divided by 2 (as an
#     expert whose copies are alone), the buckets in float32 for float64 gradients: Σ over its group / its divisor;
#   - over the wrapper's group inside a larger mesh: Mesh(dp_shard=2, cp=2)'s dp groups on 4 ranks.


class _Tracked:
    """A collective's work whose wait() is recorded (what is still in flight, and when it stopped being)."""

    def __init__(self, work):
        self.work, self.waited = work, False

    def wait(self, *args, **kwargs):
        self.waited = True
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.work, name)


@contextlib.contextmanager
def _tracked_all_reduces(log):
    """Every all-reduce issued inside backward appends [its _Tracked work, or None if it returned none (synchronous)]
    to log."""
    inner = dist.all_reduce

    def all_reduce(*args, **kwargs):
        work = inner(*args, **kwargs)
        if torch._C._current_graph_task_id() != -1 and (args[0] if args else kwargs["tensor"]).dtype == F64:
            log.append(None if work is None else _Tracked(work))
            return log[-1] if work is not None else None
        return work
    dist.all_reduce = all_reduce
    try:
        yield
    finally:
        dist.all_reduce = inner


def _bucket_train(P, seed=0, mesh=None):
    from ddp import BucketedDDP
    from lab.model import build_model
    model = build_model("tiny", seed=0, dtype=F64)
    arrived, local, works, seen = [0], {}, [], []
    names = {p: n for n, p in model.named_parameters()}

    def in_flight(when):   # each bucket all-reduce launched so far: still running, waited for, or synchronous
        seen.append((when, ["sync" if w is None else "waited" if w.waited else "flying" for w in works]))

    def count(p):   # registered before the wrapper's hooks: runs first, sees this rank's own gradient
        arrived[0] += 1
        in_flight(arrived[0])
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
        works.clear(), seen.clear()

        def probe(e):
            e.update(arrived=arrived[0])
            if e["op"] == "all_reduce" and e["dtype"] == "uint8":   # the used-flags: backward's end
                in_flight("end")
        watch.set_probe(probe)
        loss = ddp(*_batch(s, seed=seed, rank=dp_rank, size=dp_size))
        with Count() as c, _tracked_all_reduces(works):
            loss.backward()
        watch.set_probe(None)
        if s == 0:
            out.update(grads=_grads(model), local=dict(local), calls=c.calls("all_reduce"),
                       bytes=c.bytes("all_reduce"), groups=c.groups(), seen=list(seen),
                       launches=[(e["arrived"], e["in_backward"]) for e in c.events
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
        for b, ((arrived, inside), when) in enumerate(zip(got, full)):
            if not inside or arrived != when:
                return [f"rank {r}: bucket {b} ({x['buckets'][b]} gradient(s)) started after gradient #{arrived} of "
                        f"{x['n']} arrived; it was full after #{when}: start a bucket's all-reduce the moment its "
                        f"last gradient arrives, in bucket order"]
        for b, ((arrived, _), when) in enumerate(zip(got, full)):
            for at, states in x["seen"]:
                if at != "end" and at <= arrived or b < len(states) and states[b] == "flying":
                    continue
                if b < len(states):
                    what = ("was synchronous (dist.all_reduce returned no work to wait for later)"
                            if states[b] == "sync" else "was waited for")
                    later = "when backward ended" if at == "end" else f"when gradient #{at} arrived"
                    return [f"rank {r}: bucket {b}'s all-reduce {what}: it was no longer in flight {later} — start it "
                            f"with async_op=True, keep the work in bucket.work, and leave the waiting to the end of "
                            f"backward (_finish_backward), so that it runs while backward computes"]
    return []


def judge_bucket_groups(P, res):
    for r, x in enumerate(res):
        bad = [list(g) for g in x["groups"] if list(g) != x["dp"]]
        if bad:
            return [f"rank {r}: all-reduces over ranks {bad}, expected only over its group {x['dp']} (bucket.group)"]
    return judge_dp_equal(P, res, seeds=lambda r: res[r]["seed"], groups_note=" of its own group's data",
                          when="when backward returns", sizes=[len(x["dp"]) for x in res])


class _TwoOrders(torch.nn.Module):
    """Layers a and b applied b(a(x)) on even ranks and a(b(x)) on odd ones (their gradients arrive in the opposite
    order), then a frozen layer, then c on odd ranks only."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        for name in ("a", "b", "frozen", "c"):
            setattr(self, name, torch.nn.Parameter(torch.randn(4, 4, generator=g, dtype=F64) / 2,
                                                   requires_grad=name != "frozen"))

    def forward(self, x):
        odd = dist.get_rank() % 2
        h = x @ self.b @ self.a if odd else x @ self.a @ self.b
        h = h @ self.frozen
        return ((h @ self.c if odd else h) ** 2).mean()


def run_bucket_orders(P):
    """_TwoOrders in one bucket per parameter, one backward on this rank's own rows."""
    from ddp import BucketedDDP
    model = _TwoOrders()
    local, order = {}, []
    def arrived(p, n):
        local[n] = p.grad.clone()
        order.append(n)
    for n, p in model.named_parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(functools.partial(arrived, n=n))
    ddp = BucketedDDP(model, bucket_cap_mb=0, first_bucket_mb=0)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(dist.get_rank()), dtype=F64)
    ddp(x).backward()
    return dict(grads={n: p.grad for n, p in model.named_parameters() if p.grad is not None},
                none=[n for n, p in model.named_parameters() if p.grad is None],
                local={n: local.get(n, torch.zeros(4, 4, dtype=F64)) for n in ("a", "b", "c")}, order=order)


def judge_bucket_orders(P, res):
    for r, x in enumerate(res):
        if x["none"] != ["frozen"]:
            return [f"rank {r}: after backward the gradients of {x['none']} are None, expected only the frozen layer's "
                    f"(c, used on rank 1 alone, gets its average there)"]
    want = {n: sum(x["local"][n] for x in res) / P for n in ("a", "b", "c")}

    def swapped(r, n):
        return [(f"this rank's {n} summed with rank {q}'s {m}: the ranks launched their buckets in different orders "
                 f"(here the gradients arrived {' → '.join(res[r]['order'])}, on rank {q} "
                 f"{' → '.join(res[q]['order'])}): launch in bucket order, from self._next, never a later bucket "
                 f"before an earlier one", (res[r]["local"][n] + res[q]["local"][m]) / P)
                for q in range(P) if q != r for m in ("a", "b", "c") if m != n]
    return compare_named(P, res, "grads", lambda r, n: want[n], what=" (Σ_r g_r / P, one bucket per parameter)",
                         candidates_of=swapped, scales=data_scales(P))


def run_bucket_where(P):
    """The tiny model, 2 ranks: output.weight averaged over a group of one (this rank alone) and divided by 2, the
    buckets in float32 for float64 gradients."""
    from ddp import BucketedDDP
    from lab.model import build_model
    alone = [dist.new_group([q]) for q in range(P)][dist.get_rank()]   # every rank makes every group, in order
    model = build_model("tiny", seed=0, dtype=F64)
    local = {}
    def arrived(p, n):
        local[n] = p.grad.clone()
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(functools.partial(arrived, n=n))
    ddp = BucketedDDP(model, bucket_cap_mb=0.1, first_bucket_mb=0.05, reduce_dtype=torch.float32,
                      groups_of=lambda n, p: (alone, P) if n == "output.weight" else None)
    ddp(*_batch(0, rank=dist.get_rank(), size=P)).backward()
    return dict(grads=_grads(model), local=local)


def judge_bucket_where(P, res):
    want = {n: sum(x["local"][n] for x in res) / P for n in res[0]["local"]}
    own = lambda r, n: res[r]["local"][n] / P   # noqa: E731
    rest = compare_named(P, [dict(g={k: v for k, v in x["grads"].items() if k != "output.weight"}) for x in res],
                         "g", lambda r, n: want[n], what=" (reduce_dtype=float32: the bucket a float32 copy)", tol=1e-6,
                         scales=[(P, f"{P}× the expected: summed, never divided — with reduce_dtype the gradients are "
                                  f"copies, not views, of bucket.flat: divide the flat buffer that is all-reduced")])
    if rest:
        return rest
    return compare_named(P, [dict(g={"output.weight": x["grads"]["output.weight"]}) for x in res], "g", own,
                         what=f" (groups_of: averaged over a group of one, divide_by = {P})", tol=1e-6,
                         scales=[(P, f"{P}× the expected: not divided — a bucket on a group of one needs no "
                                  f"all-reduce, but its division by bucket.divide_by (not the group's size) still")],
                         candidates_of=lambda r, n: [("summed over the wrapper's group, not the bucket's own "
                                                      "(bucket.group)", want[n])])


CHECKS["bucket"] = [
    Check("equal to one process in float64: every gradient when backward returns, and the parameters after 2 SGD "
          "steps, on every rank (3 buckets)", run_bucket, judge_bucket_equal),
    Check("one all-reduce per bucket (+ one of the used-flags): calls = buckets + 1, bytes Ψ·b + n",
          run_bucket, judge_bucket_formula, worlds=(2, 4)),
    Check("overlap: each bucket's all-reduce starts inside backward the moment its last gradient arrives, in bucket "
          "order, and is still in flight when the later gradients arrive and when backward ends", run_bucket,
          judge_bucket_launch, worlds=(2, 4)),
    Check("gradients in another order on another rank (two layers applied in opposite orders), a frozen layer, one "
          "only rank 1 uses: every gradient Σ_r g_r / P, the frozen one None", run_bucket_orders,
          judge_bucket_orders, worlds=(2,)),
    Check("groups_of and reduce_dtype (train.py): a layer averaged over a group of one and divided by 2, buckets in "
          "float32: each gradient Σ over its group / its divisor", run_bucket_where, judge_bucket_where, worlds=(2,)),
    Check("over the wrapper's group inside a larger mesh: Mesh(dp_shard=2, cp=2)'s dp groups [0, 2] and [1, 3], each "
          "on its own data", run_bucket_groups, judge_bucket_groups, worlds=(4,)),
]
_ASYNC = "bucket.work = dist.all_reduce(bucket.flat, group=bucket.group, async_op=True)"
_LOOP = ("        while self._next < len(self.buckets) and all(self.buckets[self._next].ready):\n"
         "            bucket = self.buckets[self._next]\n")
BUGS["bucket"] = [
    Bug("forgot to divide by P", "            bucket.flat.div_(bucket.divide_by)  # divide first: the sum is then "
        "the average\n", "", r"2× the expected \(2 = P"),
    Bug("a synchronous all-reduce", _ASYNC, "bucket.work = dist.all_reduce(bucket.flat, group=bucket.group)",
        r"rank 0: bucket 0's all-reduce was synchronous"),
    Bug("every bucket launched only when all are ready",
        "while self._next < len(self.buckets) and all(self.buckets[self._next].ready):",
        "while self._next < len(self.buckets) and all(all(b.ready) for b in self.buckets):",
        r"bucket 0 \(\d+ gradient\(s\)\) started after gradient #(\d+) of \1 arrived; it was full after #\d+"),
    Bug("all-reduced over the world, not the bucket's group",
        "dist.all_reduce(bucket.flat, group=bucket.group, async_op=True)",
        "dist.all_reduce(bucket.flat, async_op=True)",
        r"rank 0: all-reduces over ranks \[\[0, 1, 2, 3\]\], expected only over its group \[0, 2\]", 4),
    Bug("the all-reduce waited for right after its launch", _ASYNC, _ASYNC + "\n                bucket.work.wait()",
        r"rank 0: bucket 0's all-reduce was waited for: it was no longer in flight when gradient #\d+ arrived"),
    Bug("every ready bucket launched, in whatever order it fills", _LOOP + (
        "            bucket.flat.div_(bucket.divide_by)  # divide first: the sum is then the average\n"
        "            if dist.get_world_size(bucket.group) > 1:\n                " + _ASYNC + "\n"
        "            self._next += 1\n"),
        "        for bucket in self.buckets[self._next:]:\n            if all(bucket.ready) and bucket.work is None:\n"
        "                bucket.flat.div_(bucket.divide_by)\n                if dist.get_world_size(bucket.group) > 1:\n"
        "                    " + _ASYNC + "\n        while self._next < len(self.buckets) and "
        "self.buckets[self._next].work is not None:\n            self._next += 1\n",
        r"rank 0, \w \(Σ_r g_r / P.*: off by .* this rank's \w summed with rank 1's \w: the ranks launched their "
        r"buckets in different orders"),
    Bug("divided only when the group has more ranks", "            bucket.flat.div_(bucket.divide_by)  # divide "
        "first: the sum is then the average\n            if dist.get_world_size(bucket.group) > 1:\n",
        "            if dist.get_world_size(bucket.group) > 1:\n                bucket.flat.div_(bucket.divide_by)\n",
        r"rank 0, output.weight \(groups_of: .*\): off by .* 2× the expected: not divided — a bucket on a group of one"),
    Bug("the gradients divided instead of the flat buffer", "            bucket.flat.div_(bucket.divide_by)  # divide "
        "first: the sum is then the average\n", "            for p in bucket.params:\n"
        "                if p.grad is not None:\n                    p.grad.div_(bucket.divide_by)\n",
        r"rank 0, .* \(reduce_dtype=float32.*\): off by .* 2× the expected: summed, never divided — with reduce_dtype "
        r"the gradients are copies"),
]
VARIANTS["bucket"] = [
    Variant("recursive: launch the next bucket, then try the one after", _LOOP + (
            "            bucket.flat.div_(bucket.divide_by)  # divide first: the sum is then the average\n"
            "            if dist.get_world_size(bucket.group) > 1:\n                " + _ASYNC + "\n"
            "            self._next += 1\n"),
            "        if self._next == len(self.buckets) or not all(self.buckets[self._next].ready):\n"
            "            return\n        bucket = self.buckets[self._next]\n        bucket.flat.mul_(1 / bucket.divide_by)\n"
            "        if bucket.group.size() > 1:\n            " + _ASYNC + "\n        self._next += 1\n"
            "        self._launch_in_order()\n"),
    Variant("a for loop over the buckets from self._next, break at the first not ready", _LOOP + (
            "            bucket.flat.div_(bucket.divide_by)  # divide first: the sum is then the average\n"
            "            if dist.get_world_size(bucket.group) > 1:\n                " + _ASYNC + "\n"
            "            self._next += 1\n"),
            "        for bucket in self.buckets[self._next:]:\n            if not all(bucket.ready):\n"
            "                break\n            torch.div(bucket.flat, bucket.divide_by, out=bucket.flat)\n"
            "            bucket.work = (dist.all_reduce(bucket.flat, dist.ReduceOp.SUM, bucket.group, True)\n"
            "                           if dist.get_world_size(bucket.group) > 1 else None)\n"
            "            self._next += 1\n"),
]


# ---- 2. fsdp: zero_step (fsdp.py: zero_step) -------------------------------------------------------------------------
# One FlatParameter per module of the tiny float64 model, SGD over the shards for 2 steps on 1, 2 and 4 ranks, at
# stage 2 and at stage 3 (buffers freed between uses): equal to one process after each step on every rank (the
# slice that is wrong named); one reduce-scatter and one all-gather of 8Ψ bytes per unit, no all-reduce; after the
# step gradients on the slices only (Ψ/P elements). The training run serves gather_when_used too.

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
                    f"— {slice_pattern(got, w, b0, n_[u], P, r)}"] + (
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
BUGS["zero_step"] = [
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
]


# ---- 2. fsdp: gather_when_used (fsdp.py: gather_when_used) -----------------------------------------------------------
# Stage 3 with gather_when_used's hooks (zero_step's run) on 1, 2 and 4 ranks: equal to one process after each of 2
# steps; each unit all-gathered before its forward and before its backward (2·8Ψ bytes per step); one unit whole at
# a time in forward, nothing gathered at rest.

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
BUGS["gather_when_used"] = [
    Bug("never freed after forward", "    module.register_forward_hook(free)\n", "",
        r"rank 0: in forward, up to 5 units held their whole buffer at once; expected 1", 1),
    Bug("not gathered before backward", "    module.register_full_backward_pre_hook(gather)\n", "",
        r"every rank: RuntimeError: .*"),
    Bug("never freed after backward", "    module.register_full_backward_hook(free)\n", "",
        r"all-gathers per step .* expected \(10, .*\), measured \(15, "),
]


# ---- 3. hsdp: across_replicas (hsdp.py: across_replicas) -------------------------------------------------------------
# shard_hybrid on Mesh(dp_replicate=2, dp_shard=P/2) for 2 SGD steps, 2 replicas × 1 shard on 2 ranks and 2 × 2 on
# 4: equal to one process after each step on every rank; across replicas only the reduced shards and the
# used-flags, 8Ψ/S + 4k bytes all-reduced over the replicate group.

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
BUGS["across_replicas"] = [
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
]


# ---- 4. tensor parallel: f_and_g (tensor_parallel.py: _all_reduce, F_TP, G_TP) ---------------------------------------
# The tiny float64 model under apply_tensor_parallel, one step on 2 and 4 ranks: the loss and every gradient of
# every rank's slice equal to one process; Megatron's 2L + 1 all-reduces each way (+3 for the loss). The run serves
# pair too.

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
BUGS["f_and_g"] = [
    Bug("f and g swapped", "F_TP = (_identity,           _all_reduce)", "F_TP = (_all_reduce, _identity)",
        r"rank 0: the loss .* where one process has"),
    Bug("g's backward all-reduces too", "G_TP = (_all_reduce,         _identity)",
        "G_TP = (_all_reduce, _all_reduce)", r"rank 0, .*: off by .* 2× the expected \(= t\^1, t = tp size 2: summed "
        r"over tp 1 time\(s\) where it was whole"),
    Bug("f's backward is the identity", "F_TP = (_identity,           _all_reduce)",
        "F_TP = (_identity, _identity)", r"rank 0, .*: off by"),
]


# ---- 4. tensor parallel: pair (tensor_parallel.py: ColumnParallelLinear.forward, RowParallelLinear.forward) ----------
# f_and_g's run on 1, 2 and 4 ranks, and with sequence parallel on 2 and 4: the loss and every slice's gradient
# equal to one process; Megatron's collectives, 2L + 1 each way: all-reduces (tensor parallel), all-gathers and
# reduce-scatters (sequence parallel).

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
BUGS["pair"] = [
    Bug("the row-parallel linear never sums its partial outputs",
        "return exit_tp(self.linear(x, self.weight), self.group, self.sp)", "return self.linear(x, self.weight)",
        r"rank 0: the loss .* where one process has"),
    Bug("the column-parallel linear never enters the pair",
        "        if self.input_op is not None:\n            x = enter_tp(x, self.group, sp=self.input_op == "
        "\"gather\")\n", "", r"rank 0, .*: off by"),
    Bug("the row-parallel linear ignores sequence parallel", "exit_tp(self.linear(x, self.weight), self.group, "
        "self.sp)", "exit_tp(self.linear(x, self.weight), self.group, False)", r"every rank: RuntimeError"),
]


# ---- 5. pipeline: one_f_one_b (pipeline.py: one_f_one_b_plain) -------------------------------------------------------
# A 4-layer float64 model cut into p stages, one step of m micro-batches (m = 2 on 1 rank; 1 and 4 on 2; 2 and 4 on
# 4: m < p and m ≥ p): every stage's gradients and the last stage's loss equal to one process; each rank's order of
# F and B 1F1B's; at most min(p−r, m) micro-batches' activations held; per boundary m activations forward and m
# gradients back, [B/m, S, H]·b bytes each.

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
BUGS["one_f_one_b"] = [
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
]


# ---- 6. ring attention: merge (ring_attention.py: merge) -------------------------------------------------------------
# Where the course calls it: RingAttention.forward folds into each query chunk's running (out, lse) every block of
# keys that reaches it, its own block first (the empty start: None, None), then the other ranks' blocks in ring order
# (Ulysses with a ring inside calls the same); out [B, H, c, D] and lse [B, H, c] in the ring's work dtype: float64
# here, float32 when the inputs are bf16 (at least fp32); scores of any size. Graded without ranks (one process is
# the formula), against attention over all the keys at once:
#   - two blocks merged, in either order; the empty start;
#   - four blocks folded in two orders;
#   - scores in the thousands in float64 and in the hundreds in float32 (e^lse beyond either dtype): finite, exact to
#     the dtype's rounding, and the result in the blocks' dtype.
# Every call gets fresh copies of its inputs (a merge may update them in place), and the wrong answers a result is
# compared with are built before the call.

def _blocks(n, seed=0, scale=1.0, B_=2, H=3, c=5, D=4, dtype=F64):
    """n blocks' (out, lse) of one query block (cast to dtype) and, in float64, the attention over all their keys."""
    from ring_attention import block_forward
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B_, H, c, D, generator=g, dtype=F64) * scale
    ks = [torch.randn(B_, H, c, D, generator=g, dtype=F64) for _ in range(n)]
    vs = [torch.randn(B_, H, c, D, generator=g, dtype=F64) for _ in range(n)]
    parts = [tuple(t.to(dtype) for t in block_forward(q, k, v, 1.0, False)) for k, v in zip(ks, vs)]
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
            ("lse + lse_b: log of a product, not of a sum", l + bl),
            ("logsigmoid's sign flipped: lse' = lse − logsigmoid(lse − lse_b)",
             l + torch.nn.functional.logsigmoid(l - bl))]


MERGE_ERRORS = [(r"must match the size of tensor", "lse is [B, H, c] and out [B, H, c, D]: a weight per query row "
                 "needs [..., None] to broadcast over D"),
                (r"NoneType", "out and lse are None (merge(None, None, out_b, lse_b)): return the block itself, (out_b, "
                 "lse_b)")]


def _merged(mine, label, *args):
    """mine(*fresh copies of args), its error said with the case."""
    with explained(*MERGE_ERRORS, prefix=f"{label}: "):
        return mine(*(None if a is None else a.clone() for a in args))


def _tol(t):
    return TOL if t.dtype == F64 else 1e-5


def _judge_merge_pairs(mine, cases):
    for label, (o, l, bo, bl), (wo, wl) in cases:
        cands = {"out": _merge_wrong(o, l, bo, bl), "lse": _lse_wrong(l, bl)}   # (before the call)
        go, gl = _merged(mine, label, o, l, bo, bl)
        for what, got, want in (("out", go, wo), ("lse", gl, wl)):
            if got.dtype != o.dtype:
                return [f"{label}: {what} in {got.dtype} where the blocks are {o.dtype}: merge in the blocks' dtype "
                        f"(the ring chooses its work dtype)"]
            if not close(got, want, _tol(got)):
                diff = (got.double() - want).abs().max().item() if got.shape == want.shape else float("nan")
                return [f"{label}: {what} off by {diff:.2e} — {pattern(got, want, (), cands[what])}"]
    return []


def judge_merge_two(mine, ref):
    (a, b), whole = _blocks(2)
    return _judge_merge_pairs(mine, [("two blocks merged", (*a, *b), whole), ("the same two, the other way round",
                                                                              (*b, *a), whole)])


def judge_merge_start(mine, ref):
    (a,), _ = _blocks(1)
    got = _merged(mine, "the empty start", None, None, *a)
    if got[0] is None or not (close(got[0], a[0]) and close(got[1], a[1])):
        return ["merge(None, None, out_b, lse_b) must return the block itself (out_b, lse_b): the empty start"]
    return []


def judge_merge_four(mine, ref):
    parts, whole = _blocks(4, seed=1)
    for order in ((0, 1, 2, 3), (3, 1, 0, 2)):
        o = l = None
        for k, i in enumerate(order):
            o, l = parts[i] if k == 0 else _merged(mine, f"four blocks folded in the order {order}", o, l, *parts[i])
        if not (close(o, whole[0], 1e-10) and close(l, whole[1], 1e-10)):
            what, got, want = ("out", o, whole[0]) if not close(o, whole[0], 1e-10) else ("lse", l, whole[1])
            return [f"four blocks folded in the order {order}: {what} off by {(got - want).abs().max().item():.2e} — "
                    f"{pattern(got, want)}"]
    return []


def judge_merge_overflow(mine, ref):
    cases = []
    for dtype, scale in ((F64, 300.0), (torch.float32, 30.0)):   # e^lse beyond float64's 709 and float32's 88
        (a, b), whole = _blocks(2, seed=2, scale=scale, dtype=dtype)
        cases.append((f"{str(dtype)[6:]} scores up to {whole[1].abs().max().item():,.0f} (e^lse overflows)",
                      (*a, *b), whole))
    return _judge_merge_pairs(mine, cases)


CHECKS["merge"] = [
    Check("two blocks' (out, lse) merged equal attention over both blocks' keys, in either order (float64)", None,
          judge_merge_two),
    Check("(None, None) is the empty start: the first block comes back as it is", None, judge_merge_start),
    Check("four blocks folded in any order equal attention over all their keys", None, judge_merge_four),
    Check("no overflow: scores in the thousands (float64) and hundreds (float32), e^lse beyond the dtype: finite, exact "
          "to the dtype's rounding, in the blocks' dtype", None, judge_merge_overflow),
]
BUGS["merge"] = [
    Bug("a sign", "return out - torch.sigmoid(block_lse - lse)[..., None] * (out - block_out)",
        "return out + torch.sigmoid(block_lse - lse)[..., None] * (out - block_out)",
        r"two blocks merged: out off by .* the correction's sign flipped", None),
    Bug("sigmoid's argument reversed", "torch.sigmoid(block_lse - lse)[..., None]",
        "torch.sigmoid(lse - block_lse)[..., None]", r"each output weighted by the OTHER block's share", None),
    Bug("the textbook formula without the maximum (overflows)",
        "    return out - torch.sigmoid(block_lse - lse)[..., None] * (out - block_out), lse - F.logsigmoid(lse - "
        "block_lse)\n", "    a, b = torch.exp(lse), torch.exp(block_lse)\n    return (a[..., None] * out + "
        "b[..., None] * block_out) / (a + b)[..., None], torch.log(a + b)\n",
        r"float64 scores up to .* out off by .* NaN or infinite", None),
    Bug("lse' the larger of the two", "lse - F.logsigmoid(lse - block_lse)", "torch.maximum(lse, block_lse)",
        r"lse off by .* the larger of the two", None),
    Bug("logsigmoid's sign flipped", "lse - F.logsigmoid(lse - block_lse)", "lse + F.logsigmoid(lse - block_lse)",
        r"two blocks merged: lse off by .* logsigmoid's sign flipped", None),
    Bug("the weight not broadcast over D", "torch.sigmoid(block_lse - lse)[..., None] * (out - block_out)",
        "torch.sigmoid(block_lse - lse) * (out - block_out)",
        r"RuntimeError: two blocks merged: lse is \[B, H, c\] and out \[B, H, c, D\]: .*\[\.\.\., None\]", None),
    Bug("no empty start", "ring-flash-attention).\"\"\"\n    if out is None:\n        return block_out, block_lse\n",
        "ring-flash-attention).\"\"\"\n",
        r"TypeError: the empty start: out and lse are None .*: return the block itself",
        None),
    Bug("the running terms cast to float64 (a float32 merge returns float64)",
        "    return out - torch.sigmoid(", "    out, lse = out.double(), lse.double()\n    return out - torch.sigmoid(",
        r"float32 scores up to .*: out in torch.float64 where the blocks are torch.float32", None),
]
VARIANTS["merge"] = [
    Variant("in place: the running out and lse updated and returned",
            "    return out - torch.sigmoid(block_lse - lse)[..., None] * (out - block_out), lse - F.logsigmoid(lse - "
            "block_lse)\n",
            "    w = torch.sigmoid(block_lse - lse).unsqueeze(-1)\n    out.sub_(w * (out - block_out))\n"
            "    lse.sub_(F.logsigmoid(lse - block_lse))\n    return out, lse\n"),
    Variant("both shares written out, lse by logaddexp",
            "    return out - torch.sigmoid(block_lse - lse)[..., None] * (out - block_out), lse - F.logsigmoid(lse - "
            "block_lse)\n",
            "    mine = torch.sigmoid(lse - block_lse)[..., None]      # e^lse / (e^lse + e^lse_b)\n"
            "    return mine * out + (1 - mine) * block_out, torch.logaddexp(lse, block_lse)\n"),
    Variant("the running maximum subtracted (the online softmax)",
            "    return out - torch.sigmoid(block_lse - lse)[..., None] * (out - block_out), lse - F.logsigmoid(lse - "
            "block_lse)\n",
            "    m = torch.maximum(lse, block_lse)\n    a, b = torch.exp(lse - m), torch.exp(block_lse - m)\n"
            "    new = (a[..., None] * out + b[..., None] * block_out) / (a + b)[..., None]\n"
            "    return new, m + torch.log(a + b)\n"),
]


# ---- 6. ring attention: ring (ring_attention.py: RingAttention.forward) ----------------------------------------------
# A seeded float64 sequence (B=1, S=16, 4 heads, 2 kv heads) sharded contiguous and causal, zigzag and causal,
# zigzag and not causal, on 1, 2 and 4 ranks: the output, and dq, dk, dv from the lesson's backward, equal to
# whole-sequence SDPA on every rank; forward sends (cp−1)·2 blocks of B·c·d_kv·b bytes per rank.

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
BUGS["ring"] = [
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
]


# ---- 7. expert parallel: all_to_all (expert_parallel.py: AllToAll.forward, AllToAll.backward) ------------------------
# The expert-parallel layer (4 experts, top-2) on uneven tokens per rank, dropless and with capacity factor 1.0, on
# 1, 2 and 4 ranks: the output and the gradients of the tokens, the router and every expert equal to the
# single-device MoE; the all-to-alls' bytes: counts, dispatch, combine, and both again in backward with the splits
# swapped. The run and checks serve dispatch_combine too.

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


CHECKS["all_to_all"] = [
    Check("the expert-parallel layer equals the single-device MoE in float64: output, and the gradients of the tokens, "
          "the router and every expert, dropless and with a capacity, uneven tokens per rank", run_ep, judge_ep_equal),
    Check("all-to-all bytes: counts, dispatch (my kept rows·H·b), combine (the rows I received), and backward both "
          "again with the splits swapped", run_ep, judge_ep_bytes, worlds=(2, 4)),
]
BUGS["all_to_all"] = [
    Bug("the backward's splits not swapped", "ctx.splits, ctx.group = (in_splits, out_splits), group",
        "ctx.splits, ctx.group = (out_splits, in_splits), group",
        r"RuntimeError: all_to_all_single: the input has \d+ rows but input_split_sizes .* add up to \d+"),
    Bug("the backward passes the gradient through", "return _all_to_all(grad, *ctx.splits, ctx.group), None, "
        "None, None", "return grad, None, None, None", r"RuntimeError: .*AllToAll"),
    Bug("the forward's splits swapped", "return _all_to_all(x, out_splits, in_splits, group)",
        "return _all_to_all(x, in_splits, out_splits, group)",
        r"RuntimeError: all_to_all_single: the input has \d+ rows but input_split_sizes .* add up to \d+"),
]


# ---- 7. expert parallel: dispatch_combine (expert_parallel.py: ExpertParallelMoE.dispatch_combine) -------------------
# all_to_all's run and checks, and: the ranks' dropped assignments add up to the single device's (capacity
# C = ⌈T·k/E·cf⌉ per expert).

def judge_ep_dropped(P, res):
    for case in ("dropless", "capacity 1.0"):
        total = sum(x[case]["dropped"] for x in res)
        want = res[0][case]["ref_dropped"]
        if total != want:
            return [f"{case}: the ranks dropped {total} assignments in all, the single device drops {want}"]
    return []


CHECKS["dispatch_combine"] = CHECKS["all_to_all"] + [
    Check("drops: the ranks' dropped assignments add up to the single device's (capacity C = ⌈T·k/E·cf⌉ per expert)",
          run_ep, judge_ep_dropped),
]
BUGS["dispatch_combine"] = [
    Bug("the results not weighted by the router", "index_add(0, tok, back * weights.flatten()[sel, None])",
        "index_add(0, tok, back)", r"rank 0, out \(dropless\): off by .* without the router's weights"),
    Bug("the combine's splits not swapped", "back = self.all_to_all(y, send, recv, self.ep_group)",
        "back = self.all_to_all(y, recv, send, self.ep_group)",
        r"RuntimeError: all_to_all_single: the input has \d+ rows but input_split_sizes .* add up to \d+"),
    Bug("index_copy: a token's k results overwrite each other", "torch.zeros_like(x).index_add(0, tok, ",
        "torch.zeros_like(x).index_copy(0, tok, ", r"rank 0, out \(dropless\): off by"),
]

assert set(CHECKS) == set(BY_NAME), set(BY_NAME) ^ set(CHECKS)
