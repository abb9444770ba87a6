"""Where a parallel run first differs from one process: what train.py --check says when the losses differ.

When a layout's losses (or gradient norms) differ from the single-process run, --check replays the run's steps on
the same ranks with every PLACE of each step recorded, and beside it, on rank 0, the one-process run with the same
places recorded; step by step it compares them in the order one process computes them and stops at the first place
that differs. The places of a step, in that order:

    in use     each parameter as the forward uses it: the compute copy (ZeRO-3: as gathered)
    output     each module's output — the embedding, every block, the final norm, the head — per micro-batch
    loss       the step's loss
    backward   each parameter's gradient after backward, before any sync: the ranks' own gradients, summed as the
               sync must sum them (over the ranks holding the same slice; tp-partial ones over tp too) ÷ dp·cp
    sync       each parameter's gradient after the sync: the optimizer's slice of it, on every rank
    norm       the global gradient norm (clipping)
    step       each parameter after the optimizer step: the optimizer's slice, on every rank

Every recorded piece says where it sits in the one-process tensor, read from the layout itself: a parameter's tp
slice or experts (Trainer.where), a pipeline stage's layers (their names), a ZeRO unit's flat slice (its names and
offsets, rank r holding [r·n, (r+1)·n)), an activation's rows (dp rank, micro-batch) and sequence positions (the cp
rank's zigzag chunks, sequence parallel's S/tp). Each piece also keeps the collective that produced it on its rank:
the last collective that wrote its memory, else the last one in its window (a module's forward or backward, the
unit's sync, the step), or none — often the clue to a missing one.

What differs is said in the grader's pattern language (lab/diagnosis.py: P× or ÷P, a sign, zeros, which elements),
with what only a parallel run can get wrong: values that add up to the expected over the ranks that hold them (a
missing all-reduce), a rank's own gradient never summed, a shard offset, the wrong slice, sequence chunks.

Equal means rounding's bound. In float64 it is diagnosis.TOL (1e-9 of the values' scale; measured 1e-15). A
float32 or bfloat16 run is replayed in float64 first: a place that differs there is a bug; if none does, the run
is replayed in its own dtype and each parameter held to AdamW's reach (lab/baseline.adamw_reach): beyond it is a
bug only that dtype shows, within it the difference is rounding — and the report says which.

    first_difference(args, device, last, reference_run)   on every rank: the report's lines (the same on each)
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import train
from lab import checkpoint
from lab.baseline import adamw_reach
from lab.data import load_corpus
from lab.diagnosis import TOL, close, pattern, slice_pattern
from lab.instruments import CommCounter

KINDS = ("in use", "output", "loss", "backward", "sync", "norm", "step")
WHAT = {"in use": "the parameters as the forward uses them", "output": "every module's output in forward",
        "loss": "the loss", "backward": "the gradients after backward", "sync": "the gradients after the sync",
        "norm": "the gradient norm", "step": "the parameters after the optimizer step"}
ACTIVATIONS = ("tok_embeddings", "norm", "output")  # and every block, layers.<i>, and its halves .attn and .mlp


def _recorded(name: str) -> bool:
    """The modules whose outputs are places: the embedding, each block and its attention and MLP, the norm, the head."""
    parts = name.split(".")
    return name in ACTIVATIONS or parts[0] == "layers" and (len(parts) == 2 or len(parts) == 3 and parts[2] in (
        "attn", "mlp"))
_HERE = (os.path.abspath(__file__), os.path.abspath(CommCounter.__module__.replace(".", os.sep) + ".py"))


# ---- the collectives a rank issued, with where they came from ---------------------------------------------------

class CollectiveLog(CommCounter):
    """CommCounter that also keeps, per collective, the code that issued it, the memory it wrote and whether a
    backward pass ran it: enough to say which collective produced a tensor."""

    def __init__(self):
        super().__init__()
        self.notes = []  # per event: (where, storages written, in backward, numel, dtype, shape)

    def _record(self, op, t_idx, g_idx, args, functional):
        super()._record(op, t_idx, g_idx, args, functional)
        out = args[0] if not functional else None
        tensors = [t for t in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(t, torch.Tensor)]
        data = args[t_idx]
        first = data[0] if isinstance(data, (list, tuple)) and data else data
        shape = tuple(first.shape) if isinstance(first, torch.Tensor) else ()
        dtype = first.dtype if isinstance(first, torch.Tensor) else None
        self.notes.append((_caller(), {_storage(t) for t in tensors}, torch._C._current_graph_task_id() != -1,
                           math.prod(shape), dtype, shape))

    def describe(self, i: int) -> str:
        e, (where, _, _, numel, dtype, shape) = self.events[i], self.notes[i]
        what = f"{e.op} over ranks {list(e.group_ranks)} of {numel} {str(dtype).replace('torch.', '')} {list(shape)}"
        return what + (f", at {where}" if where else "")

    def made_by(self, lo: int, hi: int, storages=()) -> int | None:
        """The collective that produced a tensor whose window is events [lo, hi): the last that wrote one of
        `storages`, else the last on floating-point data (not flags), else None."""
        window = range(min(hi, len(self.events)) - 1, lo - 1, -1)
        wrote = next((i for i in window if self.notes[i][1] & set(storages)), None)
        return wrote if wrote is not None else next(
            (i for i in window if self.notes[i][4] is not None and self.notes[i][4].is_floating_point), None)


def _host(t) -> torch.Tensor:
    """A recorded copy: float64, in host memory (every rank's pieces travel to rank 0 and meet the reference there)."""
    return t.detach().to("cpu", torch.float64, copy=True)


def _storage(t) -> int:
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) and t.untyped_storage().size() else 0


def _caller() -> str:
    """The innermost frames of the code that issued a collective (the course's or a learner's; not torch's)."""
    frames = [f for f in traceback.extract_stack()[:-3]
              if os.path.abspath(f.filename) not in _HERE and "/torch/" not in f.filename
              and not f.filename.startswith("<") and "/python3" not in f.filename]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    name = lambda f: os.path.relpath(f.filename, root) if f.filename.startswith(root) else f.filename  # noqa: E731
    return " ← ".join(f"{name(f)}:{f.lineno} in {f.name}" for f in reversed(frames[-3:]))


# ---- what one rank records in a step --------------------------------------------------------------------------

@dataclass
class Piece:
    """One tensor a rank recorded at one place, and how it maps into the one-process tensor.

    where    in use, backward: (full shape, narrow) of the parameter (narrow: (dim, start, end) or None)
             output: (rows [b], positions [s] or None, last-dim narrow or None)
             sync, step: the index of this rank's unit in `units`
    """
    kind: str
    name: str
    value: torch.Tensor
    rank: int
    where: object = None
    mb: int = 0
    made_by: str | None = None
    window: tuple = (0, 0)
    storages: set = field(default_factory=set)
    window_text: str = ""
    tp: int = 0         # the rank's tp coordinate
    none: bool = False  # backward: the rank had no gradient for it (zeros sent)


@dataclass
class Unit:
    """A ZeRO unit's layout on one rank: which parameters its flat buffer holds where, and this rank's slice."""
    names: list
    offsets: list
    numels: list
    wheres: list        # per parameter (full shape, narrow)
    n: int              # the slice each rank holds
    P: int              # ranks in its group
    r: int              # this rank's index in it
    group: list         # the group's global ranks


class Recorder:
    """Every place of this rank's steps, from hooks on a train.Trainer: module hooks for what the forward uses and
    makes, wrappers of the optimizer's reduction and of ddp's bucket launches for the gradients before and after
    the sync, tensor hooks for each module's backward window, and a CollectiveLog around the step."""

    def __init__(self, trainer):
        self.t, self.rank = trainer, dist.get_rank()
        a, mesh = trainer.args, trainer.mesh
        self.B, self.S, self.m = a.global_batch_size, a.seq_len, trainer.m
        self.dp, self.cp, self.tp = trainer.dp, trainer.cp, trainer.tp
        self.d, self.c, self.tr = mesh.rank("dp"), mesh.rank("cp"), mesh.rank("tp")
        # the tokens this rank holds are those Trainer.batch cut for it: the same cut of the positions
        self.positions = torch.arange(self.S) if self.cp == 1 else \
            train.ring_attention.shard_sequence(torch.arange(self.S), self.cp, self.c, train.CP_LAYOUT, dim=0)
        self.partial = set(getattr(trainer.model, "tp_partial_grads", None) or {})
        self.units = [Unit(list(u.names), list(u.offsets), list(u.numels), [trainer.where(n) for n in u.names],
                           u.shard_numel, u.group_size, u.rank,
                           dist.get_process_group_ranks(u.group) if u.stage > 0 else [self.rank])
                      for u in trainer.opt.units]
        self.active, self.pieces, self.log = False, [], CollectiveLog()
        self.tied_pp = trainer.tied is not None
        self._hook(trainer)

    # -- installing
    def _hook(self, t):
        model = t.model
        for name, mod in model.named_modules():
            if _recorded(name):
                mod.register_forward_pre_hook(lambda m, args, name=name: self._enter(name, args))
                mod.register_forward_hook(lambda m, args, out, name=name: self._output(name, out))
            if name.endswith("loss_fn"):   # the loss's window: its own call (the vocab-parallel loss's all-reduces)
                mod.register_forward_pre_hook(lambda m, args: self._loss_window(0))
                mod.register_forward_hook(lambda m, args, out: self._loss_window(1))
            if any(True for _ in mod.parameters(recurse=False)):
                mod.register_forward_pre_hook(lambda m, args, name=name: self._in_use(name, m))
        opt = t.opt
        reduce_unit, reduce_gradients = opt.reduce_unit, opt.reduce_gradients

        def reduce_unit_watched(u):
            self._local([(n, p) for n, p in zip(u.names, u.params)])
            return reduce_unit(u)

        def reduce_gradients_watched():
            fresh = not opt.reduced
            out = reduce_gradients()
            if fresh and self.active:
                self._sync()
            return out
        opt.reduce_unit, opt.reduce_gradients = reduce_unit_watched, reduce_gradients_watched
        if t.ddp is not None:
            dp, launch = t.ddp, t.ddp._launch_in_order

            def launch_watched():
                for b in dp.buckets[dp._next:]:
                    if not all(b.ready):
                        break
                    self._local([(dp.names[p], v) for p, v in zip(b.params, b.views)], grads=False)
                return launch()
            dp._launch_in_order = launch_watched

    @contextlib.contextmanager
    def step(self, s: int):
        """Record step s (every other step runs unrecorded)."""
        self.active, self.pieces, self.calls, self.used = True, [], {}, set()
        self.local, self.bw, self.loss_at, self.tick, self.sync_at = {}, {}, [0, 0], 0, None
        self.log.reset()
        self.log.notes.clear()
        pipeline = train.pipeline   # (train.py calls it through the module: a changed pipeline.py's too)
        tied = pipeline.sync_tied_embedding

        def tied_watched(stage, group):  # the tied head's two halves are summed here, before any ZeRO reduction
            if group is not None:
                self._local([("tok_embeddings.weight", stage.tok_embeddings.weight)])
            return tied(stage, group)
        pipeline.sync_tied_embedding = tied_watched
        try:
            with self.log:
                yield
            self._after_step()
        finally:
            pipeline.sync_tied_embedding = tied
            self.active = False

    # -- forward
    def _enter(self, name, args):
        if not self._forward():
            return
        self.calls.setdefault(name, []).append(len(self.log.events))
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if x is not None and x.requires_grad:   # its gradient arrives when this module's backward is done
            x.register_hook(lambda g, name=name: self._mark(name, "end"))

    def _output(self, name, out):
        if not self._forward():
            return
        start, mb = self.calls[name][-1], len(self.calls[name]) - 1
        if not isinstance(out, torch.Tensor):
            return
        if out.requires_grad:
            out.register_hook(lambda g, name=name: self._mark(name, "start"))
        rows = self.d * (self.B // self.dp) + mb * (self.B // self.dp // self.m) + torch.arange(out.shape[0])
        L, pos = out.shape[1], None
        if L == len(self.positions):
            pos = self.positions
        elif L * self.tp == len(self.positions):
            pos = self.positions.tensor_split(self.tp)[self.tr]
        full, narrow = self.t.places.get(f"{name}.weight", (None, None)) if name == "output" else (None, None)
        last = (narrow[1], narrow[2]) if narrow is not None and narrow[0] == 0 else None
        self.pieces.append(Piece("output", name, _host(out), self.rank, (rows, pos, last), mb,
                                 window=(start, len(self.log.events)), storages={_storage(out)},
                                 window_text=f"in {name}'s forward (micro-batch {mb})"))

    def _in_use(self, module_name, mod):
        if not self._forward():
            return
        for pname, p in mod.named_parameters(recurse=False):
            name = f"{module_name}.{pname}" if module_name else pname
            if name in self.used or name not in self.t.places:
                continue
            self.used.add(name)
            self.pieces.append(Piece("in use", name, _host(p), self.rank, self.t.where(name),
                                     window=(0, len(self.log.events)), storages={_storage(p)},
                                     window_text="before the forward used it, in this step"))

    def _loss_window(self, end: int):
        if self._forward():
            self.loss_at[end] = len(self.log.events)

    def _forward(self) -> bool:  # recording, and not inside a backward (a checkpointed block's recompute)
        return self.active and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1

    def _mark(self, name, end):
        if self.active:   # (the order the marks came in, and the collectives issued so far)
            self.tick += 1
            self.bw.setdefault(name, {}).setdefault(end, (self.tick, len(self.log.events)))

    # -- gradients
    def _local(self, named, grads=True):
        """The gradients of `named` [(name, param or gradient)] as this rank computed them, before any sync (the
        first time the step hands them to a collective: ddp's bucket, ZeRO's reduction, the tied head's sum)."""
        if not self.active:
            return
        for name, x in named:
            if name in self.local:
                continue
            g = x.grad if grads else x
            self.local[name] = (None if g is None else _host(g), len(self.log.events),
                                {_storage(g)} if g is not None else set())

    def _sync(self):
        self.sync_at = len(self.log.events)
        for k, u in enumerate(self.t.opt.units):
            g = u.master.grad
            if g is None:
                continue
            local = set().union(*[self.local.get(n, (None, 0, set()))[2] for n in u.names])
            start = min([self.local[n][1] for n in u.names if n in self.local], default=0)
            self.pieces.append(Piece("sync", u.names[0], _host(g), self.rank, k,
                                     window=(start, self.sync_at), storages={_storage(g)} | local,
                                     window_text="in the sync of its unit"))

    def _after_step(self):
        end = len(self.log.events)
        starts = sorted((m["start"], name) for name, m in self.bw.items() if "start" in m)
        for name, (g, at, storages) in self.local.items():
            # the window: from the backward that ran just before this module's (the gradient flowing into it is
            # made there: a tensor-parallel f's all-reduce, the ring's dk, dv) to the end of its own
            module = _module_of(name)
            marks = self.bw.get(module, {})
            mine = marks.get("start", (0, 0))
            before = [n for t, n in starts if t < mine and n != module]
            lo = self.bw[before[-1]]["start"][1] if before else mine[1]
            hi = marks["end"][1] if "end" in marks else at
            where = f"in the backward of {before[-1]} and {module}" if before else (
                f"in {module}'s backward" if module else "in backward")
            self.pieces.append(Piece("backward", name, g if g is not None else torch.zeros(()), self.rank,
                                     self.t.where(name), window=(lo, max(lo, hi)), storages=storages,
                                     window_text=where, none=g is None))
        sync_at = end if self.sync_at is None else self.sync_at
        for k, u in enumerate(self.t.opt.units):
            self.pieces.append(Piece("step", u.names[0], _host(u.master), self.rank, k,
                                     window=(sync_at, end), storages={_storage(u.master)},
                                     window_text="in the optimizer step"))
        if self.t.grad_norm is not None:
            norm = torch.tensor(float(self.t.grad_norm), dtype=torch.float64)
            self.pieces.append(Piece("norm", "the global gradient norm", norm, self.rank, window=(sync_at, end),
                                     window_text="in clipping"))
        for p in self.pieces:   # which collective produced it, while this rank's log is at hand
            p.tp = self.tr
            i = self.log.made_by(*p.window, p.storages)
            p.made_by = self.log.describe(i) if i is not None else None
            p.storages = set()
        i = self.log.made_by(*self.loss_at)
        self.loss_made_by = self.log.describe(i) if i is not None else None


def _module_of(name: str) -> str:
    """The innermost recorded module a parameter belongs to: layers.<i>.attn or .mlp, layers.<i>, the embedding,
    the norm, the head ("" for none)."""
    parts = name.split(".")
    return next((".".join(parts[:k]) for k in (3, 2, 1) if len(parts) > k and _recorded(".".join(parts[:k]))), "")


# ---- the one-process run, with the same places ---------------------------------------------------------------

class Reference:
    """The single-process reference of a run, a step at a time, with each step's places as whole tensors: parameters
    before and after, each module's output over the whole global batch, the loss, the gradients (before clipping)
    and the norm. reference_run(args, device, on_rows) -> (lab.baseline.OneProcess, batches): train_demo's."""

    def __init__(self, args, device, reference_run):
        self.rows, self.recording, self.B = None, False, 0
        self.one, self.batches = reference_run(args, device, on_rows=self._rows)
        self.outputs = {}
        for name, mod in self.one.model.named_modules():
            if _recorded(name):
                mod.register_forward_hook(lambda m, a, out, name=name: self._output(name, out))

    def _rows(self, rows):
        self.rows = rows

    def _output(self, name, out):
        if self.recording:
            full = self.outputs.setdefault(name, torch.zeros((self.B,) + tuple(out.shape[1:]), dtype=torch.float64))
            full[self.rows.cpu()] = _host(out)

    def step(self, s: int, record: bool = True) -> dict:
        model = self.one.model
        self.recording, self.outputs, self.B = record, {}, self.batches[s][0].shape[0]
        named = lambda: dict(model.named_parameters(remove_duplicate=False))  # noqa: E731
        before = {n: _host(p) for n, p in named().items()} if record else None
        grads = {}

        def after_backward(m):
            if record:
                grads.update({n: None if p.grad is None else _host(p.grad)
                              for n, p in named().items()})
        loss = self.one.step(self.batches[s], after_backward)
        self.recording = False
        if not record:
            return {}
        return dict(before=before, outputs=self.outputs, loss=loss, grads=grads,
                    norm=self.one.norms[-1] if self.one.norms else None,
                    after={n: _host(p) for n, p in named().items()})


# ---- comparing one step --------------------------------------------------------------------------------------

@dataclass
class Fail:
    """One piece that differs: what it holds, what one process has there, in words, and where it sits."""
    piece: Piece
    got: torch.Tensor
    want: torch.Tensor
    why: str
    what: str
    order: int = 0


@dataclass
class Finding:
    kind: str
    step: int
    rank: int
    what: str           # the tensor, and where it sits
    diff: float
    why: str            # the pattern
    made_by: str | None
    window_text: str
    count: str = ""     # how many more pieces at this place differ


def _narrowed(full, where):
    _, narrow = where
    return full if narrow is None else full.narrow(narrow[0], narrow[1], narrow[2] - narrow[1])


def _where_text(where) -> str:
    full, narrow = where
    if narrow is None:
        return f"{list(full)}"
    dim, a, b = narrow
    return f"{list(full)}, its [{a}:{b}] along dim {dim}"


def _shift_pattern(got, want, n, P) -> str | None:
    """A flat buffer of P slices of n whose wrong slices each hold the expected slice moved by the same few elements
    (rolled within the slice, or shifted along the buffer): an offset off by that much."""
    found = set()
    for j in range(P):
        g, w = got[j * n:(j + 1) * n], want[j * n:(j + 1) * n]
        if close(g, w):
            continue
        hit = next((("rolled", d) for d in (1, -1, 2, -2) if close(g, w.roll(d))), None) or next(
            (("shifted", d) for d in (1, -1, 2, -2) if 0 <= j * n - d and (j + 1) * n - d <= len(want)
             and close(g, want[j * n - d:(j + 1) * n - d])), None)
        if hit is None:
            return None
        found.add(hit)
    if len(found) != 1:
        return None
    how, d = found.pop()
    return (f"every slice holds the expected values {how} by {d:+d} element(s) (rank r's slice is [r·n, (r+1)·n), "
            f"n = {n}): an offset off by {d:+d} where the slice is cut, sent or placed")


def _span(idx: list[int]) -> str:
    """[0, 1, 2, 5, 6] -> '0-2, 5-6'"""
    runs, start = [], None
    for i, v in enumerate(idx):
        if start is None:
            start = v
        if i + 1 == len(idx) or idx[i + 1] != v + 1:
            runs.append(f"{start}-{v}" if v > start else f"{v}")
            start = None
    return ", ".join(runs[:6]) + (", ..." if len(runs) > 6 else "")


class Comparison:
    """Rank 0: one step's pieces from every rank against the reference's places, in the order of the KINDS."""

    def __init__(self, args, mesh_sizes: dict, units: list, tol, params_only_bound=None):
        self.args, self.tol, self.bound = args, tol, params_only_bound
        self.D = mesh_sizes["dp"] * mesh_sizes["cp"]
        self.m, self.tp, self.cp = args.microbatches, mesh_sizes["tp"], mesh_sizes["cp"]
        self.units = units  # per rank: [Unit]
        self.compared = {}  # kind -> pieces compared (a check that compares nothing cannot fail)
        sizes = {}   # the factors a parallel run gets wrong: the mesh's sizes and the micro-batches
        for what, k in (("dp·cp", self.D), ("dp_replicate", mesh_sizes["dp_replicate"]), ("tp", self.tp),
                        ("cp", self.cp), ("ep", args.ep), ("m, the micro-batches", self.m)):
            if k > 1:
                sizes.setdefault(k, []).append(what)
        self.scales = [s for k, names in sizes.items() for s in (
            (k, f"{k}× the expected ({k} = {' = '.join(names)}): a sum not divided by it, or a part counted {k} "
                f"times"),
            (1 / k, f"1/{k} of the expected ({k} = {' = '.join(names)}): divided by it once too often, or {k - 1} "
                    f"of {k} parts missing"))]

    def differs(self, got, want, kind=None) -> bool:
        self.compared[kind] = self.compared.get(kind, 0) + 1
        if self.bound is not None:   # AdamW's reach; a bf16 compute copy adds its own cast, 2^-8 relative
            cast = 2.0 ** -8 * want.abs().max().item() if kind == "in use" and self.args.dtype == "bfloat16" else 0.0
            return tuple(got.shape) != tuple(want.shape) or bool((got - want).abs().max() > self.bound + cast)
        return not close(got, want, self.tol)

    def first(self, s: int, every: list, ref: dict, prev_before=None):
        """The first place of step s (0-based) that differs, as a Finding, or None. every: each rank's recording
        (Recorder.step's, gathered); ref: Reference.step's; prev_before: its parameters a step earlier."""
        pieces = [p for e in every for p in e["pieces"]]
        by_kind = {k: [p for p in pieces if p.kind == k] for k in KINDS}
        self.partial = set().union(*[e["partial"] for e in every])       # tp-partial gradients, by name
        self.tied_pp = any(e["tied_pp"] for e in every)                  # a tied head on two pipeline stages
        self.backward_pieces = by_kind["backward"]
        loss = next((e["loss"] for e in every if e["loss"]["made_by"] is not None), every[-1]["loss"])
        order = list(ref["before"])   # the parameters in the model's order
        checks = [("in use", lambda: self._in_use(s, by_kind["in use"], ref, order, prev_before)),
                  ("output", lambda: self._outputs(s, by_kind["output"], ref)),
                  ("loss", lambda: self._loss(s, loss, ref)),
                  ("backward", lambda: self._backward(s, by_kind["backward"], ref, order)),
                  ("sync", lambda: self._units(s, "sync", by_kind["sync"], ref["grads"], ref, order)),
                  ("norm", lambda: self._norm(s, by_kind["norm"], ref)),
                  ("step", lambda: self._units(s, "step", by_kind["step"], ref["after"], ref, order))]
        if self.bound is not None:  # only the parameters are judged (AdamW's reach)
            checks = [c for c in checks if c[0] in ("in use", "step")]
        return next((found for _, check in checks for found in [check()] if found is not None), None)

    # -- the places (each returns its Finding, or None)
    def _in_use(self, s, pieces, ref, order, prev_before):
        fails = []
        for p in sorted(pieces, key=lambda p: (order.index(p.name) if p.name in order else 0, p.rank)):
            want = _narrowed(ref["before"][p.name], p.where)
            if not self.differs(p.value, want, "in use"):
                continue
            why, unit = None, self._unit_of(p.rank, p.name)
            if unit is not None and unit.P > 1:   # read on the unit's flat buffer: which rank's slice is wrong
                got_flat = self._flat_from(unit, {q.name: q.value for q in pieces if q.rank == p.rank})
                if got_flat is not None:
                    before = self._flat(unit, prev_before) if prev_before is not None else torch.zeros_like(got_flat)
                    want_flat = self._flat(unit, ref["before"])
                    why = _shift_pattern(got_flat, want_flat, unit.n, unit.P) or \
                        slice_pattern(got_flat, want_flat, before, unit.n, unit.P, unit.r)
            if why is None:
                before = _narrowed(prev_before[p.name], p.where) if prev_before is not None else None
                why = self._pattern(p.value, want, before=before)
            fails.append(Fail(p, p.value, want, why, f"{p.name} {_where_text(p.where)}"))
        return self._finding(s, "in use", fails)

    def _outputs(self, s, pieces, ref):
        order, fails = list(ref["outputs"]), []
        for p in sorted(pieces, key=lambda p: (order.index(p.name) if p.name in order else len(order), p.mb, p.rank)):
            rows, pos, last = p.where
            full = ref["outputs"].get(p.name)
            if full is None or pos is None or fails and p.name != fails[0].piece.name:
                continue
            want = full[rows][:, pos]
            want = want if last is None else want[..., last[0]:last[1]]
            if not self.differs(p.value, want, "output"):
                continue
            same = [q for q in pieces if q.name == p.name and q.mb == p.mb and q.rank != p.rank
                    and torch.equal(q.where[0], rows) and q.where[1] is not None and torch.equal(q.where[1], pos)
                    and q.where[2] == last]
            why = self._pattern(p.value, want, holders=[(p, p.value)] + [(q, q.value) for q in same])
            if why.startswith("wrong"):
                why += self._positions(p.value, want, pos)
            where = f"rows {_span(rows.tolist())} of the global batch, positions {_span(pos.tolist())}" + (
                f", vocabulary [{last[0]}:{last[1]}]" if last else "")
            fails.append(Fail(p, p.value, want, why, f"{p.name}'s output, micro-batch {p.mb} ({where})"))
        return self._finding(s, "output", fails)

    def _loss(self, s, loss, ref):
        got, want = (torch.tensor(v, dtype=torch.float64) for v in (loss["value"], ref["loss"]))
        if not self.differs(got, want, "loss"):
            return None
        why = (f"{got.item():.10g} where one process has {want.item():.10g} ({(got / want).item():.6g}×) while "
               f"every module's output agrees: the loss itself — its reduction over the vocabulary, the targets it "
               f"is given, or what it is divided by")
        # (the global loss: a rank only where a collective made it, the vocab-parallel loss's)
        return Finding("loss", s, loss["rank"] if loss["made_by"] else None, "the loss", (got - want).abs().item(),
                       why, loss["made_by"], "in the loss")

    def _backward(self, s, pieces, ref, order):
        """Σ over the ranks holding the same slice (tp-partial ones: over tp too) ÷ dp·cp, against the gradient."""
        groups = {}
        for p in pieces:
            whole = p.name in self.partial or p.name == "tok_embeddings.weight" and self.tied_pp
            groups.setdefault((p.name, p.where[1], None if whole else p.tp), []).append(p)
        summed = {k: sum(p.value for p in ps if not p.none) / self.D for k, ps in groups.items()}
        fails = []
        for key, ps in sorted(groups.items(), key=lambda kv: (-order.index(kv[0][0]) if kv[0][0] in order else 0,
                                                              kv[1][0].rank)):
            name, narrow, _ = key
            if ref["grads"].get(name) is None and all(p.none for p in ps):
                continue
            full = ref["grads"].get(name)
            full = full if full is not None else torch.zeros(ps[0].where[0], dtype=torch.float64)
            want = _narrowed(full, ps[0].where)
            got = summed[key] if torch.is_tensor(summed[key]) else torch.zeros_like(want)
            if not self.differs(got, want, "backward"):
                continue
            cands, others = [], [k for k in groups if k[:2] == key[:2] and k != key]
            if others and close(got + sum(summed[k] for k in others), want, 1e-8):  # the other tp ranks' too?
                ranks = sorted({q.rank for k in [key] + others for q in groups[k]})
                cands.append((f"the ranks' gradients add up to the expected only summed over the tp ranks too "
                              f"(ranks {ranks}): each tp rank holds a part and the sum over tp is missing — an "
                              f"all-reduce of the input gradient in backward (f's), or a partial gradient never "
                              f"summed", got))
            ranks = sorted(p.rank for p in ps)
            held = (f"summed over ranks {ranks}" + (f" ÷ {self.D}" if self.D > 1 else "")) if len(ps) > 1 else \
                f"on rank {ranks[0]}"
            fails.append(Fail(ps[0], got, want, self._pattern(got, want, candidates=cands),
                              f"{name} {_where_text(ps[0].where)}, {held}"))
        return self._finding(s, "backward", fails)

    def _units(self, s, kind, pieces, tensors, ref, order):
        """Each rank's slice of a ZeRO unit against the one-process tensors' (sync: gradients; step: values), read
        on the parameter of its first wrong element."""
        fails = []
        for p in pieces:
            unit = self.units[p.rank][p.where]
            flat, lo = self._flat(unit, tensors), unit.r * unit.n
            want = flat[lo:lo + unit.n]
            if not self.differs(p.value, want, kind):
                continue
            bound = self.bound if self.bound is not None else self.tol * max(1.0, want.abs().max().item())
            i = self._param_at(unit, lo + int(((p.value - want).abs() > bound).nonzero()[0]))
            start, end = max(unit.offsets[i], lo), min(unit.offsets[i] + unit.numels[i], lo + unit.n)   # in the flat
            part = slice(start - lo, end - lo)
            cands, before = [], None
            if kind == "sync":
                mine = self._flat_from(unit, {q.name: q.value for q in self.backward_pieces if q.rank == p.rank},
                                       zeros=True)[start:end]
                cands += [(f"this rank's own gradient ÷ {self.D}: never summed over the ranks that hold it (the "
                           f"sync's sum is missing)", mine / self.D)] if self.D > 1 else []
                cands += [("this rank's own gradient, " + ("neither summed nor divided" if self.D > 1 else
                                                           "never summed with the other ranks' parts"), mine)]
            else:
                before = self._flat(unit, ref["before"])[start:end]
                cands.append(("as before the step: this slice was not updated", before))
            cands += self._shifted(flat, start, end - start, unit.n, unit.P)
            holders = [(q, q.value[part]) for q in pieces if self.units[q.rank][q.where].names == unit.names
                       and self.units[q.rank][q.where].r == unit.r]
            why = self._pattern(p.value[part], want[part], candidates=cands, before=before, holders=holders)
            name, a, b = unit.names[i], start - unit.offsets[i], end - unit.offsets[i]
            what = f"{name} {_where_text(unit.wheres[i])}" + (
                f", its elements [{a}:{b}] (the slice [{lo}:{lo + unit.n}] of a ZeRO unit over ranks {unit.group})"
                if unit.P > 1 else "")
            fails.append(Fail(p, p.value[part], want[part], why, what, order.index(name) if name in order else 0))
        # (gradients nearest the loss first, as backward makes them; parameters in the model's order)
        fails.sort(key=lambda f: (-f.order if kind == "sync" else f.order, f.piece.rank))
        return self._finding(s, kind, fails)

    def _norm(self, s, pieces, ref):
        if ref["norm"] is None:
            return None
        want = torch.tensor(ref["norm"], dtype=torch.float64)
        return self._finding(s, "norm", [Fail(p, p.value, want, self._pattern(p.value, want),
                                              "the global gradient norm")
                                         for p in pieces if self.differs(p.value, want, "norm")])

    # -- what differs, in words
    def _pattern(self, got, want, candidates=(), before=None, holders=None) -> str:
        if before is not None:
            return pattern(got - before, want - before, self.scales, [(label, c - before) for label, c in candidates]) \
                + " (read on the step's update)"
        why = pattern(got, want, self.scales, candidates)
        if holders and len(holders) > 1 and why.startswith("wrong"):
            # several ranks hold this same place, differently: do their values add up to it?
            vals, ranks = [v for _, v in holders], sorted(q.rank for q, _ in holders)
            if close(sum(vals), want, 1e-8):
                return (f"a part of a sum: the values of ranks {ranks}, which hold the same place, add up to the "
                        f"expected — the all-reduce (sum) over them is missing")
        return why

    def _positions(self, got, want, pos) -> str:
        """Which sequence positions (and cp chunks) are wrong: what a wrong chunk or mask shows."""
        err = (got - want).abs().amax(dim=tuple(d for d in range(got.dim()) if d != 1))
        scale = max(1.0, want.abs().max().item())
        bad = [int(pos[i]) for i in range(len(pos)) if err[i] > TOL * scale]
        good = [int(pos[i]) for i in range(len(pos)) if err[i] <= TOL * scale]
        text = f"; wrong at sequence positions {_span(sorted(bad))}"
        if self.cp > 1:
            size = self.args.seq_len // (2 * self.cp)
            text += f" (zigzag chunks {sorted({p // size for p in bad})} of {2 * self.cp})"
        return text + (f", right at {_span(sorted(good))}" if good else "")

    def _shifted(self, flat, start, k, n, P):
        out = []
        for d in [1, -1, 2, -2] + [j * n for j in range(-(P - 1), P) if j]:
            if 0 <= start + d and start + d + k <= len(flat):
                what = (f"the slice {d // n:+d} ranks away" if abs(d) >= n and d % n == 0 else f"shifted by {d:+d} "
                        f"elements")
                out.append((f"the expected values {what}: an offset off by {d:+d} in the flat buffer (rank r holds "
                            f"[r·n, (r+1)·n), n = {n})", flat[start + d:start + d + k]))
        return out

    # -- ZeRO units
    def _unit_of(self, rank, name):
        return next((u for u in self.units[rank] if name in u.names), None)

    @staticmethod
    def _param_at(unit, index):
        return max(i for i, o in enumerate(unit.offsets) if o <= index)

    def _flat(self, unit, tensors):
        flat = torch.zeros(unit.n * unit.P, dtype=torch.float64)
        for name, off, k, where in zip(unit.names, unit.offsets, unit.numels, unit.wheres):
            t = tensors.get(name)
            if t is not None:
                flat[off:off + k] = _narrowed(t, where).reshape(-1)
        return flat

    def _flat_from(self, unit, values, zeros=False):
        """A unit's flat buffer from one rank's per-parameter values (None if one is missing)."""
        flat = torch.zeros(unit.n * unit.P, dtype=torch.float64)
        for name, off, k in zip(unit.names, unit.offsets, unit.numels):
            v = values.get(name)
            if v is None or not v.dim():
                if zeros:
                    continue
                return None
            flat[off:off + k] = v.reshape(-1)
        return flat

    # -- the finding
    def _finding(self, s, kind, fails):
        if not fails:
            return None
        f = fails[0]
        diff = (f.got - f.want).abs().max().item() if f.got.shape == f.want.shape else float("nan")
        ranks = sorted({g.piece.rank for g in fails})
        same = sum(g.why == f.why for g in fails)
        count = f"{len(fails)} piece(s) at this place differ, on rank(s) {ranks}" + (
            "; all the same way" if same == len(fails) > 1 else "")
        return Finding(kind, s, f.piece.rank, f.what, diff, f.why, f.piece.made_by, f.piece.window_text, count)


# ---- the replay -----------------------------------------------------------------------------------------------

def _replayed(args, device, tokens, last: int, ref_args, reference_run, tol, bound=None) -> tuple:
    """Replay steps [start, last) of the run `args` with every place recorded, rank 0 comparing them with one
    process; stop at the first place that differs. Returns (the Finding or None, the first step replayed, how many
    pieces of each kind were compared)."""
    mesh = train.Mesh(**{d: getattr(args, d) for d in train.DIMS}, ep=args.ep)
    trainer = train.Trainer(args, mesh, device)
    resume = train.resume_path(args)
    start = trainer.load(resume) if resume else 0
    if resume is None and args.init_from:
        trainer.init_from(args.init_from, args.init_read)
    rec, me, prev = Recorder(trainer), dist.get_rank(), None
    units = [None] * dist.get_world_size()
    dist.all_gather_object(units, rec.units)
    if me == 0:
        ref = Reference(ref_args, device, reference_run)
        for s in range(start):
            ref.step(s, record=False)
        cmp = Comparison(args, dict(dp=trainer.dp, cp=trainer.cp, tp=trainer.tp, dp_replicate=args.dp_replicate),
                         units, tol, bound)
    for s in range(start, last):
        with rec.step(s):
            share = trainer.step(s, tokens)
        loss = trainer.global_loss(share)
        mine = dict(pieces=rec.pieces, loss=dict(value=loss, rank=me, made_by=rec.loss_made_by),
                    partial=rec.partial, tied_pp=rec.tied_pp)
        every = [None] * dist.get_world_size() if me == 0 else None
        dist.gather_object(mine, every, dst=0)
        verdict = [None]
        if me == 0:
            want = ref.step(s)
            found = cmp.first(s, every, want, prev)
            prev = want["before"]
            verdict = [(found, cmp.compared)]
        dist.broadcast_object_list(verdict, src=0)
        found, compared = verdict[0]
        if found is not None:
            return found, start, compared
    return None, start, compared


def first_difference(args, device, last: int, reference_run) -> tuple[list[str], bool]:
    """On every rank: replay the run's steps up to `last` (1-based: the first whose loss or norm differs) with every
    place recorded and compared with one process (reference_run: see Reference). Returns the report's lines and
    whether it found a bug (False: the difference is float32's or bf16's rounding), the same on every rank."""
    tokens = load_corpus(args.data, tokenizer=checkpoint.tokenizer_of(args.init_from))
    # float64, and without float8: float8 quantizes every matmul by design, which no one-process run does, so only
    # the layout itself is held exact; the float8 run is then judged as float32's and bf16's are (AdamW's reach)
    exact = args.dtype == "float64" and not args.float8
    run64 = args if exact else argparse.Namespace(**dict(vars(args), dtype="float64", float8=False))
    kind = args.dtype + (" float8" if args.float8 else "")
    found, start, compared = _replayed(run64, device, tokens, last, run64, reference_run, TOL)
    steps = f"step {start + 1}" if last == start + 1 else f"steps {start + 1}-{last}"
    seen = ", ".join(f"{compared.get(k, 0)} {k}" for k in KINDS) + " pieces compared"
    if found is not None:
        return _say(found, start) + [
            f"  verdict: a bug — in float64 a correct layout equals one process to rounding, within {TOL:g} of the "
            f"values' scale (measured ~1e-15); this is off by {found.diff:.2e}" + ("" if exact else
            f" (found in this layout replayed in float64{' without float8' if args.float8 else ''}: a {kind} run "
            f"itself cannot be held that tight)")], True
    if exact:
        return [f"  no place of {steps} differs from one process by more than {TOL:g} when the run is replayed "
                f"({seen}): the run itself is not deterministic (a race, an uninitialised buffer), or what differs "
                f"is outside the places compared"], True
    # float32, bf16: the layout is exact; are the run's own parameters within what rounding can reach?
    reach = adamw_reach(args.lr, last)   # (lr_at never exceeds --lr: the bound holds for the schedule too)
    # (the reference holds its parameters as the run stores them, train.store_dtype: fp32 for a bf16 run, float64
    #  for a float64 one with float8)
    found, start, _ = _replayed(args, device, tokens, last, args, reference_run, TOL, bound=reach)
    if found is not None:
        return _say(found, start) + [
            f"  verdict: a bug that only {kind} shows — in float64 this layout equals one process at every "
            f"place of {steps}, but in {kind} this parameter is off by {found.diff:.2e}, beyond AdamW's reach "
            f"2·lr·Σc_t = {reach:.2e} (lab/baseline.adamw_reach), which no rounding exceeds"], True
    why = (f"{args.dtype}'s rounding, summed in another order by another layout" if not args.float8 else
           f"float8's quantization of every matmul, which the one-process run does not make, and {args.dtype}'s "
           f"rounding")
    return [f"  verdict: rounding, not a bug — replayed in float64{' without float8' if args.float8 else ''} this "
            f"layout equals one process at every place of {steps} (within {TOL:g}; {seen}), and in {kind} every "
            f"parameter stays within AdamW's reach 2·lr·Σc_t = {reach:.2e} of one process's "
            f"(lab/baseline.adamw_reach): {why}"], False


def _say(f: Finding, start: int) -> list[str]:
    """The report's first lines: the place, what differs there and how, the collective that made it, what agreed."""
    who, on = ("every rank", "any rank") if f.rank is None else (f"rank {f.rank}", f"rank {f.rank}")
    lines = [f"  first difference from one process: step {f.step + 1}, {WHAT[f.kind]}, {who}: {f.what} — "
             f"off by {f.diff:.2e}: {f.why}",
             f"  made by: {f.made_by} (the last collective {f.window_text} on {on})" if f.made_by else
             f"  made by: no collective ran {f.window_text} on {on}"]
    earlier = (f"steps {start + 1}-{f.step}" if f.step > start + 1 else f"step {start + 1}") if f.step > start else ""
    here = ", ".join(WHAT[k] for k in KINDS[:KINDS.index(f.kind)])
    if earlier or here:
        lines.append("  equal to one process before it: " + "; ".join(
            x for x in (earlier and f"every place of {earlier}", here and f"in step {f.step + 1} {here}") if x))
    return lines + ([f"  {f.count}"] if f.count else [])
