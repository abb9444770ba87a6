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

import collections
import contextlib
import functools
import itertools
import math
import re
import traceback
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from lab import collective_watch as watch
from lab.diagnosis import TOL, close, compare_named, data_scales, formula_line, pattern, slice_pattern
from lab.workbook import BY_NAME, reference_text

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
    another legal order, an equivalent formula): graded on every world size of its exercise, every check passes."""


CHECKS: dict[str, list[Check]] = {}
BUGS: dict[str, list[Bug]] = {}
VARIANTS: dict[str, list[Variant]] = {}


@contextlib.contextmanager
def explained(*rules, prefix=""):
    """An error raised inside, said with its case (prefix) and, where a rule (pattern, cause[, a function the
    traceback must pass through]) matches its message, the likely cause first — re-raised with its own traceback,
    so the grader still names the learner's line. A mismatch the watch found, and the blank's NotImplementedError,
    pass unchanged."""
    try:
        yield
    except (NotImplementedError, watch.CollectiveMismatch):
        raise
    except (RuntimeError, TypeError, AttributeError, ValueError, IndexError) as e:
        msg = (str(e).strip().splitlines() or [""])[0]
        frames = {f.name for f in traceback.extract_tb(e.__traceback__)}
        why = next((rule[1] for rule in rules if re.search(rule[0], msg) and (len(rule) < 3 or rule[2] in frames)),
                   "")
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
        if e["op"] == "all_to_all" and e.get("send"):   # (the list form's splits count elements, not rows)
            unit = e["row_bytes"] if "row_bytes" in e else n / max(1, e["numel"])
            return float(sum(s for j, s in enumerate(e["send"]) if j != e["index"]) * unit)
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
    """(inputs, targets) of this rank's rows: fresh copies, which a learner's code may change."""
    return tuple(t.clone() for t in _batch_once(step, B, S, seed, rank, size))


@functools.cache
def _batch_once(step, B, S, seed, rank, size):
    from lab.data import get_batch
    return get_batch(_tokens(), step, B, S, seed, rank, size)


@functools.cache
def _mesh(**sizes):
    """A Mesh of these sizes, made once in a grading rank and kept for every version graded there (each of its
    groups a dist.new_group, which every rank makes together: tens of milliseconds each on a busy machine). Made at
    the start of a run, before any learner code, so every rank makes it at the same point."""
    from mesh import Mesh
    return Mesh(**sizes)


def _snap(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _grads(model):
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


@functools.cache
def one_process(seed=0, steps=2, cfg="tiny", B=B, S=S, m=1, frozen=()):
    """THE single-process run (lab.baseline.single_process, with SGD): states [before, after step 1, ...], each
    step's gradients, losses. m > 1: a batch's loss is the mean of its m micro-batches' means (a pipeline's);
    frozen: names of parameters with requires_grad False."""
    from lab.baseline import single_process, snapshot
    from lab.model import build_model
    batches = [_batch(s, B, S, seed) for s in range(steps)]

    def loss_fn(model, batch):
        return sum(model(a, b) for a, b in zip(batch[0].chunk(m), batch[1].chunk(m))) / m
    model = build_model(cfg, seed=0, dtype=F64)
    for n, p in model.named_parameters():
        p.requires_grad_(n not in frozen)
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
    if got is None:
        return [("type", "None: the function returned nothing — a missing `return` (build the groups, then return "
                         "them)")]
    if not isinstance(got, list) or not all(isinstance(g, list) for g in got):
        return [("type", f"a {type(got).__name__}, not a list of lists of ranks (.tolist() at the end)")]
    if not all(type(r) is int for g in got for r in g):
        kinds = sorted({type(r).__name__ for g in got for r in g if type(r) is not int})
        return [("int", f"ranks of type {', '.join(kinds)}, not int (.tolist() turns a tensor into lists of ints)")]
    out = []
    if sorted(map(sorted, got)) == sorted(map(sorted, want)):
        if sorted(got) == sorted(want):
            out.append(("order", "the right groups in another order: every rank must build the groups in the same "
                                 "order — the other axes in grid order, first axis slowest"))
        out.append(("members", "the right members, out of grid order inside a group: keep the `along` axes in "
                               "their grid order"))
    moved = grid.permute([names.index(n) for n in others + along])
    if got == moved.reshape(size, -1).tolist():
        out.append(("size-1", f"the permuted grid read as [size, -1]: each row must be one group, reshape(-1, size)"))
    if got == moved.reshape(size, -1).T.tolist():
        out.append(("T", "the permuted grid read as [size, -1] and transposed: read it as [-1, size], each row one group"))
    if len(along) > 1 and got == grid.movedim(names.index(along[0]), -1).reshape(-1, size).tolist():
        out.append(("one", "only the first `along` axis moved last: move ALL the `along` axes last, in their grid order"))
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


ROWS_ERRORS = [(r"does not match the length of the desired ordering|repeated dim|duplicate dims", "the permutation must name every "
                "axis exactly once: the other axes (the names NOT in `along`), then the `along` axes"),
               (r"view size is not compatible", "a permuted grid is not contiguous: read it with .reshape(-1, size), "
                "not .view"),
               (r'can only concatenate list \(not "tuple"\) to list', "`along` (and `names`) are tuples: make one a "
                "list before adding them (others + list(along))"),
               (r"shape '\[.*\]' is invalid for input of size", "rows that do not divide the grid: a group's size is the "
                "product of the sizes of the `along` axes (not how many axes there are)")]


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
        with explained(*ROWS_ERRORS, prefix=f"{_case(shape, names, along)}: "):
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
        with explained(*ROWS_ERRORS, prefix=f"{_case(shape, names, along)}: "):
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
    Bug("the membership test inverted: `others` are the `along` axes", "others = [n for n in names if n not in along]",
        "others = [n for n in names if n in along]", r"the permutation must name every axis exactly once", None),
    Bug("a group's size: how many axes, not the product of their sizes",
        "size = math.prod(grid.shape[names.index(n)] for n in along)", "size = len(along)",
        r"rows that do not divide the grid: a group's size is the product of the sizes of the `along` axes", None),
    Bug("only the first `along` axis moved last",
        "return grid.permute([names.index(n) for n in others + list(along)]).reshape(-1, size).tolist()",
        "return grid.movedim(names.index(along[0]), -1).reshape(-1, size).tolist()",
        r"grid \[.*\] along .* only the first `along` axis moved last", None),
    Bug("a list plus the `along` tuple", "for n in others + list(along)]", "for n in others + along]",
        r"grid \[one rank\] along \['pp'\]: .*`along` \(and `names`\) are tuples: make one a list", None),
    Bug("the groups built but not returned", "    return grid.permute(", "    groups = grid.permute(",
        r"None: the function returned nothing — a missing `return`", None),
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

AVG_ERRORS = [(r"Tensors must have same number of dimensions|Sizes of tensors must match", "torch.cat joins tensors along "
               "their first dimension: flatten each gradient first (g.reshape(-1)) to make one flat buffer"),
              (r"unsupported operand type\(s\) for .*'NoneType'|NoneType' object cannot be interpreted",
               "divide_by is None unless the caller gives it: divide by the group's size then (divide_by or "
               "dist.get_world_size(group))"),
              (r"\bMesh\b", "`group` may be a Mesh (its dp group is meant) or None (the world): turn it into a process "
               "group first, group = resolve_group(group, \"dp\")")]
RAN_WHY = ("this rank's own gradient, not averaged: the all-reduce ran, but its result never reached p.grad — "
           "torch.cat makes a copy: copy each part of the summed buffer back into its gradient")


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
        with Count() as c, explained(*AVG_ERRORS):
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
    out = {}
    for label, sizes in DP_MESHES.items():
        mesh = _mesh(**sizes)
        res = _dp_train(P, seed=mesh.coords["cp"], group=mesh, dp_rank=mesh.rank("dp"), dp_size=mesh.size("dp"))
        res.update(seed=mesh.coords["cp"], dp=mesh.ranks("dp"))
        out[label] = res
    return out


def judge_dp_equal(P, res, seeds=None, groups_note="", when="after average_gradients", sizes=None, extra=None,
                   ran_why=None):
    """sizes: the group's size on each rank (when it is not the world); extra(r, name): more candidates; ran_why:
    what an unaveraged gradient means when the all-reduce did run."""
    lines = []
    seed_of = (lambda r: 0) if seeds is None else seeds
    n = len(res) if sizes is None else sizes[0]
    world = None
    if seeds is not None:  # what averaging over the whole world would give
        g = {s: one_process(s)[1][0] for s in {seed_of(r) for r in range(len(res))}}
        world = lambda nm: (f"the average over ALL {P} ranks, not over this rank's group: all-reduce over the "  # noqa: E731
                            f"group you are given", sum(g[seed_of(r)][nm] for r in range(len(res))) / len(res))
    scales = ([(n / P, f"{n}/{P} of the expected: divided by the world's size {P}, not the group's {n} "
                f"(dist.get_world_size(group))")] if n != P else []) + data_scales(n) + (
        [(n * n, f"{n * n}× the expected ({n}² = P²): multiplied by P where the sum must be divided by it — divide_by "
                 f"is what the sum is divided BY (the group's size), not 1/P")] if n > 1 else [])

    def own(r):
        return ("this rank's own gradient, not averaged: no all-reduce was made (is `params` an iterator, "
                "model.parameters(), read a second time? make it a list first)" if res[r]["calls"] == 0 else
                ran_why or "this rank's own gradient, not averaged: no all-reduce reached it")
    def from_start(r, nm):   # every gradient copied back from the start of the flat buffer: the offset not advanced
        g = one_process(seed_of(r))[1][0]
        flat = torch.cat([t.reshape(-1) for t in g.values()])
        return ("the first elements of the flat buffer: each gradient copied back from its START — advance the "
                "offset by each p.numel()", flat[:g[nm].numel()].view_as(g[nm]) if nm != next(iter(g)) else None)
    lines += compare_named(P, res, "grads", lambda r, nm: one_process(seed_of(r))[1][0][nm], what=f" (gradient {when}, "
                           f"step 1)", scales=scales,
                           candidates_of=lambda r, nm: [(own(r), res[r]["local"][nm])] + ([world(nm)] if world else [])
                           + [from_start(r, nm)] + list(extra(r, nm) if extra else []))
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
                               sizes=[len(x["dp"]) for x in per], ran_why=RAN_WHY)
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
    with explained(*AVG_ERRORS, (r"assign a gradient with dtype", "a gradient of another dtype than its parameter's: "
                                 "make the zeros with torch.zeros_like(p) (its dtype and device)"),
                   (r"'NoneType' object has no attribute", "a parameter without a gradient on this rank (p1 has none on "
                    "rank 0, p3 none anywhere): give it zeros, p.grad = torch.zeros_like(p), on every rank")):
        average_gradients(iter(ps), None, divide_by=3)   # an iterator, as model.parameters() is: read it once
    return dict(g={f"p{i}": (p.grad if p.grad is not None else torch.full_like(p, float("nan"))) for i, p in
                   enumerate(ps)}, none=[p.grad is None for p in ps], dtypes=[str(p.grad.dtype) if p.grad is not None
                                                                             else None for p in ps])


def judge_dp_divide(P, res):
    names = {3: "p3 (no rank has its gradient)", 4: "p4 (frozen: requires_grad=False)"}
    for r, x in enumerate(res):
        for i, what in ((1, "p1 (no gradient on rank 0)"), (3, names[3])):
            if x["none"][i]:
                return [f"rank {r}, {what}: still None after average_gradients, where the sum ÷ divide_by is "
                        f"expected (zeros if no rank has one) — the zeros it sends must BE p.grad (p.grad = "
                        f"torch.zeros_like(p)), so that the sum lands in it"]
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
    def compare(names):
        return compare_named(P, [dict(g={k: v for k, v in x["g"].items() if k in names}) for x in res], "g",
                             lambda r, n: want[n], what=" (sum ÷ divide_by = 3; p1 has no gradient on rank 0, p3 none "
                             "anywhere)", scales=[(3 / P, f"the sum ÷ {P} (the group's size): divide_by=3 was ignored")])
    lines = compare(want)
    if lines and not compare(("p0", "p2")):   # only the parameters some rank had no gradient for
        return [f"{lines[0]} — the gradients every rank had are right: what a rank sends for a missing gradient must "
                f"be zeros, torch.zeros_like(p) (torch.empty_like holds whatever the memory held)"] + lines[1:]
    return lines


CHECKS["average"] = [
    Check("equal to one process in float64: every gradient after average_gradients, and the parameters after 2 SGD "
          "steps, on every rank", run_dp, functools.partial(judge_dp_equal, ran_why=RAN_WHY)),
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
        'group = resolve_group(group, "dp_shard")\n    params = ',
        r"Mesh\(dp_replicate=2, cp=2\), rank 0: the all-reduce ran over ranks \[\[0\]\], expected only over its dp "
        r"group \[0, 2\]", 4),
    Bug("skipped the parameters without a gradient (a collective of another size on one rank)",
        "    for p in params:\n        if p.grad is None:\n            p.grad = torch.zeros_like(p)\n",
        "    params = [p for p in params if p.grad is not None]\n",
        r"collectives do not match: the ranks of group \[0, 1\] disagree .* rank 0: all_reduce \(sum\) of 11 "
        r"float64 elements; rank 1: all_reduce \(sum\) of 15 float64 elements"),
    Bug("the zeros made in the default dtype", "p.grad = torch.zeros_like(p)\n    all_reduce_flat(",
        "p.grad = torch.zeros(p.shape)\n    all_reduce_flat(",
        r"every rank: RuntimeError: a gradient of another dtype than its parameter's: make the zeros with "
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
    Bug("the average copied back from the start of the flat buffer (no offset)", _FLAT,
        "flat = torch.cat([p.grad.reshape(-1) for p in params])\n    dist.all_reduce(flat, group=group)\n"
        "    flat /= divide_by or dist.get_world_size(group)\n    for p in params:\n"
        "        p.grad.copy_(flat[:p.numel()].view_as(p))",
        r"rank 0, .* the first elements of the flat buffer: each gradient copied back from its START"),
    Bug("zeros given only on rank 0", "        if p.grad is None:\n            p.grad = torch.zeros_like(p)\n    all_reduce_flat(",
        "        if p.grad is None and dist.get_rank() == 0:\n            p.grad = torch.zeros_like(p)\n    all_reduce_flat(",
        r"rank 1: AttributeError: a parameter without a gradient on this rank \(p1 has none on rank 0, p3 none anywhere\)"),
    Bug("zeros sent for a missing gradient, but not kept as its gradient", _BODY,
        "    params = [p for p in params if p.requires_grad]\n    all_reduce_flat([p.grad if p.grad is not None else "
        "torch.zeros_like(p) for p in params], group, divide_by or dist.get_world_size(group))\n",
        r"rank 0, p1 \(no gradient on rank 0\): still None after average_gradients"),
    Bug("the group passed positionally, where all_reduce takes the reduction", _FLAT,
        "flat = torch.cat([p.grad.reshape(-1) for p in params])\n    dist.all_reduce(flat, group)\n"
        "    flat /= divide_by or dist.get_world_size(group)\n    for p, part in zip(params, flat.split([p.numel() for "
        "p in params])):\n        p.grad.copy_(part.view_as(p))",
        r"TypeError: dist.all_reduce\(tensor, group\): a process group passed where dist.all_reduce takes the "
        r"reduction `op`"),
    Bug("the gradients concatenated without flattening", _FLAT,
        "flat = torch.cat([p.grad for p in params])\n    dist.all_reduce(flat, group=group)\n"
        "    flat /= divide_by or dist.get_world_size(group)\n    for p, part in zip(params, flat.split([p.numel() for "
        "p in params])):\n        p.grad.copy_(part.view_as(p))",
        r"torch.cat joins tensors along their first dimension: flatten each gradient first"),
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
#   - buckets that fill out of order, the same way on every rank (2 ranks): one bucket per gradient filled last to
#     first, and two-gradient buckets where the second is half full when the first fills: each bucket launched once,
#     only when all its gradients are ready, every one, in bucket order; every gradient Σ_r g_r / P;
#   - arrival orders on 2 ranks: two layers applied in the opposite order on the two ranks (their gradients arrive
#     in another order there), a frozen layer, a layer only rank 1 uses; one bucket per parameter: every gradient
#     Σ_r g_r / P, per rank (the frozen one None);
#   - groups_of and reduce_dtype on 2 ranks: the output layer averaged over a group of one and divided by 2 (as an
#     expert whose copies are alone), the buckets in float32 for float64 gradients: Σ over its group / its divisor;
#   - over the wrapper's group inside a larger mesh: Mesh(dp_shard=2, cp=2)'s dp groups on 4 ranks;
#   - gradient accumulation on 2 ranks (train.py's micro-batches): 2 micro-batches, the first in no_sync() and
#     the second synced; and both with sync_next_backward(False), then synchronize(), which calls the core after
#     backward: equal to one process of the global batch.


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
def _tracked_all_reduces(log, inputs=None, on_launch=None):
    """Every all-reduce issued inside backward appends [its _Tracked work, or None if it returned none (synchronous)]
    to log; inputs: each float64 one's (tensor, a copy of its values at the launch); on_launch(tensor): called on each
    float64 one as it is launched."""
    inner = dist.all_reduce

    def all_reduce(*args, **kwargs):
        t = args[0] if args else kwargs["tensor"]
        if inputs is not None and t.dtype == F64:
            inputs.append((t, t.detach().clone()))
        if on_launch is not None and t.dtype == F64:
            on_launch(t)
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


BUCKET_ERRORS = [(r"list index out of range", "self._next ran past the last bucket: take self.buckets[self._next] "
                  "BEFORE advancing self._next (and stop at len(self.buckets))", "_launch_in_order"),
                 (r"'bool' object has no attribute 'wait'", "bucket.work holds what .wait() returned (True), not the "
                  "work: keep the work that dist.all_reduce(..., async_op=True) returns in bucket.work, unwaited — "
                  "_finish_backward waits for it at backward's end")]


def _launch_record(ddp):
    """(list, on_launch): on_launch(t) appends, for each float64 all-reduce, (the bucket whose whole flat buffer t is,
    or None; how many of its gradients were ready; of how many; the bucket t is a part of, or None)."""
    launched = []

    def on_launch(t):
        b = next((b for b, bk in enumerate(ddp.buckets) if bk.flat.data_ptr() == t.data_ptr()
                  and bk.flat.numel() == t.numel()), None)
        part = next((b for b, bk in enumerate(ddp.buckets) if bk.flat.numel() and bk.flat.data_ptr() <= t.data_ptr()
                     < bk.flat.data_ptr() + bk.flat.numel() * bk.flat.element_size()), None)
        ready = list(ddp.buckets[b].ready) if b is not None else []
        launched.append((b, sum(ready), len(ready), part))
    return launched, on_launch


def _bucket_launches(ddp, launched, flats) -> str:
    """What is wrong with the buckets launched during one backward ('' if nothing): a flat buffer replaced, an
    all-reduce of something else than a whole flat buffer, another order than bucket order, a bucket not full."""
    nb = len(ddp.buckets)
    for b, bk in enumerate(ddp.buckets):
        if flats[b] != bk.flat.data_ptr():
            return (f"bucket {b}'s flat buffer was replaced by a new tensor (bucket.flat = ...): its views — the "
                    f"gradients — still point into the old one, which no all-reduce touches; change it in place "
                    f"(bucket.flat.div_(...))")
    other = next((x for x in launched if x[0] is None), None)
    if other is not None:
        return ((f"an all-reduce of a part of bucket {other[3]}'s flat buffer: all-reduce the whole bucket.flat, one "
                 f"call per bucket") if other[3] is not None else
                ("an all-reduce of a tensor that is no bucket's flat buffer (a copy, or a new tensor): all-reduce "
                 "bucket.flat itself, in place — its views are the gradients"))
    got = [b for b, *_ in launched]
    if got != list(range(nb)):
        twice = sorted({b for b in got if got.count(b) > 1})
        never = [b for b in range(nb) if b not in got]
        what = "; ".join(w for w in (f"bucket(s) {never} never launched" if never else "",
                                     f"bucket(s) {twice} launched more than once" if twice else "") if w)
        return (f"the buckets' all-reduces launched in the order {got}, expected each once, in bucket order "
                f"{list(range(nb))}" + (f" — {what}" if what else "") + ": launch self.buckets[self._next], then "
                f"advance self._next by one")
    for b, k, n, _ in launched:
        if k < n:
            return (f"bucket {b} launched when {k} of its {n} gradients had arrived — launch a bucket only once ALL "
                    f"its gradients are ready (all(bucket.ready))")
    return ""


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
        inputs = []
        launched, on_launch = _launch_record(ddp)
        flats = [bk.flat.data_ptr() for bk in ddp.buckets]
        with Count() as c, _tracked_all_reduces(works, inputs, on_launch), explained(*BUCKET_ERRORS):
            loss.backward()
        watch.set_probe(None)
        wrong = _bucket_launches(ddp, launched, flats) if s == 0 and dist.get_world_size(ddp.buckets[0].group) > 1 \
            else ""
        if wrong:
            raise RuntimeError(f"during backward: {wrong}")
        if s == 0:
            # the buckets whose all-reduce was launched on the undivided gradients (a division after the launch
            # races with the collective in flight)
            out["undivided"] = [b for b, bk in enumerate(ddp.buckets) if bk.divide_by != 1 for t, v in inputs
                                if t.data_ptr() == bk.flat.data_ptr() and t.numel() == bk.flat.numel()
                                and close(v, torch.cat([local[names[p]].reshape(-1) for p in bk.params]))]
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


def _bucket_own(P, res):
    """The candidate of a bucket whose all-reduce's result never reached the gradients."""
    return lambda r, nm: [("this rank's own gradient ÷ P, never summed: the all-reduce's result did not reach the "
                           "gradients — all-reduce bucket.flat itself, in place (its views are the gradients), not a "
                           "copy or a part of it", res[r]["local"][nm] / P)] if P > 1 else []


def judge_bucket_equal(P, res):
    lines = judge_dp_equal(P, res, when="when backward returns", extra=_bucket_own(P, res))
    total = {nm: sum(x["local"][nm] for x in res) for nm in res[0]["local"]}
    for r, x in enumerate(res):
        if x.get("undivided") and not all(close(g, total[nm]) for nm, g in x["grads"].items()):
            return [f"rank {r}: bucket {x['undivided'][0]}'s all-reduce was launched on the undivided gradients, and "
                    f"they were divided while it was in flight — divide bucket.flat BEFORE dist.all_reduce(..., "
                    f"async_op=True): an asynchronous collective owns its tensor until its work is waited for"] + lines
    return lines


def run_bucket_groups(P):
    mesh = _mesh(dp_shard=2, cp=2)
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


class _Chain(torch.nn.Module):
    """Parameters p0..p{n-1} (4×4) applied in the order `use`: their gradients arrive in the reverse of it."""

    def __init__(self, n, use):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(4, 4, generator=g, dtype=F64) / 2)
                                          for _ in range(n)])
        self.use = use

    def forward(self, x):
        for i in self.use:
            x = x @ self.ps[i]
        return (x ** 2).mean()


FILL_CASES = {   # label: (parameters, the order they are used, bucket cap in MiB); buckets hold the last ones first
    "3 buckets of one gradient each, filled last to first": (3, (2, 1, 0), 0),
    "2 buckets of two gradients, the second half full when the first fills": (4, (0, 2, 1, 3), 256 / 2 ** 20)}


def run_bucket_fill(P):
    """Each of FILL_CASES, the same on every rank: which bucket each float64 all-reduce launched, and how many of
    its gradients had arrived then; the gradients after backward, each rank's own."""
    from ddp import BucketedDDP
    out = {}
    for label, (n, use, cap) in FILL_CASES.items():
        model, local, launched = _Chain(n, use), {}, []
        for i, p in enumerate(model.ps):
            p.register_post_accumulate_grad_hook(functools.partial(lambda p, i: local.update({f"p{i}": p.grad.clone()}),
                                                                   i=i))
        ddp = BucketedDDP(model, bucket_cap_mb=cap, first_bucket_mb=cap)
        inner = dist.all_reduce

        def all_reduce(*args, **kwargs):
            t = args[0] if args else kwargs["tensor"]
            if t.dtype == F64:
                b = next((b for b, bk in enumerate(ddp.buckets) if bk.flat.data_ptr() == t.data_ptr()), None)
                launched.append((b, None if b is None else list(ddp.buckets[b].ready)))
            return inner(*args, **kwargs)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(dist.get_rank()), dtype=F64)
        dist.all_reduce = all_reduce
        try:
            ddp(x).backward()
        finally:
            dist.all_reduce = inner
        out[label] = dict(launched=launched, buckets=len(ddp.buckets), local=local,
                          grads={f"p{i}": p.grad for i, p in enumerate(model.ps)})
    return out


def judge_bucket_fill(P, res):
    for label in FILL_CASES:
        per = [x[label] for x in res]
        for r, x in enumerate(per):
            for b, ready in x["launched"]:
                if ready is not None and not all(ready):
                    return [f"{label}, rank {r}: bucket {b} launched when {sum(ready)} of its {len(ready)} gradients "
                            f"had arrived — launch a bucket only once ALL its gradients are ready (all(bucket.ready))"]
            got, nb = [b for b, _ in x["launched"]], x["buckets"]
            if got != list(range(nb)):
                missing = [b for b in range(nb) if b not in got]
                return [f"{label}, rank {r}: the buckets' all-reduces launched in the order {got}, expected each once, "
                        f"in bucket order {list(range(nb))} — " + (
                            f"bucket(s) {missing} never launched: when a bucket fills, launch it AND every ready "
                            f"bucket after it (a loop, up to the first not ready)" if missing else
                            "launch in bucket order, from self._next, never a later bucket before an earlier one "
                            "(on ranks whose gradients arrive in other orders, different buckets would be summed)")]
        want = {nm: sum(x["local"][nm] for x in per) / P for nm in per[0]["local"]}
        lines = compare_named(P, per, "grads", lambda r, nm: want[nm], what=" (Σ_r g_r / P)", scales=data_scales(P),
                              candidates_of=_bucket_own(P, per))
        if lines:
            return [f"{label}, {lines[0]}"] + lines[1:]
    return []


def run_bucket_accum(P):
    """Gradient accumulation over 2 micro-batches of this rank's rows (each loss ÷ 2): the first backward inside
    no_sync(), the second synced; then again with sync_next_backward(False) for both and synchronize() after
    (train.py's way: the buckets launched outside backward)."""
    from ddp import BucketedDDP
    from lab.model import build_model
    out = {}
    for how in ("no_sync", "synchronize"):
        model = build_model("tiny", seed=0, dtype=F64)
        ddp = BucketedDDP(model, bucket_cap_mb=0.1, first_bucket_mb=0.05)
        x, y = _batch(0, rank=dist.get_rank(), size=P)
        for k, (a, b) in enumerate(zip(x.chunk(2), y.chunk(2))):
            if how == "no_sync":
                with ddp.no_sync() if k == 0 else contextlib.nullcontext():
                    loss = ddp(a, b) / 2
            else:
                loss = ddp(a, b) / 2
                ddp.sync_next_backward(False)
            loss.backward()
        local = _grads(model)   # (the synchronize path: this rank's own accumulated gradient, not yet reduced)
        if how == "synchronize":
            ddp.synchronize()
        out[how] = dict(grads=_grads(model), local=local)
    return out


def judge_bucket_accum(P, res):
    for how, what in (("no_sync", "the first inside no_sync(), the second synced"),
                      ("synchronize", "both with sync_next_backward(False), then synchronize(): the buckets launched "
                       "after backward")):
        lines = compare_named(P, [x[how] for x in res], "grads", lambda r, nm: one_process()[1][0][nm],
                              what=f" (2 micro-batches accumulated, {what})", scales=data_scales(P),
                              candidates_of=lambda r, nm: [] if how == "no_sync" else [(
                                  "this rank's own accumulated gradient: synchronize() reduced nothing — "
                                  "_launch_in_order launches every ready bucket whenever it is called, inside backward "
                                  "or after it (whether a backward syncs is the hooks' business, not its own)",
                                  res[r][how]["local"][nm])])
        if lines:
            return lines + ["(expected: the one-process gradient of the global batch; _launch_in_order is also "
                            "called outside backward, by synchronize(), for gradients accumulated without sync)"]
    return []


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


@functools.cache
def _alone():
    """A group of this rank alone (every rank makes every such group, in order, once per grading rank)."""
    return [dist.new_group([q]) for q in range(dist.get_world_size())][dist.get_rank()]


def run_bucket_where(P):
    """The tiny model, 2 ranks: output.weight averaged over a group of one (this rank alone) and divided by 2, the
    buckets in float32 for float64 gradients."""
    from ddp import BucketedDDP
    from lab.model import build_model
    alone = _alone()
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
    Check("buckets that fill out of order, the same on every rank: each launched once all its gradients are ready, "
          "every one, in bucket order; every gradient Σ_r g_r / P", run_bucket_fill, judge_bucket_fill, worlds=(2,)),
    Check("gradients in another order on another rank (two layers applied in opposite orders), a frozen layer, one "
          "only rank 1 uses: every gradient Σ_r g_r / P, the frozen one None", run_bucket_orders,
          judge_bucket_orders, worlds=(2,)),
    Check("groups_of and reduce_dtype (train.py): a layer averaged over a group of one and divided by 2, buckets in "
          "float32: each gradient Σ over its group / its divisor", run_bucket_where, judge_bucket_where, worlds=(2,)),
    Check("over the wrapper's group inside a larger mesh: Mesh(dp_shard=2, cp=2)'s dp groups [0, 2] and [1, 3], each "
          "on its own data", run_bucket_groups, judge_bucket_groups, worlds=(4,)),
    Check("gradient accumulation (train.py's micro-batches): 2 micro-batches, the first in no_sync(); and both "
          "unsynced, then synchronize() — equal to one process of the global batch", run_bucket_accum,
          judge_bucket_accum, worlds=(2,)),
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
        r"3 buckets of one gradient each, filled last to first, rank 0: the buckets' all-reduces launched in the "
        r"order \[2, 1, 0\], expected each once, in bucket order \[0, 1, 2\] — launch in bucket order"),
    Bug("divided only when the group has more ranks", "            bucket.flat.div_(bucket.divide_by)  # divide "
        "first: the sum is then the average\n            if dist.get_world_size(bucket.group) > 1:\n",
        "            if dist.get_world_size(bucket.group) > 1:\n                bucket.flat.div_(bucket.divide_by)\n",
        r"rank 0, output.weight \(groups_of: .*\): off by .* 2× the expected: not divided — a bucket on a group of one"),
    Bug("the gradients divided instead of the flat buffer", "            bucket.flat.div_(bucket.divide_by)  # divide "
        "first: the sum is then the average\n", "            for p in bucket.params:\n"
        "                if p.grad is not None:\n                    p.grad.div_(bucket.divide_by)\n",
        r"rank 0, .* \(reduce_dtype=float32.*\): off by .* 2× the expected: summed, never divided — with reduce_dtype "
        r"the gradients are copies"),
    Bug("one bucket launched per call (if, not while)", _LOOP, _LOOP.replace("        while ", "        if "),
        r"filled last to first, rank 0: the buckets' all-reduces launched in the order \[0, 1\], .* bucket\(s\) \[2\] "
        r"never launched"),
    Bug("launched when any gradient of the bucket is ready", "all(self.buckets[self._next].ready):",
        "any(self.buckets[self._next].ready):",
        r"2 buckets of two gradients, .*, rank 0: bucket 1 launched when 1 of its 2 gradients had arrived"),
    Bug("divided after the asynchronous launch", "            bucket.flat.div_(bucket.divide_by)  # divide first: the "
        "sum is then the average\n            if dist.get_world_size(bucket.group) > 1:\n                " + _ASYNC + "\n",
        "            if dist.get_world_size(bucket.group) > 1:\n                " + _ASYNC + "\n"
        "            bucket.flat.div_(bucket.divide_by)\n",
        r"rank 0: bucket 0's all-reduce was launched on the undivided gradients, and they were divided while it was in "
        r"flight"),
    Bug("self._next advanced before the bucket is taken (off by one)", _LOOP + (
        "            bucket.flat.div_(bucket.divide_by)  # divide first: the sum is then the average\n"
        "            if dist.get_world_size(bucket.group) > 1:\n                " + _ASYNC + "\n"
        "            self._next += 1\n"),
        "        while self._next < len(self.buckets) and all(self.buckets[self._next].ready):\n"
        "            self._next += 1\n            bucket = self.buckets[min(self._next, len(self.buckets) - 1)]\n"
        "            bucket.flat.div_(bucket.divide_by)\n            if dist.get_world_size(bucket.group) > 1:\n"
        "                " + _ASYNC + "\n",
        r"every rank: RuntimeError: during backward: the buckets' all-reduces launched in the order \[1, 2, 2\], "
        r"expected each once, in bucket order \[0, 1, 2\] — bucket\(s\) \[0\] never launched; bucket\(s\) \[2\] "
        r"launched more than once"),
    Bug("the bucket divided out of place (bucket.flat rebound)", "bucket.flat.div_(bucket.divide_by)",
        "bucket.flat = bucket.flat / bucket.divide_by",
        r"every rank: RuntimeError: during backward: bucket 0's flat buffer was replaced by a new tensor"),
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
# Where the course calls it: the lesson's core on FlatParameters (ZeroOptimizer and train.py run the same three moves
# unit by unit), at stage 2 (buffers whole between steps) and stage 3 (buffers freed between uses: the next use
# gathers); on a group that is the world, or a shard group inside a larger mesh (HSDP's dp_shard, train.py's
# dp_shard_cp: f.rank and f.group_size are the group's, not the world's); with frozen parameters, whose gradient
# is None (packed as zeros). Graded:
#   - after the step only the slices hold gradients: Ψ/P elements, none on the whole parameters (stage 2), and at
#     stage 3 nothing gathered at rest — first, as a gradient left behind also spoils the next step;
#   - stages 2 and 3 equal to one process in float64 after each of 2 SGD steps, on every rank (the slice that is
#     wrong named);
#   - inside a larger mesh on 4 ranks: Mesh(dp_replicate=2, dp_shard=2)'s shard groups [0, 1] and [2, 3], each on
#     its own data, with a frozen parameter: equal to one process on that group's data (the same frozen);
#   - per rank and step: stage 2 one reduce-scatter and one all-gather of 8Ψ per unit, no all-reduce; stage 3 the
#     reduce-scatter alone (no all-gather into a freed buffer). The training run serves gather_when_used too.
# A first step that changes nothing is named by the step's own facts (gradients cleared before f.pack read them, the
# optimizer stepped before the reduce-scatter, the old values gathered instead of f.shard), and a stage-3 gather whose
# own slice is not f.shard at the gather itself.

def _units(model):
    return [("tok_embeddings", model.tok_embeddings)] + [(f"layers.{i}", m) for i, m in enumerate(model.layers)] + \
        [("norm", model.norm), ("output", model.output)]


ZERO_ERRORS = [(r"setStorage|storage of size 0|numel\(\) == 0|Trying to resize storage|size 0",
                "a freed buffer used (stage 3: f.buf has no bytes between uses): all-gather only into a gathered "
                "buffer — the next use gathers a freed one"),
               (r"'NoneType' object has no attribute", "a parameter without a gradient (frozen, or unused here): pack "
                "zeros for it (f.pack does), every rank hands over the same sizes"),
               (r"assigned grad expected to be a Tensor or None but got grad of type tuple", "f.reduce_scatter returns "
                "(my slice, its work): unpack it, mine, _ = f.reduce_scatter(...)"),
               (r"assign a gradient with dtype", "a gradient of another dtype than the shard's: pack in f.shard.dtype, "
                "the dtype the optimizer steps")]
ZERO_FROZEN = ("layers.0.attn.wq.weight",)
_STORAGE = r"setStorage|storage of size 0|numel\(\) == 0|Trying to resize storage"
GATHER_ERRORS = [(_STORAGE, "all-gathered into a freed buffer: flat.unshard() gives flat.buf its bytes back, then "
                  "gathers", "all_gather"),
                 (_STORAGE, "a unit's parameters read while its buffer is freed: gather right BEFORE its forward and "
                  "before its backward (the pre-hooks), free right AFTER each"),
                 (r"Cannot use both regular backward hooks and full backward hooks", "register_backward_hook is the old "
                  "module hook, which fires for the module's last op alone: use register_full_backward_hook"),
                 (r"invalid tensor size at index 0 \(expected \(\d+\), got \(0\)\)", "flat.buf has no elements: it was "
                  "replaced by an empty tensor, which the parameters are no views of — free with flat.free(), which "
                  "releases buf's bytes and keeps its shape")]


def _zero_train(P, stage, mesh=None):
    """fsdp's core on the tiny float64 model, one FlatParameter per module, SGD over the shards, 2 steps; with a Mesh,
    over its dp_shard group on the data of its replica, a parameter frozen."""
    from fsdp import FlatParameter, gather_when_used, zero_step
    from lab.model import build_model
    model = build_model("tiny", seed=0, dtype=F64)
    frozen = ZERO_FROZEN if mesh is not None else ()
    for n, p in model.named_parameters():
        p.requires_grad_(n not in frozen)
    group = mesh.group("dp_shard") if mesh is not None else None
    seed = mesh.coords["dp_replicate"] if mesh is not None else 0
    units = _units(model)
    flats = [FlatParameter(m.parameters(), group) for _, m in units]
    opt = _sgd([f.shard for f in flats])
    gathered = [0, 0]   # the most units whole at once in forward, in backward
    if stage == 3:
        for (_, m), f in zip(units, flats):
            gather_when_used(m, f)
            f.free()
        with explained(*GATHER_ERRORS):
            _watch_gathered(units, flats, gathered)
    out = dict(flats=[], names=[[f"{u}.{n}" for n, _ in m.named_parameters()] for u, m in units],
               labels=[u for u, _ in units], seed=seed, frozen=frozen, G=flats[0].group_size, stage=stage,
               N=[f.flat_numel for f in flats], n=[f.shard_numel for f in flats])
    batch = functools.partial(_batch, seed=seed, rank=flats[0].rank, size=flats[0].group_size)
    for s in range(2):
        with Count() as c:
            with explained(*GATHER_ERRORS):
                model(*batch(s)).backward()
            if s == 0:
                out["peak_forward"], out["peak_backward"] = gathered
            before = [f.shard.detach().clone() for f in flats]
            with Count() as step, explained(*ZERO_ERRORS):
                zero_step(flats, opt)
        if s == 0:
            grads = [f.shard.grad for f in flats if f.shard.grad is not None]
            out.update(comm=step.summary(), comm_all=c.summary(),
                       shard_moved=any(not torch.equal(b, f.shard.detach()) for b, f in zip(before, flats)),
                       grads_zero=bool(grads) and all(not g.any() for g in grads),
                       full_grads=sum(p.grad.numel() for f in flats for p in f.params if p.grad is not None),
                       shard_grads=sum(f.shard.grad.numel() for f in flats if f.shard.grad is not None),
                       at_rest=sum(f.buf.untyped_storage().nbytes() for f in flats))
        for f in flats:
            f.shard.grad = None
        if stage == 3:
            for f in flats:
                f.unshard()
        out["flats"].append([f.buf.clone() for f in flats])
        if stage == 3:
            for f in flats:
                f.free()
            if s == 0:   # an evaluation between steps: forward hooks, no backward
                with torch.no_grad(), explained(*GATHER_ERRORS):
                    model(*batch(1))
                out["after_eval"] = sum(f.buf.untyped_storage().nbytes() for f in flats)
    return out


def _watch_gathered(units, flats, gathered):
    """Hooks registered AFTER gather_when_used's, so they run after its gather and its free: in forward and in
    backward, the most units holding their whole buffer at once."""
    def after(i, *_):
        if i == 1 or torch.is_grad_enabled():   # (not an evaluation's forward)
            gathered[i] = max(gathered[i], sum(f.buf.untyped_storage().size() > 0 for f in flats))
    mark = [0]

    def before(*_):     # (prepended: runs before gather_when_used's own pre-hooks)
        mark[0] = len(watch.events)

    def fresh(f, *_):   # right after a gather: this rank's own slice of buf must be f.shard, what it keeps
        # (a gather still in flight or dropped unwaited: the grader names that, with its line, after the check)
        if f.buf.untyped_storage().size() > 0 and any(e["op"] == "all_gather" for e in watch.events[mark[0]:]) \
                and not watch.unwaited():
            n = f.shard_numel
            if not torch.equal(f.buf[f.rank * n:(f.rank + 1) * n], f.shard.detach()):
                raise RuntimeError("a unit gathered does not hold f.shard in its own slice: the all-gather must send "
                                   "f.shard (my slice, kept while buf is freed), not buf's own slice, whose bytes were "
                                   "released with buf and are gone")
    for (_, m), f in zip(units, flats):
        m.register_forward_pre_hook(before, prepend=True)
        m.register_full_backward_pre_hook(before, prepend=True)
        m.register_forward_pre_hook(functools.partial(fresh, f))
        m.register_full_backward_pre_hook(functools.partial(fresh, f))
    for _, m in units:
        m.register_forward_pre_hook(functools.partial(after, 0))
        m.register_forward_hook(functools.partial(after, 0))
        m.register_full_backward_pre_hook(functools.partial(after, 1))
        m.register_full_backward_hook(functools.partial(after, 1))


def run_zero2(P):
    return _zero_train(P, 2)


def run_zero3(P):
    return _zero_train(P, 3)


def run_zero_mesh(P):
    return _zero_train(P, 2, _mesh(dp_replicate=2, dp_shard=2))


def _ref_flats(names, N, step, seed=0, frozen=()):
    """The one-process parameters after `step` steps as the units' flat buffers (zero padding to N)."""
    state = one_process(seed, steps=2, B=B, frozen=frozen)[0][step]
    out = []
    for ns, n in zip(names, N):
        v = torch.cat([state[k].flatten() for k in ns])
        out.append(torch.cat([v, v.new_zeros(n - len(v))]))
    return out


def judge_zero_equal(P, res):
    for r, x in enumerate(res):
        ops = x["comm"]
        if P > 1 and not any(ops.get(op, {}).get("calls") for op in ("reduce_scatter", "all_reduce")):
            return [f"rank {r}: no collective summed the gradients in the step (no reduce-scatter, no all-reduce): each "
                    f"rank stepped its own gradient — reduce-scatter the packed gradient over f.group (f.reduce_scatter)"]
        if x["stage"] == 3 and not x["comm_all"].get("all_gather", {}).get("calls"):
            return [f"rank {r}, stage 3: no all-gather in forward, backward or the step: a freed unit given its bytes "
                    f"back holds no values until every rank's slice is gathered into it (flat.unshard gathers)"]
    for s in range(2):
        for r, x in enumerate(res):
            ref = functools.partial(_ref_flats, x["names"], x["N"], seed=x["seed"], frozen=x["frozen"])
            want, before = ref(s + 1), ref(s)
            failing = [u for u, (got, w) in enumerate(zip(x["flats"][s], want)) if not close(got, w)]
            if not failing:
                continue
            # read the pattern on a unit whose every slice changes (the embedding's rows of unused bytes do not)
            n_, G = x["n"], x["G"]
            whole = [u for u in failing if all((want[u] - before[u])[j * n_[u]:(j + 1) * n_[u]].abs().max() > 0
                                               for j in range(G))]
            u = (whole or failing)[0]
            got, w, b0 = x["flats"][s][u], want[u], before[u]
            if s == 0 and close(got, b0):
                stale = _zero_stale(x)
                if stale:
                    return [f"rank {r}, unit {u} ({x['labels'][u]}), step 1: no slice changed — {stale}"]
            if x["G"] > 1 and any(close(got, b0 / x["G"] + k * (w - b0)) for k in (1, x["G"])):
                return [f"rank {r}, unit {u} ({x['labels'][u]}), step {s + 1}: every parameter divided by "
                        f"P = {x['G']} besides its update: the division belongs to the gradient (f.shard.grad), "
                        f"not to the parameters (f.shard)"]
            if close(got, (b0 - w) / LR):
                return [f"rank {r}, unit {u} ({x['labels'][u]}), step {s + 1}: the flat buffer holds the averaged "
                        f"GRADIENT, not the new parameters — all-gather f.shard (the slice the optimizer stepped), "
                        f"not f.shard.grad"]
            scales = [(G / P, f"{G}/{P} of the expected: divided by the world's size {P}, not the group's {G} "
                       f"(f.group_size)")] if G != P else []
            scales += [(k, f"{k}× the expected update: the optimizer stepped {k} times — once per unit? step once, "
                        f"after every unit's gradient is reduced") for k in range(2, len(x["N"]) + 1) if k != G]
            where = f" of group {r // G * G}..{r // G * G + G - 1}" if G != P else ""
            return [f"rank {r}{where}, unit {u} ({x['labels'][u]}), step {s + 1}: off by "
                    f"{(got - w).abs().max().item():.2e} — {slice_pattern(got, w, b0, n_[u], G, r % G, scales)}"] + (
                [f"{len(failing)} of {len(want)} units differ on rank {r}"] if len(failing) > 1 else [])
    return []


def _zero_stale(x):
    """Why nothing changed in the first step though the run got that far: the step's own facts (run_zero*)."""
    if x.get("grads_zero"):
        return ("the reduced gradient f.shard.grad is all zeros: the parameters' gradients were cleared (p.grad = "
                "None) before f.pack read them — pack and reduce first, then clear")
    if not x.get("shard_moved", True):
        return ("the optimizer did not move f.shard: it stepped before f.shard.grad was set (reduce-scatter every "
                "unit first, then optimizer.step())")
    if x["stage"] == 2 and x["comm"].get("all_gather", {}).get("calls"):
        return ("f.shard moved, but the all-gather after the step filled the flat buffer with the OLD values: it "
                "gathered something other than f.shard (the slice the optimizer stepped), e.g. buf's own slice")
    return ""


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
        if x["stage"] == 2:
            lines = lines or formula_line(f"rank {r}: all-gathers after the step (8Ψ bytes, one per unit: stage 2)",
                                          (units, 8 * N), (ag["calls"], ag["bytes"]),
                                          "every rank needs every new slice before the next forward")
        else:
            lines = lines or formula_line(f"rank {r}: all-gathers in the step at stage 3 (none: a freed unit is "
                                          f"gathered by its next use)", (0, 0), (ag["calls"], ag["bytes"]))
        if lines:
            return lines
    return []


def judge_zero_memory(P, res):
    for r, x in enumerate(res):
        n = sum(x["n"])
        if x["full_grads"] or x["shard_grads"] not in (0, n):   # (0: the slices' gradients cleared after the step)
            return [f"rank {r}, stage {x['stage']}: after the step, gradients held: whole parameters "
                    f"{x['full_grads']:,} elements (expected 0: set p.grad = None), slices {x['shard_grads']:,} "
                    f"(expected Ψ/P = {n:,}, or 0 if cleared after the step)"]
        if x["stage"] == 3 and x["at_rest"]:
            return [f"rank {r}, stage 3: after the step the flat buffers hold {x['at_rest']:,} bytes, expected 0: a "
                    f"freed unit stays freed until its next use"]
    return []


CHECKS["zero_step"] = [
    Check("after the step only the slices hold gradients: Ψ/P elements, none on the whole parameters (stage 2); at "
          "stage 3 nothing gathered at rest", run_zero2, judge_zero_memory),
    Check("stage 2: equal to one process in float64 after each of 2 SGD steps, on every rank (one FlatParameter per "
          "module)", run_zero2, judge_zero_equal),
    Check("stage 3 (buffers freed between uses): equal to one process after each of 2 steps, nothing gathered at "
          "rest", run_zero3, judge_zero_equal),
    Check("inside a larger mesh: Mesh(dp_replicate=2, dp_shard=2)'s shard groups [0, 1] and [2, 3], each on its own "
          "data, a parameter frozen: equal to one process on that group's data", run_zero_mesh, judge_zero_equal,
          worlds=(4,)),
    Check("per step one reduce-scatter of 8Ψ bytes and one all-gather of 8Ψ per unit after the step, no all-reduce "
          "(ZeRO §7: 2Ψ elements); stage 3: the reduce-scatter alone", run_zero2, judge_zero_bytes, worlds=(2, 4)),
    Check("stage 3's step: the reduce-scatter alone, no all-gather (the next use gathers), 0 bytes at rest", run_zero3,
          judge_zero_bytes, worlds=(2, 4)),
]
_ZERO_GATHER = "        if f.buf.untyped_storage().size():\n            f.all_gather()\n"
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
    Bug("no all-gather after the step", _ZERO_GATHER, "        pass\n",
        r"rank 0, unit 1 \(layers.0\), step 1: .* no slice changed, this rank's own neither: .*the "
        r"all-gather after the step is missing"),
    Bug("always all-gathered, a freed buffer too", _ZERO_GATHER, "        f.all_gather()\n",
        r"RuntimeError: a freed buffer used \(stage 3: f.buf has no bytes between uses\)"),
    Bug("divided by the world's size, not the group's", "f.shard.grad.div_(f.group_size)",
        "f.shard.grad.div_(dist.get_world_size())", r"rank 0 of group 0..1, unit 1 \(layers.0\), step 1: .* every "
        r"slice: 2/4 of the expected: divided by the world's size 4, not the group's 2", 4),
    Bug("the whole parameters' gradients kept", "        for p in f.params:\n            p.grad = None              "
        "                # stages 2-3 keep only the reduced slice\n", "",
        r"rank 0, stage 2: after the step, gradients held: whole parameters [\d,]+ elements \(expected 0: set p.grad "
        r"= None\)"),
    Bug("the optimizer stepped inside the loop, once per unit", "            p.grad = None                              "
        "# stages 2-3 keep only the reduced slice\n    optimizer.step()\n",
        "            p.grad = None\n        optimizer.step()\n",
        r"rank 0, unit \d \(.*\), step 1: .* \d× the expected update: the optimizer stepped \d times — once per unit\?"),
    Bug("a pack of its own, which skips no parameter", "f.reduce_scatter(f.pack(f.shard.dtype))",
        "f.reduce_scatter(torch.cat([p.grad.reshape(-1) for p in f.params]\n            + [f.buf.new_zeros("
        "f.flat_numel - sum(f.numels))]))", r"AttributeError: a parameter without a gradient \(frozen, or unused here\): "
        r"pack zeros for it", 4),
    Bug("this rank's slice of its own gradient, no collective", "f.shard.grad, _ = f.reduce_scatter(f.pack(f.shard.dtype))",
        "g = f.pack(f.shard.dtype)\n        f.shard.grad = g[f.rank * f.shard_numel:(f.rank + 1) * f.shard_numel].clone()",
        r"rank 0: no collective summed the gradients in the step"),
    Bug("the (slice, work) pair assigned as the gradient", "f.shard.grad, _ = f.reduce_scatter(",
        "f.shard.grad = f.reduce_scatter(", r"f.reduce_scatter returns \(my slice, its work\): unpack it", 1),
    Bug("the gradients packed in float32", "f.reduce_scatter(f.pack(f.shard.dtype))", "f.reduce_scatter(f.pack(torch.float32))",
        r"a gradient of another dtype than the shard's: pack in f.shard.dtype", 1),
    Bug("buf's own (old) slice gathered after the step, not f.shard", "            f.all_gather()\n",
        "            n = f.shard_numel\n            all_gather_single(f.buf, f.buf[f.rank * n:(f.rank + 1) * n].clone(), "
        "group=f.group)\n", r"step 1: no slice changed — f.shard moved, but the all-gather after the step filled the flat "
        r"buffer with the OLD values", 1),
    Bug("the optimizer stepped before the reduce-scatter", ("    optimizer.step()\n    for f in flats:\n        if",
        "    for f in flats:\n        f.shard.grad, _"), ("    for f in flats:\n        if",
        "    optimizer.step()\n    for f in flats:\n        f.shard.grad, _"), r"step 1: no slice changed — the optimizer did "
        r"not move f.shard: it stepped before f.shard.grad was set", 1),
]
VARIANTS["zero_step"] = [
    Variant("every reduce-scatter launched, then every one waited for; the gathers likewise", (
        "    for f in flats:\n        f.shard.grad, _ = f.reduce_scatter(f.pack(f.shard.dtype))\n"
        "        f.shard.grad.div_(f.group_size)               # gloo has no ReduceOp.AVG: sum, then divide\n"
        "        for p in f.params:\n            p.grad = None                              # stages 2-3 keep only "
        "the reduced slice\n    optimizer.step()\n" + "    for f in flats:\n" + _ZERO_GATHER),
        "    pending = []\n    for f in flats:\n        g = f.pack(f.shard.dtype)\n        for p in f.params:\n"
        "            p.grad = None\n        pending.append((f, *f.reduce_scatter(g, async_op=True)))\n"
        "    for f, mine, work in pending:\n        work.wait()\n        f.shard.grad = mine / f.group_size\n"
        "    optimizer.step()\n    works = [f.all_gather(async_op=True) for f in flats if "
        "f.buf.untyped_storage().size() > 0]\n    for work in works:\n        work.wait()\n"),
    Variant("the collectives called directly, each gradient divided before it is summed", (
        "    for f in flats:\n        f.shard.grad, _ = f.reduce_scatter(f.pack(f.shard.dtype))\n"
        "        f.shard.grad.div_(f.group_size)               # gloo has no ReduceOp.AVG: sum, then divide\n"
        "        for p in f.params:\n            p.grad = None                              # stages 2-3 keep only "
        "the reduced slice\n    optimizer.step()\n" + "    for f in flats:\n" + _ZERO_GATHER),
        "    for f in flats:\n        g = f.pack(f.shard.dtype).div_(f.group_size)\n"
        "        out = g.new_empty(f.shard_numel)\n        reduce_scatter_single(out, g, group=f.group)\n"
        "        f.shard.grad = out\n        for p in f.params:\n            p.grad = None\n    optimizer.step()\n"
        "    for f in flats:\n        if f.buf.untyped_storage().size() > 0:\n"
        "            all_gather_single(f.buf, f.shard.detach(), group=f.group)\n"),
    Variant("reduce_scatter_tensor and all_gather_into_tensor from dist; the slices' gradients cleared after the step", (
        "        f.shard.grad, _ = f.reduce_scatter(f.pack(f.shard.dtype))\n", "    optimizer.step()\n", _ZERO_GATHER), (
        "        mine = torch.empty(f.shard_numel, dtype=f.shard.dtype)\n        dist.reduce_scatter_tensor(mine, "
        "f.pack(f.shard.dtype), op=dist.ReduceOp.SUM, group=f.group)\n        f.shard.grad = mine\n",
        "    optimizer.step()\n    optimizer.zero_grad(set_to_none=True)\n",
        "        if f.buf.untyped_storage().size() > 0:\n            dist.all_gather_into_tensor(f.buf, f.shard.data, "
        "group=f.group)\n")),
]


# ---- 2. fsdp: gather_when_used (fsdp.py: gather_when_used) -----------------------------------------------------------
# Where the course calls it: the lesson's stage 3 on each unit of a model (section 4's hooks do the same with
# prefetching for real training): a unit whose inputs need no gradient (the token embedding: its full backward hook
# fires as soon as its output's gradient arrives), forwards under no_grad between steps (an evaluation: forward hooks
# run, no backward). Graded on zero_step's stage-3 run with an evaluation forward added:
#   - stage 3 equal to one process in float64 after each of 2 SGD steps, on every rank;
#   - a unit whole only while it runs: one unit gathered at a time in forward and in backward, nothing at rest after
#     the step, nor after an evaluation forward;
#   - per rank and step each unit all-gathered twice, before its forward and before its backward: 2·8Ψ bytes.

def run_gather(P):
    return _zero_train(P, 3)


def judge_gather_bytes(P, res):
    for r, x in enumerate(res):
        N, units = sum(x["N"]), len(x["N"])
        ag = x["comm_all"].get("all_gather", dict(calls=0, bytes=0))
        lines = formula_line(f"rank {r}: all-gathers per step (each unit before its forward and before its backward: "
                             f"2·8Ψ bytes)", (2 * units, 2 * 8 * N), (ag["calls"], ag["bytes"]),
                             "more: a unit gathered again while gathered — hooks on its submodules too "
                             "(module.modules()), or a gather where a free belongs" if ag["calls"] > 2 * units else
                             "fewer: a unit not gathered before its forward or before its backward")
        if lines:
            return lines
    return []


def judge_gather_memory(P, res):
    for r, x in enumerate(res):
        for when in ("forward", "backward"):
            if x[f"peak_{when}"] != 1:
                return [f"rank {r}: in {when}, up to {x[f'peak_{when}']} units held their whole buffer at once; "
                        f"expected 1 (free a unit right after its {when})"]
        if x["at_rest"]:
            return [f"rank {r}: after the step the flat buffers hold {x['at_rest']:,} bytes, expected 0 (free each "
                    f"unit right after its backward)"]
        if x["after_eval"]:
            return [f"rank {r}: after an evaluation's forward (under torch.no_grad, no backward) the flat buffers "
                    f"hold {x['after_eval']:,} bytes, expected 0: free a unit after its forward whatever follows"]
    return []


CHECKS["gather_when_used"] = [
    Check("stage 3 equal to one process in float64 after each of 2 SGD steps, on every rank", run_gather,
          judge_zero_equal),
    Check("a unit whole only while it runs: one unit gathered at a time in forward and in backward, 0 bytes gathered "
          "at rest after the step and after an evaluation's forward", run_gather, judge_gather_memory),
    Check("per step each unit all-gathered twice, before its forward and before its backward: 2·8Ψ bytes (ZeRO §7's "
          "3Ψ with the reduce-scatter)", run_gather, judge_gather_bytes, worlds=(2, 4)),
]
_HOOKS = ("    module.register_forward_pre_hook(gather)\n    module.register_forward_hook(free)\n"
          "    module.register_full_backward_pre_hook(gather)\n    module.register_full_backward_hook(free)\n")
BUGS["gather_when_used"] = [
    Bug("never freed after forward", "    module.register_forward_hook(free)\n", "",
        r"rank 0: in forward, up to 5 units held their whole buffer at once; expected 1", 1),
    Bug("not gathered before backward", "    module.register_full_backward_pre_hook(gather)\n", "",
        r"every rank: RuntimeError: .*"),
    Bug("never freed after backward", "    module.register_full_backward_hook(free)\n", "",
        r"rank 0: in backward, up to [2-5] units held their whole buffer at once; expected 1 \(free a unit right after "
        r"its backward\)"),
    Bug("gathered after the forward, not before", "module.register_forward_pre_hook(gather)",
        "module.register_forward_hook(gather)", r"every rank: RuntimeError: a unit's parameters read while its buffer is "
        r"freed: gather right BEFORE its forward"),
    Bug("all_gather() where unshard() belongs", "        flat.unshard()\n", "        flat.all_gather()\n",
        r"every rank: RuntimeError: all-gathered into a freed buffer: flat.unshard\(\) gives flat.buf its bytes back"),
    Bug("the hooks on every submodule too", _HOOKS, "    for m in module.modules():\n" + _HOOKS.replace(
        "    module.", "        m."), r"all-gathers per step .* expected \(10, .*\), measured \(\d\d+, .* hooks on its "
        r"submodules too"),
    Bug("the storage given its bytes back, nothing gathered", "        flat.unshard()\n",
        "        flat.buf.untyped_storage().resize_(flat.flat_numel * flat.buf.element_size())\n",
        r"rank 0, stage 3: no all-gather in forward, backward or the step", 1),
    Bug("freed by replacing flat.buf", "        flat.free()\n", "        flat.buf = flat.buf.new_empty(0)\n",
        r"flat.buf has no elements: it was replaced by an empty tensor", 1),
    Bug("the old register_backward_hook", "    module.register_full_backward_hook(free)\n",
        "    module.register_backward_hook(free)\n", r"register_backward_hook is the old module hook", 1),
    Bug("buf's own slice gathered into the fresh bytes, not f.shard", "        flat.unshard()\n",
        "        flat.buf.untyped_storage().resize_(flat.flat_numel * flat.buf.element_size())\n        n = "
        "flat.shard_numel\n        all_gather_single(flat.buf, flat.buf[flat.rank * n:(flat.rank + 1) * n].clone(), "
        "group=flat.group)\n", r"RuntimeError: a unit gathered does not hold f.shard in its own slice", 1),
]
VARIANTS["gather_when_used"] = [
    Variant("one loop over (register, action) pairs, lambdas that return None", "    def gather(*_):\n"
            "        flat.unshard()\n\n    def free(*_):\n        flat.free()\n" + _HOOKS,
            "    for register, act in ((module.register_forward_pre_hook, flat.unshard),\n"
            "                          (module.register_forward_hook, flat.free),\n"
            "                          (module.register_full_backward_pre_hook, flat.unshard),\n"
            "                          (module.register_full_backward_hook, flat.free)):\n"
            "        register(lambda *_, act=act: act() and None)   # a hook's return value would replace its input\n"),
    Variant("the backward hooks first; gather only when freed; free by resizing the storage", "    def gather(*_):\n"
            "        flat.unshard()\n\n    def free(*_):\n        flat.free()\n" + _HOOKS,
            "    def gather(*_):\n        if flat.buf.untyped_storage().size() == 0:\n            flat.unshard()\n\n"
            "    def free(*_):\n        flat.buf.untyped_storage().resize_(0)\n"
            "    module.register_full_backward_pre_hook(gather)\n    module.register_full_backward_hook(free)\n"
            "    module.register_forward_pre_hook(gather)\n    module.register_forward_hook(free)\n"),
]


# ---- 3. hsdp: across_replicas (hsdp.py: across_replicas) -------------------------------------------------------------
# Where the course calls it: hsdp.shard_hybrid hands it to fsdp's after_reduce seam, which calls it on every reduced
# gradient shard (in the master's dtype: fp32 under bf16 compute, float64 here) and on the used-flags (int32), in
# place, the sum then divided by S·R — at stage 3 (the lesson's HSDP) and at stages 1-2 (train.py's --zero-stage
# with dp_replicate > 1, over dp_shard_cp); a parameter that only another replica's data reaches gets its gradient
# through the flags. Graded on Mesh(dp_replicate=2, dp_shard=P/2): 2 replicas × 1 shard on 2 ranks, 2 × 2 on 4, the
# tiny float64 model inside a wrapper whose extra parameter only replica 0's loss uses:
#   - per rank: across replicas only the reduced shards and the flags cross, 8Ψ/S + 4k bytes all-reduced over the
#     replicate group, nothing else crosses (first: a missing or misplaced sum is named by where it went — a
#     broadcast or a reduce in its place, another op than the sum, the shards cast to another dtype, the flags summed
#     on a copy);
#   - stage 3 and stage 2 equal to one process after each of 2 SGD steps, on every rank, the extra parameter
#     included (stepped on every replica).

R_EXTRA = 0.1   # replica 0's loss adds R_EXTRA·Σ extra²
HSDP_ERRORS = [(r"can't be cast to the desired output type (Int|Long)", "the used-flags (int32) cannot hold an "
                "average: the replicas' shards and flags are SUMMED (ReduceOp.SUM, the default) — shard_hybrid divides "
                "the gradients by S·R afterwards"),
               (r"(?i)AVG|PREMUL_SUM", "gloo has no average: sum (ReduceOp.SUM, the default) — shard_hybrid divides the "
                "gradients by S·R afterwards")]
_CROSSING = {"reduce": "only its destination gets the sum, and every replica needs it: all-reduce",
             "broadcast": "it copies one replica's gradient over the others', where the replicas' gradients must be "
                          "SUMMED: all-reduce",
             "all_gather": "R copies gathered (R× the memory) where one sum in place is the step: all-reduce t"}


class _ReplicaExtra(torch.nn.Module):
    """The tiny model, and a parameter `extra` that only the ranks of replica 0 use."""

    def __init__(self, uses: bool):
        super().__init__()
        from lab.model import build_model
        self.model, self.uses = build_model("tiny", seed=0, dtype=F64), uses
        self.extra = torch.nn.Parameter(torch.arange(1.0, 5.0, dtype=F64))

    def forward(self, x, y):
        loss = self.model(x, y)
        return loss + R_EXTRA * (self.extra ** 2).sum() if self.uses else loss


def run_hsdp(P):
    import hsdp
    mesh = _mesh(dp_replicate=2, dp_shard=P // 2)
    with explained((r"ProcessGroup' object (has no attribute|is not subscriptable)|unsupported operand.*ProcessGroup",
                    "the function was called on the group: across_replicas returns the function itself (return "
                    "all_reduce_across, without calling it) — the seam calls it on each shard", "across_replicas"),
                   prefix="across_replicas(replicate_group): "):
        returned = callable(hsdp.across_replicas(mesh.group("dp_replicate")))
    out = dict(rep=mesh.ranks("dp_replicate"), shard=mesh.ranks("dp_shard"), S=P // 2, returned=returned)
    for stage in (3, 2):
        model = _ReplicaExtra(uses=mesh.coords["dp_replicate"] == 0)
        opt = hsdp.shard_hybrid(model, mesh, stage=stage, optimizer_cls=SGD, lr=LR)
        states = []
        for s in range(2):
            with Count() as c, explained(*HSDP_ERRORS):
                model(*_batch(s, rank=dist.get_rank(), size=P)).backward()
                opt.step()
            opt.zero_grad()
            if s == 0 and stage == 3:
                out.update(events=[(e["op"], tuple(e["group"]), e["bytes"], e["dtype"]) for e in c.events],
                           reds=[(re.search(r"^all_reduce \((\w+)\)", e.get("line", "")) or [None, None])[1]
                                 for e in c.events],
                           numel=sum(u.flat_numel for u in opt.units), k=sum(len(u.params) for u in opt.units))
            states.append({k.removeprefix("model."): v for k, v in opt.full_state_dict().items()})
        out[stage] = states
    return out


def _extra_after(step):
    """extra after `step` SGD steps: only replica 0's S ranks add 2·R_EXTRA·extra, divided by S·R = 2S."""
    return torch.arange(1.0, 5.0, dtype=F64) * (1 - LR * 2 * R_EXTRA / 2) ** step


def judge_hsdp_equal(P, res, stage=3):
    R = 2
    crossed = [sum(b for op, g, b, _ in x["events"] if g == tuple(x["rep"]) and op == "all_reduce") for x in res]
    for s in range(2):
        def want(r, n):
            return _extra_after(s + 1) if n == "extra" else one_process()[0][s + 1][n]

        def before(r, n):
            return _extra_after(s) if n == "extra" else one_process()[0][s][n]

        def cands(r, n):
            if n == "extra":
                return [("unchanged: not stepped on this replica — the used-flags were not summed across replicas, so "
                         "a parameter only another replica's data reached has no gradient here (the flags, int32, "
                         "take the same road)", before(r, n))]
            never = ("the shards were never summed across the replicas" if not crossed[r] else
                     "the sum crossed the replicas but never reached t: all-reduce t itself, in place (the seam "
                     "ignores a return value)")
            return [(f"this replica's own gradient ÷ {R}: {never}", _replica_alone(P, r)[n])] if s == 0 else []
        lines = compare_named(P, [dict(x=r_[stage][s]) for r_ in res], "x", want,
                              what=f" (stage {stage}, parameter after step {s + 1})", before_of=before,
                              scales=[(1 / R, f"1/{R} of the expected update: divided by R once too often "
                                       f"(shard_hybrid divides the sum by S·R afterwards)"),
                                      (R, f"{R}× the expected update: summed across replicas twice")],
                              candidates_of=cands)
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
        other = sorted({(op, g) for op, g, _, _ in x["events"] if g not in (rep, shard) and len(g) > 1})
        if other:
            op, g = other[0]
            return [f"rank {r}: a {op} over ranks {list(g)}: only the shard group {list(shard)} and the replicate group "
                    f"{list(rep)} may talk (across replicas, the replicate group alone)"]
        got = sum(b for op, g, b, _ in x["events"] if g == rep and op == "all_reduce")
        flags = sum(b for op, g, b, d in x["events"] if g == rep and op == "all_reduce" and d == "int32")
        want = 8 * x["numel"] // x["S"] + 4 * x["k"]
        crossing = [op for op, g, _, _ in x["events"] if g == rep and op != "all_reduce"]
        if crossing:
            how = _CROSSING.get(crossing[0])
            return [f"rank {r}: a {crossing[0]} across replicas" + (f": {how}" if how else ": only the reduced shards "
                                                                    "and the flags cross them")]
        reds = x.get("reds") or [None] * len(x["events"])
        wrong_op = [(red, d) for (op, g, _, d), red in zip(x["events"], reds)
                    if g == rep and op == "all_reduce" and d.startswith("float") and red not in (None, "sum")]
        if wrong_op:
            return [f"rank {r}: an all_reduce ({wrong_op[0][0]}) of {wrong_op[0][1]} gradient shards across replicas: "
                    f"the replicas' gradients ADD up (each saw other data) — ReduceOp.SUM, the default"]
        floats = {d for op, g, _, d in x["events"] if g == rep and op == "all_reduce" and d.startswith("float")}
        grads = sum(b for op, g, b, d in x["events"] if g == rep and op == "all_reduce" and d.startswith("float"))
        shard = 8 * x["numel"] // x["S"]
        why = ("across_replicas returned None: return the function the seam calls (a closure over "
               "replicate_group)" if not x["returned"] else
               "nothing crossed: the shards were not summed across replicas" if got == 0 else
               f"the shards crossed in {sorted(floats - {'float64'})[0]}, not their own float64: sum t itself, in its "
               f"dtype (a cast copy loses precision, and its sum must be copied back)" if floats - {"float64"} else
               f"the used-flags (int32, 4k = {4 * x['k']} bytes) did not cross: they take the same road as the "
               f"shards — sum them too" if got == want - 4 * x["k"] and not flags else
               f"the used-flags crossed as a float copy ({got - shard:,} bytes, not 4k = {4 * x['k']:,} int32): "
               f"all-reduce t itself, in place — the copy's sum never reaches the flags" if not flags
               and grads > shard else
               f"less than the formula: some of the shards or flags the seam was handed were not summed across "
               f"replicas — every call all-reduces its whole t, every step" if got < want else
               f"more than the formula: something crossed twice, or more than t" if got > want else "")
        lines = formula_line(f"rank {r}: all-reduce bytes across replicas {list(rep)} per step (the reduced shards "
                             f"8Ψ/S + the used-flags 4k)", want, got, why)
        if lines:
            return lines
    return []


CHECKS["across_replicas"] = [
    Check("across replicas only the reduced shards and the used-flags: 8Ψ/S + 4k bytes all-reduced over the "
          "replicate group per step, nothing else crosses", run_hsdp, judge_hsdp_bytes, worlds=(2, 4)),
    Check("HSDP at stage 3 equal to one process in float64 after each of 2 SGD steps, on every rank: 2 replicas × 1 "
          "shard (2 ranks), 2 × 2 (4 ranks), a parameter only replica 0 uses", run_hsdp, judge_hsdp_equal,
          worlds=(2, 4)),
    Check("the same at stage 2 (train.py's --zero-stage 2 with dp_replicate > 1)", run_hsdp,
          functools.partial(judge_hsdp_equal, stage=2), worlds=(2, 4)),
]
_ACROSS = "        dist.all_reduce(t, group=replicate_group)\n"
BUGS["across_replicas"] = [
    Bug("forgot the all-reduce", _ACROSS, "        pass\n",
        r"rank 0: all-reduce bytes across replicas .* measured 0 — nothing crossed: the shards were not summed"),
    Bug("all-reduced over the whole world", "dist.all_reduce(t, group=replicate_group)", "dist.all_reduce(t)",
        r"rank 0: a all_reduce over ranks \[0, 1, 2, 3\]: only the shard group \[0, 1\] and the replicate group "
        r"\[0, 2\] may talk", 4),
    Bug("divided inside (shard_hybrid divides afterwards)", _ACROSS, _ACROSS + "        if t.is_floating_point():\n"
        "            t /= dist.get_world_size(replicate_group)\n", r"1/2 of the expected update: divided by R once too "
        r"often"),
    Bug("an all-reduce on some ranks only", _ACROSS, "        if dist.get_rank() < 2:\n    " + _ACROSS,
        r"collectives do not match|rank \d waits at all_reduce .* but rank \d left without it", 4),
    Bug("the used-flags left out", _ACROSS, "        if t.is_floating_point():   # the gradients\n    " + _ACROSS,
        r"rank 0: all-reduce bytes .* the used-flags \(int32, 4k = \d+ bytes\) did not cross"),
    Bug("the sum made on a copy", "    def all_reduce_across(t):\n", "    def all_reduce_across(t):\n"
        "        t = t.clone()\n", r"rank 0, .*: off by .* the sum crossed the replicas but never reached t: all-reduce t "
        r"itself, in place"),
    Bug("the function not returned", "    return all_reduce_across\n", "",
        r"rank 0: all-reduce bytes .* measured 0 — across_replicas returned None: return the function"),
    Bug("the maximum across replicas, not the sum", _ACROSS, "        dist.all_reduce(t, op=dist.ReduceOp.MAX, "
        "group=replicate_group)\n", r"rank 0: an all_reduce \(max\) of float64 gradient shards across replicas: the "
        r"replicas' gradients ADD up"),
    Bug("a reduce to the first replica, never sent back", _ACROSS, "        dist.reduce(t, dst=dist.get_global_rank("
        "replicate_group, 0), group=replicate_group)\n", r"rank 0: a reduce across replicas: only its destination gets "
        r"the sum"),
    Bug("the sum made in float32, copied back", _ACROSS, "        x = t.float() if t.is_floating_point() else t\n"
        "        dist.all_reduce(x, group=replicate_group)\n        t.copy_(x)\n", r"rank 0: all-reduce bytes .* — the "
        r"shards crossed in float32, not their own float64"),
    Bug("the function called on the group, not returned", "    return all_reduce_across\n",
        "    return all_reduce_across(replicate_group)\n",
        r"across_replicas\(replicate_group\): the function was called on the group: across_replicas returns the "
        r"function itself"),
]
VARIANTS["across_replicas"] = [
    Variant("a class whose instances are called", (
            "    def all_reduce_across(t):\n", "    return all_reduce_across\n"), (
            "    class AllReduceAcross:\n        def __call__(self, t):\n"
            "            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=replicate_group)\n\n"
            "    def all_reduce_across(t):\n", "    return AllReduceAcross()\n")),
    Variant("functools.partial of torch's all_reduce", (
            "    def all_reduce_across(t):\n", "    return all_reduce_across\n"), (
            "    import functools\n    return functools.partial(dist.all_reduce, group=replicate_group)\n\n"
            "    def all_reduce_across(t):\n", "")),
    Variant("asynchronous, waited for at once", _ACROSS, "        dist.all_reduce(t, group=replicate_group, "
            "async_op=True).wait()\n"),
]


# ---- 4. tensor parallel: f_and_g (tensor_parallel.py: _all_reduce, F_TP, G_TP) ---------------------------------------
# Where the course calls them: enter_tp and exit_tp, around every column/row pair of apply_tensor_parallel (attention,
# the MLP, the vocab-parallel head), on the tp group — the world in the lesson, a group inside a larger mesh in
# train.py (tp with dp, cp, pp around it); every activation float64 here (bf16 in training: the all-reduce sums in
# the activation's dtype, as Megatron). Graded on the tiny float64 model, one step:
#   - per rank, Megatron's collectives: 2L + 1 all-reduces of B·S·H·b in forward (+3 for the loss), 2L + 1 in
#     backward, each a sum in the activation's dtype (first: a missing or extra sum is named by where it is; an
#     all-gather, another op, a cast copy by what it is);
#   - f and g called directly on the world, in float64 and in bf16 (train.py's dtype): g's forward the sum of the
#     ranks' tensors, f's backward the sum of their gradients, the other two the identity; the dtype kept, bf16
#     within its rounding; neither changes what it is handed (a tensor autograd saved, an incoming gradient);
#   - on 2 and 4 ranks (tp = the world): the loss and every gradient of every rank's slice equal to one process;
#   - inside a larger mesh on 4 ranks: Mesh(dp_shard=2, tp=2)'s tp groups [0, 1] and [2, 3]: only the tp group
#     talks, and the loss and gradients equal to one process. The runs serve pair too.

TP_B, TP_S = 2, 8
TP_ERRORS = [(r"NoneType|returned None|got None", "a (forward, backward) function returned None: return the tensor "
              "(_all_reduce: the summed clone)"),
             (r"shapes cannot be multiplied", "a matmul of the wrong shapes: self.linear(x, self.weight), the weight as "
              "nn.Linear's [out, in] (F.linear transposes it): the column's [F/t, H] rows, the row's [H, F/t] columns"),
             (r"Size does not match at dimension|expected index", "shapes differ after a pair: under sequence parallel "
              "a pair enters from [B, S/t, H] (all-gather) and exits to [B, S/t, H] (reduce-scatter) — each linear "
              "enters and exits as its input_op and sp say"),
             (r"incompatible function arguments", "a collective's argument in the wrong place: dist.all_reduce("
              "tensor, op=ReduceOp.SUM, group=None, async_op=False) — its second positional argument is the op; pass "
              "the group by name, group=group"),
             (r"must match the size of tensor", "shapes differ after a pair: under sequence parallel a pair enters from "
              "[B, S/t, H] (all-gather) and exits to [B, S/t, H] (reduce-scatter) — each linear enters and exits as its "
              "input_op and sp say")]


@functools.cache
def _tp_reference():
    from lab.baseline import single_process
    from lab.model import build_model
    one = single_process(build_model("tiny", seed=0, dtype=F64), [_batch(0, TP_B, TP_S, seed=3)], lr=LR,
                         optimizer=SGD, keep_grads=True)
    return one["losses"][0], one["grads"][0]


@contextlib.contextmanager
def _counted_linears(calls):
    """The pair's swappable matmul (Column/RowParallelLinear.linear, which float8 and zero bubble replace) counted."""
    import tensor_parallel as tp
    olds = {cls: cls.__dict__["linear"] for cls in (tp.ColumnParallelLinear, tp.RowParallelLinear)}

    def counted(inner):
        def linear(x, w, *args, **kwargs):
            calls[0] += 1
            return inner(x, w, *args, **kwargs)
        return staticmethod(linear)
    for cls, old in olds.items():
        cls.linear = counted(old.__func__)
    try:
        yield
    finally:
        for cls, old in olds.items():
            cls.linear = old


@contextlib.contextmanager
def _op_by_name():
    """dist.all_reduce(x, group): the group handed over as the op, said before the watch compares the ranks' ops."""
    inner = dist.all_reduce

    def all_reduce(tensor, op=dist.ReduceOp.SUM, *args, **kwargs):
        if isinstance(op, dist.ProcessGroup):
            raise TypeError("dist.all_reduce(x, group) hands the group over as the op, its second positional argument "
                            "(all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False)): pass it by name, "
                            "group=group")
        return inner(tensor, op, *args, **kwargs)
    dist.all_reduce = all_reduce
    try:
        yield
    finally:
        dist.all_reduce = inner


def _tp(P, sp, group=None):
    import tensor_parallel as tp
    from lab.model import build_model
    x, y = _batch(0, TP_B, TP_S, seed=3)
    model = tp.apply_tensor_parallel(build_model("tiny", seed=0, dtype=F64), group, sequence_parallel=sp)
    pairs, calls = sum(isinstance(m, (tp.ColumnParallelLinear, tp.RowParallelLinear)) for m in model.modules()), [0]
    with explained(*TP_ERRORS), _counted_linears(calls), _op_by_name():
        with Count() as fwd:
            loss = model(x, y)
        with Count() as bwd:
            loss.backward()
    tp.finish_grads(model)
    lost = [n for n, p in model.named_parameters() if p.grad is None]
    if lost:
        raise RuntimeError(f"{lost[0]} (and {len(lost) - 1} more) got no gradient: the backward never reached it — a "
                           f"pair's input or output detached (or made under no_grad) cuts the graph; f, the matmul "
                           f"and g stay on autograd's road")
    ars = [e for e in fwd.events + bwd.events if e["op"] == "all_reduce"]
    return dict(loss=loss.detach(), grads={n: p.grad.detach().clone() for n, p in model.named_parameters()},
                reds=sorted({((re.search(r"^all_reduce \((\w+)\)", e.get("line", "")) or [None, None])[1],
                              e["numel"]) for e in ars}), dtypes=sorted({(e["dtype"], e["numel"]) for e in ars}),
                slices={n: getattr(p, "tp_slice", None) for n, p in model.named_parameters()},
                fwd=fwd.summary(), bwd=bwd.summary(), sp=sp, groups=sorted(set(fwd.groups() + bwd.groups())),
                linears=(pairs, calls[0]))


def run_tp(P):
    return _tp(P, False)


def run_sp(P):
    return _tp(P, True)


def _tp_mesh(P, sp):
    """4 ranks as Mesh(dp_shard=2, tp=2), each tp pair on the same batch."""
    mesh = _mesh(dp_shard=2, tp=2)
    return {sp: dict(_tp(P, sp, mesh.group("tp")), tp=mesh.ranks("tp"))}


def run_tp_mesh(P):
    return _tp_mesh(P, False)


def run_sp_mesh(P):
    return _tp_mesh(P, True)


def judge_tp_equal(P, res, t=None):
    t = t or P
    loss, grads = _tp_reference()
    for r, x in enumerate(res):
        if not close(x["loss"], torch.tensor(loss, dtype=F64)):
            ratio = x["loss"].item() / loss
            return [f"rank {r}: the loss {x['loss'].item():.10f} where one process has {loss:.10f} ({ratio:.4g}×): "
                    f"the forward already differs — a pair's output must be the SUM of the ranks' partial outputs "
                    f"(g's forward), its input the same x on every rank (f's forward: the identity)"]

    def want(r, n):
        sl = res[r]["slices"][n]
        full = grads[n]
        return full if sl is None else full.narrow(sl[0], sl[1], sl[2] - sl[1])
    L = 2 * 2 + 2
    scales = [(float(t) ** k, f"{t ** k}× the expected (= t^{k}, t = tp size {t}: summed over tp {k} time(s) where "
               f"it was whole — a backward that should be the identity all-reduces)") for k in range(1, L + 1)]
    lines = compare_named(P, res, "grads", want, what=" (gradient of this rank's slice)", reverse=True,
                          scales=scales + [(1 / t, f"1/{t} of the expected: a partial gradient never summed over tp")])
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
        others = ("all_gather", "reduce_scatter", "reduce", "broadcast")
        if not sp and any(op in c for c in (x["fwd"], x["bwd"]) for op in others):
            op = next(op for op in others if op in x["fwd"] or op in x["bwd"])
            return [f"rank {r}: a {op} in tensor parallel, where f and g all-reduce: " + {
                "all_gather": "t copies gathered, then summed (t× the memory, (t−1)·n bytes on the wire against the "
                              "all-reduce's 2(t−1)/t·n) — all-reduce a clone in place",
                "reduce_scatter": "a reduce-scatter leaves each rank 1/t of the sum, and every rank needs all of it",
                "reduce": "a reduce leaves the sum on its destination rank alone, and every rank needs all of it",
                "broadcast": "a broadcast copies one rank's tensor to the others; f and g SUM every rank's"}[op]]
        act = TP_B * TP_S * cfg.dim   # f's and g's tensors: [B, S, H] (the loss's all-reduces are smaller: [B·S])
        if [red for red, n in x.get("reds", []) if red != "sum" and n == act]:
            red = next(red for red, n in x["reds"] if red != "sum" and n == act)
            return [f"rank {r}: an all_reduce ({red}) in tensor parallel: f's backward and g's forward SUM the ranks' "
                    f"parts (ReduceOp.SUM, the default)"]
        narrow = [d for d, n in x.get("dtypes", []) if d in ("float32", "float16", "bfloat16") and n == act]
        if narrow:
            return [f"rank {r}: an all-reduce in {narrow[0]} where the activations are float64: sum in the "
                    f"activation's own dtype (a cast copy loses precision, and the result must keep x's dtype)"]
        ops = ("all_gather", "reduce_scatter") if sp else ("all_reduce",)
        for op in ops:
            f, b = x["fwd"].get(op, {}).get("calls", 0), x["bwd"].get(op, {}).get("calls", 0)
            wf, wb = 2 * L + 1 + (3 if op == "all_reduce" else 0), 2 * L + 1
            if (f, b) != (wf, wb):
                loss = ", + the loss 3" if op == "all_reduce" else ""
                why = [("more than g's in forward: f's forward is the identity, every rank holds all of x already"
                        if f > wf else "g's forward missing: a pair's output is the sum of the ranks' partial outputs "
                        "(g exits each pair: exit_tp in the row-parallel linear)" if f < wf else ""),
                       ("more than f's in backward: g's backward is the identity, and a pair is entered once (input_op "
                        "None: its caller entered already)" if b > wb else "f's backward missing: every rank used all "
                        "of x, its gradient is their sum (f enters each pair: enter_tp in the column-parallel linear, "
                        "unless input_op is None)" if b < wb else "")]
                why = " — " + "; ".join(w for w in why if w)
                return [f"rank {r}: {op} calls in forward / backward: expected {wf} / {wb} (Megatron: f and g, 2 per "
                        f"layer + the embedding's g forward, the head's f backward{loss}), measured {f} / {b}{why}"]
        for op, (calls, nbytes) in want.items():
            got = (x["fwd"].get(op, {}).get("calls", 0) + x["bwd"].get(op, {}).get("calls", 0),
                   x["fwd"].get(op, {}).get("bytes", 0) + x["bwd"].get(op, {}).get("bytes", 0))
            if got != (calls, nbytes):
                why = (" — as many as Megatron's, of other sizes: f and g move [B, S, H] activations — f enters "
                       "BEFORE the column-parallel matmul (on its input x), g exits AFTER the row-parallel matmul (on "
                       "its output); one on a [B, S, F/t] slice sits on the wrong side of a matmul"
                       if got[0] == calls else "")
                return [f"rank {r}: {op} per step: expected {calls} calls, {nbytes:,} bytes (4L + 2 of B·S·H·b), "
                        f"measured {got[0]} calls, {got[1]:,} bytes{why}"]
    return []


def judge_tp_mesh(P, res, modes=(False,)):
    for sp in modes:
        per = [x[sp] for x in res]
        name = "sequence parallel" if sp else "tensor parallel"
        for r, x in enumerate(per):
            bad = [list(g) for g in x["groups"] if list(g) != x["tp"]]
            if bad:
                return [f"Mesh(dp_shard=2, tp=2), {name}, rank {r}: collectives over ranks {bad}: tensor parallel's run "
                        f"over the tp group {x['tp']} it is given (the `group` argument), never the world"]
        lines = judge_tp_equal(P, per, t=2)
        if lines:
            return [f"Mesh(dp_shard=2, tp=2), {name}, {lines[0]}"] + lines[1:]
    return []


TP_H, TP_F, BF16_TOL = 8, 16, 3e-2   # the direct checks' sizes; bf16 keeps 8 bits: a few roundings, relative


def _gen(q, *shape):
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(1000 + q))


def run_tp_direct(P):
    """f and g, and one column/row pair, called directly on the world group: on a tensor autograd saved (exp's output)
    and a gradient a hook saw (f and g never change what they are handed), on each rank's own x (g sums the ranks'),
    in float64 and in bfloat16 (train.py's tensor parallel: the dtype kept, the values within bf16's rounding)."""
    import tensor_parallel as tp
    r, world, out = dist.get_rank(), dist.group.WORLD, {}
    with explained(*TP_ERRORS), _op_by_name():
        for name, dt in (("f64", F64), ("bf16", torch.bfloat16)):
            w = _gen(r, 2, 4, TP_H).to(dt).requires_grad_()
            x = w.exp()                                            # exp's backward reads x: a change would show
            kept = x.detach().clone()
            y = tp.exit_tp(x, world, False)                        # g
            g_kept = torch.equal(x.detach(), kept)
            y.backward(_gen(50, 2, 4, TP_H).to(dt))
            v = _gen(r, 2, 4, TP_H).to(dt).requires_grad_()
            seen = {}
            z = tp.enter_tp(v, world, False)                        # f
            z.register_hook(lambda g, seen=seen: seen.update(g=g, before=g.clone()))
            (z * _gen(60 + r, 2, 4, TP_H).to(dt)).sum().backward()
            out[name] = dict(g_kept=g_kept, g_fwd=y.detach().clone(), g_fwd_dtype=str(y.dtype),
                             g_bwd=w.grad.clone(), f_fwd=z.detach().clone(), f_bwd=v.grad.clone(),
                             f_kept=torch.equal(seen["g"], seen["before"]), f_bwd_dtype=str(v.grad.dtype))
            # one column/row pair, each rank its F/t rows of W1 [F, H] and columns of W2 [H, F]
            W1, W2, xin = _gen(70, TP_F, TP_H), _gen(71, TP_H, TP_F), _gen(72, 2, 4, TP_H)
            a, b = r * TP_F // P, (r + 1) * TP_F // P
            col = tp.ColumnParallelLinear(W1.to(dt), world, (a, b), input_op="copy")
            row = tp.RowParallelLinear(W2.to(dt), world, (a, b), sequence_parallel=False)
            xp = xin.to(dt).requires_grad_()
            yp = row(col(xp))
            yp.backward(_gen(73, 2, 4, TP_H).to(dt))
            out[name].update(pair=yp.detach().clone(), pair_dtype=str(yp.dtype), pair_x=xp.grad.clone(),
                             pair_w1=col.weight.grad.clone(), pair_w2=row.weight.grad.clone(), rows=(a, b))
    return out


@functools.cache
def _pair_want():
    W1, W2, xin = (t.clone().requires_grad_() for t in (_gen(70, TP_F, TP_H), _gen(71, TP_H, TP_F), _gen(72, 2, 4, TP_H)))
    y = torch.nn.functional.linear(torch.nn.functional.linear(xin, W1), W2)
    y.backward(_gen(73, 2, 4, TP_H))
    return y.detach(), xin.grad, W1.grad, W2.grad


def _near(got, want, tol):
    """bf16: within tol of want, relative to want's largest element."""
    return tuple(got.shape) == tuple(want.shape) and bool(
        ((got.double() - want.double()).abs() <= tol * max(1.0, want.double().abs().max().item())).all())


def _fg_wants(P, r, dt):
    """What f and g give on rank r: g's forward the sum of every rank's exp(w), its backward the gradient unchanged;
    f's forward the identity, its backward the sum of every rank's gradient."""
    cast = (lambda t: t.to(torch.bfloat16).double()) if dt == "bf16" else (lambda t: t)
    xs = [cast(_gen(q, 2, 4, TP_H)).exp() for q in range(P)]
    return dict(g_fwd=sum(xs), g_bwd=cast(_gen(50, 2, 4, TP_H)) * xs[r], f_fwd=cast(_gen(r, 2, 4, TP_H)),
                f_bwd=sum(cast(_gen(60 + q, 2, 4, TP_H)) for q in range(P)), parts=xs,
                f_parts=[cast(_gen(60 + q, 2, 4, TP_H)) for q in range(P)])


_FG_WHAT = dict(g_fwd="g's forward (the sum of the ranks' partial outputs)",
                g_bwd="g's backward (the identity: every part's gradient is the sum's)",
                f_fwd="f's forward (the identity: every rank holds all of x)",
                f_bwd="f's backward (the sum of the ranks' gradients of x)")


def _fg_pattern(got, want, parts, own):
    P = len(parts)
    for label, cand in ((f"1/{P} of the sum: averaged (ReduceOp.AVG, or a division) — f and g SUM", want / P),
                        ("the elementwise maximum of the ranks' tensors: ReduceOp.MAX — f and g SUM",
                         torch.stack(parts).max(0).values),
                        ("this rank's own tensor, unsummed: the sum never reached what was returned (return the "
                         "all-reduced clone)", own),
                        (f"{P}× the expected: summed where the identity belongs, or twice", want * P)):
        if tuple(got.shape) == tuple(cand.shape) and close(got, cand, 1e-6):
            return label
    return ""


def judge_fg_direct(P, res):
    for dt in ("f64", "bf16"):
        for r, x in enumerate(res):
            d, want = x[dt], _fg_wants(P, r, dt)
            if not d["g_kept"]:
                return [f"rank {r}: g's forward changed the tensor it was handed (here exp's output, which exp's "
                        f"backward reads): all-reduce a clone, never autograd's tensor in place"]
            if not d["f_kept"]:
                return [f"rank {r}: f's backward changed the gradient it was handed (autograd may hand the same "
                        f"gradient to others): all-reduce a clone, never the incoming gradient in place"]
            for key in ("g_fwd", "g_bwd", "f_fwd", "f_bwd"):
                got = d[key]
                if dt == "bf16" and str(got.dtype) != "torch.bfloat16":
                    return [f"rank {r}, bfloat16: {_FG_WHAT[key]} returned {str(got.dtype).replace('torch.', '')} "
                            f"from bfloat16 (train.py runs tensor parallel in bf16): return x's own dtype (Megatron "
                            f"sums in it)"]
                ok = close(got, want[key], 1e-9) if dt == "f64" else _near(got, want[key], BF16_TOL)
                if not ok:
                    parts = want["parts"] if key[0] == "g" else want["f_parts"]
                    own = parts[r] if key in ("g_fwd", "f_bwd") else want[key]
                    why = _fg_pattern(got.double(), want[key], parts, own)
                    off = (got.double() - want[key]).abs().max().item()
                    return [f"rank {r}, {'float64' if dt == 'f64' else 'bfloat16'}: {_FG_WHAT[key]} off by {off:.3g}"
                            + (f" — {why}" if why else "" if dt == "f64" else
                               f" — beyond bf16's rounding ({BF16_TOL:g} of the largest)")]
    return []


def judge_pair_direct(P, res):
    y, gx, g1, g2 = _pair_want()
    for dt in ("f64", "bf16"):
        for r, x in enumerate(res):
            d = x[dt]
            a, b = d["rows"]
            want = dict(pair=y, pair_x=gx, pair_w1=g1[a:b], pair_w2=g2[:, a:b])
            what = dict(pair="the pair's output", pair_x="the input's gradient", pair_w1="the column weight's gradient",
                        pair_w2="the row weight's gradient")
            for key, w in want.items():
                got = d[key]
                if dt == "bf16" and str(got.dtype) != "torch.bfloat16":
                    return [f"rank {r}, bfloat16: {what[key]} in {str(got.dtype).replace('torch.', '')} from bfloat16 "
                            f"weights and input (train.py runs tensor parallel in bf16): keep the dtype"]
                ok = close(got, w, 1e-9) if dt == "f64" else _near(got, w, BF16_TOL)
                if not ok:
                    off = (got.double() - w).abs().max().item()
                    return [f"rank {r}, one column/row pair called directly ({'float64' if dt == 'f64' else 'bfloat16'}"
                            f"): {what[key]} off by {off:.3g} from x @ W1.T @ W2.T" +
                            (f" (bf16 rounds to {BF16_TOL:g} of the largest)" if dt == "bf16" else "")]
    return []


CHECKS["f_and_g"] = [
    Check("Megatron's collectives: 2L + 1 all-reduces of B·S·H·b in forward (+3 for the loss), 2L + 1 in backward",
          run_tp, judge_tp_formula, worlds=(2, 4)),
    Check("f and g called directly, in float64 and in bfloat16 (train.py's): g's forward the sum, f's backward the "
          "sum, the others the identity, the dtype kept, bf16 within its rounding; never changing what they are handed",
          run_tp_direct, judge_fg_direct, worlds=(2, 4)),
    Check("tensor parallel equal to one process in float64: the loss and every gradient of every rank's slice",
          run_tp, judge_tp_equal, worlds=(2, 4)),
    Check("inside a larger mesh: Mesh(dp_shard=2, tp=2)'s tp groups [0, 1] and [2, 3] alone talk, the loss and "
          "gradients equal to one process", run_tp_mesh, judge_tp_mesh, worlds=(4,)),
]
_AR = ("    x = x.clone(memory_format=torch.contiguous_format)  # all_reduce works in place: not on autograd's tensor\n"
       "    dist.all_reduce(x, group=group)\n    return x\n")
BUGS["f_and_g"] = [
    Bug("f and g swapped", "F_TP = (_identity,           _all_reduce)", "F_TP = (_all_reduce, _identity)",
        r"rank 0: all_reduce calls .* measured 13 / 0 — more than g's in forward: f's forward is the identity"),
    Bug("g's backward all-reduces too", "G_TP = (_all_reduce,         _identity)",
        "G_TP = (_all_reduce, _all_reduce)", r"rank 0: all_reduce calls in forward / backward: expected 8 / 5 .*, "
        r"measured 8 / 10 — more than f's in backward: g's backward is the identity"),
    Bug("f's backward is the identity", "F_TP = (_identity,           _all_reduce)",
        "F_TP = (_identity, _identity)", r"rank 0: all_reduce calls in forward / backward: expected 8 / 5 .*, measured "
        r"8 / 0 — f's backward missing"),
    Bug("the all-reduce over the whole world", "    dist.all_reduce(x, group=group)\n    return x\n",
        "    dist.all_reduce(x)\n    return x\n", r"Mesh\(dp_shard=2, tp=2\), tensor parallel, rank 0: collectives "
        r"over ranks \[\[0, 1, 2, 3\]\]: tensor parallel's run over the tp group \[0, 1\]", 4),
    Bug("the all-reduce averages", "    dist.all_reduce(x, group=group)\n    return x\n",
        "    dist.all_reduce(x, group=group)\n    return x / dist.get_world_size(group)\n",
        r"rank 0, float64: g's forward .* off by .* — 1/2 of the sum: averaged .* f and g SUM"),
    Bug("_all_reduce returns nothing", "    dist.all_reduce(x, group=group)\n    return x\n",
        "    dist.all_reduce(x, group=group)\n", r"every rank: \w+: a \(forward, backward\) function returned None"),
    Bug("the sum made in place on autograd's tensor (no clone)", _AR, "    dist.all_reduce(x, group=group)\n    return x\n",
        r"rank 0: g's forward changed the tensor it was handed .* all-reduce a clone"),
    Bug("the maximum, not the sum", _AR, _AR.replace("group=group)", "op=dist.ReduceOp.MAX, group=group)"),
        r"rank 0: an all_reduce \(max\) in tensor parallel: f's backward and g's forward SUM"),
    Bug("bf16 summed in float32 and left there", _AR, "    y = x.float() if x.dtype == torch.bfloat16 else "
        "x.clone(memory_format=torch.contiguous_format)\n    dist.all_reduce(y, group=group)\n    return y\n",
        r"rank 0, bfloat16: g's forward .* returned float32 from bfloat16 .* return x's own dtype"),
    Bug("the group passed positionally, where the op goes", _AR, "    x = x.clone()\n    dist.all_reduce(x, group)\n"
        "    return x\n", r"TypeError: dist.all_reduce\(x, group\) hands the group over as the op"),
    Bug("a reduce to one rank, not an all-reduce", _AR, "    x = x.clone()\n    dist.reduce(x, dst=dist.get_global_rank("
        "group, 0), group=group)\n    return x\n", r"rank 0: a reduce in tensor parallel, where f and g all-reduce: a "
        r"reduce leaves the sum on its destination rank alone"),
]
VARIANTS["f_and_g"] = [
    Variant("the identity as a lambda; the sum into a new contiguous tensor", (
            _AR, "F_TP = (_identity,           _all_reduce)", "G_TP = (_all_reduce,         _identity)"), (
            "    y = torch.empty_like(x, memory_format=torch.contiguous_format).copy_(x)\n"
            "    dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)\n    return y\n",
            "F_TP = (lambda x, group: x, _all_reduce)", "G_TP = (_all_reduce, lambda x, group: x)")),
    Variant("lists, not tuples; the all-reduce asynchronous, waited for at once", (
            _AR, "F_TP = (_identity,           _all_reduce)", "G_TP = (_all_reduce,         _identity)"), (
            "    out = x.contiguous().clone()\n    dist.all_reduce(out, group=group, async_op=True).wait()\n"
            "    return out\n", "F_TP = [_identity, _all_reduce]", "G_TP = [_all_reduce, _identity]")),
    Variant("bf16 summed in float32, cast back to x's dtype", _AR, "    y = x.float() if x.dtype == torch.bfloat16 else "
            "x.clone(memory_format=torch.contiguous_format)\n    dist.all_reduce(y, group=group)\n"
            "    return y.to(x.dtype)\n"),
]


# ---- 4. tensor parallel: pair (tensor_parallel.py: ColumnParallelLinear.forward, RowParallelLinear.forward) ----------
# Where the course calls them: every column/row pair of apply_tensor_parallel — attention's wq, wk, wv (entered once
# for all: input_op None) and wo, the MLP's w1, w3 and w2, the vocab-parallel head (input_op "copy") — with and without
# sequence parallel ("gather", sp), on the tp group (inside a larger mesh in train.py); float8 training and zero
# bubble replace the pair's matmul, self.linear, on a layer. Graded on f_and_g's runs:
#   - per rank, Megatron's collectives, 2L + 1 each way: all-reduces (tensor parallel), all-gathers and
#     reduce-scatters (sequence parallel), each before the equality it explains;
#   - tensor parallel on 1, 2 and 4 ranks and sequence parallel on 2 and 4: the loss and every slice's gradient equal
#     to one process;
#   - inside a larger mesh on 4 ranks (Mesh(dp_shard=2, tp=2)), both modes: only the tp group talks, equal to one
#     process;
#   - one column/row pair called directly in float64 and in bf16 (train.py's dtype): x @ W1.T @ W2.T and the
#     gradients of x and of each rank's weight slices, the dtype kept, bf16 within its rounding;
#   - every matmul through self.linear (the swappable one), one call per linear per forward.
# A detached input (no gradient reaches the earlier layers) and a matmul of the wrong shapes are named where they
# happen.

def judge_linears(P, res):
    for r, x in enumerate(res):
        want, got = x["linears"]
        if got != want:
            return [f"rank {r}: {got} of the {want} parallel linears' matmuls went through self.linear — call "
                    f"self.linear(x, self.weight), not F.linear or x @ W.T: float8 training and zero bubble swap "
                    f"self.linear on a layer"]
    return []


CHECKS["pair"] = [
    Check("Megatron's collectives: 2L + 1 in forward and in backward (TP: all-reduces; SP: all-gathers and "
          "reduce-scatters of the same wire bytes)", run_tp, judge_tp_formula, worlds=(2, 4)),
    Check("tensor parallel equal to one process in float64: the loss and every gradient of every rank's slice",
          run_tp, judge_tp_equal),
    Check("sequence parallel's collectives: 2L + 1 all-gathers and 2L + 1 reduce-scatters each way", run_sp,
          judge_tp_formula, worlds=(2, 4)),
    Check("sequence parallel equal to one process: the loss and every gradient", run_sp, judge_tp_equal,
          worlds=(2, 4)),
    Check("inside a larger mesh: Mesh(dp_shard=2, tp=2)'s tp groups alone talk, tensor parallel equal to one process",
          run_tp_mesh, judge_tp_mesh, worlds=(4,)),
    Check("the same with sequence parallel", run_sp_mesh, functools.partial(judge_tp_mesh, modes=(True,)),
          worlds=(4,)),
    Check("one column/row pair called directly in float64 and in bfloat16 (train.py's): x @ W1.T @ W2.T and its "
          "gradients, the dtype kept, bf16 within its rounding", run_tp_direct, judge_pair_direct, worlds=(2, 4)),
    Check("every matmul through self.linear (float8 and zero bubble swap it): one call per parallel linear", run_tp,
          judge_linears),
]
_COL = ("        if self.input_op is not None:\n            x = enter_tp(x, self.group, sp=self.input_op == \"gather\")\n"
        "        return self.linear(x, self.weight)                              # [B, S, F/t]\n")
_ROW = "        return exit_tp(self.linear(x, self.weight), self.group, self.sp)   # [B, S, H] or [B, S/t, H]\n"
BUGS["pair"] = [
    Bug("the row-parallel linear never sums its partial outputs",
        "return exit_tp(self.linear(x, self.weight), self.group, self.sp)", "return self.linear(x, self.weight)",
        r"rank 0: all_reduce calls .* measured 4 / 5 — g's forward missing: a pair's output is the sum"),
    Bug("the column-parallel linear never enters the pair",
        "        if self.input_op is not None:\n            x = enter_tp(x, self.group, sp=self.input_op == "
        "\"gather\")\n", "", r"rank 0: all_reduce calls in forward / backward: expected 8 / 5 .*, measured \d / \d — "
        r"f's backward missing"),
    Bug("the row-parallel linear ignores sequence parallel", "exit_tp(self.linear(x, self.weight), self.group, "
        "self.sp)", "exit_tp(self.linear(x, self.weight), self.group, False)", r"every rank: RuntimeError: shapes "
        r"differ after a pair: under sequence parallel"),
    Bug("F.linear called directly, not the swappable self.linear", "        return self.linear(x, self.weight)       "
        "                       # [B, S, F/t]\n", "        return F.linear(x, self.weight)\n",
        r"rank 0: \d+ of the \d+ parallel linears' matmuls went through self.linear — call self.linear"),
    Bug("the column-parallel linear always enters, input_op None too",
        "        if self.input_op is not None:\n            x = enter_tp(x, self.group, sp=self.input_op == "
        "\"gather\")\n", "        x = enter_tp(x, self.group, sp=self.input_op == \"gather\")\n",
        r"rank 0: all_reduce calls in forward / backward: expected 8 / 5 .*, measured 8 / \d+ — more than f's in "
        r"backward: .* a pair is entered once"),
    Bug("the row-parallel linear exits over the default group",
        "exit_tp(self.linear(x, self.weight), self.group, self.sp)", "exit_tp(self.linear(x, self.weight), None, "
        "self.sp)", r"Mesh\(dp_shard=2, tp=2\), tensor parallel, rank 0: collectives over ranks \[\[0, 1, 2, 3\]\]", 4),
    Bug("the column-parallel linear never gathers (sequence parallel)", _COL, _COL.replace(
        "sp=self.input_op == \"gather\"", "sp=False"), r"every rank: RuntimeError: shapes differ after a pair: under "
        r"sequence parallel"),
    Bug("the column-parallel linear detaches its input", _COL, _COL.replace("        return self.linear",
        "        x = x.detach()\n        return self.linear"), r"(every rank|rank 0): RuntimeError: .* got no gradient: the backward "
        r"never reached it"),
    Bug("the row-parallel matmul made in float64 (bf16 upcast)", _ROW, "        return exit_tp(self.linear(x.double(), "
        "self.weight.double()), self.group, self.sp)\n", r"rank 0, bfloat16: the pair's output in float64 from bfloat16"),
]
BUGS["pair"].append(Bug(
    "f applied to the column-parallel linear's output, not its input", (_COL,), (
        "        y = self.linear(x, self.weight)\n        if self.input_op is not None:\n"
        "            y = enter_tp(y, self.group, sp=self.input_op == \"gather\")\n        return y\n",),
    r"rank 0: all_reduce per step: .* measured 13 calls, .* — as many as Megatron's, of other sizes: .* f enters BEFORE "
    r"the column-parallel matmul"))
VARIANTS["pair"] = [
    Variant("each input_op its own branch; the partial product named", (_COL, _ROW), (
            "        if self.input_op == \"copy\":\n            x = enter_tp(x, self.group, False)\n"
            "        elif self.input_op == \"gather\":\n            x = enter_tp(x, self.group, True)\n"
            "        y = self.linear(x, self.weight)\n        return y\n",
            "        partial = self.linear(x, self.weight)        # my columns' share of y\n"
            "        return exit_tp(partial, self.group, sp=bool(self.sp))\n")),
    Variant("a conditional expression; keyword arguments", (_COL, _ROW), (
            "        entered = x if self.input_op is None else enter_tp(x, self.group, self.input_op == \"gather\")\n"
            "        return self.linear(entered, self.weight)\n",
            "        return exit_tp(x=self.linear(x, self.weight), group=self.group, sp=self.sp)\n")),
]


# ---- 5. pipeline: one_f_one_b (pipeline.py: one_f_one_b_plain) -------------------------------------------------------
# Where the course calls it: the lesson's core on the pipeline of all ranks, and pipeline_demo's pipelines inside a
# larger mesh (pp with dp: a pipeline's ranks are not consecutive, its peers pipe.prev and pipe.next are global
# ranks); m < p and m ≥ p micro-batches; stages in the model's dtype (float64 here: every received buffer in the
# stage's dtype). It exists for 1F1B's memory: at most min(p−r, m) micro-batches in flight on rank r (no overlap of
# its own). Graded on a 4-layer float64 model cut into p stages, one step of m micro-batches (m = 2 on 1 rank; 1 and 4
# on 2; 2 and 4 on 4), each m on fresh copies of the batch:
#   - each rank's order of F and B 1F1B's; at most min(p−r, m) micro-batches' activations held (per rank) — first:
#     a schedule's mistake is named by its order;
#   - per rank and boundary m activations forward and m gradients back, [B/m, S, H]·b bytes each;
#   - every stage's gradients and the last stage's loss equal to one process, on every rank;
#   - inside a larger mesh on 4 ranks: Mesh(pp=2, dp_shard=2)'s pipelines [0, 2] and [1, 3], each on its own data:
#     equal to one process on that data, every transfer to the rank's neighbours in its own pipeline.
# A received activation that does not require grad (its gradient could never go back, or detached after it was
# received), a transfer to a rank that is not the neighbour, a forward beyond the m micro-batches (a warm-up longer
# than m), a return with micro-batches never backpropagated (no cool-down), micro-batches cut along the sequence and
# a backward without the received gradient are named where they happen; so are a gradient sent on to pipe.next or an
# activation back to pipe.prev, a receive beyond the m micro-batches, and a return with fewer than m sends to a neighbour.

PIPE_MS = {1: (2,), 2: (1, 4), 4: (2, 4)}


@contextlib.contextmanager
def _neighbours_only(pipe, received=None, m=None, outputs=None):
    """Every transfer's peer checked before it is posted: pipe.prev or pipe.next, never another rank (received: a list
    each receive's buffer is appended to); with m, at most m receives from each neighbour (one activation or gradient
    per micro-batch); with outputs (the stage's forward outputs), an activation never sent back nor a received
    activation's gradient forward."""
    # (not dist.isend / irecv: a P2POp accepts only the very functions torch.distributed defines)
    me, names = dist.get_rank(), ("batch_isend_irecv", "send", "recv")
    inner = {n: getattr(dist, n) for n in names}
    taken = collections.Counter()

    def check(kind, peer, tensor=None):
        if peer is None or peer == me or peer not in (pipe.prev, pipe.next):
            raise ValueError(f"rank {me} posts a {kind} {'to' if 'send' in kind else 'from'} rank {peer}, which is not "
                             f"its neighbour in its pipeline {pipe.ranks} (position r = {pipe.r}: prev {pipe.prev}, "
                             f"next {pipe.next}) — pipe.prev and pipe.next are the neighbours' global ranks; r ± 1 is "
                             f"a position, not a rank")
        side = "pipe.prev" if peer == pipe.prev else "pipe.next"
        what = "activation" if side == "pipe.prev" else "gradient"
        if kind == "send" and tensor is not None:
            ptr = tensor.data_ptr()
            if side == "pipe.next" and any(b.grad is not None and b.grad.data_ptr() == ptr for b in received or ()):
                raise ValueError(f"rank {me} (stage {pipe.r}) sends a GRADIENT (the .grad of an activation it received) "
                                 f"to pipe.next, rank {peer}: gradients go back to pipe.prev, activations forward to "
                                 f"pipe.next")
            if side == "pipe.prev" and any(o.data_ptr() == ptr for o in outputs or ()):
                raise ValueError(f"rank {me} (stage {pipe.r}) sends its forward's OUTPUT to pipe.prev, rank {peer}: "
                                 f"activations go forward to pipe.next, gradients back to pipe.prev")
        if kind == "receive" and m is not None:
            taken[side] += 1
            if taken[side] > m:
                raise ValueError(f"rank {me} (stage {pipe.r}) posts receive #{taken[side]} from {side} (rank {peer}) in "
                                 f"a step of m = {m} micro-batches: one {what} comes per micro-batch — a receive too "
                                 f"many (after the last micro-batch's {'forward' if what == 'activation' else 'backward'}"
                                 f", none follows)")

    def batch(ops):
        for op in ops:
            kind = "send" if "send" in getattr(op.op, "__name__", "") else "receive"
            check(kind, getattr(op, "peer", None), op.tensor)
            if kind == "receive" and received is not None:
                received.append(op.tensor)
        return inner["batch_isend_irecv"](ops)

    def single(name):
        def call(tensor, peer=None, *args, **kwargs):
            check("send" if "send" in name else "receive", peer, tensor)
            if "recv" in name and received is not None:
                received.append(tensor)
            return inner[name](tensor, peer, *args, **kwargs)
        return call
    dist.batch_isend_irecv = batch
    for n in names[1:]:
        setattr(dist, n, single(n))
    try:
        yield
    finally:
        for n, f in inner.items():
            setattr(dist, n, f)


def _received_needs_grad(stage, r, received=()):
    """received: the buffers this rank's receives filled (a list _neighbours_only appends to)."""
    def check(mod, args):
        if not stage.is_first and torch.is_grad_enabled() and not args[0].requires_grad:
            copied = any(b.requires_grad and b.data_ptr() == args[0].data_ptr() for b in received)
            raise RuntimeError(f"the activation stage {r} received does not require grad: its gradient could never be "
                               f"sent back — " + ("it was received with requires_grad, then detached before the "
                                                  "stage's forward: hand the stage the received tensor itself, and "
                                                  "keep it (its .grad is what goes back)" if copied else
                                                  "requires_grad_() on a received activation before its forward"))
    stage.register_forward_pre_hook(check)


PIPE_ERRORS = [(r"grad can be implicitly created only for scalar outputs", "a backward without its output's gradient: "
                "a stage before the last backpropagates the gradient it RECEIVES from pipe.next (a receive from "
                "pipe.prev, or none, gave it nothing)"),
               (r"element 0 of tensors does not require grad", "a backward of an output cut from the graph: keep "
                "the stage's output itself for its backward (out, not out.detach()); send a detached copy"),
               (r"^pop from empty list|deque", "a backward with no micro-batch in flight: m forwards, then m backwards "
                "(warm-up min(p−r−1, m), cool-down as many)")]


def _pipe_run(pipe, ms, seed=0):
    from lab.model import get_config
    from pipeline import one_f_one_b_plain
    cfg, out = get_config("tiny", n_layers=4), {}
    for m in ms:
        x, y = _batch(0, B, S, seed=seed)   # fresh for each m: a core may change what it is handed
        stage = _stage(cfg, pipe.r, pipe.p)
        log, shapes, mb_losses, received, outs = [], [], [], [], []

        def fwd_hook(mod, args, output, log=log, m=m):
            i = sum(a == "F" for a, _ in log)
            if i >= m:
                raise RuntimeError(f"rank {dist.get_rank()} (stage {pipe.r} of {pipe.p}): a forward of micro-batch {i}, "
                                   f"but there are only m = {m} — the warm-up is min(p−r−1, m) = "
                                   f"{min(pipe.p - pipe.r - 1, m)} forwards, never more than m")
            log.append(("F", i))
            outs.append(output)
            shapes.append(tuple(args[0].shape[:2]))
            if stage.is_last:
                mb_losses.append(float(output))
            if output.requires_grad:
                output.register_hook(lambda g, i=i: log.append(("B", i)))
        stage.register_forward_hook(fwd_hook)
        _received_needs_grad(stage, pipe.r, received)
        with Count() as c, _neighbours_only(pipe, received, m, outs), explained(*PIPE_ERRORS):
            loss = one_f_one_b_plain(stage, pipe, x, y, m)
        done = sorted(i for a, i in log if a == "B")
        if len(done) < sum(a == "F" for a, _ in log):
            left = [i for a, i in log if a == "F" and i not in done]
            raise RuntimeError(f"rank {dist.get_rank()} (stage {pipe.r} of {pipe.p}), m = {m}: returned with micro-"
                               f"batch(es) {left} forwarded but never backpropagated — the cool-down: after the steady "
                               f"phase, w = min(p−r−1, m) = {min(pipe.p - pipe.r - 1, m)} backwards, each on the "
                               f"gradient received from pipe.next")
        for side, peer, what in (("pipe.prev", pipe.prev, "gradients back"), ("pipe.next", pipe.next,
                                                                               "activations forward")):
            sent = sum(e["op"] == "send" and e["group"][1] == peer for e in c.events)
            if peer is not None and sent < m:
                raise RuntimeError(f"rank {dist.get_rank()} (stage {pipe.r} of {pipe.p}), m = {m}: returned having sent "
                                   f"{sent} of {m} {what} to {side} (rank {peer}) — one per micro-batch: "
                                   + ("each backward's input gradient goes back to pipe.prev, never to pipe.next"
                                      if side == "pipe.prev" else "each forward's output goes on to pipe.next"))
        out[m] = dict(grads=_grads(stage), loss=None if loss is None else float(loss), log=log, shapes=shapes,
                      mb_losses=mb_losses, sent=(c.calls("send"), c.bytes("send")), seed=seed)
    return out


def run_pipe(P):
    from pipeline import PipeGroup
    return _pipe_run(PipeGroup.from_ranks(list(range(P))), PIPE_MS[P])


def run_pipe_mesh(P):
    """4 ranks as Mesh(pp=2, dp_shard=2): pipelines [0, 2] and [1, 3], the pipeline at dp index d on data seed d."""
    from pipeline import PipeGroup
    mesh = _mesh(pp=2, dp_shard=2)
    return _pipe_run(PipeGroup.from_ranks(mesh.ranks("pp")), (2,), seed=mesh.coords["dp_shard"])


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


def judge_pipe_equal(P, res, ms=None, p=None, last=None):
    """ms: the micro-batch counts; p: the pipeline's length; last: the ranks of the last stages."""
    ms, p, last = ms or PIPE_MS[P], p or P, last or [P - 1]
    for m in ms:
        lines = compare_named(P, [x[m] for x in res], "grads",
                              lambda r, n: one_process(res[r][m]["seed"], steps=1, cfg=_pipe_cfg(), m=m)[1][0][n],
                              what=f" (m = {m} micro-batches)",
                              scales=[(m, f"{m}× the expected ({m} = m, the micro-batches): each micro-batch's loss "
                                       f"must be scaled by 1/m"),
                                      (1 / m, f"1/{m} of the expected (1/m): scaled by 1/m twice — the last stage's "
                                       f"loss alone is scaled; an earlier stage's output scaled too divides its "
                                       f"gradients again")] if m > 1 else [])
        if lines:
            return lines
        for r in last:
            want = one_process(res[r][m]["seed"], steps=1, cfg=_pipe_cfg(), m=m)[2][0]
            got = res[r][m]["loss"]
            if got is None or abs(got - want) > 1e-9:
                mine = res[r][m].get("mb_losses") or []
                one = next((j for j, v in enumerate(mine) if got is not None and abs(got - v) < 1e-9), None)
                why = (f" ({got / want:.4g}× = m: return the mean of the micro-batches' losses, not their sum)"
                       if got is not None and m > 1 and abs(got / want - m) < 1e-9 else
                       f" (the loss of micro-batch {one} alone: return the mean of all m micro-batches' losses)"
                       if one is not None and m > 1 else
                       " (None: the last stage returns the mean of the micro-batches' losses)" if got is None else "")
                return [f"rank {r} (the last stage), m = {m}: loss {got} where one process has {want:.10f}{why}"]
    return []


def judge_pipe_mesh(P, res):
    lines = judge_pipe_equal(P, res, ms=(2,), p=2, last=[2, 3])
    return [f"Mesh(pp=2, dp_shard=2), pipelines [0, 2] and [1, 3]: {lines[0]}"] + lines[1:] if lines else []


@functools.cache
def _pipe_cfg():
    from lab.model import get_config
    return get_config("tiny", n_layers=4)


def _order(P, m, r):
    from pipeline import SCHEDULES
    return [f"{a.op}{a.mb}" for a in SCHEDULES["1f1b"](P, m)[r] if a.op in ("F", "B")]


def judge_pipe_order(P, res):
    for m in PIPE_MS[P]:
        first = res[0][m].get("shapes") or []
        if first and any(sh != (B // m, S) for sh in first):
            return [f"rank 0, m = {m}: micro-batches of tokens {first[0]} where 1F1B's are [B/m, S] = "
                    f"{(B // m, S)}: split the batch dimension (dim 0) into m, never the sequence"]
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
    Check("the order of F and B on each rank is 1F1B's: warm-up min(p−r−1, m) forwards, one F one B, cool-down",
          run_pipe, judge_pipe_order),
    Check("activations held: at most min(p−r, m) micro-batches on rank r (1F1B's memory, Narayanan et al. §2.2)",
          run_pipe, judge_pipe_memory, worlds=(2, 4)),
    Check("per boundary m activations forward and m gradients back, each [B/m, S, H]·b bytes", run_pipe,
          judge_pipe_sends, worlds=(2, 4)),
    Check("every stage's gradients, and the last stage's loss, equal one process on the whole batch in float64 (m < p "
          "and m ≥ p)", run_pipe, judge_pipe_equal),
    Check("inside a larger mesh: Mesh(pp=2, dp_shard=2)'s pipelines [0, 2] and [1, 3], each on its own data, equal to "
          "one process on that data; every transfer between neighbours of one pipeline", run_pipe_mesh,
          judge_pipe_mesh, worlds=(4,)),
]
def _between(name, first, last):
    """The reference core's text from the line `first` to the line `last`, both included (text edits of a long part)."""
    text = reference_text(BY_NAME[name])
    start = text.index(first)
    return text[start:text.index(last, start) + len(last)]


_PIPE_TAIL = _between("one_f_one_b", "    w = min(pipe.p - pipe.r - 1, m)\n",
                      "    return torch.stack(losses).mean() if stage.is_last else None\n")
BUGS["one_f_one_b"] = [
    Bug("the micro-batch losses not scaled by 1/m",
        "outputs.append(out / m if stage.is_last else out)", "outputs.append(out)",
        r"rank \d, .*: off by .* 4× the expected \(4 = m, the micro-batches\)"),
    Bug("the newest micro-batch's backward first (LIFO)", "inp, out = inputs.pop(0), outputs.pop(0)",
        "inp, out = inputs.pop(), outputs.pop()", r"rank 0 of 2, m = 4: F0 F1 B1 .* where 1F1B is F0 F1 B0 .* the oldest "
        r"micro-batch first"),
    Bug("the warm-up one forward too long (off by one)", "w = min(pipe.p - pipe.r - 1, m)",
        "w = min(pipe.p - pipe.r, m)", r"rank 0 of 2, m = 4: F0 F1 F2 B0 .* where 1F1B is F0 F1 B0 F2 .* warm-up "
        r"min\(p−r−1, m\) = 1 forward"),
    Bug("sends and receives posted one after the other (a deadlock)",
        "        for work in dist.batch_isend_irecv(ops) if ops else []:\n            work.wait()\n",
        "        for op in ops:\n            for work in dist.batch_isend_irecv([op]):\n                work.wait()\n",
        r"a hang, stopped: deadlock: every rank here waits for a peer that waits elsewhere .* rank 0 waits to send .* rank 1 waits "
        r"to send .* post each send together with the receive it waits for"),
    Bug("a received activation without requires_grad_", "return buf if buf is None else buf.requires_grad_(recv_from "
        "== pipe.prev)", "return buf", r"rank 1: RuntimeError: the activation stage 1 received does not require grad: "
        r"its gradient could never be sent back"),
    Bug("the receive buffer in the default dtype", "buf = None if recv_from is None else torch.empty(shape, "
        "dtype=dtype, device=x.device)", "buf = None if recv_from is None else torch.empty(shape)",
        r"rank 0 sends .* float64 .* but rank 1's receive .* float32 .*: a transfer's two sides must agree"),
    Bug("the neighbours as r ± 1", _PIPE_TAIL, "    prv, nxt = pipe.r - 1 if pipe.r > 0 else None, pipe.r + 1 if pipe.r "
        "< pipe.p - 1 else None\n" + _PIPE_TAIL.replace("pipe.next", "nxt").replace("pipe.prev", "prv"),
        r"rank 0: ValueError: rank 0 posts a send to rank 1, which is not its neighbour in its pipeline \[0, 2\]", 4),
    Bug("the micro-batches' losses summed, not averaged", "return torch.stack(losses).mean() if stage.is_last",
        "return torch.stack(losses).sum() if stage.is_last", r"rank 1 \(the last stage\), m = 4: loss .* \(4× = m: "
        r"return the mean of the micro-batches' losses, not their sum\)"),
    Bug("the warm-up without min(·, m)", "w = min(pipe.p - pipe.r - 1, m)", "w = pipe.p - pipe.r - 1",
        r"rank 0: RuntimeError: rank 0 \(stage 0 of 4\): a forward of micro-batch 2, but there are only m = 2", 4),
    Bug("no cool-down", "    for _ in range(w):                                            # cool-down\n"
        "        p2p(backward(p2p(recv_from=pipe.next)), pipe.prev)\n", "", r"rank 0: RuntimeError: rank 0 \(stage 0 of "
        r"2\), m = 1: returned with micro-batch\(es\) \[0\] forwarded but never backpropagated — the cool-down"),
    Bug("every stage's output scaled by 1/m", "outputs.append(out / m if stage.is_last else out)",
        "outputs.append(out / m)", r"rank 0, .*: off by .* 1/4 of the expected \(1/m\): scaled by 1/m twice"),
    Bug("the gradient sent to the next stage", "inp = p2p(backward(grad), pipe.prev, pipe.prev if more else None)",
        "inp = p2p(backward(grad), pipe.next, pipe.prev if more else None)", r"rank 1 \(stage 1 of 2\), m = 1: returned "
        r"having sent 0 of 1 gradients back to pipe.prev \(rank 0\)"),
    Bug("a receive too many after the last micro-batch", "pipe.prev, pipe.prev if more else None)", "pipe.prev, pipe.prev)",
        r"rank 1 \(stage 1\) posts receive #2 from pipe.prev \(rank 0\) in a step of m = 1 micro-batches: .* a receive too "
        r"many"),
]
VARIANTS["one_f_one_b"] = [
    Variant("warm-up min(p − r, m) − 1, one loop around it; a send and its receive posted in two batches", (
            "        ops = ([dist.P2POp(dist.isend, send, to)] if send is not None and to is not None else []) \\\n"
            "            + ([dist.P2POp(dist.irecv, buf, recv_from)] if buf is not None else [])\n"
            "        for work in dist.batch_isend_irecv(ops) if ops else []:\n            work.wait()\n", _PIPE_TAIL), (
            "        works = []\n        if send is not None and to is not None:\n"
            "            works += dist.batch_isend_irecv([dist.P2POp(dist.isend, send, to)])\n"
            "        if buf is not None:                              # posted before the send is waited for\n"
            "            works += dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, recv_from)])\n"
            "        for work in works:\n            work.wait()\n",
            "    w = min(pipe.p - pipe.r, m) - 1                # forwards before the first backward, less one\n"
            "    inp = xs[0] if stage.is_first else p2p(recv_from=pipe.prev)\n"
            "    for i in range(m):\n        more, steady = i + 1 < m, i >= w\n"
            "        grad = p2p(forward(i, inp), pipe.next, pipe.next if steady else None)\n"
            "        if steady:                                 # the oldest micro-batch's backward\n"
            "            inp = p2p(backward(grad), pipe.prev, pipe.prev if more else None)\n"
            "        elif more:\n            inp = p2p(recv_from=pipe.prev)\n"
            "        if stage.is_first and more:\n            inp = xs[i + 1]\n"
            "    for _ in range(w):                             # cool-down\n"
            "        p2p(backward(p2p(recv_from=pipe.next)), pipe.prev)\n"
            "    return torch.stack(losses).mean() if stage.is_last else None\n")),
    Variant("a deque of micro-batches in flight; a while loop for the warm-up; the loss summed, then divided",
            (_PIPE_TAIL, "    inputs, outputs, losses = [], [], []\n", "        inp, out = inputs.pop(0), outputs.pop(0)"),
            ("    w, i = min(pipe.p - pipe.r - 1, m), 0\n    inp = xs[0] if stage.is_first else p2p(recv_from=pipe.prev)\n"
             "    while i < w:\n        p2p(forward(i, inp), pipe.next)\n        i += 1\n        if i < m:\n"
             "            inp = xs[i] if stage.is_first else p2p(recv_from=pipe.prev)\n"
             "    while i < m:\n        grad = p2p(forward(i, inp), pipe.next, pipe.next)\n        i += 1\n"
             "        inp = p2p(backward(grad), pipe.prev, pipe.prev if i < m else None)\n"
             "        if stage.is_first and i < m:\n            inp = xs[i]\n"
             "    for _ in range(w):\n        p2p(backward(p2p(recv_from=pipe.next)), pipe.prev)\n"
             "    return sum(losses) / m if stage.is_last else None\n",
             "    import collections\n    inputs, outputs, losses = collections.deque(), collections.deque(), []\n",
             "        inp, out = inputs.popleft(), outputs.popleft()")),
    Variant("the transfers by dist.irecv and dist.isend, the receive posted first", (
            "        for work in dist.batch_isend_irecv(ops) if ops else []:\n            work.wait()\n"), (
            "        works = [dist.irecv(buf, recv_from)] if buf is not None else []\n"
            "        if send is not None and to is not None:\n            works.append(dist.isend(send, to))\n"
            "        for work in works:\n            work.wait()\n")),
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
# compared with are built before the call. (Rank-less checks get the exercise's first core only — lab/grader.py's
# pure_outcomes — which is all of merge.)

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
             (torch.sigmoid(bl - l)[..., None] * o + torch.sigmoid(l - bl)[..., None] * bo)),
            ("the running output kept whole, the block's added with its share: out' = out + w_b·out_b — the running "
             "output must shrink to its own share 1 − w_b = sigmoid(lse − lse_b)",
             o + torch.sigmoid(bl - l)[..., None] * bo),
            ("the block's share taken against the NEW lse through a sigmoid: its share is e^(lse_b − lse') = "
             "sigmoid(lse_b − lse), a difference of the two OLD lse's",
             o - torch.sigmoid(bl - torch.logaddexp(l, bl))[..., None] * (o - bo)),
            ("the weighted sum not divided by the weights' sum: out' = (a·out + b·out_b)/(a + b), a = e^(lse−m), "
             "b = e^(lse_b−m)", _unnormalised(o, l, bo, bl)),
            ("the two shares normalised over the query rows (softmax's dim), not over the two blocks: each row's two "
             "shares must add up to 1 — a softmax over the stacked pair along its new dim 0",
             torch.softmax(l, -1)[..., None] * o + torch.softmax(bl, -1)[..., None] * bo)]


def _unnormalised(o, l, bo, bl):
    m = torch.maximum(l, bl)
    return torch.exp(l - m)[..., None] * o + torch.exp(bl - m)[..., None] * bo


def _lse_wrong(l, bl):
    return [("the running lse unchanged", l), ("the block's lse alone", bl),
            ("the larger of the two: lse' = log(e^lse + e^lse_b), not the max", torch.maximum(l, bl)),
            ("lse + lse_b: log of a product, not of a sum", l + bl),
            ("logsigmoid's sign flipped: lse' = lse − logsigmoid(lse − lse_b)",
             l + torch.nn.functional.logsigmoid(l - bl)),
            ("the maximum m subtracted and never added back: lse' = m + log(e^(lse−m) + e^(lse_b−m))",
             torch.logaddexp(l, bl) - torch.maximum(l, bl)),
            ("logsigmoid's argument reversed: lse' = lse − logsigmoid(lse − lse_b), the running lse first (or, "
             "symmetric, lse_b − logsigmoid(lse_b − lse))", l - torch.nn.functional.logsigmoid(bl - l))]


MERGE_ERRORS = [(r"must match the size of tensor", "lse is [B, H, c] and out [B, H, c, D]: a weight per query row "
                 "needs [..., None] to broadcast over D"),
                (r"NoneType", "out and lse are None (merge(None, None, out_b, lse_b)): return the block itself, (out_b, "
                 "lse_b)"),
                (r"Boolean value of Tensor with more than one value is ambiguous", "`if not out` asks a tensor for one "
                 "truth value: test the empty start with `out is None`")]


def _merged(mine, label, *args):
    """mine(*fresh copies of args), its error said with the case."""
    with explained(*MERGE_ERRORS, prefix=f"{label}: "):
        return mine(*(None if a is None else a.clone() for a in args))


def _tol(t):
    return TOL if t.dtype == F64 else 1e-5


def _judge_merge_pairs(mine, cases):
    for label, (o, l, bo, bl), (wo, wl) in cases:
        cands = {"out": _merge_wrong(o, l, bo, bl), "lse": _lse_wrong(l, bl)}   # (before the call)
        got = _merged(mine, label, o, l, bo, bl)
        if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
            return [f"{label}: merge returned {_kinds(got)}: return the pair (out [B, H, c, D], lse [B, H, c])"]
        go, gl = got
        if go.shape == wl.shape and gl.shape == wo.shape:
            return [f"{label}: out came back {tuple(go.shape)} and lse {tuple(gl.shape)}: the two returned the other way "
                    f"round — return (out, lse)"]
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


def _kinds(got):
    if isinstance(got, tuple):
        return "(" + ", ".join(f"a {type(t).__name__}" if not isinstance(t, torch.Tensor) else f"a tensor "
                               f"{tuple(t.shape)}" for t in got) + ")"
    return f"a {type(got).__name__}"


def judge_merge_start(mine, ref):
    (a,), _ = _blocks(1)
    got = _merged(mine, "the empty start", None, None, *a)
    if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
        return [f"the empty start: merge(None, None, out_b, lse_b) returned {_kinds(got)}: return the block itself, "
                f"(out_b, lse_b) — both are needed by the next merge"]
    if not (close(got[0], a[0]) and close(got[1], a[1])):
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
_MERGE_RET = ("    return out - torch.sigmoid(block_lse - lse)[..., None] * (out - block_out), lse - F.logsigmoid(lse - "
              "block_lse)\n")
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
BUGS["merge"] += [
    Bug("the running output not rescaled", _MERGE_RET, "    w = torch.sigmoid(block_lse - lse)[..., None]\n"
        "    return out + w * block_out, lse - F.logsigmoid(lse - block_lse)\n",
        r"two blocks merged: out off by .* the running output kept whole, the block's added with its share", None),
    Bug("the online softmax's maximum never added back to lse", _MERGE_RET,
        "    m = torch.maximum(lse, block_lse)\n    a, b = torch.exp(lse - m), torch.exp(block_lse - m)\n"
        "    return (a[..., None] * out + b[..., None] * block_out) / (a + b)[..., None], torch.log(a + b)\n",
        r"two blocks merged: lse off by .* the maximum m subtracted and never added back", None),
    Bug("(lse, out) returned the other way round", _MERGE_RET, "    return lse - F.logsigmoid(lse - block_lse), out - "
        "torch.sigmoid(block_lse - lse)[..., None] * (out - block_out)\n",
        r"two blocks merged: out came back \(2, 3, 5\) and lse \(2, 3, 5, 4\): the two returned the other way round", None),
]
BUGS["merge"] += [
    Bug("logsigmoid's argument reversed in lse", "lse - F.logsigmoid(lse - block_lse)",
        "lse - F.logsigmoid(block_lse - lse)", r"two blocks merged: lse off by .* logsigmoid's argument reversed", None),
    Bug("the empty start tested by truth value", "    if out is None:\n        return block_out, block_lse\n    return out -",
        "    if not out:\n        return block_out, block_lse\n    return out -",
        r"RuntimeError: two blocks merged: `if not out` asks a tensor for one truth value", None),
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
# Where the course calls it: ContextParallelAttention in every attention block of train.py (cp > 1), over the cp group
# — a group inside the larger mesh — or the ring group of Ulysses + ring; layouts contiguous and zigzag (train.py's),
# causal or not, GQA (fewer kv heads); bf16 inputs in training: the merges in fp32 at least, the k, v block travelling
# in its own dtype, out and lse saved in the work dtype for the lesson's backward, the output in q's dtype. It exists
# for overlap: the next block travels while the current one is computed. Graded on a seeded sequence (B=1, S=16, 4
# heads, 2 kv heads):
#   - per rank, forward sends (cp−1)·2 blocks of B·c·d_kv·b bytes (float64 and bf16: b = 2, the block in its own
#     dtype) — first: a block not passed, or passed once too often, is named by its count;
#   - float64, contiguous and causal, zigzag and causal, zigzag and not causal, on 1, 2 and 4 ranks: the output, and
#     dq, dk, dv from the lesson's backward, equal to whole-sequence SDPA on every rank;
#   - overlap, judged by what is in flight: in every step that computes, a block_forward runs while the next block's
#     transfer is posted and not yet waited for (the watch's transfers, however they are posted);
#   - bf16 inputs (a run of their own): the block's bytes in bf16, the output in bf16, out and lse saved in float32
#     (what the backward computes in), the output equal to SDPA within bf16's rounding;
#   - inside a larger mesh on 4 ranks: Mesh(dp_shard=2, cp=2)'s cp groups [0, 1] and [2, 3], contiguous and causal:
#     equal to SDPA on the group's sequence, every transfer inside the cp group.

RING_CASES = [("contiguous", True), ("zigzag", True), ("zigzag", False)]
RING_SHAPE = dict(B=1, S=16, H=4, Hkv=2, D=8)
BF16 = ("zigzag", True, "bf16")


def _pending_transfers() -> int:
    """The transfers this rank has posted and not yet waited for, as the collective watch holds them (it sees every
    transfer, batched or not)."""
    return watch.pending_transfers()


@contextlib.contextmanager
def _in_flight(log, fn):
    """log gets ("send",) for each send the watch sees posted, however it is posted, and ("compute", k) for each
    block_forward that the function fn calls, k the transfers in flight (posted, not yet waited for) meanwhile."""
    where = fn.__globals__
    block_forward = where["block_forward"]

    def counted(*args, **kwargs):
        log.append(("compute", _pending_transfers()))
        return block_forward(*args, **kwargs)
    watch.set_probe(lambda e: log.append(("send",)) if e["op"] == "send" else None)
    where["block_forward"] = counted
    try:
        yield
    finally:
        watch.set_probe(None)
        where["block_forward"] = block_forward


def _skipped_steps(P, group, layout, causal, sends):
    """A forward whose sends are exactly the passes of its steps with a pair to compute skipped the others: said as
    the ring steps, at once (the next rank would wait for those blocks in vain)."""
    from ring_attention import ring_schedule
    plan = ring_schedule(P, dist.get_rank(group), layout, causal)[:-1]   # (the last step passes nothing)
    empty = [t for t, _, pairs in plan if not pairs]
    if empty and sends != 2 * len(plan) and sends == 2 * (len(plan) - len(empty)):
        raise RuntimeError(f"forward ({layout}, {'causal' if causal else 'not causal'}): ring step(s) {empty} passed "
                           f"nothing on — this rank has no pair to compute there (every key of the block in hand comes "
                           f"after its queries), but the next rank still needs the block: pass the block in hand at "
                           f"every step but the last, computed or not")


RING_ERRORS = [(r"expected Tensor as element \d+ in argument 0, but got NoneType", "a query chunk's (out, lse) is still "
                "None after the ring: no pair ever computed it — take the pairs from ring_schedule(cp, rank, layout, "
                "causal) with this call's layout and rank, and fold every pair into its query chunk i"),
               (r"unsupported operand type\(s\) for .*'NoneType'", "merge(out, lse, block_out, block_lse) takes the "
                "running (out, lse) first, the block's second: called the other way, the empty start (None) arrives as "
                "the block", "merge"),
               (r"expected (m1 and m2|both vectors|mat1 and mat2) to have the same dtype|expected scalar type", "q in "
                "the work dtype met a block's k or v in its own dtype: cast what arrives to the work dtype before "
                "block_forward (kb.to(work_dtype)) — the block travels in its own dtype, is computed in the work dtype")]


def _ring_case(P, r, group, layout, causal, dtype=F64):
    from lab.ring_attention_demo import seeded_inputs
    from ring_attention import RingAttention, shard_sequence
    sh, log = RING_SHAPE, []
    q, k, v, dout = (shard_sequence(t, P, r, layout, dim=2).to(dtype).requires_grad_(i < 3) for i, t in
                     enumerate(seeded_inputs(sh["B"], sh["S"], sh["H"], sh["Hkv"], sh["D"], F64, 0)))
    before = len(watch.unwaited())
    try:
        with Count() as c, _in_flight(log, RingAttention.forward), explained(
                *RING_ERRORS, prefix=f"forward ({layout}, {'causal' if causal else 'not causal'}): "):
            o = RingAttention.apply(q, k, v, group, layout, causal)
    except Exception:
        if len(watch.unwaited()) > before:   # a pass posted, then the error: its peer's transfers would block the next
            watch.mark_unusable("a forward raised with transfers posted and never waited: the next job gets a fresh "
                                "group")
        raise
    _skipped_steps(P, group, layout, causal, c.calls("send"))
    never = watch.unwaited()
    if len(never) > before:   # the backward's own transfers would block on them: say it now
        watch.mark_unusable("transfers posted and never waited: the next job gets a fresh group")
        raise RuntimeError(f"forward ({layout}, {'causal' if causal else 'not causal'}) returned with "
                           f"{len(never) - before} transfer(s) posted and never waited ({never[-1]['what']}): take a "
                           f"block only from the pass's wait() (nxt.wait()), which completes its transfers")
    if o.shape != q.shape:
        raise RuntimeError(f"forward returned out of shape {tuple(o.shape)} where q's {tuple(q.shape)} [B, H, c, D] is "
                           f"expected: the query chunks' outputs are concatenated along the sequence (dim 2)")
    saved = [str(t.dtype) for t in o.grad_fn.saved_tensors]
    with explained((r"expected (m1 and m2|both vectors|mat1 and mat2) to have the same dtype|expected scalar type",
                    f"saved for backward {saved}: the lesson's backward computes in the dtype of the out saved — save "
                    f"out and lse in the work dtype (promote_types(q.dtype, float32))"), prefix="backward: "):
        o.backward(dout)
    return dict(out=o.detach(), dq=q.grad, dk=k.grad, dv=v.grad, sends=(c.calls("send"), c.bytes("send")),
                peers=sorted({e["group"][1] for e in c.events if e["op"] in ("send", "recv")}), log=log,
                saved=saved, dtype=str(o.dtype))


def run_ring(P):
    """Each case: this rank's shard of the seeded q, k, v through RingAttention, forward and backward."""
    r, world = dist.get_rank(), dist.group.WORLD
    return {(layout, causal): _ring_case(P, r, world, layout, causal) for layout, causal in RING_CASES}


def run_ring_bf16(P):
    return {BF16: _ring_case(P, dist.get_rank(), dist.group.WORLD, BF16[0], BF16[1], torch.bfloat16)}


def run_ring_mesh(P):
    """4 ranks as Mesh(dp_shard=2, cp=2): each cp pair holds the seeded sequence, contiguous and causal."""
    mesh = _mesh(dp_shard=2, cp=2)
    res = _ring_case(2, mesh.rank("cp"), mesh.group("cp"), "contiguous", True)
    return {("contiguous", True): res, "cp": mesh.ranks("cp"), "cp_rank": mesh.rank("cp")}


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


RING_TWISTS = {
    "mask": "every pair computed with the causal mask (block_forward(..., causal)): only a diagonal pair needs it — "
            "the schedule's third element says which",
    "chunk": "query chunk i against key chunk i of the block in hand: the pair (i, j, diagonal) names key chunk j",
    "reverse": "the blocks travel the wrong way round the ring: send to the next rank (r+1) mod cp and receive from "
               "the previous (r−1) mod cp, so that at step t the block of rank (r−t) mod cp is in hand",
    "own": "this rank's own k, v passed on at every step, not the block in hand: from step 1 on it always holds its "
           "neighbour's block",
    "v": "k travels round the ring but v does not: every step's v is still this rank's own (take both from what "
         "arrived)",
    "scale": "the scores scaled by √D: the scale is D^−1/2",
}


@functools.cache
def _ring_twisted(P, layout, causal):
    """{twist: [each rank's out]}: what the ring gives with one typical mistake (RING_TWISTS), simulated in one
    process with the lesson's own schedule, block_forward and merge."""
    from lab.ring_attention_demo import seeded_inputs
    from ring_attention import block_forward, chunk_ids, merge, ring_schedule, shard_sequence
    sh = RING_SHAPE
    q, k, v, _ = seeded_inputs(sh["B"], sh["S"], sh["H"], sh["Hkv"], sh["D"], F64, 0)
    qs_, ks_, vs_ = ([shard_sequence(t, P, r, layout, dim=2) for r in range(P)] for t in (q, k, v))
    n, out = len(chunk_ids(layout, P, 0)), {}
    for how in RING_TWISTS:
        scale = sh["D"] ** (0.5 if how == "scale" else -0.5)
        outs_r = []
        for r in range(P):
            qc, outs, lses = qs_[r].chunk(n, dim=2), [None] * n, [None] * n
            for t, src, pairs in ring_schedule(P, r, layout, causal):
                held = (r + t) % P if how == "reverse" else (r - 1) % P if how == "own" and t else src
                kc, vc = ks_[held].chunk(n, dim=2), vs_[r if how == "v" else held].chunk(n, dim=2)
                for i, j, diagonal in pairs:
                    jj, d = (i if how == "chunk" else j), (causal if how == "mask" else diagonal)
                    outs[i], lses[i] = merge(outs[i], lses[i], *block_forward(qc[i], kc[jj], vc[jj], scale, d))
            outs_r.append(torch.cat(outs, dim=2))
        out[how] = outs_r
    return out


def _judge_ring(P, res, names, cases=RING_CASES, ring=None, rank_of=None, label=""):
    """ring: the ring's size (P unless it is a group inside the world); rank_of(r): rank r's place in its ring."""
    ring, rank_of = ring or P, rank_of or (lambda r: r)
    for layout, causal in cases:
        want = _ring_reference(ring, layout, causal)

        def cands(r, n):
            if n != "out":
                return []
            twisted = _ring_twisted(ring, layout, causal)
            mine = [(why, twisted[how][rank_of(r)]) for how, why in RING_TWISTS.items()]
            if layout != "contiguous" or ring == 1:
                return mine
            return mine + [("this rank's queries against its own keys only: the other ranks' blocks were never folded in (the "
                     "ring stops short)", _ring_alone(ring, rank_of(r), causal))] + (
                [("its own block seen without the causal mask: a query reads the keys after it (a diagonal pair needs "
                  "the mask: block_forward(..., diagonal))", _ring_alone(ring, rank_of(r), False))]
                if causal and rank_of(r) == 0 else [])
        lines = compare_named(P, [{"t": {n: x[(layout, causal)][n] for n in names}} for x in res], "t",
                              lambda r, n: want[rank_of(r)][n], what=f" ({layout}, {'causal' if causal else 'not causal'})",
                              candidates_of=cands)
        if lines:
            return [label + lines[0]] + lines[1:]
    return []


def judge_ring_forward(P, res):
    return _judge_ring(P, res, ("out",))


def judge_ring_backward(P, res):
    lines = _judge_ring(P, res, ("dq", "dk", "dv"))
    return lines + ["(the output is right: the lesson's backward works from what forward saved — q, k, v, out and lse "
                    "over all the keys, in the work dtype)"] if lines else []


def judge_ring_bytes(P, res):
    c = RING_SHAPE["S"] // P
    for case in [k for k in RING_CASES + [BF16] if k in res[0]]:
        b = 2 if case == BF16 else 8
        block = RING_SHAPE["B"] * c * RING_SHAPE["Hkv"] * RING_SHAPE["D"] * b
        for r, x in enumerate(res):
            got = x[case]["sends"]
            want = (2 * (P - 1), 2 * (P - 1) * block)
            why = ("one pass too many: the last step needs no next block" if got[0] > want[0] else
                   "k and v must travel all the way round the ring" if got[0] < want[0] else
                   f"{got[1] // max(1, got[0]) // (block // b)}-byte elements: the block travels in its own dtype "
                   f"({'bfloat16' if b == 2 else 'float64'}), cast only when computed" if got[1] != want[1] else "")
            lines = formula_line(f"rank {r} ({case[0]}{', bf16' if case == BF16 else ''}): sends in forward "
                                 f"((cp−1)·2 blocks k, v of B·c·d_kv·b = {block:,} bytes)", want, got, why)
            if lines:
                return lines
    return []


def judge_ring_overlap(P, res):
    """After each send, the blocks computed before the next one (if any: a causal contiguous rank 0 has empty steps)
    must include one computed while a transfer is in flight."""
    for case in RING_CASES:
        for r, x in enumerate(res):
            steps, sends = [], 0
            for e in x[case]["log"]:
                if e[0] == "send":
                    sends += 1
                    steps.append((sends, []))
                elif steps:
                    steps[-1][1].append(e[1])
            for i, flying in steps:
                if flying and not any(flying):
                    return [f"rank {r} ({case[0]}, {'causal' if case[1] else 'not causal'}): the blocks computed after "
                            f"send #{i} was posted saw no transfer in flight — it was waited for before them: post the "
                            f"next block's transfer (RingPass) before the current block's block_forward, and wait for it "
                            f"after, so that it travels while the block is computed"]
    return []


def judge_ring_bf16(P, res):
    want = _ring_reference(P, BF16[0], BF16[1])
    for r, x in enumerate(res):
        y = x[BF16]
        if y["dtype"] != "torch.bfloat16":
            return [f"rank {r}: the output in {y['dtype']} for bfloat16 inputs: return out in q's dtype"]
        if len(y["saved"]) < 5 or y["saved"][3:5] != ["torch.float32", "torch.float32"]:
            return [f"rank {r}: saved for backward {y['saved']}: out and lse must be saved in the work dtype (float32 "
                    f"for bfloat16 inputs: promote_types(q.dtype, float32)) — the lesson's backward computes in the "
                    f"dtype of the out it saved"]
        if not close(y["out"].double(), want[r]["out"], 2e-2):
            return [f"rank {r} (bf16, zigzag, causal): out off by "
                    f"{(y['out'].double() - want[r]['out']).abs().max().item():.2e} — "
                    f"{pattern(y['out'].double(), want[r]['out'])}"]
    return []


def judge_ring_mesh(P, res):
    for r, x in enumerate(res):
        bad = [q for q in x[("contiguous", True)]["peers"] if q not in x["cp"]]
        if bad:
            return [f"Mesh(dp_shard=2, cp=2), rank {r}: transfers with rank(s) {bad}, outside its cp group {x['cp']}: the "
                    f"ring runs over the group it is given (dist.get_rank(group), dist.get_global_rank(group, ...))"]
    lines = _judge_ring(P, res, ("out", "dq", "dk", "dv"), cases=[("contiguous", True)], ring=2,
                        rank_of=lambda r: res[r]["cp_rank"], label="Mesh(dp_shard=2, cp=2), ")
    if lines:   # which ranks: those whose place in the group is not their rank in the world?
        want = _ring_reference(2, "contiguous", True)
        wrong = [r for r, x in enumerate(res) if not close(x[("contiguous", True)]["out"], want[x["cp_rank"]]["out"])]
        moved = [r for r, x in enumerate(res) if x["cp_rank"] != r]
        if wrong == moved:
            return [f"Mesh(dp_shard=2, cp=2): the output is wrong on ranks {wrong} alone, the ranks whose place in their "
                    f"cp group is not their rank in the world: the ring's rank is dist.get_rank(group)"] + lines
    return lines


CHECKS["ring"] = [
    Check("forward passes each k, v block cp−1 times: (cp−1)·2 sends of B·c·d_kv·b bytes per rank", run_ring,
          judge_ring_bytes, worlds=(2, 4)),
    Check("ring attention's output equals whole-sequence attention (SDPA) in float64 on every rank: contiguous and "
          "zigzag, causal and not, GQA", run_ring, judge_ring_forward),
    Check("the lesson's backward, from what your forward saved (out, lse), gives SDPA's dq, dk, dv", run_ring,
          judge_ring_backward),
    Check("overlap: the next block in flight while a block is computed (its transfer posted before a block_forward, "
          "waited for after)", run_ring, judge_ring_overlap, worlds=(2, 4)),
    Check("bf16 inputs: the block travels in bf16 (B·c·d_kv·2 bytes a send)", run_ring_bf16, judge_ring_bytes,
          worlds=(2, 4)),
    Check("bf16 inputs: the output in bf16, out and lse saved in float32 for the backward, equal to SDPA within bf16's "
          "rounding", run_ring_bf16, judge_ring_bf16),
    Check("inside a larger mesh: Mesh(dp_shard=2, cp=2)'s cp groups [0, 1] and [2, 3], every transfer inside the group, "
          "output and gradients equal to SDPA", run_ring_mesh, judge_ring_mesh, worlds=(4,)),
]
_RING_NEXT = ("            nxt = RingPass([kb, vb], group) if t < cp - 1 else None      # the next block moves while we "
              "compute\n")
_RING_TAKE = ("*block_forward(qs[i], ks[j], vs[j], scale, diagonal))\n            if nxt is not None:\n"
              "                kb, vb = nxt.wait()\n")
BUGS["ring"] = [
    Bug("the blocks never passed on", "nxt = RingPass([kb, vb], group) if t < cp - 1 else None      # the next",
        "nxt = None      # the next", r"rank 0 \(contiguous\): sends in forward .* expected \(2, 2048\), measured "
        r"\(0, 0\) — k and v must travel all the way round the ring"),
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
    Bug("the next block waited for before the current one is computed", (_RING_NEXT, _RING_TAKE), (
        _RING_NEXT + "            arrived = nxt.wait() if nxt is not None else None\n",
        "*block_forward(qs[i], ks[j], vs[j], scale, diagonal))\n            if nxt is not None:\n"
        "                kb, vb = arrived\n"), r"rank 0 \(contiguous, causal\): the blocks computed after send #\d was "
        r"posted saw no transfer in flight — it was waited for before them"),
    Bug("computed in q's dtype (bf16), not at least fp32", "work_dtype, scale = torch.promote_types(q.dtype, "
        "torch.float32), q.shape[-1] ** -0.5", "work_dtype, scale = q.dtype, q.shape[-1] ** -0.5",
        r"rank 0: saved for backward .*torch.bfloat16.*: out and lse must be saved in the work dtype"),
    Bug("the rank in the world, not in the group", "cp, rank = dist.get_world_size(group), dist.get_rank(group)",
        "cp, rank = dist.get_world_size(group), dist.get_rank()", r"Mesh\(dp_shard=2, cp=2\): the output is wrong on "
        r"ranks \[2, 3\] alone, the ranks whose place in their cp group is not their rank in the world", 4),
    Bug("the empty steps skipped (a causal rank with no pair to compute passes nothing on)",
        "for t, src, pairs in ring_schedule(cp, rank, layout, causal):\n" + _RING_NEXT,
        "for t, src, pairs in ring_schedule(cp, rank, layout, causal):\n            if not pairs:\n"
        "                continue\n" + _RING_NEXT, r"rank 0: RuntimeError: forward \(contiguous, causal\): ring step\(s\) "
        r"\[1, 2\] passed nothing on — this rank has no pair to compute there", 4),
    Bug("the block cast to the work dtype before it travels", _RING_NEXT,
        _RING_NEXT.replace("[kb, vb]", "[kb.to(work_dtype), vb.to(work_dtype)]"),
        r"rank 0 \(zigzag, bf16\): sends in forward .* 4-byte elements: the block travels in its own dtype"),
]
_RING_END = "scale, diagonal))\n            if nxt is not None:\n                kb, vb = nxt.wait()\n        out, lse = torch.cat"
BUGS["ring"] += [
    Bug("v never taken from what arrived", _RING_END, _RING_END.replace("kb, vb = nxt.wait()", "kb, _ = nxt.wait()"),
        r"rank 1, out \(contiguous, causal\): off by .* k travels round the ring but v does not"),
    Bug("the arrived buffers taken without waiting", _RING_END, _RING_END.replace("nxt.wait()", "nxt.bufs"),
        r"rank 0: RuntimeError: forward \(contiguous, causal\) returned with \d+ transfer\(s\) posted and never waited"),
]
_RING_LOOP = (_RING_NEXT + "            ks, vs = kb.to(work_dtype).chunk(n, dim=2), vb.to(work_dtype).chunk(n, dim=2)\n"
              "            for i, j, diagonal in pairs:\n                outs[i], lses[i] = merge(outs[i], lses[i], "
              + _RING_TAKE)
BUGS["ring"].append(Bug(
    "the ring turned the wrong way (send to the previous rank, receive from the next)", _RING_LOOP,
    "            works = []\n            if t < cp - 1:\n                bufs = [torch.empty_like(kb), torch.empty_like(vb)]\n"
    "                to, frm = dist.get_global_rank(group, (rank - 1) % cp), dist.get_global_rank(group, (rank + 1) % cp)\n"
    "                works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x.contiguous(), to, group) for x in (kb, vb)]\n"
    "                                               + [dist.P2POp(dist.irecv, b, frm, group) for b in bufs])\n"
    "            ks, vs = kb.to(work_dtype).chunk(n, dim=2), vb.to(work_dtype).chunk(n, dim=2)\n"
    "            for i, j, diagonal in pairs:\n"
    "                outs[i], lses[i] = merge(outs[i], lses[i], *block_forward(qs[i], ks[j], vs[j], scale, diagonal))\n"
    "            for w in works:\n                w.wait()\n            if works:\n                kb, vb = bufs\n",
    r"rank 1, out \(contiguous, causal\): off by .* the blocks travel the wrong way round the ring", 4))
BUGS["ring"] += [
    Bug("merge called with the block first", "merge(outs[i], lses[i], *block_forward(qs[i], ks[j], vs[j], scale, "
        "diagonal))", "merge(*block_forward(qs[i], ks[j], vs[j], scale, diagonal), outs[i], lses[i])",
        r"(rank 0|every rank): TypeError: forward \(contiguous, causal\): merge\(out, lse, block_out, block_lse\) takes "
        r"the running \(out, lse\) first"),
    Bug("the arrived block not cast to the work dtype (bf16 against float32)", _RING_LOOP,
        _RING_LOOP.replace("ks, vs = kb.to(work_dtype).chunk(n, dim=2), vb.to(work_dtype).chunk(n, dim=2)",
                           "ks, vs = kb.chunk(n, dim=2), vb.chunk(n, dim=2)"),
        r"(rank 0|every rank): RuntimeError: forward \(zigzag, causal\): q in the work dtype met a block's k or v in its "
        r"own dtype"),
]
VARIANTS["ring"] = [
    Variant("the transfers posted by hand (batch_isend_irecv into fresh buffers), the chunks sliced per pair",
            _RING_LOOP,
            "            works = None\n            if t < cp - 1:                       # post the next block first\n"
            "                to = dist.get_global_rank(group, (rank + 1) % cp)\n"
            "                frm = dist.get_global_rank(group, (rank - 1) % cp)\n"
            "                sent = [kb.contiguous(), vb.contiguous()]\n"
            "                bufs = [torch.empty_like(x) for x in sent]\n"
            "                works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, to, group) for x in sent]\n"
            "                                               + [dist.P2POp(dist.irecv, x, frm, group) for x in bufs])\n"
            "            for i, j, diagonal in pairs:\n"
            "                kj = kb.to(work_dtype).chunk(n, dim=2)[j]\n"
            "                vj = vb.to(work_dtype).chunk(n, dim=2)[j]\n"
            "                outs[i], lses[i] = merge(outs[i], lses[i], *block_forward(qs[i], kj, vj, scale, diagonal))\n"
            "            if works is not None:\n                for w in works:\n                    w.wait()\n"
            "                kb, vb = bufs\n"),
    Variant("dist.isend and dist.irecv one tensor at a time, the receives posted first", _RING_LOOP,
            "            works = []\n            if t < cp - 1:\n"
            "                bufs = [torch.empty_like(kb), torch.empty_like(vb)]\n"
            "                works = [dist.irecv(b, dist.get_global_rank(group, (rank - 1) % cp), group) for b in bufs]\n"
            "                works += [dist.isend(x.contiguous(), dist.get_global_rank(group, (rank + 1) % cp), group)\n"
            "                          for x in (kb, vb)]\n"
            "            ks, vs = kb.to(work_dtype).chunk(n, dim=2), vb.to(work_dtype).chunk(n, dim=2)\n"
            "            for i, j, diagonal in pairs:\n"
            "                outs[i], lses[i] = merge(outs[i], lses[i], *block_forward(qs[i], ks[j], vs[j], scale, "
            "diagonal))\n            for w in works:\n                w.wait()\n            if works:\n                kb, vb = bufs\n"),
    Variant("the pairs key-chunk first; a dict of running (out, lse) per query chunk", (
            "        kb, vb = k, v                                      # the block in hand travels in its own dtype\n",
            _RING_LOOP), ("        kb, vb, running = k, v, {}\n",
            "            nxt = RingPass([kb, vb], group) if t < cp - 1 else None\n"
            "            ks, vs = (x.to(work_dtype).chunk(n, dim=2) for x in (kb, vb))\n"
            "            for i, j, diagonal in sorted(pairs, key=lambda p: (p[1], p[0])):\n"
            "                o, l = block_forward(qs[i], ks[j], vs[j], scale, diagonal)\n"
            "                acc = running.get(i)\n"
            "                running[i] = (o, l) if acc is None else merge(*acc, o, l)\n"
            "            if nxt is not None:\n                kb, vb = nxt.wait()\n"
            "        outs, lses = [running[i][0] for i in range(n)], [running[i][1] for i in range(n)]\n")),
]


# ---- 7. expert parallel: all_to_all (expert_parallel.py: AllToAll.forward, AllToAll.backward) ------------------------
# Where the course calls it: ExpertParallelMoE's dispatch and combine (its backward: the same exchange, splits
# swapped), on the ep group — the world in the lesson, ep consecutive dp ranks inside a larger mesh in train.py —
# with uneven splits (tokens per rank differ, routing differs) and empty ones (an expert's capacity reached); rows in
# the activations' dtype. Graded with the expert-parallel layer (4 experts, top-2) on uneven tokens per rank:
#   - dropless and with capacity factor 1.0 on 1, 2 and 4 ranks: the output and the gradients of the tokens, the
#     router and every expert equal to the single-device MoE, on every rank;
#   - per rank, every all-to-all's bytes: counts, dispatch, combine, and in backward both again with the splits
#     swapped;
#   - inside a larger mesh on 4 ranks: Mesh(dp_shard=4, ep=2)'s ep groups [0, 1] and [2, 3] (dropless): every
#     all-to-all over the ep group, equal to the single-device MoE on all the ranks' tokens.
# The run and checks serve dispatch_combine too.

EP_SIZES = {1: [10], 2: [7, 12], 4: [7, 12, 5, 9]}   # tokens per rank: uneven, so the splits are too
A2A_ERRORS = [(r"different dtypes", "the output buffer must have the rows' dtype (x.new_empty)"),
              (r"Number of tensor splits not equal to group size", "a split list holds one number per rank of the ep "
               "group: rows to each rank (keep_send summed over each rank's experts), rows from each rank (keep_recv "
               "summed over my experts)"),
              (r"AllToAllBackward returned an invalid gradient at index 0", "backward must return x's gradient in x's "
               "shape: each row's gradient sent back to the rank the row came from (the exchange, splits swapped)"),
              (r"returned an incorrect number of gradients", "backward returns one gradient per argument of forward: "
               "x's, then None for out_splits, in_splits and group"),
              (r"ProcessGroupGloo::alltoall: invalid tensor size", "gloo's list form of all_to_all takes pieces of one "
               "size only, and the splits here are uneven (some empty): exchange the rows with all_to_all_single and "
               "the split sizes, as NCCL and gloo both run it")]
EP_INDEX = [(r"index -?\d+ is out of bounds for dimension 0 with size", "an index past this rank's tokens: sel indexes "
             "assignments t·k + slot; their tokens are tok = sel // k")]
EP_ERRORS = [(r"shape '\[\d+, \d+\]' is invalid for input of size", "the experts split by rank do not fit: ep is the "
              "ep group's size (self.ep), not the world's")]


def _ep_case(P, capacity, mesh=None):
    from copy import deepcopy
    from types import SimpleNamespace
    from expert_parallel import parallelize_experts, sync_gradients
    from lab.model import build_model, get_config
    inside = mesh is not None
    mesh = mesh or _mesh(dp_shard=P, ep=P)
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
    handed, experts_of = [], layer.experts

    def recorded(xs):   # what my experts are handed: rows of which tokens
        handed.append([t.detach().clone() for t in xs])
        return experts_of(xs)
    layer.experts = recorded
    with Count() as c:
        with explained(*EP_ERRORS, *A2A_ERRORS, *EP_INDEX, prefix="forward: "):
            out = layer(x)
        with explained(*EP_ERRORS, prefix="backward (the all-to-alls' gradients): "):
            ((out * dy[sl]).sum() * D / N + layer.aux_loss).backward()
        sync_gradients(layer, mesh.group("dp_cp"), mesh.group("edp_cp"), D)
    lo, n = layer.first, layer.n_local
    pairs = dict(out=(out, out_ref[sl]), x_grad=(x.grad / D, x_ref.grad[sl]),
                 router_grad=(layer.router.weight.grad, ref.router.weight.grad))
    for name, p, q in zip(("w1", "w3", "w2"), layer.expert_parameters(), (ref.w1, ref.w3, ref.w2)):
        pairs[name + "_grad"] = (p.grad, q.grad[lo:lo + n])
    _, weights, experts, _ = ref.route(x_all.view(-1, cfg.dim))
    unweighted = one = None
    if capacity is None:   # what a combine that forgets the router's weights gives: the k experts' outputs summed
        with torch.no_grad():   # (and one that overwrites: each token's result from one expert alone)
            xs = x_all.view(-1, cfg.dim)
            each = [torch.stack([ref.expert(int(e), xs[t]) for t, e in enumerate(experts[:, j])])
                    for j in range(cfg.top_k)]
            unweighted = sum(each)[sl].view_as(out)
            one = [torch.stack([weights[t, j] * each[j][t] for t, j in enumerate(pick.tolist())])[sl].view_as(out)
                   for pick in (experts.argmax(1), experts.argmin(1))]
    rows, kept = _expected_rows(experts, ref.capacity(N), sizes, n, P) if not inside else (None, None)
    xs_all, want_tok = x_all.view(-1, cfg.dim), _expert_tokens(experts, ref.capacity(N))
    got_tok = None if not handed or inside else [
        sorted(next(iter((xs_all == row).all(1).nonzero().flatten().tolist()), -1) for row in chunk)
        for chunk in handed[0]]
    return dict(got={k: a.detach().clone() for k, (a, _) in pairs.items()},
                want={k: b.detach().clone() for k, (_, b) in pairs.items()}, unweighted=unweighted, one=one,
                a2a=[(e["bytes"], c.wire(e)) for e in c.events if e["op"] == "all_to_all"],
                a2a_groups=sorted({tuple(e["group"]) for e in c.events if e["op"] == "all_to_all"}),
                ep=mesh.ranks("ep"), rows=rows, kept=kept, dropped=layer.dropped, ref_dropped=ref.dropped,
                tokens_per_expert=[int(t) for t in layer.tokens_per_expert], first=lo, n_local=n,
                handed=got_tok, handed_want=[want_tok.get(e, []) for e in range(lo, lo + n)],
                routed=[_expert_tokens(experts, None).get(e, []) for e in range(lo, lo + n)], cap=ref.capacity(N),
                assignments=sizes[r] * cfg.top_k)


def _expert_tokens(experts, cap):
    """{expert: the tokens it keeps, in token order} (each expert its first `cap` assignments)."""
    taken = {}
    for t, chosen in enumerate(experts.tolist()):
        for e in chosen:
            if cap is None or len(taken.get(e, [])) < cap:
                taken.setdefault(e, []).append(t)
    return taken


def _handed_line(P, res, case):
    """Which expert was handed the wrong tokens' rows (None: each was handed its own, or the experts were not run
    through self.experts)."""
    for r, x in enumerate(res):
        y = x[case]
        if y.get("handed") is None:
            return None
        if len(y["handed"]) != len(y["handed_want"]):
            return (f"rank {r} ({case}): self.experts was handed {len(y['handed'])} group(s) of rows for this rank's "
                    f"{len(y['handed_want'])} experts: split the rows, sorted by expert, into one group per MY expert "
                    f"(sizes: what each of my experts received from all ranks, keep_recv summed over the ranks)")
        for e, (got, want) in enumerate(zip(y["handed"], y["handed_want"])):
            if got == sorted(want):
                continue
            head = f"rank {r} ({case}): expert {y['first'] + e} was handed "
            routed = y.get("routed", [[]] * len(y["handed"]))[e]
            if len(got) != len(want) and -1 not in got:
                return (head + f"{len(got)} rows where the routing sends it {len(want)} (tokens {got}, expected "
                        f"{sorted(want)}): split the rows, sorted by expert, by what each of MY experts received "
                        f"from all ranks (keep_recv summed over the ranks: [E/ep])")
            if y.get("cap") is not None and len(got) == len(want) and set(got) <= set(routed):
                return (head + f"tokens {got} where with capacity C = {y['cap']} it keeps {sorted(want)}, the FIRST "
                        f"C of the tokens routed to it ({routed}): keep each expert's first C assignments in token "
                        f"order, rank by rank (pos < keep_send[e] in a stable sort by expert), and drop the rest")
            if -1 in got:
                return (head + f"{got.count(-1)} row(s) that are no token's row (scaled or mixed): dispatch the tokens' "
                        f"rows x[tok] as they are — the router's weights apply to the experts' results, in the combine")
            mine = sorted(t for g in y["handed"] for t in g)
            if mine == sorted(t for w in y["handed_want"] for t in w):
                return (head + f"tokens {got} where the routing sends it {sorted(want)}: the rows arrive grouped by "
                        f"source rank, then by expert — regroup them by expert (a stable sort by each row's expert: "
                        f"from source rank s, my expert e's keep_recv[s, e] rows) before the experts run")
            return (head + f"tokens {got} where the routing sends it {sorted(want)}: the rows dispatched are not the "
                    f"kept assignments' tokens (assignment a = t·k + slot: its token is a // k)")
    return "every expert was handed the right tokens' rows"


def _expected_rows(experts, cap, sizes, n_local, ep):
    """rows[d][j]: rank d's assignments kept by the experts of rank j, every expert taking its first `cap` in token
    order over the group's tokens (rank order); kept[e]: the assignments expert e keeps."""
    rows, taken, bounds = [[0] * ep for _ in sizes], {}, list(itertools.accumulate(sizes))
    for t, chosen in enumerate(experts.tolist()):
        d = next(i for i, b in enumerate(bounds) if t < b)
        for e in chosen:
            if cap is None or taken.get(e, 0) < cap:
                taken[e] = taken.get(e, 0) + 1
                rows[d][e // n_local] += 1
    return rows, [taken.get(e, 0) for e in range(n_local * ep)]


def _a2a_split(src, dst):
    return (src + 2 * dst + 1) % 3   # rows rank src sends rank dst: uneven, some empty


def run_a2a_exchange(P):
    """AllToAll alone on the world: rank r's row #i for rank j reads [10·r + j, i]; forward, then backward with the
    gradient out + 0.5, whose inverse permutation is x + 0.5 exactly."""
    from expert_parallel import AllToAll
    r = dist.get_rank()
    x = torch.cat([torch.tensor([[10.0 * r + j, i] for i in range(_a2a_split(r, j))], dtype=F64).view(-1, 2)
                   for j in range(P)]).requires_grad_()
    want = torch.cat([torch.tensor([[10.0 * i + r, n] for n in range(_a2a_split(i, r))], dtype=F64).view(-1, 2)
                      for i in range(P)])
    with explained(*A2A_ERRORS, prefix="forward: "):
        out = AllToAll.apply(x, [_a2a_split(i, r) for i in range(P)], [_a2a_split(r, j) for j in range(P)],
                             dist.group.WORLD)
    got = out.detach().clone()
    if got.shape == want.shape:
        with explained(*A2A_ERRORS, prefix="backward: "), _a2a_backward_said():
            out.backward(want + 0.5)
    # even splits, two rows to every rank: in_splits == out_splits on every rank, yet every row still moves
    even = torch.tensor([[10.0 * r + j, i] for j in range(P) for i in range(2)], dtype=F64)
    with explained(*A2A_ERRORS, prefix="forward, even splits: "):
        out_even = AllToAll.apply(even.clone(), [2] * P, [2] * P, dist.group.WORLD)
    return dict(x=x.detach(), out=got, want=want, grad=None if x.grad is None else x.grad.clone(), even=even,
                out_even=out_even.detach().clone(),
                want_even=torch.tensor([[10.0 * i + r, n] for i in range(P) for n in range(2)], dtype=F64))


@contextlib.contextmanager
def _a2a_backward_said():
    """A backward whose gradient goes through another collective (an all-reduce: ranks hold different numbers of
    rows, the watch finds the sizes differ): said as its cause, not as the watch's generic mismatch."""
    try:
        yield
    except watch.CollectiveMismatch as e:
        ops = set(re.findall(r"rank \d+: (\w+)", str(e)))
        other = sorted(op for op in ops if not op.startswith("all_to_all"))
        if not other:
            raise
        raise watch.CollectiveMismatch(
            f"backward: an {other[0]} of the gradient in AllToAll's backward — the gradient of a permutation is the "
            f"inverse permutation: each row's gradient goes back unchanged to the rank the row came from (the same "
            f"exchange, splits swapped), nothing summed, averaged or gathered ({str(e)[:200]})") from None


def _a2a_row(row):
    return f"rank {int(row[0]) // 10}'s row #{int(row[1])} for rank {int(row[0]) % 10}"


def judge_a2a_exchange(P, res):
    for r, x in enumerate(res):
        got, want = x["out"], x["want"]
        if got.shape != want.shape:
            return [f"rank {r}: forward returned {tuple(got.shape)} where {tuple(want.shape)} is expected: "
                    f"sum(out_splits) rows, out_splits[i] of them from rank i"]
        bad = (got != want).any(1).nonzero().flatten().tolist()
        if bad:
            k = bad[0]
            return [f"rank {r}: forward: row {k} holds {_a2a_row(got[k])} where {_a2a_row(want[k])} belongs — what "
                    f"arrives from rank i comes before what arrives from rank i+1, rank i's rows in the order sent"]
    for r, x in enumerate(res):
        got, want = x["out_even"], x["want_even"]
        if P > 1 and got.shape == x["even"].shape and torch.equal(got, x["even"]):
            return [f"rank {r}: forward with even splits (in_splits == out_splits == {[2] * P}) returned this rank's "
                    f"own rows unchanged: equal splits say how many rows move, not that none do — row block i of the "
                    f"result comes from rank i"]
        if got.shape != want.shape or not torch.equal(got, want):
            k = next(iter((got != want).any(1).nonzero().flatten().tolist()), 0) if got.shape == want.shape else None
            return [f"rank {r}: forward with even splits ({[2] * P}): " + (
                f"returned {tuple(got.shape)} where {tuple(want.shape)} is expected" if k is None else
                f"row {k} holds {_a2a_row(got[k])} where {_a2a_row(want[k])} belongs")]
    for r, x in enumerate(res):
        g, want = x["grad"], x["x"] + 0.5
        if g is None:
            return [f"rank {r}: backward gave x no gradient (None): return the exchanged gradient for x, then None for "
                    f"out_splits, in_splits and group"]
        if g.shape != want.shape:
            return [f"rank {r}: backward returned a gradient {tuple(g.shape)} for x {tuple(want.shape)}: each row's "
                    f"gradient goes back to the rank the row came from — the forward's exchange with the splits "
                    f"swapped"]
        if not close(g, want):
            why = pattern(g, want, [(P, f"{P}× (summed over the {P} ranks)"), (1 / P, f"1/{P}× (averaged over the "
                                                                                     f"{P} ranks)")] if P > 1 else [])
            return [f"rank {r}: backward: x's gradient off by {(g - want).abs().max().item():.2e} — {why}: the "
                    f"gradient of a permutation is the inverse permutation, each row's gradient sent back unchanged"]
    return []


def run_ep(P):
    return {"dropless": _ep_case(P, None), "capacity 1.0": _ep_case(P, 1.0)}


def run_ep_mesh(P):
    return {"dropless": _ep_case(P, None, _mesh(dp_shard=4, ep=2))}


def judge_ep_equal(P, res, cases=("dropless", "capacity 1.0"), label=""):
    for case in cases:
        lines = compare_named(P, [x[case] for x in res], "got", lambda r, n: res[r][case]["want"][n],
                              what=f" ({case})", scales=[(P, f"{P}× the expected ({P} = ep)")] if P > 1 else [],
                              candidates_of=lambda r, n: [("the k experts' outputs summed without the router's weights: "
                                                           "weight each result by weights[t, slot] before summing it "
                                                           "into its token", res[r][case]["unweighted"])] + [
                                  ("each token's result from one of its k experts alone, the other overwritten (index_copy "
                                   "or an indexed assignment): ADD a token's results (index_add)", one)
                                  for one in res[r][case]["one"]]
                              if n == "out" and res[r][case]["unweighted"] is not None else [])
        if lines and case == cases[0] and lines[0].split(":")[0].split(", ")[-1].startswith("out ") and \
                ("no simple pattern" in lines[0] or "right elsewhere" in lines[0]):
            handed = _handed_line(P, res, case)
            if handed and handed.startswith("every expert"):
                handed = (f"{lines[0].split(':')[0]}: wrong, though {handed}: the results go wrong after the experts "
                          f"— put them back in arrival order (undo the sort by expert) before sending them home, and "
                          f"weight each by ITS assignment's weight (weights.flatten()[sel]) as it is added into ITS "
                          f"token")
            lines = ([label + handed] if handed else []) + lines
            label = ""
        elif lines and case == cases[0] and "no simple pattern" in lines[0]:   # out right by luck, a gradient not:
            handed = _handed_line(P, res, case)                                 # an expert handed the wrong rows?
            if handed and not handed.startswith("every expert"):
                lines, label = [label + handed] + lines, ""
        if lines and case != cases[0]:   # dropless was right: which tokens an expert kept, if it kept the wrong ones
            handed = _handed_line(P, res, case)
            if handed and not handed.startswith("every expert"):
                lines = [handed] + lines
        if lines:
            if case != cases[0] and " was handed " not in lines[0]:   # dropless was right
                lines[0] += (" — dropless is right: with a capacity each expert keeps its FIRST C assignments in token "
                             "order, rank by rank (a stable sort by expert keeps that order)")
            return [label + lines[0]] + lines[1:] + ["(expected: the single-device MoE of lab/model.py on all the ranks' "
                                                     "tokens)"]
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


def judge_ep_mesh(P, res):
    for r, x in enumerate(res):
        bad = [list(g) for g in x["dropless"]["a2a_groups"] if list(g) != x["dropless"]["ep"]]
        if bad:
            return [f"Mesh(dp_shard=4, ep=2), rank {r}: all-to-alls over ranks {bad}: the exchange runs over the ep "
                    f"group {x['dropless']['ep']} it is given"]
    return judge_ep_equal(P, res, cases=("dropless",), label="Mesh(dp_shard=4, ep=2), ")


CHECKS["all_to_all"] = [
    Check("the exchange alone, uneven and empty splits: forward hands rank j the rows x[sum(in_splits[:j]) : "
          "+in_splits[j]], returned in rank order; backward sends each row's gradient back unchanged", run_a2a_exchange,
          judge_a2a_exchange),
    Check("the expert-parallel layer equals the single-device MoE in float64: output, and the gradients of the tokens, "
          "the router and every expert, dropless and with a capacity, uneven tokens per rank", run_ep, judge_ep_equal),
    Check("all-to-all bytes: counts, dispatch (my kept rows·H·b), combine (the rows I received), and backward both "
          "again with the splits swapped", run_ep, judge_ep_bytes, worlds=(2, 4)),
    Check("inside a larger mesh: Mesh(dp_shard=4, ep=2)'s ep groups [0, 1] and [2, 3], every all-to-all over the ep "
          "group, equal to the single-device MoE on all the ranks' tokens", run_ep_mesh, judge_ep_mesh, worlds=(4,)),
]
_A2A_BWD = "        return _all_to_all(grad, *ctx.splits, ctx.group), None, None, None\n"
BUGS["all_to_all"] = [
    Bug("the backward's splits not swapped", "ctx.splits, ctx.group = (in_splits, out_splits), group",
        "ctx.splits, ctx.group = (out_splits, in_splits), group",
        r"rank 0: RuntimeError: backward( \(the all-to-alls' gradients\))?: all_to_all_single: the input has \d+ rows but "
        r"input_split_sizes .* add up to \d+"),
    Bug("the backward passes the gradient through", "return _all_to_all(grad, *ctx.splits, ctx.group), None, "
        "None, None", "return grad, None, None, None", r"rank \d: RuntimeError: backward( \(the all-to-alls' gradients\))?: "
        r"backward must return x's gradient in x's shape"),
    Bug("the forward's splits swapped", "return _all_to_all(x, out_splits, in_splits, group)",
        "return _all_to_all(x, in_splits, out_splits, group)",
        r"rank 0: RuntimeError: forward: all_to_all_single: the input has \d+ rows but input_split_sizes .* add up to "
        r"\d+: the splits must describe this rank's own input"),
    Bug("the backward over the default group (ctx.group not used)", _A2A_BWD,
        "        return _all_to_all(grad, *ctx.splits, None), None, None, None\n",
        r"all_to_all_single over ranks \[0, 1, 2, 3\]: rank \d's (input|output)_split_sizes \[\d+, \d+\] name 2 "
        r"ranks, the group has 4", 4),
    Bug("the backward returns the gradient alone", _A2A_BWD, "        return _all_to_all(grad, *ctx.splits, ctx.group)\n",
        r"every rank: RuntimeError: backward.*: backward returns one gradient per argument of forward"),
    Bug("the splits saved with save_for_backward", "        ctx.splits, ctx.group = (in_splits, out_splits), group\n",
        "        ctx.save_for_backward(in_splits, out_splits)\n        ctx.splits, ctx.group = (in_splits, out_splits), "
        "group\n", r"every rank: TypeError: forward: save_for_backward can only save variables"),
]
BUGS["all_to_all"] += [
    Bug("the backward averages the gradient over the group", _A2A_BWD, "        return _all_to_all(grad, *ctx.splits, "
        "ctx.group) / dist.get_world_size(ctx.group), None, None, None\n",
        r"rank 0: backward: x's gradient off by .* 1/2× \(averaged over the 2 ranks\)"),
    Bug("the backward returns None for x", _A2A_BWD, "        return None, None, None, None\n",
        r"rank 0: backward gave x no gradient \(None\)"),
    Bug("the output buffer made without the rows' dtype", "        return _all_to_all(x, out_splits, in_splits, group)\n",
        "        out = torch.empty(sum(out_splits), x.shape[1])\n"
        "        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)\n        return out\n",
        r"(rank 0|every rank): ValueError: forward: the output buffer must have the rows' dtype"),
]
BUGS["all_to_all"] += [
    Bug("the backward all-reduces the exchanged gradient", _A2A_BWD, "        g = _all_to_all(grad, *ctx.splits, "
        "ctx.group)\n        dist.all_reduce(g, group=ctx.group)\n        return g, None, None, None\n",
        r"collectives do not match: backward: an all_reduce of the gradient in AllToAll's backward — the gradient of a "
        r"permutation is the inverse permutation"),
    Bug("nothing moved when the splits agree", "        return _all_to_all(x, out_splits, in_splits, group)\n",
        "        if list(out_splits) == list(in_splits):\n            return x\n"
        "        return _all_to_all(x, out_splits, in_splits, group)\n",
        r"rank 0: forward with even splits \(in_splits == out_splits == \[2, 2\]\) returned this rank's own rows "
        r"unchanged"),
]
VARIANTS["all_to_all"] = [
    Variant("torch's all_to_all_single called directly, the splits kept by name", (
            "        ctx.splits, ctx.group = (in_splits, out_splits), group\n"
            "        return _all_to_all(x, out_splits, in_splits, group)\n", _A2A_BWD), (
            "        ctx.sent, ctx.got, ctx.group = list(in_splits), list(out_splits), group\n"
            "        out = x.new_empty((sum(out_splits), *x.shape[1:]))\n"
            "        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)\n"
            "        return out\n",
            "        back = grad.new_empty((sum(ctx.sent), *grad.shape[1:]))\n"
            "        dist.all_to_all_single(back, grad.contiguous(), ctx.sent, ctx.got, group=ctx.group)\n"
            "        return back, None, None, None\n")),
    Variant("the backward as the same Function applied with the splits swapped", _A2A_BWD,
            "        back, forth = ctx.splits       # the forward's in_splits and out_splits: here the other way\n"
            "        return AllToAll.apply(grad, back, forth, ctx.group), None, None, None\n"),
]


# ---- 7. expert parallel: dispatch_combine (expert_parallel.py: ExpertParallelMoE.dispatch_combine) -------------------
# Where the course calls it: ExpertParallelMoE.forward on every MoE layer of train.py and the lesson — alone (the aux
# loss over the ep group) or composed (parallelize_experts: the aux loss over dp × cp, the gradient divisor D),
# dropless or with a capacity, tokens per rank uneven (sequence lengths, tp's token split), the ep group inside a
# larger mesh. Graded on all_to_all's runs, and:
#   - per rank: the assignments it dropped (its own that no expert kept) and tokens_per_expert (what its experts
#     kept, from every rank), against the single device's routing with capacity C = ⌈T·k/E·cf⌉ per expert; the ranks'
#     drops adding up to the single device's.

def judge_ep_dropped(P, res):
    for case in ("dropless", "capacity 1.0"):
        for r, x in enumerate(res):
            y = x[case]
            want = y["assignments"] - sum(y["rows"][r])
            if y["dropped"] != want:
                return [f"rank {r} ({case}): dropped {y['dropped']} of its {y['assignments']} assignments, expected "
                        f"{want} (the single device's routing: each expert keeps its first C = ⌈T·k/E·cf⌉ in token "
                        f"order)"]
            mine = y["kept"][y["first"]:y["first"] + y["n_local"]]
            if y["tokens_per_expert"] != mine:
                return [f"rank {r} ({case}): tokens_per_expert {y['tokens_per_expert']} where its experts kept {mine} "
                        f"(the rows each of MY experts received, from every rank: keep_recv.sum(0))"]
        total = sum(x[case]["dropped"] for x in res)
        want = res[0][case]["ref_dropped"]
        if total != want:
            return [f"{case}: the ranks dropped {total} assignments in all, the single device drops {want}"]
    return []


CHECKS["dispatch_combine"] = CHECKS["all_to_all"][1:] + [
    Check("per rank: the assignments dropped and tokens_per_expert as the single device routes them (capacity "
          "C = ⌈T·k/E·cf⌉ per expert); the drops adding up to the single device's", run_ep, judge_ep_dropped),
]
BUGS["dispatch_combine"] = [
    Bug("the results not weighted by the router", "index_add(0, tok, back * weights.flatten()[sel, None])",
        "index_add(0, tok, back)", r"rank 0, out \(dropless\): off by .* without the router's weights"),
    Bug("the combine's splits not swapped", "back = self.all_to_all(y, send, recv, self.ep_group)",
        "back = self.all_to_all(y, recv, send, self.ep_group)",
        r"rank 0: RuntimeError: forward: all_to_all_single: the input has \d+ rows but input_split_sizes .* add up to "
        r"\d+"),
    Bug("index_copy: a token's k results overwrite each other", "torch.zeros_like(x).index_add(0, tok, ",
        "torch.zeros_like(x).index_copy(0, tok, ", r"rank 0, out \(dropless\): off by .* each token's result from one "
        r"of its k experts alone, the other overwritten"),
    Bug("an unstable sort by expert", "order = torch.argsort(flat, stable=True)", "order = torch.argsort(flat)",
        r"\(capacity 1.0\): expert \d was handed tokens \[.*\] where with capacity C = \d+ it keeps .* the FIRST C .* "
        r"in a stable sort by expert"),
    Bug("tokens_per_expert: what this rank sends, not what its experts received",
        "self.tokens_per_expert, self.dropped = aux, keep_recv.sum(0), T * k - len(sel)",
        "self.tokens_per_expert, self.dropped = aux, keep_send, T * k - len(sel)",
        r"rank 0 \(dropless\): tokens_per_expert \[.*\] where its experts kept \[.*\]"),
    Bug("one assignment too many kept per expert (<=)", "sel = order[pos < keep_send[sorted_e]]",
        "sel = order[pos <= keep_send[sorted_e]]", r"all_to_all_single: the input has \d+ rows but input_split_sizes"),
    Bug("ep as the world's size", "T, k, n_local, ep = x.shape[0], self.top_k, self.n_local, self.ep",
        "T, k, n_local, ep = x.shape[0], self.top_k, self.n_local, dist.get_world_size()",
        r"every rank: RuntimeError: forward: the experts split by rank do not fit: ep is the ep group's size", 4),
]
BUGS["dispatch_combine"] += [
    Bug("the arrivals not grouped by expert before the experts run", "        ys = self.experts(rows[perm].split(",
        "        ys = self.experts(rows.split(", r"rank 0 \(dropless\): expert 0 was handed tokens \[.*\] where the "
        r"routing sends it \[.*\]: .* regroup them by expert"),
    Bug("the results not put back in arrival order", "        y = torch.cat(ys)[torch.argsort(perm)]",
        "        y = torch.cat(ys)", r"rank 0, out \(dropless\): wrong, though every expert was handed the right tokens' "
        r"rows: .*undo the sort by expert"),
    Bug("the router's weights applied to the inputs", ("rows = self.all_to_all(x[tok], recv",
        "index_add(0, tok, back * weights.flatten()[sel, None])"), ("rows = self.all_to_all(x[tok] * "
        "weights.flatten()[sel, None], recv", "index_add(0, tok, back)"),
        r"rank 0 \(dropless\): expert 0 was handed \d+ row\(s\) that are no token's row"),
]
_DC_SELECT = ("        order = torch.argsort(flat, stable=True)             # [T·k]\n        sorted_e = flat[order]\n"
              "        pos = torch.arange(T * k, device=x.device) - (counts.cumsum(0) - counts)[sorted_e]\n"
              "        sel = order[pos < keep_send[sorted_e]]               # [N_send] kept, grouped by owner rank\n")
_DC_EXPERTS = ("        perm = torch.argsort(row_expert, stable=True)        # expert-major: one matmul per expert\n"
               "        ys = self.experts(rows[perm].split(keep_recv.sum(0).tolist()))\n"
               "        y = torch.cat(ys)[torch.argsort(perm)]               # back to arrival order [N_recv, H]\n")
BUGS["dispatch_combine"] += [
    Bug("each expert keeps its LAST C assignments", "        sel = order[pos < keep_send[sorted_e]] ",
        "        sel = order[pos >= counts[sorted_e] - keep_send[sorted_e]] ",
        r"rank \d \(capacity 1.0\): expert \d was handed tokens \[.*\] where with capacity C = \d+ it keeps \[.*\], "
        r"the FIRST C"),
    Bug("the experts' rows split by rank, not by expert", "ys = self.experts(rows[perm].split(keep_recv.sum(0).tolist()))",
        "ys = self.experts(rows[perm].split(keep_recv.sum(1).tolist()))",
        r"rank \d \(dropless\): (expert \d was handed \d+ rows where the routing sends it \d+|self.experts was handed \d+ "
        r"group)"),
]
VARIANTS["dispatch_combine"] = [
    Variant("each expert's first keep_send[e] assignments by nonzero, in expert order; the drops counted from the "
            "counts", (_DC_SELECT, "T * k - len(sel)"), (
            "        sel = torch.cat([(flat == e).nonzero().flatten()[:int(keep_send[e])]\n"
            "                         for e in range(self.n_experts)])\n", "int(counts.sum() - keep_send.sum())")),
    Variant("my experts run one by one on their rows, in place; the combine by scatter_add", (
            _DC_EXPERTS, "        out = torch.zeros_like(x).index_add(0, tok, back * weights.flatten()[sel, None])\n"), (
            "        y = torch.empty_like(rows)\n        for e, w in enumerate(zip(self.w1, self.w3, self.w2)):\n"
            "            idx = (row_expert == e).nonzero().flatten()\n"
            "            y[idx] = F.silu(rows[idx] @ w[0].T) * (rows[idx] @ w[1].T) @ w[2].T\n",
            "        weighted = back * weights.flatten()[sel].unsqueeze(1)\n"
            "        out = torch.zeros_like(x).scatter_add(0, tok[:, None].expand_as(weighted), weighted)\n")),
]

assert set(CHECKS) == set(BY_NAME), set(BY_NAME) ^ set(CHECKS)
