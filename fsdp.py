"""Lesson 2 — ZeRO stages 1-3 and FSDP: shard what data parallel keeps P times.

Plain data parallel (stage 0) keeps on every one of P ranks the whole model state: parameters
(b_p bytes per element), gradients (b_g) and the optimizer state (K bytes: Adam's two fp32 moments,
8, plus a 4-byte fp32 master copy when the parameters are computed in bf16). ZeRO removes the
redundancy in three steps:

    stage 1  shard the optimizer state        (b_p + b_g)·Ψ + K·Ψ/P
    stage 2  + shard the gradients             b_p·Ψ + (b_g + K)·Ψ/P
    stage 3  + shard the parameters (FSDP)     (b_p + b_g + K)·Ψ/P
    stage 0  (no sharding)                     (b_p + b_g + K)·Ψ

Every unit's parameters are flattened into one buffer of N elements (N padded to a multiple of P),
so "my shard" is the contiguous slice [r·N/P, (r+1)·N/P).

Communication per step (elements; gradients are reduced in fp32, parameters are gathered in their
compute dtype; a ring sends (P-1)/P of the API bytes per all-gather or reduce-scatter and 2(P-1)/P
per all-reduce):
    stage 0     all-reduce(grads)                          = RS + AG  -> 2Ψ
    stage 1, 2  reduce-scatter(grads) + all-gather(params)            -> 2Ψ
    stage 3     all-gather before forward, again before backward, reduce-scatter -> 3Ψ
                (the root unit is not freed between its forward and backward, and
                 reshard_after_forward=False skips the second all-gather: 2Ψ)

Overlap: stage 3 prefetches the next unit's all-gather while the current one computes (forward
order, then reverse order in backward); stages 2-3 reduce-scatter a unit as soon as its gradients
are complete. On NCCL that traffic runs beside the compute; on gloo, CPU threads carry the
all-gathers, and reduce-scatters are waited for at once (their threads would compete with compute).

The user's loop does not change:  loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()
— the one extra call is `opt = shard_model(model, stage=...)`. Stage 1 also works alone on any
parameters: `ZeroOptimizer.from_params(...)`.
"""

import argparse
import contextlib
import itertools
import math
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from instruments import model_state_bytes
from mesh import all_gather_single, reduce_scatter_single

# ---- the formulas the measurements are compared with ---------------------------------------------


def zero_state_formula(stage: int, numel: int, P: int, param_bytes: int = 4, master_bytes: int = 0,
                       grad_bytes: int | None = None, state_bytes: int = 8) -> dict:
    """Model-state bytes per rank by category (Rajbhandari et al.; K = master_bytes + state_bytes).
    grad_bytes: bytes a *held* gradient takes; stages 0-1 hold the local gradient in the compute
    dtype (default param_bytes), stages 2-3 hold the reduced fp32 shard (4)."""
    grad_bytes = (param_bytes if stage <= 1 else 4) if grad_bytes is None else grad_bytes
    sharded = lambda on: numel / P if on else numel  # noqa: E731  (Ψ/P once the stage shards it)
    out = dict(parameters=param_bytes * sharded(stage >= 3), master=master_bytes * sharded(stage >= 1),
               gradients=grad_bytes * sharded(stage >= 2), optimizer=state_bytes * sharded(stage >= 1))
    return dict(out, total=sum(out.values()))


def zero_comm_formula(stage: int, numel: int, P: int, param_bytes: int = 4, root_numel: int = 0,
                      reshard_after_forward: bool = True, replicas: int = 1) -> dict:
    """API bytes per step by collective ({op: bytes}); Ψ = numel padded, gradients reduced in fp32.
    replicas > 1 (HSDP): the reduced gradient shards are all-reduced across replicas."""
    if stage == 0:
        return {"all_reduce": 4 * numel}
    again = numel - root_numel if stage == 3 and reshard_after_forward else 0  # before backward, but the root
    out = {"reduce_scatter": 4 * numel, "all_gather": param_bytes * (numel + again)}
    return dict(out, all_reduce=4 * numel // P) if replicas > 1 else out


# ---- one unit's parameters, flattened -------------------------------------------------------------

class FlatUnit:
    """The parameters of one unit in one flat buffer [N]; this rank keeps the slice [r·n, (r+1)·n).

    buf     [N] compute dtype: what forward uses; the module's parameters are views of it
            (stage 3 frees its storage between uses).
    shard   [n] compute dtype: my slice (a view of buf in stages 0-2; its own tensor in stage 3).
    master  nn.Parameter [n], fp32 (the parameters' own dtype): the tensor the optimizer steps.
            It *is* the shard when no cast is needed. Stage 0 has P = 1, r = 0: my slice is all of buf.
    """

    def __init__(self, entries, stage, group, param_dtype=None, init_fn=None):
        # entries: [(qualified name, owning module or None, attribute name, parameter)]
        self.stage, self.group = stage, group
        self.P, self.r = (dist.get_world_size(group), dist.get_rank(group)) if stage > 0 else (1, 0)
        self.names, self.shapes = [e[0] for e in entries], [tuple(e[3].shape) for e in entries]
        self.numels = [math.prod(s) for s in self.shapes]
        self.N = -(-sum(self.numels) // self.P) * self.P  # padded: every rank gets n = N/P elements
        self.n = self.N // self.P
        p0 = entries[0][3]
        if p0.is_meta:  # materialise where our collectives run; a bf16 model gets an fp32 master
            nccl = dist.get_backend(group) == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
            master_dtype = torch.promote_types(p0.dtype, torch.float32)
        else:
            master_dtype, device = p0.dtype, p0.device
        self.dtype = param_dtype or master_dtype

        # The fp32 master slice [lo, lo + n), materialised from my part of each parameter only.
        lo = self.r * self.n
        master = torch.zeros(self.n, dtype=master_dtype, device=device)
        for (name, _, _, p), off, k in zip(entries, self.offsets(), self.numels):
            a, b = max(off, lo), min(off + k, lo + self.n)
            if a < b:  # this parameter overlaps my slice
                full = init_fn(name, p.shape) if p.is_meta else p.detach()
                master[a - lo:b - lo] = full.reshape(-1)[a - off:b - off].to(device)

        self.buf = torch.empty(self.N, dtype=self.dtype, device=device)
        same = self.dtype == master_dtype
        if stage == 3:  # my slice lives apart from buf, which holds bytes only while gathered
            self.shard = master if same else torch.empty_like(master, dtype=self.dtype)
        else:           # my slice is a view of buf; with no cast the optimizer steps it in place
            self.shard = self.buf[lo:lo + self.n]
            master = self.shard.copy_(master) if same else master
        self.master = nn.Parameter(master)
        self.publish()  # fill my compute slice (stages 1-2: and gather everyone else's)

        # Replace every parameter by a view of buf. `.data` gives the views their own version
        # counter, so refilling buf (stage 3) does not trip autograd's saved-tensor check.
        self.params = []
        for (name, owner, attr, p), view in zip(entries, self.views(self.buf.data)):
            if owner is None:  # bare parameters (ZeroOptimizer.from_params): re-point in place
                p.data = view
            else:
                p = owner._parameters[attr] = nn.Parameter(view, requires_grad=p.requires_grad)
            self.params.append(p)
        self.gather_work, self.ready = None, 0  # for the hooks: a gather in flight; gradients arrived
        if stage == 3:
            self.free()

    def offsets(self):
        return [0, *itertools.accumulate(self.numels)][:-1]

    def views(self, flat):
        """A flat [N] tensor as one view per parameter, in its shape."""
        return [t.view(s) for t, s in zip(flat[:sum(self.numels)].split(self.numels), self.shapes)]

    @torch.no_grad()
    def publish(self):
        """After the master slice changed: refresh my compute slice; stages 1-2 all-gather buf."""
        if self.shard.data_ptr() != self.master.data_ptr():
            self.shard.copy_(self.master)  # e.g. fp32 -> bf16
        if self.stage in (1, 2):
            all_gather_single(self.buf, self.shard, group=self.group)

    # stage 3: buf holds bytes only between unshard() and free() -----------------------------------
    def unshard(self, async_op=False):
        """All-gather buf from the shards: [n] per rank -> [N] (async: a prefetch); no-op if gathered."""
        if self.gather_work is None and self.buf.untyped_storage().size() == 0:
            self.buf.untyped_storage().resize_(self.N * self.buf.element_size())
            self.gather_work = all_gather_single(self.buf, self.shard, group=self.group, async_op=True)
        if not async_op:  # the caller needs the parameters now (a prefetch may be in flight)
            self.wait()

    def wait(self):
        if self.gather_work is not None:
            self.gather_work.wait()
            self.gather_work = None

    def free(self):
        self.wait()
        self.buf.untyped_storage().resize_(0)  # every parameter view now has no bytes


# ---- the optimizer that owns the shards -----------------------------------------------------------

class ZeroOptimizer:
    """Steps this rank's fp32 master slices with any torch.optim class; reduces gradients first.

    stage 0: all-reduce the full gradient at step() (the naive data-parallel baseline)
    stage 1: reduce-scatter the gradient at step(); step my slice; all-gather the parameters
    stage 2: gradients were reduce-scattered during backward (hooks); step; all-gather
    stage 3: same as 2, but there is nothing to all-gather: forward gathers what it needs
    """

    def __init__(self, units, optimizer_cls, stage, group=None, replicate_group=None,
                 max_grad_norm=None, **optimizer_kwargs):
        self.units, self.stage, self.group, self.max_grad_norm = units, stage, group, max_grad_norm
        R = dist.get_world_size(replicate_group) if replicate_group is not None else 1
        self.replicate_group = replicate_group if R > 1 else None  # a replica of one has nothing to average
        self.dp_size = dist.get_world_size(group) * R  # gloo has no ReduceOp.AVG: sum, then divide
        self.inner = optimizer_cls([u.master for u in units], **optimizer_kwargs)
        # Leave reductions running behind the rest of backward only on NCCL (its own CUDA stream). On
        # gloo they run on CPU threads that compete with compute: measured slower when ranks share cores.
        self.async_reduce = dist.get_backend(group) == "nccl"
        self.pending = []  # reductions in flight: (unit, work, reduced output, input kept alive)
        self.grad_norm = None

    @classmethod
    def from_params(cls, params, optimizer_cls=torch.optim.AdamW, group=None, **optimizer_kwargs):
        """Stage 1 on its own, like ZeroRedundancyOptimizer: any parameters, any optimizer."""
        params = [p for p in params if p.requires_grad]
        unit = FlatUnit([(f"param{i}", None, None, p) for i, p in enumerate(params)], 1, group)
        return cls([unit], optimizer_cls, 1, group, **optimizer_kwargs)

    state = property(lambda self: self.inner.state)  # what LR schedulers and checkpoints look at
    param_groups = property(lambda self: self.inner.param_groups)

    def zero_grad(self, set_to_none=True):
        for p in [p for u in self.units for p in u.params + [u.master]]:
            p.grad = None

    def reduce_unit(self, u):
        """Stage 0: all-reduce one unit's fp32 gradient [N]; else reduce-scatter it -> my slice [n]."""
        g = torch.zeros(u.N, dtype=u.master.dtype, device=u.master.device)  # zeros where there is none
        for p, view in zip(u.params, u.views(g)):
            if p.grad is not None:
                view.copy_(p.grad)
        if self.stage == 0:
            out, work = g, dist.all_reduce(g, group=self.group, async_op=True)
        else:
            out = torch.empty(u.n, dtype=g.dtype, device=g.device)
            work = reduce_scatter_single(out, g, group=self.group, async_op=True)
        if not self.async_reduce:
            work.wait()
        self.pending.append((u, work, out, g))

    def finish_reduction(self):
        """Wait for the reductions; average; all-reduce shards across replicas (HSDP)."""
        for u, work, out, _ in self.pending:
            work.wait()
            if self.replicate_group is not None:
                dist.all_reduce(out, group=self.replicate_group)
            out.div_(self.dp_size)
            u.master.grad = out if u.master.grad is None else u.master.grad + out
        self.pending.clear()

    @torch.no_grad()
    def step(self):
        if self.stage <= 1:  # stages 2-3 reduced every unit during backward (hooks)
            for u in self.units:
                self.reduce_unit(u)
        self.finish_reduction()
        if self.stage == 0:  # DDP semantics: every .grad holds the averaged gradient
            for u in self.units:
                for p, g in zip(u.params, u.views(u.master.grad)):
                    p.grad = g.to(p.dtype)
        if self.max_grad_norm is not None:
            self.clip_grad_norm_(self.max_grad_norm)
        self.inner.step()
        for u in self.units:
            u.publish()  # the new compute copy of my slice; stages 1-2 gather the others' slices
            if self.stage <= 1:
                u.master.grad = None  # the reduced gradient lived only for this step

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so their global L2 norm is at most max_norm (torch's formula)."""
        grads = [u.master.grad for u in self.units if u.master.grad is not None]
        sq = torch.as_tensor(sum(g.float().pow(2).sum() for g in grads), dtype=torch.float32)
        if self.stage > 0:
            dist.all_reduce(sq, group=self.group)  # shards of one replica make the whole gradient
        self.grad_norm = sq.sqrt()
        coef = (max_norm / (self.grad_norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return self.grad_norm

    # measurements and checkpoints ----------------------------------------------------------------
    def state_bytes(self) -> dict:
        """Model-state bytes this rank holds, by category (storage-based)."""
        compute = [p for u in self.units for p in u.params] + [u.shard for u in self.units]
        masters = [u.master for u in self.units if u.master.data_ptr() != u.shard.data_ptr()]  # a cast apart
        shards = [u.master.grad for u in self.units if u.master.grad is not None]
        ms = model_state_bytes(compute, self.inner, extra={"master": masters, "grad_shards": shards})
        ms["gradients"] += ms.pop("grad_shards")
        return ms

    def full_state_dict(self) -> dict:
        """{name: full fp32 tensor} on every rank, gathered from the master shards."""
        out = {}
        for u in self.units:
            full = u.master.detach()
            if self.stage > 0:
                full = torch.empty(u.N, dtype=u.master.dtype, device=u.master.device)
                all_gather_single(full, u.master.detach().clone(), group=self.group)
            out.update((name, v.clone()) for name, v in zip(u.names, u.views(full)))
        return out

    @torch.no_grad()
    def load_full_state_dict(self, sd: dict | None, src: int = 0):
        """Load a full state dict held by global rank `src` into every rank's shards."""
        for u in self.units:
            full = torch.zeros(u.N, dtype=u.master.dtype, device=u.master.device)
            if dist.get_rank() == src:
                for name, view in zip(u.names, u.views(full)):
                    view.copy_(sd[name])
            dist.broadcast(full, src=src)
            u.master.copy_(full[u.r * u.n:(u.r + 1) * u.n])
            u.publish()


# ---- the entry point: hooks that drive the units ---------------------------------------------------

def shard_model(model: nn.Module, stage: int, optimizer_cls=torch.optim.AdamW, *, group=None,
                replicate_group=None, units=None, param_dtype=None, reshard_after_forward=True,
                prefetch=True, max_grad_norm=None, init_fn=None, **optimizer_kwargs) -> ZeroOptimizer:
    """Shard `model` in place by ZeRO stage 0-3 and return the optimizer that owns the shards.

    units: module classes (default: the model's transformer Block) or a list of submodules; each
    is one flat unit, the remaining parameters form the root unit. group: the ranks parameters are
    sharded over; replicate_group: HSDP's replicas (stages 1-3). param_dtype: compute dtype (bf16
    for mixed precision; master, optimizer state and gradient reduction stay fp32). init_fn(name,
    shape): values for parameters on the meta device (only my slice is kept).
    """
    from model import Block
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if stage == 0 and replicate_group is not None:
        raise ValueError("stage 0 already replicates everything: pass replicate_group only with stage 1, 2 or 3")
    if param_dtype is not None and not param_dtype.is_floating_point:
        raise ValueError(f"param_dtype must be a floating dtype such as torch.bfloat16, got {param_dtype}")
    if init_fn is None and any(p.is_meta for p in model.parameters()):
        raise ValueError("the model is on the meta device: pass init_fn(name, shape) to materialise the shards")
    units = (Block,) if units is None else units
    if isinstance(units, tuple) and all(isinstance(c, type) for c in units):
        units = [m for m in model.modules() if isinstance(m, units) and m is not model]
    else:
        units, known = list(units), {id(m) for m in model.modules()}
        if not all(isinstance(m, nn.Module) and id(m) in known and m is not model for m in units):
            raise ValueError("units must be module classes or a list of submodules of the model")

    # Collect every unit's parameters before flattening any (flattening replaces them).
    names, taken, per_unit = {id(m): n for n, m in model.named_modules()}, set(), []
    for um in units + [model]:  # the root unit last: it gets what no unit took
        entries = []
        for mname, m in um.named_modules(prefix=names[id(um)]):
            for attr, p in m.named_parameters(recurse=False):
                if id(p) not in taken and p.requires_grad:
                    taken.add(id(p))
                    entries.append((f"{mname}.{attr}" if mname else attr, m, attr, p))
        per_unit.append((um, entries))
    flat = [(um, FlatUnit(e, stage, group, param_dtype, init_fn)) for um, e in per_unit if e]
    opt = ZeroOptimizer([u for _, u in flat], optimizer_cls, stage, group, replicate_group,
                        max_grad_norm, **optimizer_kwargs)
    if stage >= 2:
        _add_gradient_hooks(opt, free_after=stage == 3)
    if stage == 3:
        _add_unshard_hooks(flat, flat[-1][1] if flat[-1][0] is model else None, reshard_after_forward, prefetch)
    return opt


def _add_gradient_hooks(opt: ZeroOptimizer, free_after: bool):
    """Stages 2-3: when every parameter of a unit has its gradient, reduce-scatter the unit's
    gradient at once and drop the full-size one; at the end of backward, wait for them all."""
    def finish():
        opt.finish_reduction()
        for u in opt.units:
            u.ready = 0

    def on_grad(u):
        u.ready += 1
        if u.ready < len(u.params):
            return
        opt.reduce_unit(u)
        for q in u.params:
            q.grad = None  # the full gradient is gone: I keep only my reduced slice
        if free_after:
            u.free()
        if len(opt.pending) == 1:  # the first unit this backward: wait for all at its end
            torch.autograd.Variable._execution_engine.queue_callback(finish)

    for u in opt.units:
        for p in u.params:
            p.register_post_accumulate_grad_hook(lambda p, u=u: on_grad(u))


def _add_unshard_hooks(flat, root, reshard_after_forward, prefetch):
    """Stage 3: all-gather a unit before its forward and before its backward, free it after its
    forward; prefetch the next unit's all-gather (forward order, then reverse in backward)."""
    order = []  # units in the order their forwards ran (recorded on the first step)

    def gather(u, step):  # u now, and the next unit in this pass's direction in the background
        u.unshard()
        i = order.index(u) + step
        if prefetch and 0 <= i < len(order) and order[i] is not root:
            order[i].unshard(async_op=True)  # overlaps with this unit's compute

    def pre_forward(u):
        if u not in order:
            order.append(u)
        gather(u, +1)

    def pre_backward(u):
        if u.ready < len(u.params):  # not yet reduced and freed in this backward
            gather(u, -1)

    def post_forward(u, output):
        if u is root:
            return  # backward starts right here: keep the root gathered until its gradients are reduced
        if reshard_after_forward:
            u.free()
        for t in output if isinstance(output, (tuple, list)) else [output]:
            if isinstance(t, torch.Tensor) and t.requires_grad:  # (none under no_grad)
                t.register_hook(lambda g, u=u: pre_backward(u))  # runs before the unit's backward

    for um, u in flat:
        um.register_forward_pre_hook(lambda m, a, u=u: pre_forward(u))
        um.register_forward_hook(lambda m, a, o, u=u: post_forward(u, o))


# ---- a measured training run (torchrun demo, tests and the notebook call it) ----------------------

def train_and_measure(stage, model_name="tiny", steps=3, batch=8, seq=32, lr=1e-2, param_dtype=None,
                      group=None, replicate_group=None, meta=False, seed=0, dtype=torch.float32,
                      track_peak=False, **shard_kwargs) -> dict:
    """Shard the shared model at `stage`, train `steps` global batches with AdamW and return the
    full parameters, the losses, and what the last step measured next to the formulas.
    meta: build on the meta device (only my slices are ever materialised).
    track_peak: run the last step under PyTorch's MemTracker (slow) for the peak bytes."""
    from data import get_batch, load_corpus
    from instruments import CommCounter, memory_tracker, sync
    from model import build_model, get_config, init_tensor
    cfg, P = get_config(model_name), dist.get_world_size(group)
    R = dist.get_world_size(replicate_group) if replicate_group is not None else 1
    dp_rank = dist.get_rank(group) + P * (dist.get_rank(replicate_group) if R > 1 else 0)  # replica-major
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    model = build_model(cfg, seed, dtype, device="meta" if meta else device)
    opt = shard_model(model, stage, group=group, replicate_group=replicate_group, param_dtype=param_dtype,
                      init_fn=(lambda name, shape: init_tensor(cfg, name, shape, seed)) if meta else None,
                      lr=lr, **shard_kwargs)
    tokens, losses, times, peak = load_corpus(), [], [], None
    for s in range(steps):
        x, y = get_batch(tokens, s, batch, seq, seed, dp_rank, P * R, device=device)
        tracked = track_peak and s == steps - 1
        with memory_tracker(model, opt.inner) if tracked else contextlib.nullcontext() as mt, \
                warnings.catch_warnings(), CommCounter() as comm:
            # MemTracker warns about parameters whose .grad is None (ours, after reduce-scatter)
            warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper")
            t = time.perf_counter()
            loss = model(x, y)
            loss.backward()
            opt.step()
            sync(device)
            times.append(time.perf_counter() - t)
        if tracked:  # {device: {category: bytes}}
            peak = next(iter(mt.get_tracker_snapshot("peak").values()))["Total"]
        memory = opt.state_bytes()  # at rest, after the step (before zero_grad)
        opt.zero_grad()
        loss = loss.detach().float()
        dist.all_reduce(loss)  # the global batch's loss, for printing (outside the counter)
        losses.append(loss.item() / (P * R))
    u0, numel = opt.units[0], sum(u.N for u in opt.units)
    root_numel = opt.units[-1].N if opt.units[-1].names[0] == "tok_embeddings.weight" else 0
    pb, mb = u0.buf.element_size(), 0 if u0.dtype == u0.master.dtype else 4
    return dict(
        state={k: v.cpu().numpy() for k, v in opt.full_state_dict().items()}, losses=losses, peak=peak,
        step_time=statistics.median((times[1:-1] if track_peak else times[1:]) or times),  # 0 warms up
        comm=comm.summary(), events=[(e.op, e.group_ranks, e.api_bytes) for e in comm.events],
        memory=memory, numel=numel, root_numel=root_numel, P=P, param_bytes=pb,
        memory_formula=zero_state_formula(stage, numel, P, pb, mb),
        comm_formula=zero_comm_formula(stage, numel, P, pb, root_numel,
                                       shard_kwargs.get("reshard_after_forward", True), R),
        grad_norm=None if opt.grad_norm is None else opt.grad_norm.item())


def measure_stages(stages=(0, 1, 2, 3), param_dtypes=(None,), **kwargs) -> list[dict]:
    """A rank function for the notebook: train_and_measure per (dtype, stage), parameters left out."""
    runs = [(s, pd, train_and_measure(s, param_dtype=pd, **kwargs)) for pd in param_dtypes for s in stages]
    return [{k: v for k, v in r.items() if k not in ("state", "events")} | dict(stage=s, param_dtype=str(pd))
            for s, pd, r in runs]


if __name__ == "__main__":
    # PyTorch's FSDP2 appears only here, as the reference the demo compares with (--compare).
    import gc

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from data import get_batch, load_corpus
    from instruments import sync, wire_bytes
    from mesh import init_distributed, print0
    from model import build_model

    DTYPES = {"fp32": None, "bf16": torch.bfloat16}  # None: compute in the parameters' own fp32
    ap = argparse.ArgumentParser(description="ZeRO stage 0-3 on the shared model, measured against the formulas")
    ap.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8, help="global batch (divisible by the number of ranks)")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--param-dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--no-reshard", action="store_true", help="keep units gathered from forward to backward")
    ap.add_argument("--no-prefetch", action="store_true")
    ap.add_argument("--peak", action="store_true", help="measure the last step's peak with MemTracker (slow)")
    ap.add_argument("--compare", action="store_true", help="also run PyTorch's FSDP2 fully_shard, side by side")
    args = ap.parse_args()

    device = init_distributed()
    rank, world, pd = dist.get_rank(), dist.get_world_size(), DTYPES[args.param_dtype]
    kw = dict(param_dtype=pd, reshard_after_forward=not args.no_reshard, prefetch=not args.no_prefetch)
    res = train_and_measure(args.stage, args.model, args.steps, args.batch, args.seq, args.lr,
                            track_peak=args.peak, **kw)
    cf, mib = res["comm_formula"], 1 / 2**20
    print0(f"ZeRO stage {args.stage}, {world} ranks, model {args.model} (Ψ = {res['numel']:,} elements padded), "
           f"compute {args.param_dtype}; losses {[round(x, 4) for x in res['losses']]}")
    lines = [f"rank {rank}: model state at rest, MiB (measured | formula)"]
    lines += [f"    {k:10s} {res['memory'][k] * mib:9.4f} | {v * mib:9.4f}" for k, v in res["memory_formula"].items()]
    lines.append("  bytes per step (API measured | formula; ring wire bytes sent by this rank)")
    for op in sorted(set(res["comm"]) | set(cf)):
        got = res["comm"].get(op, dict(bytes=0, wire_bytes=0.0, calls=0))
        lines.append(f"    {op:14s} {got['bytes']:>10,} | {cf.get(op, 0):>10,}   wire {got['wire_bytes']:>12,.0f} | "
                     f"{wire_bytes(op, cf.get(op, 0), res['P']):>12,.0f}   ({got['calls']} calls)")
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    lines.append(f"  step time {res['step_time'] * 1e3:.1f} ms" + (f", CUDA peak {peak * mib:.1f} MiB" if peak else "")
                 + (f", MemTracker peak {res['peak'] * mib:.3f} MiB (model state + activations + "
                    f"temporaries)" if res["peak"] else ""))
    for r in range(world):  # rank by rank, so lines do not interleave
        if r == rank:
            print("\n".join(lines), flush=True)
        dist.barrier()

    tokens = load_corpus()

    def train(runs, r=0, w=1):  # one step of each (model, optimizer) in turn, so machine load hits them alike
        times = [[] for _ in runs]
        for s in range(args.steps):
            x, y = get_batch(tokens, s, args.batch, args.seq, 0, r, w, device=device)
            for (model, opt), ts in zip(runs, times):
                if w > 1:
                    dist.barrier()
                t = time.perf_counter()
                model(x, y).backward()
                opt.step()
                opt.zero_grad()
                sync(device)
                ts.append(time.perf_counter() - t)
        return [statistics.median(ts[1:] or ts) for ts in times]

    def max_diff(model, full=lambda p: p):
        return max((torch.as_tensor(res["state"][n]) - full(p).detach().cpu()).abs().max().item()
                   for n, p in model.named_parameters())

    ref = build_model(args.model, seed=0, device=device)  # the single-process run: the whole global batch
    train([(ref, torch.optim.AdamW(ref.parameters(), lr=args.lr))])
    # Adam turns rounding-level gradient differences into up to a whole step (lr) on elements
    # whose gradient is ~0: fp32 must stay within 5% of one step per step; bf16 within 2 steps.
    err, tol = max_diff(ref), (0.05 if pd is None else 2.0) * args.lr * args.steps
    ok = err < tol
    print0(f"parameters vs the single-process run: max |diff| = {err:.2e} (tolerance {tol:.1e}) -> "
           f"{'ok' if ok else 'MISMATCH'}")
    if args.compare:  # FSDP2 on each Block, then the root, beside a fresh copy of ours
        theirs, ours = build_model(args.model, seed=0, device=device), build_model(args.model, seed=0, device=device)
        mp = MixedPrecisionPolicy(param_dtype=pd, reduce_dtype=torch.float32)
        for block in theirs.layers:
            fully_shard(block, reshard_after_forward=not args.no_reshard, mp_policy=mp)
        fully_shard(theirs, mp_policy=mp)
        otime, ftime = train([(ours, shard_model(ours, args.stage, lr=args.lr, **kw)),
                              (theirs, torch.optim.AdamW(theirs.parameters(), lr=args.lr))], rank, world)
        err = max_diff(theirs, lambda p: p.full_tensor())  # a collective: on every rank
        print0(f"PyTorch FSDP2 fully_shard: max |diff| to ours = {err:.2e}; step time (alternating steps) ours "
               f"{otime * 1e3:.1f} ms vs FSDP2 {ftime * 1e3:.1f} ms -> our throughput = {ftime / otime:.2f}x FSDP2's")
        del theirs, ours  # FSDP2's state first, while the process group still exists
        gc.collect()
    dist.barrier()  # no rank tears the group down while another still has work in flight on it
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)
