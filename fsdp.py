"""Lesson 2 — ZeRO stages 1-3 and FSDP: shard what data parallel keeps P times.

The idea
--------
Plain data parallel (stage 0) keeps on every one of P ranks the whole model state:
parameters (b_p bytes per element), gradients (b_g) and the optimizer state
(K bytes: Adam's two fp32 moments, 8, plus a 4-byte fp32 master copy when the
parameters are computed in bf16). ZeRO removes the redundancy in three steps:

    stage 1  shard the optimizer state        (b_p + b_g)·Ψ + K·Ψ/P
    stage 2  + shard the gradients             b_p·Ψ + (b_g + K)·Ψ/P
    stage 3  + shard the parameters (FSDP)     (b_p + b_g + K)·Ψ/P
    stage 0  (no sharding)                     (b_p + b_g + K)·Ψ

Every unit's parameters are flattened into one buffer of N elements (N padded to
a multiple of P), so "my shard" is the contiguous slice [r·N/P, (r+1)·N/P).

Communication per step (elements; gradients are reduced in fp32, parameters are
gathered in their compute dtype; a ring sends (P-1)/P of the API bytes per
all-gather or reduce-scatter and 2(P-1)/P per all-reduce):
    stage 0     all-reduce(grads)                          = RS + AG  -> 2Ψ
    stage 1, 2  reduce-scatter(grads) + all-gather(params)            -> 2Ψ
    stage 3     all-gather before forward, again before backward, reduce-scatter -> 3Ψ
                (the root unit is not freed between its forward and backward, and
                 reshard_after_forward=False skips the second all-gather: 2Ψ)

Overlap: stage 3 prefetches the next unit's all-gather while the current one computes (forward
order, then reverse order in backward); stages 2-3 reduce-scatter a unit as soon as its gradients
are complete. On NCCL that traffic runs beside the compute; on gloo it runs on CPU threads.

The user's loop does not change:  loss = model(x, y); loss.backward(); opt.step();
opt.zero_grad() — the one extra call is `opt = shard_model(model, stage=...)`.
Stage 1 also works alone on any parameters: `ZeroOptimizer.from_params(...)`.
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from instruments import model_state_bytes
from mesh import all_gather_single, reduce_scatter_single

# ---- the formulas the measurements are compared with ---------------------------------------------


def zero_state_formula(stage: int, numel: int, P: int, param_bytes: int = 4, master_bytes: int = 0,
                       grad_bytes: int | None = None, state_bytes: int = 8) -> dict:
    """Model-state bytes per rank by category (Rajbhandari et al.; K = master_bytes + state_bytes).

    grad_bytes: bytes a *held* gradient takes; stages 0-1 hold the local gradient in the
    compute dtype (default param_bytes), stages 2-3 hold the reduced fp32 shard (4).
    """
    Psi = numel
    if grad_bytes is None:
        grad_bytes = param_bytes if stage <= 1 else 4
    sharded = lambda on: Psi / P if on else Psi  # noqa: E731
    out = dict(parameters=param_bytes * sharded(stage >= 3), master=master_bytes * sharded(stage >= 1),
               gradients=grad_bytes * sharded(stage >= 2), optimizer=state_bytes * sharded(stage >= 1))
    out["total"] = sum(out.values())
    return out


def zero_comm_formula(stage: int, numel: int, P: int, param_bytes: int = 4, root_numel: int = 0,
                      reshard_after_forward: bool = True, replicas: int = 1) -> dict:
    """API bytes per step by collective ({op: bytes}); Ψ = numel padded, gradients reduced in fp32.

    replicas > 1 (HSDP): the reduced gradient shards are all-reduced across replicas."""
    out = {}
    if stage == 0:
        out["all_reduce"] = 4 * numel
    else:
        out["reduce_scatter"] = 4 * numel
        gathers = numel
        if stage == 3 and reshard_after_forward:
            gathers += numel - root_numel  # again before backward, except the root unit
        out["all_gather"] = param_bytes * gathers
        if replicas > 1:
            out["all_reduce"] = 4 * numel // P
    return out


# ---- one unit's parameters, flattened -------------------------------------------------------------

class FlatUnit:
    """The parameters of one unit in one flat buffer [N]; this rank keeps the slice [r·n, (r+1)·n).

    buf     [N] compute dtype: what forward uses; the module's parameters are views of it
            (stage 3 frees its storage between uses).
    shard   [n] compute dtype: my slice (a view of buf in stages 0-2; its own tensor in stage 3).
    master  nn.Parameter, fp32 (the parameters' own dtype): [N] in stage 0, [n] otherwise;
            the tensor the optimizer steps. It *is* the shard when no cast is needed.
    """

    def __init__(self, entries, stage, group, param_dtype=None, init_fn=None, device=None):
        # entries: [(qualified name, owning module or None, attribute name, parameter)]
        self.stage, self.group = stage, group
        self.P = dist.get_world_size(group) if stage > 0 else 1
        self.r = dist.get_rank(group) if stage > 0 else 0
        self.names = [e[0] for e in entries]
        self.shapes = [tuple(e[3].shape) for e in entries]
        self.numels = [math.prod(s) for s in self.shapes]
        self.numel = sum(self.numels)
        self.N = -(-self.numel // self.P) * self.P  # padded: every rank gets n = N/P elements
        self.n = self.N // self.P
        p0 = entries[0][3]
        master_dtype = torch.float32 if p0.is_meta else p0.dtype
        self.dtype = param_dtype or master_dtype
        device = device or (torch.device("cpu") if p0.is_meta else p0.device)

        # The fp32 master slice, materialised from my part of each parameter only.
        lo, length = (0, self.N) if stage == 0 else (self.r * self.n, self.n)
        master = torch.zeros(length, dtype=master_dtype, device=device)
        for name, shape, off, p in zip(self.names, self.shapes, self.offsets(), (e[3] for e in entries)):
            a, b = max(off, lo), min(off + math.prod(shape), lo + length)
            if a < b:  # this parameter overlaps my slice
                full = init_fn(name, shape) if p.is_meta else p.detach()
                master[a - lo:b - lo] = full.reshape(-1)[a - off:b - off].to(device)

        self.buf = torch.empty(self.N, dtype=self.dtype, device=device)  # filled below (stage 3: on use)
        if stage == 3:
            self.shard = master if self.dtype == master_dtype else master.to(self.dtype)
        else:
            self.shard = self.buf[lo:lo + length]
            self.shard.copy_(master)
            if self.dtype == master_dtype:
                master = self.shard  # no cast: the optimizer steps my slice of buf in place
            if stage > 0:  # every rank materialised only its slice: gather the rest
                all_gather_single(self.buf, self.shard, group=group)
        self.master = nn.Parameter(master)

        # Replace every parameter by a view of buf. `.data` gives the views their own version
        # counter, so refilling buf (stage 3) does not trip autograd's saved-tensor check.
        base, self.params = self.buf.data, []
        for (name, owner, attr, p), shape, off, k in zip(entries, self.shapes, self.offsets(), self.numels):
            view = base[off:off + k].view(shape)
            if owner is None:  # bare parameters (ZeroOptimizer.from_params): re-point in place
                p.data = view
                new = p
            else:
                new = nn.Parameter(view, requires_grad=p.requires_grad)
                owner._parameters[attr] = new
            self.params.append(new)
        self.gather_work = None
        self.is_full = stage != 3
        if stage == 3:
            self.free()

    def offsets(self):
        out, off = [], 0
        for k in self.numels:
            out.append(off)
            off += k
        return out

    # stage 3: unshard / reshard ---------------------------------------------------------------
    def unshard(self, async_op=False):
        """All-gather buf from the shards: [n] per rank -> [N] (async: a prefetch)."""
        if not self.is_full and self.gather_work is None:
            self.buf.untyped_storage().resize_(self.N * self.buf.element_size())
            self.gather_work = all_gather_single(self.buf, self.shard, group=self.group, async_op=True)
        if not async_op:  # the caller needs the parameters now (a prefetch may be in flight)
            self.wait()

    def wait(self):
        if self.gather_work is not None:
            self.gather_work.wait()
            self.gather_work, self.is_full = None, True

    def free(self):
        self.wait()
        self.buf.untyped_storage().resize_(0)  # every parameter view now has no bytes
        self.is_full = False

    def flat_grad(self, dtype):
        """The local gradients of my parameters as one [N] tensor (zeros where there are none)."""
        g = torch.zeros(self.N, dtype=dtype, device=self.buf.device)
        for p, off, k in zip(self.params, self.offsets(), self.numels):
            if p.grad is not None:
                g[off:off + k] = p.grad.reshape(-1)
        return g


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
        self.units, self.stage = units, stage
        self.group = group
        # a replicate group of one rank has nothing to average: skip its all-reduce
        self.replicate_group = replicate_group if replicate_group is not None and \
            dist.get_world_size(replicate_group) > 1 else None
        self.max_grad_norm = max_grad_norm
        # gloo has no ReduceOp.AVG: sum, then divide by all the data-parallel ranks.
        self.dp_size = dist.get_world_size(group) * \
            (dist.get_world_size(replicate_group) if replicate_group is not None else 1)
        self.inner = optimizer_cls([u.master for u in units], **optimizer_kwargs)
        # Leave reduce-scatters running behind the rest of backward only on NCCL (its own CUDA
        # stream). On gloo the "background" work runs on CPU threads that compete with compute
        # for the same cores: measured slower when ranks share cores.
        self.async_reduce = dist.get_backend(group) == "nccl"
        self.pending = []       # reduce-scatters in flight: (unit, work, out, input kept alive)
        self.grad_norm = None

    @classmethod
    def from_params(cls, params, optimizer_cls=torch.optim.AdamW, group=None, **optimizer_kwargs):
        """Stage 1 on its own, like ZeroRedundancyOptimizer: any parameters, any optimizer."""
        params = [p for p in params if p.requires_grad]
        unit = FlatUnit([(f"param{i}", None, None, p) for i, p in enumerate(params)], 1, group)
        return cls([unit], optimizer_cls, 1, group, **optimizer_kwargs)

    @property
    def state(self):
        return self.inner.state

    @property
    def param_groups(self):
        return self.inner.param_groups

    def zero_grad(self, set_to_none=True):
        for u in self.units:
            for p in u.params + [u.master]:
                p.grad = None

    # gradients ------------------------------------------------------------------------------
    def reduce_unit(self, u, async_op=True):
        """Reduce-scatter one unit's fp32 gradient [N] -> my slice [n] (stages 1-3)."""
        g = u.flat_grad(u.master.dtype)
        out = torch.empty(u.n, dtype=g.dtype, device=g.device)
        work = reduce_scatter_single(out, g, group=self.group, async_op=True)
        if not self.async_reduce:
            work.wait()
        self.pending.append((u, work, out, g))

    def finish_reduction(self):
        """Wait for the reduce-scatters; average; all-reduce shards across replicas (HSDP)."""
        for u, work, out, _ in self.pending:
            work.wait()
            if self.replicate_group is not None:
                dist.all_reduce(out, group=self.replicate_group)
            out.div_(self.dp_size)
            u.master.grad = out if u.master.grad is None else u.master.grad + out
        self.pending.clear()

    @torch.no_grad()
    def step(self):
        if self.stage == 0:  # the baseline: every rank all-reduces and steps everything
            works = []
            for u in self.units:
                g = u.flat_grad(u.master.dtype)
                works.append((u, g, dist.all_reduce(g, group=self.group, async_op=True)))
            for u, g, w in works:
                w.wait()
                u.master.grad = g.div_(self.dp_size)
                for p, off, k in zip(u.params, u.offsets(), u.numels):  # DDP semantics: averaged .grad
                    p.grad = g[off:off + k].view_as(p).to(p.dtype)
        elif self.stage == 1:
            for u in self.units:
                self.reduce_unit(u)
        self.finish_reduction()
        if self.max_grad_norm is not None:
            self.clip_grad_norm_(self.max_grad_norm)
        self.inner.step()
        for u in self.units:
            if u.master is not u.shard and self.stage > 0:
                u.shard.copy_(u.master)          # new compute copy of my slice (e.g. fp32 -> bf16)
            if self.stage == 0 and u.master.data_ptr() != u.buf.data_ptr():
                u.buf.copy_(u.master)
            if self.stage in (1, 2):
                all_gather_single(u.buf, u.shard, group=self.group)  # shard is buf's own slice
            if self.stage <= 1:
                u.master.grad = None  # the reduced gradient lived only for this step

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so their global L2 norm is at most max_norm (torch's formula)."""
        sq = sum(u.master.grad.float().pow(2).sum() for u in self.units if u.master.grad is not None)
        sq = torch.as_tensor(sq, dtype=torch.float32)
        if self.stage > 0:
            dist.all_reduce(sq, group=self.group)  # shards of one replica make the whole gradient
        self.grad_norm = sq.sqrt()
        coef = (max_norm / (self.grad_norm + 1e-6)).clamp(max=1.0)
        for u in self.units:
            if u.master.grad is not None:
                u.master.grad.mul_(coef.to(u.master.grad.dtype))
        return self.grad_norm

    # measurements and checkpoints ----------------------------------------------------------------
    def state_bytes(self) -> dict:
        """Model-state bytes this rank holds, by category (storage-based)."""
        compute = [p for u in self.units for p in u.params] + [u.shard for u in self.units]
        masters = [u.master for u in self.units
                   if u.master.untyped_storage().data_ptr() not in
                   (u.buf.untyped_storage().data_ptr(), u.shard.untyped_storage().data_ptr())]
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
            for name, shape, off, k in zip(u.names, u.shapes, u.offsets(), u.numels):
                out[name] = full[off:off + k].view(shape).clone()
        return out

    @torch.no_grad()
    def load_full_state_dict(self, sd: dict | None, src: int = 0):
        """Load a full state dict held by global rank `src` into every rank's shards."""
        for u in self.units:
            full = torch.zeros(u.N, dtype=u.master.dtype, device=u.master.device)
            if dist.get_rank() == src:
                for name, off, k in zip(u.names, u.offsets(), u.numels):
                    full[off:off + k] = sd[name].reshape(-1)
            dist.broadcast(full, src=src)
            lo = 0 if self.stage == 0 else u.r * u.n
            u.master.copy_(full[lo:lo + u.master.numel()])
            if u.master is not u.shard:
                u.shard.copy_(full[lo:lo + u.shard.numel()])
            if self.stage == 0:
                u.buf.copy_(full)
            elif self.stage in (1, 2):
                all_gather_single(u.buf, u.shard, group=self.group)


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
        unit_modules = [m for m in model.modules() if isinstance(m, units) and m is not model]
    else:
        unit_modules = list(units)
        known = {id(m) for m in model.modules()}
        if not all(isinstance(m, nn.Module) and id(m) in known and m is not model for m in unit_modules):
            raise ValueError("units must be module classes or a list of submodules of the model")

    names = {id(m): n for n, m in model.named_modules()}
    taken, per_unit = set(), []
    for um in unit_modules + [model]:  # the root unit last: it gets what no unit took
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
    root = flat[-1][1] if flat[-1][0] is model else None
    if stage >= 2:
        _add_gradient_hooks(opt, free_after=stage == 3)
    if stage == 3:
        _add_unshard_hooks(opt, flat, root, reshard_after_forward, prefetch)
    return opt


def _add_gradient_hooks(opt: ZeroOptimizer, free_after: bool):
    """Stages 2-3: when every parameter of a unit has its gradient, reduce-scatter the unit's
    gradient at once (async) and drop the full-size one; at the end of backward, wait."""
    state = dict(queued=False)

    def finish():
        opt.finish_reduction()
        state["queued"] = False
        for u in opt.units:
            u.ready, u.backward_started = 0, False

    for u in opt.units:
        u.ready, u.backward_started = 0, False

        def on_grad(p, u=u):
            u.ready += 1
            if u.ready < len(u.params):
                return
            opt.reduce_unit(u)
            for q in u.params:
                q.grad = None  # the full gradient is gone: I keep only my reduced slice
            if free_after:
                u.free()
            if not state["queued"]:
                state["queued"] = True
                torch.autograd.Variable._execution_engine.queue_callback(finish)

        for p in u.params:
            p.register_post_accumulate_grad_hook(on_grad)


def _add_unshard_hooks(opt, flat, root, reshard_after_forward, prefetch):
    """Stage 3: all-gather a unit before its forward and before its backward, free it after its
    forward; prefetch the next unit's all-gather (forward order, then reverse in backward)."""
    order = []  # units in the order their forwards ran (recorded on the first step)

    def pre_forward(module, args, u):
        if u not in order:
            order.append(u)
        u.unshard()
        i = order.index(u)
        if prefetch and i + 1 < len(order):
            order[i + 1].unshard(async_op=True)  # overlaps with this unit's compute

    def pre_backward(u):
        if u.backward_started:
            return
        u.backward_started = True
        u.unshard()
        i = order.index(u)
        if prefetch and i > 0 and order[i - 1] is not root:
            order[i - 1].unshard(async_op=True)

    def post_forward(module, args, output, u):
        if u is root:
            return  # backward starts right here: keep the root gathered until its gradients are reduced
        if reshard_after_forward:
            u.free()
        if torch.is_grad_enabled():
            tensors = output if isinstance(output, (tuple, list)) else [output]
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda g, u=u: pre_backward(u))  # runs before the unit's backward

    for um, u in flat:
        um.register_forward_pre_hook(lambda m, a, u=u: pre_forward(m, a, u))
        um.register_forward_hook(lambda m, a, o, u=u: post_forward(m, a, o, u))


# ---- a measured training run (torchrun demo, tests and the notebook call it) ----------------------

def train_and_measure(stage, model_name="tiny", steps=3, batch=8, seq=32, lr=1e-2, param_dtype=None,
                      group=None, replicate_group=None, dp_rank=None, dp_size=None, meta=False,
                      seed=0, dtype=torch.float32, track_peak=False, **shard_kwargs) -> dict:
    """Shard the shared model at `stage`, train `steps` global batches with AdamW and return the
    full parameters, the losses, and what the last step measured next to the formulas.
    track_peak: run the last step under PyTorch's MemTracker (slow) for the peak bytes."""
    import contextlib
    import warnings

    from data import get_batch, load_corpus
    from instruments import CommCounter, memory_tracker
    from model import Transformer, build_model, get_config, init_tensor
    cfg = get_config(model_name)
    dp_rank = dist.get_rank() if dp_rank is None else dp_rank
    dp_size = dist.get_world_size() if dp_size is None else dp_size
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    if meta:  # shapes only: nothing is allocated until shard_model materialises my slices
        with torch.device("meta"):
            model = Transformer(cfg, seed=None).to(dtype)
    else:
        model = build_model(cfg, seed=seed, dtype=dtype, device=device)
    init_fn = (lambda name, shape: init_tensor(cfg, name, shape, seed)) if meta else None
    opt = shard_model(model, stage, torch.optim.AdamW, group=group, replicate_group=replicate_group,
                      param_dtype=param_dtype, init_fn=init_fn, lr=lr, **shard_kwargs)
    tokens, losses, times, peak = load_corpus(), [], [], None
    for s in range(steps):
        x, y = get_batch(tokens, s, batch, seq, seed, dp_rank, dp_size, device=device or "cpu")
        tracked = track_peak and s == steps - 1
        with memory_tracker(model, opt.inner) if tracked else contextlib.nullcontext() as mt, \
                warnings.catch_warnings(), CommCounter() as comm:
            # MemTracker warns about parameters whose .grad is None (ours, after reduce-scatter)
            warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper")
            t = time.perf_counter()
            loss = model(x, y)
            loss.backward()
            opt.step()
            if device is not None:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t)
        if tracked:
            snap = mt.get_tracker_snapshot("peak")
            peak = {str(k).split(".")[-1]: v for k, v in snap[next(iter(snap))].items()}["Total"]
        memory = opt.state_bytes()  # at rest, after the step (before zero_grad)
        opt.zero_grad()
        loss = loss.detach().float()
        dist.all_reduce(loss)  # the global batch's loss, for printing (outside the counter)
        losses.append(loss.item() / dp_size)
    P = dist.get_world_size(group)
    numel = sum(u.N for u in opt.units)
    root_numel = opt.units[-1].N if opt.units[-1].names[0] == "tok_embeddings.weight" else 0
    pb = torch.finfo(opt.units[0].dtype).bits // 8
    mb = 0 if opt.units[0].dtype == opt.units[0].master.dtype else 4
    reps = dist.get_world_size(replicate_group) if replicate_group is not None else 1
    return dict(
        state={k: v.cpu().numpy() for k, v in opt.full_state_dict().items()} if dist.get_backend() != "nccl"
        else {k: v.cpu() for k, v in opt.full_state_dict().items()},
        losses=losses, peak=peak, step_time=_median(times[1:-1] if track_peak else times[1:]) or times[0],
        comm=comm.summary(), events=[(e.op, e.group_ranks, e.api_bytes) for e in comm.events],
        memory=memory, numel=numel, root_numel=root_numel, P=P, param_bytes=pb,
        memory_formula=zero_state_formula(stage, numel, P, pb, mb),
        comm_formula=zero_comm_formula(stage, numel, P, pb,
                                       root_numel, shard_kwargs.get("reshard_after_forward", True), reps),
        grad_norm=None if opt.grad_norm is None else opt.grad_norm.item())



def _median(xs):
    return sorted(xs)[len(xs) // 2] if xs else None


def measure_stages(stages=(0, 1, 2, 3), param_dtypes=(None,), **kwargs) -> list[dict]:
    """A rank function for the notebook: train_and_measure per (stage, dtype), parameters left out."""
    out = []
    for pd in param_dtypes:
        for s in stages:
            r = train_and_measure(s, param_dtype=pd, **kwargs)
            r.pop("state"), r.pop("events")
            out.append(dict(r, stage=s, param_dtype=str(pd)))
    return out

if __name__ == "__main__":
    # PyTorch's FSDP2 appears only here, as the reference the demo compares with (--compare).
    from instruments import wire_bytes
    from mesh import init_distributed, print0

    def fsdp2_side_by_side(args, device):
        """PyTorch's fully_shard on the same model, data and optimizer, trained step for step beside
        a fresh copy of ours: one step of each in turn, so machine load hits both alike.
        Returns (FSDP2's full state, our median step time, FSDP2's median step time)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from data import get_batch, load_corpus
        from model import build_model
        pd = DTYPES[args.param_dtype]
        theirs = build_model(args.model, seed=0, device=device)
        mp = MixedPrecisionPolicy(param_dtype=pd, reduce_dtype=torch.float32)
        for block in theirs.layers:
            fully_shard(block, reshard_after_forward=not args.no_reshard, mp_policy=mp)
        fully_shard(theirs, mp_policy=mp)
        ours = build_model(args.model, seed=0, device=device)
        runs = [(ours, shard_model(ours, args.stage, lr=args.lr, param_dtype=None if pd == torch.float32 else pd,
                                   reshard_after_forward=not args.no_reshard, prefetch=not args.no_prefetch), []),
                (theirs, torch.optim.AdamW(theirs.parameters(), lr=args.lr), [])]
        tokens = load_corpus()
        for s in range(args.steps):
            x, y = get_batch(tokens, s, args.batch, args.seq, 0, dist.get_rank(), dist.get_world_size(),
                             device=device)
            for model, opt, times in runs:
                dist.barrier()
                t = time.perf_counter()
                model(x, y).backward()
                opt.step()
                opt.zero_grad()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t)
        state = {n: p.full_tensor().detach().cpu() for n, p in theirs.named_parameters()}
        return state, _median(runs[0][2][1:]), _median(runs[1][2][1:])

    def reference_run(args):
        """The single-process run: the whole global batch, one AdamW step each."""
        from data import get_batch, load_corpus
        from model import build_model
        model = build_model(args.model, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        tokens = load_corpus()
        for s in range(args.steps):
            x, y = get_batch(tokens, s, args.batch, args.seq, 0)
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        return {n: p.detach() for n, p in model.named_parameters()}

    def max_diff(a, b):
        return max((torch.as_tensor(a[k]).float().cpu() - torch.as_tensor(b[k]).float().cpu()).abs().max().item()
                   for k in b)

    DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
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
    rank, world = dist.get_rank(), dist.get_world_size()
    pd = DTYPES[args.param_dtype]
    res = train_and_measure(args.stage, args.model, args.steps, args.batch, args.seq, args.lr,
                            None if pd == torch.float32 else pd,
                            reshard_after_forward=not args.no_reshard, prefetch=not args.no_prefetch,
                            track_peak=args.peak)
    P, mib = res["P"], 1 / 2**20
    print0(f"ZeRO stage {args.stage}, {world} ranks, model {args.model} (Ψ = {res['numel']:,} elements padded), "
           f"compute {args.param_dtype}; losses {[round(x, 4) for x in res['losses']]}")
    lines = [f"rank {rank}: model state at rest, MiB (measured | formula)"]
    for k in ("parameters", "master", "gradients", "optimizer", "total"):
        lines.append(f"    {k:10s} {res['memory'][k] * mib:9.4f} | {res['memory_formula'][k] * mib:9.4f}")
    lines.append("  bytes per step (API measured | formula; ring wire bytes sent by this rank)")
    for op in sorted(set(res["comm"]) | set(res["comm_formula"])):
        got = res["comm"].get(op, dict(bytes=0, wire_bytes=0.0, calls=0))
        lines.append(f"    {op:14s} {got['bytes']:>10,} | {res['comm_formula'].get(op, 0):>10,}   "
                     f"wire {got['wire_bytes']:>12,.0f} | {wire_bytes(op, res['comm_formula'].get(op, 0), P):>12,.0f}"
                     f"   ({got['calls']} calls)")
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    lines.append(f"  step time {res['step_time'] * 1e3:.1f} ms" + (f", CUDA peak {peak * mib:.1f} MiB" if peak else "")
                 + (f", MemTracker peak {res['peak'] * mib:.3f} MiB (model state + activations + "
                    f"temporaries)" if res["peak"] else ""))
    for r in range(world):  # rank by rank, so lines do not interleave
        if r == rank:
            print("\n".join(lines), flush=True)
        dist.barrier()
    ok = True
    if rank == 0:
        err = max_diff(res["state"], reference_run(args))
        # Adam turns rounding-level gradient differences into up to a whole step (lr) on elements
        # whose gradient is ~0: fp32 must stay within 5% of one step per step; bf16 within 2 steps.
        tol = (0.05 if pd == torch.float32 else 2.0) * args.lr * args.steps
        ok = err < tol
        print(f"parameters vs the single-process run: max |diff| = {err:.2e} (tolerance {tol:.1e}) -> "
              f"{'ok' if ok else 'MISMATCH'}", flush=True)
    if args.compare:
        fstate, otime, ftime = fsdp2_side_by_side(args, device)
        if rank == 0:
            print(f"PyTorch FSDP2 fully_shard: max |diff| to ours = {max_diff(res['state'], fstate):.2e}; "
                  f"step time (alternating steps) ours {otime * 1e3:.1f} ms vs FSDP2 {ftime * 1e3:.1f} ms "
                  f"-> our throughput = {ftime / otime:.2f}x FSDP2's", flush=True)
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)
