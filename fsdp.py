"""Lesson 2 — ZeRO stages 1-3 and FSDP: shard what data parallel keeps P times.

Data parallel keeps on each of P ranks the whole model state of Ψ parameters: parameters (b_p bytes
each), gradients (b_g) and optimizer state (K: Adam's two fp32 moments, 8, plus a 4-byte fp32 master
copy when the compute copy is bf16). ZeRO shards it step by step; bytes per rank (Rajbhandari et al.
2020, "ZeRO", arXiv:1910.02054 §5 and Figure 1):

    stage 0  nothing sharded            (b_p + b_g + K)·Ψ
    stage 1  + the optimizer state      (b_p + b_g)·Ψ + K·Ψ/P
    stage 2  + the gradients            b_p·Ψ + (b_g + K)·Ψ/P
    stage 3  + the parameters (FSDP)    (b_p + b_g + K)·Ψ/P

Communication per step in elements (ZeRO §7): stage 0 all-reduces the gradients, 2Ψ (a reduce-scatter
plus an all-gather); stages 1-2 reduce-scatter the gradients and all-gather the new parameters, 2Ψ;
stage 3 all-gathers each unit before its forward and again before its backward and reduce-scatters its
gradient, 3Ψ. In API bytes (handed to a collective; README section "Lesson 0 — ranks, process groups",
its three conventions): stage 3 all-gathers b_p·(2Ψ − Ψ_root) and reduce-scatters b_m·Ψ (gradients
reduced in the fp32 master's b_m = 4 bytes); the root unit — what no unit encloses — stays gathered from its forward into its backward
(Ψ_root = 0 for the course's model); with reshard_after_forward=False every unit does: b_p·Ψ. Each step
also all-reduces one int32 per parameter tensor: which got a gradient on any rank.

The file, in order (after PyTorch FSDP, Zhao et al. 2023, arXiv:2304.11277 §3-4):
  1. The core, ZeRO as the paper states it: FlatParameter (a unit's parameters as views of one flat buffer
     [N], a slice [n] per rank, and ZeRO's moves: reduce-scatter, all-gather, free), zero_step (reduce-scatter
     the gradients, step my slice, all-gather the parameters) and gather_when_used (stage 3: gather before
     each use, free after).
  2. FlatUnit, the core's FlatParameter for any model: made from this rank's slice alone (a meta model),
     a bf16 compute copy beside the fp32 master, aliases of a tied weight, asynchronous moves.
  3. ZeroOptimizer: zero_step for every stage — stage 1 reduces at step(), 2-3 during backward.
  4. The hooks: stage 2 reduce-scatters a unit's gradient once its backward is done, stage 3 gathers a unit
     before its forward and its backward and frees it after each (prefetching the next).
  5. shard_model(model, stage): cuts the model into units and returns the optimizer; the loop stays
     loss.backward(); opt.step(); opt.zero_grad(). Any nn.Module, any forward output.
  6. State dicts: full ({name: whole tensor}) and sharded (this rank's slices, the same layout).
  7. A stage-3 parameter between uses: a placeholder whose values cannot be read (one error naming
     full_state_dict, never freed memory read).
What other lessons need sits after, named for them: OffloadedUnit (ZeRO-Offload, lesson 8) and, in section 5,
Seams (hybrid sharding's after_reduce, tensor parallel's before_reduce, expert groups, lesson 1's averaged
buckets, the planner's shapes_only). Checkpoints any layout can load are lab/checkpoint.py's, from section 6's
slices.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import math
from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from mesh import agree, agree_step, all_gather_single, collective_device, reduce_scatter_single, resolve_group


# ---- 1. the core: ZeRO as the paper states it ---------------------------------------------------------

class FlatParameter:
    """Parameters as views of one flat buffer buf [N], N padded to a multiple of the group's P ranks; rank r owns
    the slice [r·n, (r+1)·n), n = N/P, kept apart as `shard` (what the optimizer steps). ZeRO's three moves, each
    one collective over the whole unit (FSDP's FlatParameter):
        reduce_scatter  the gradients packed into [N], summed over the group: my [n] of the sum   (stages 1-3)
        all_gather      every rank's slice [n] into buf [N]: whole parameters again   (1-2 after the step; 3 unshard)
        free            buf's bytes released, my slice alone remains                   (3: after each use)"""

    def __init__(self, params, group=None):
        self.group = resolve_group(group)
        self.group_size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)   # P, r
        self.params = list(params)
        self.shapes, self.numels = [tuple(p.shape) for p in self.params], [p.numel() for p in self.params]
        self.flat_numel = -(-sum(self.numels) // self.group_size) * self.group_size              # N
        self.shard_numel = self.flat_numel // self.group_size                                     # n
        self.buf = self.params[0].new_zeros(self.flat_numel)                                      # [N]
        for p, view in zip(self.params, self.views(self.buf)):
            view.copy_(p.detach())
            p.data = view                                 # the parameter now lives inside buf
        mine = self.buf[self.rank * self.shard_numel:(self.rank + 1) * self.shard_numel]
        self.shard = nn.Parameter(mine.clone())           # [n]: my slice, the only one this rank steps

    def views(self, flat):
        """A flat [N] tensor as one view per parameter, in its shape."""
        return [t.view(s) for t, s in zip(flat[:sum(self.numels)].split(self.numels), self.shapes)]

    def pack(self, dtype):
        """The gradients as one [N], zeros where a parameter has none (every rank hands over the same sizes)."""
        g = torch.zeros(self.flat_numel, dtype=dtype, device=self.buf.device)
        for p, view in zip(self.params, self.views(g)):
            if p.grad is not None:
                view.copy_(p.grad)
        return g

    def reduce_scatter(self, g, async_op=False):
        """[N] on every rank -> my [n] of their sum. Returns (it, the collective's work if async_op)."""
        out = g.new_empty(self.shard_numel)
        return out, reduce_scatter_single(out, g, group=self.group, async_op=async_op)

    def all_gather(self, async_op=False):
        """Every rank's shard [n] into buf [N]."""
        return all_gather_single(self.buf, self.shard.detach(), group=self.group, async_op=async_op)

    def free(self):
        self.buf.untyped_storage().resize_(0)          # every parameter view now has no bytes

    def unshard(self, async_op=False):
        self.buf.untyped_storage().resize_(self.flat_numel * self.buf.element_size())
        return self.all_gather(async_op)


@torch.no_grad()
def zero_step(flats, optimizer) -> None:
    """One ZeRO step after loss.backward(); `optimizer` owns the flats' shards (ZeRO §5.1-5.2, §7):
      1. each unit's gradient reduce-scattered: rank r receives the sum of slice r alone, ÷P the average;
      2. the optimizer steps my slice alone: optimizer state for 1/P of the parameters;
      3. the new slices all-gathered, so every rank holds whole parameters again — unless buf was freed
         (stage 3), when the next use gathers them."""
    for f in flats:
        f.shard.grad, _ = f.reduce_scatter(f.pack(f.shard.dtype))
        f.shard.grad.div_(f.group_size)               # gloo has no ReduceOp.AVG: sum, then divide
        for p in f.params:
            p.grad = None                              # stages 2-3 keep only the reduced slice
    optimizer.step()
    for f in flats:
        if f.buf.untyped_storage().size():
            f.all_gather()


def gather_when_used(module: nn.Module, flat: FlatParameter) -> None:
    """Stage 3 on a module whose parameters `flat` holds: gathered right before its forward and again right
    before its backward, freed right after each, so the module holds whole parameters only while it runs.
    (PyTorch runs a module's full backward hook once its inputs' gradients exist; for a module whose inputs need
    none — the token embedding, whose backward reads only the token ids — as soon as its output's gradient
    arrives, and says so in a warning. Section 4's hooks mark a unit's end of backward themselves, prefetch,
    and reduce during backward.)"""
    def gather(*_):
        flat.unshard()

    def free(*_):
        flat.free()
    module.register_forward_pre_hook(gather)
    module.register_forward_hook(free)
    module.register_full_backward_pre_hook(gather)
    module.register_full_backward_hook(free)


# ---- 2. the flat unit: the core's FlatParameter for any model -------------------------------------------
#
# Every collective below is announced first (mesh.agree), and the optimizer's step agreed before it is applied
# (mesh.agree_step): ranks that are about to make different ones — a unit only some ranks run, units in another
# order — stop with one error naming each rank's, instead of aborting, hanging or swapping data. What to do then:
AGREE_FIX = ("Every rank must run the same sharded modules in the same order: a module that only some ranks run "
             "cannot be gathered unit by unit. Run it on every rank, or keep it gathered: leave it out of units= "
             "(it joins the root unit, gathered from forward into backward), or pass reshard_after_forward=False.")


def _agree(group, what, t=None):
    """mesh.agree, with the collective's size: ranks whose units differ in size stop here, never in gloo."""
    agree(group, what if t is None else f"{what} [{t.numel():,} {str(t.dtype).replace('torch.', '')}]", AGREE_FIX)


class FlatUnit(FlatParameter):
    """One unit's parameters on one group as a FlatParameter, for real training (stage 0: P = 1, the whole buffer):
    made from this rank's slice alone (a meta-device model is never materialised whole), with a compute copy
    beside the master, a tied weight under all its names, and its moves asynchronous. In API bytes (b_p compute
    bytes per element; b_m bytes of the master dtype gradients are reduced in: fp32, also under a bf16 compute
    copy, float64 for a float64 model):

        unshard  all-gather      [n] per rank -> [N]        b_p·N      (stage 3: before forward and backward)
        publish  all-gather      my new slice -> [N]        b_p·N      (stages 1-2: after the step)
        reduce   reduce-scatter  [N] gradients -> my [n]    b_m·N      (stages 1-3; stage 0 all-reduces [N])

    buf     [N] compute dtype: the module's parameters are views of it (stage 3 frees it between uses)
    shard   [n] compute dtype: my slice (a view of buf in stages 0-2; its own tensor in stage 3)
    master  [n] the parameters' dtype (fp32): what the optimizer updates; the shard itself if no cast
            (offload: its own tensor in host memory, the reduced gradient downloaded to it, the new
            values uploaded to the shard after each step)
    pieces  [(i, a, b, piece)]: piece = master[a:b], my part of parameter i, the optimizer's parameter
    """

    offload = False  # the master beside the shard, on this device (OffloadedUnit: in host memory)

    def __init__(self, entries, stage, group, divide_by, after_reduce=None, param_dtype=None, init_fn=None,
                 label="a unit"):
        # Not FlatParameter.__init__, which flattens whole parameters: a unit is made from my slice alone.
        # entries [(names, holders [(module, attr)], param)]: names[0] as named_parameters() has it, then aliases
        self.stage, self.group, self.label = stage, group, label  # label: "unit 2 (layers.1)", in errors
        self.divide_by, self.after_reduce = divide_by, after_reduce  # how the optimizer finishes a reduction
        self.group_size, self.rank = (dist.get_world_size(group), dist.get_rank(group)) if stage > 0 else (1, 0)
        self.aliases, self.shapes = [e[0] for e in entries], [tuple(e[2].shape) for e in entries]
        self.names, self.numels = [a[0] for a in self.aliases], [math.prod(s) for s in self.shapes]
        self.offsets = [0, *itertools.accumulate(self.numels)][:-1]  # of each parameter in buf
        self.flat_numel = -(-sum(self.numels) // self.group_size) * self.group_size  # N: padded to P·n
        self.shard_numel = self.flat_numel // self.group_size                         # n
        master = _my_slice(self, entries, init_fn)  # [n], made from my part of each parameter only
        self.dtype, device = param_dtype or master.dtype, master.device
        same = param_dtype in (None, master.dtype) and not self.offload  # the optimizer may step the shard itself
        self.buf = torch.empty(self.flat_numel, dtype=self.dtype, device=device)
        if stage == 3:  # my slice lives apart from buf, which holds bytes only while gathered
            self.shard = master if same else torch.empty_like(master, dtype=self.dtype)
        else:           # my slice is a view of buf; with no cast the optimizer steps it in place
            self.shard = self.buf[self.rank * self.shard_numel:(self.rank + 1) * self.shard_numel]
            master = self.shard.copy_(master) if same else master
        self.master = nn.Parameter(self.home(master))
        self.pieces = [(i, a, b, nn.Parameter(self.master.detach()[a:b])) for i, a, b in self.spans()]
        self.params = [_repoint(e, view) for e, view in zip(entries, self.views(self.buf.data))]
        self.used = torch.zeros(len(self.params), dtype=torch.int32, device=device)  # got a gradient here
        self.gather_work, self.unreduced = None, False  # unreduced: a reduction deferred by accumulating()
        self.averaged = False  # stage 0: True when the gradients arrive averaged already (ddp.py's buckets)
        self.root = False  # of the root unit (the model itself: what no unit encloses), kept gathered into backward
        self.publish()

    def spans(self):
        """[(i, a, b)]: parameter i covers [a, b) of my slice (parameters outside it are left out)."""
        lo, hi = self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel
        return [(i, max(o, lo) - lo, min(o + k, hi) - lo) for i, (o, k) in enumerate(zip(self.offsets, self.numels))
                if max(o, lo) < min(o + k, hi)]

    def home(self, master):
        """Where the master slice lives: here, beside the shard (OffloadedUnit: in host memory)."""
        return master

    def receive(self, grad):
        """A reduced gradient slice, where the optimizer steps: here, as it is (OffloadedUnit: downloaded)."""
        return grad

    @torch.no_grad()
    def refresh_shard(self):
        """The compute slice from the master: a cast (fp32 -> bf16), or nothing when they are one tensor."""
        if self.shard.data_ptr() != self.master.data_ptr():
            self.shard.copy_(self.master)

    @torch.no_grad()
    def publish(self):
        """After the master slice changed (a step, a load): refresh every compute copy of it — zero_step's 3."""
        self.refresh_shard()
        if self.stage in (1, 2):
            _agree(self.group, f"gathers {self.label}'s new parameters", self.buf)
            self.all_gather()
        if self.stage == 3:
            self.free()  # a gathered copy would be stale: the next use gathers the new values

    def unshard(self, why="for forward"):
        """Stage 3: start the all-gather of buf, [n] per rank -> [N], unless it is gathered already."""
        if self.gather_work is None and self.buf.untyped_storage().size() == 0:
            _agree(self.group, f"gathers {self.label} {why}", self.buf)
            self.gather_work = super().unshard(async_op=True)
            for p, view in zip(self.params, self.views(self.buf.data)):
                _Resharded.restore(p, view)

    def wait(self):
        if self.gather_work is not None:
            self.gather_work.wait()
            self.gather_work = None

    def free(self):
        self.wait()
        super().free()  # every parameter view now has no bytes, so no parameter may be read: see _Resharded
        for p, names in zip(self.params, self.aliases):
            _Resharded.mark(p, names[0], self.shard)

    def reduce(self):
        """zero_step's 1 for one unit: the gradients packed into one [N] in the master's dtype and summed over the
        group — stage 0 all-reduces it, the others reduce-scatter it to my slice [n] — asynchronously; the
        optimizer divides. Returns (result, work, input)."""
        g = self.pack(self.master.dtype)
        for i, p in enumerate(self.params):
            if p.grad is not None:
                self.used[i] = 1
                if self.stage >= 2:
                    p.grad = None  # stages 2-3 keep only the reduced slice
        if self.stage == 0:  # (a group of one has nothing to add; nor have gradients averaged already)
            single = dist.get_world_size(self.group) == 1 or self.averaged
            if not single:
                _agree(self.group, f"all-reduces {self.label}'s gradients", g)
            return g, None if single else dist.all_reduce(g, group=self.group, async_op=True), g
        _agree(self.group, f"reduce-scatters {self.label}'s gradients", g)
        return (*self.reduce_scatter(g, async_op=True), g)


def _my_slice(u, entries, init_fn):
    """A new unit's master slice [n], made from my part of each parameter only: a meta-device model's
    from init_fn, on the device our collectives use, in at least fp32 (a bf16 model gets an fp32 master)."""
    p0, lo = entries[0][2], u.rank * u.shard_numel
    if p0.is_meta and init_fn is None:  # shapes only (a memory plan): no values anywhere
        return torch.empty(u.shard_numel, dtype=torch.promote_types(p0.dtype, torch.float32), device="meta")
    master = torch.zeros(u.shard_numel, device=collective_device(u.group) if p0.is_meta else p0.device,
                         dtype=torch.promote_types(p0.dtype, torch.float32) if p0.is_meta else p0.dtype)
    for (i, a, b), off in [(s, u.offsets[s[0]]) for s in u.spans()]:
        names, _, p = entries[i]
        full = init_fn(names[0], p.shape) if p.is_meta else p.detach()
        master[a:b] = full.reshape(-1)[lo + a - off:lo + b - off].to(master.device)
    return master


def _repoint(entry, view):
    """Every holder of the parameter now holds `view` (of buf). `.data`-made views get their own version
    counter, so refilling buf (stage 3) does not trip autograd's check on saved tensors. No holders (a bare
    parameter, shard_optimizer): the parameter itself keeps its identity and its data becomes the view."""
    if not entry[1]:
        entry[2].data = view
        return entry[2]
    p = nn.Parameter(view)
    for module, attr in entry[1]:
        module._parameters[attr] = p
    return p


# ---- 3. the optimizer that owns the shards: zero_step for every stage -------------------------------

class ZeroOptimizer:
    """Steps this rank's pieces with any torch.optim class once their gradients are reduced: at step()
    for stages 0-1 (all-reduce; reduce-scatter), during backward for 2-3 (the hooks below). Stages 1-2
    then all-gather the new parameters; stage 3 leaves that to the next forward."""

    def __init__(self, module, units, optimizer_cls, stage, max_grad_norm=None, before_reduce=None, groups=None,
                 **optimizer_kw):
        self.module, self.units, self.stage = module, units, stage  # module: for its frozen params and buffers
        self.max_grad_norm, self.before_reduce = max_grad_norm, before_reduce
        pieces = [q for u in units for *_, q in u.pieces]
        # groups: the optimizer's parameter groups, each {"params": [pieces], **its settings}; default one group
        self.inner = optimizer_cls(groups if groups is not None else pieces, **optimizer_kw)
        # Reductions run behind the rest of backward only on NCCL (its own CUDA stream); on gloo their CPU
        # threads would take the cores compute needs: wait at once.
        self.async_reduce = all(dist.get_backend(u.group) == "nccl" for u in units)
        self.pending, self.deferring, self.in_backward, self.reduced, self.grad_norm = [], False, False, False, None
        self.saw_backward = False  # a backward hook ran since the last step (stages 2-3)
        # the groups a step reduces over, whose ranks agree on it (a unit's, hsdp's replicas', the clip's)
        self.groups = list({id(g): g for g in [u.group for u in units if stage > 0 or not u.averaged]
                            + [getattr(u.after_reduce, "group", None) for u in units]
                            if g is not None}.values())

    param_groups = property(lambda self: self.inner.param_groups)  # what LR schedulers set

    def zero_grad(self, set_to_none=True):
        for u in self.units:
            for p in u.params + [u.master] + [q for *_, q in u.pieces]:
                p.grad = None
            u.used.zero_()
        self.reduced = self.in_backward = self.saw_backward = False

    @contextlib.contextmanager
    def accumulating(self):
        """Backwards inside keep their full local gradients (stage 3 with reshard_after_forward=False also
        keeps its units gathered); the next backward outside, or step(), reduces each unit once."""
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False

    def reduce_unit(self, u):
        if self.before_reduce is not None:
            self.before_reduce(u.params)  # e.g. tensor parallel: sum partial gradients over tp first
        out, work, g = u.reduce()
        if work is not None and not self.async_reduce:
            work.wait()
        self.pending.append((u, work, out, g if self.async_reduce else None))  # NCCL: g in use until done
        u.unreduced = False

    def finish_reduction(self):
        for u, work, out, _ in self.pending:
            if work is not None:
                work.wait()
            if u.after_reduce is not None:
                u.after_reduce(out)  # e.g. HSDP: the shard, summed over my shard group, now across replicas
            out.div_(u.divide_by)  # gloo has no ReduceOp.AVG: sum, then divide
            out = u.receive(out)  # (offload: down to the host, where the optimizer steps)
            u.master.grad = out if u.master.grad is None else u.master.grad.add_(out)
        self.pending.clear()
        late = [n for u in self.units for n, p in zip(u.names, u.params) if self.stage >= 2 and p.grad is not None]
        if late and not self.saw_backward:  # no backward hook ran: the output hid its tensors from them
            raise RuntimeError(f"{late[0]} has a gradient but no backward hook of the sharded model ran: the loss "
                               f"was not computed from a tensor, tuple, list, dict or dataclass the model's forward "
                               f"returned (or a unit's); return the output (or its tensors) from forward")
        if late:  # stages 2-3 pack every gradient when they reduce: this one came after its unit's reduction
            raise RuntimeError(f"the gradient of {late[0]} arrived after its unit was reduced: if it is used outside "
                               f"its unit's forward, pass units= so that one unit encloses all its uses; if its "
                               f"backward was deferred (zero bubble's W), run it inside opt.accumulating()")

    @torch.no_grad()
    def reduce_gradients(self):
        """Reduce what is not reduced yet (stages 0-1: everything), then agree, with one all-reduce of an
        int32 per parameter and group, which parameters got a gradient on any rank: the others get none."""
        if self.reduced:
            return
        for u in [u for u in self.units if self.stage <= 1 or u.unreduced]:
            self.reduce_unit(u)
        self.finish_reduction()
        by_group = {}
        for u in self.units:  # one order on every rank
            by_group.setdefault((u.group, u.after_reduce), []).append(u)
        for (group, after_reduce), us in by_group.items():
            used = torch.cat([u.used for u in us])
            if dist.get_world_size(group) > 1 and not us[0].averaged:
                _agree(group, f"all-reduces which of {len(used)} parameters got a gradient")
                dist.all_reduce(used, group=group)
            if after_reduce is not None:
                after_reduce(used)
            for u, part in zip(us, used.split([len(u.params) for u in us])):
                u.used.copy_(part)
        for u in self.units:
            used, g = u.used.tolist(), u.master.grad
            for i, a, b, q in u.pieces:
                q.grad = g[a:b] if used[i] and g is not None else None
        self.reduced = True

    @torch.no_grad()
    def step(self):
        self.reduce_gradients()
        if self.max_grad_norm is not None:
            self.clip_grad_norm_(self.max_grad_norm)
        # every rank made the same collectives since the last step, or none applies it (mesh.agree_step)
        agree_step(groups=self.groups)
        self.inner.step()
        for u in self.units:
            if self.stage <= 1:  # the reduced gradient lived for this step only
                for *_, q in u.pieces:
                    q.grad = None
                u.master.grad = None
            u.publish()  # my new compute slice; stages 1-2 gather the others', stage 3 drops a gathered copy
        self.reduced = self.saw_backward = False

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, group=None, weight_of=None) -> torch.Tensor:
        """Scale the gradients so their global L2 norm is at most max_norm (torch's formula). Each rank sums
        its pieces' squares, weighted by weight_of(name) (e.g. 1/ranks holding a copy), and all-reduces the
        sum over `group` — by default each unit's own group, whose ranks hold its gradient once (stage 0: no
        all-reduce, every rank holds it all)."""
        self.reduce_gradients()
        sums = {}
        for u in self.units:
            s = sums.setdefault(group if group is not None else u.group if self.stage > 0 else None,
                                torch.zeros((), dtype=torch.float64, device=u.used.device))  # where groups talk
            for i, _, _, q in [p for p in u.pieces if p[3].grad is not None]:
                s += (q.grad.double().pow(2).sum() * (1.0 if weight_of is None else weight_of(u.names[i]))).to(s.device)
        for g, s in sums.items():
            if g is not None:
                if all(g is not h for h in self.groups):
                    self.groups.append(g)
                _agree(g, "all-reduces the gradients' squared norm (clipping)")
                dist.all_reduce(s, group=g)
        self.grad_norm = sum(sums.values()).sqrt()
        for u in [u for u in self.units if u.master.grad is not None]:
            u.master.grad.mul_((max_norm / (self.grad_norm + 1e-6)).clamp(max=1.0).to(u.master.grad))
        return self.grad_norm

    # the state dicts (section 6)
    def full_state_dict(self) -> dict:
        return full_state_dict(self)

    def load_full_state_dict(self, sd: dict) -> None:
        load_full_state_dict(self, sd)

    def shard_state_dict(self) -> dict:
        return shard_state_dict(self)

    def load_shard_state_dict(self, sd: dict) -> None:
        load_shard_state_dict(self, sd)


def shard_optimizer(params, optimizer_cls=torch.optim.AdamW, *, group=None, **optimizer_kwargs) -> ZeroOptimizer:
    """ZeRO-1 over any parameters, as PyTorch's ZeroRedundancyOptimizer takes them: an iterable of parameters
    (or of parameter groups, dicts with "params" and their own settings) and an optimizer class. Each group's
    trainable parameters become views of one flat buffer [N] (each keeps its identity: only its .data moves),
    this rank steps its slice [n] of it, and then all-gathers everyone's. Frozen parameters are left alone;
    a parameter listed twice (a tied weight) once. The loop: loss.backward(); opt.step(); opt.zero_grad() —
    step() reduce-scatters the gradients (the data-parallel average) first. shard_model(module, 1) is the same
    optimizer on a module's units, with names for its state dicts."""
    groups = list(params)
    groups = groups if groups and isinstance(groups[0], dict) else [dict(params=groups)]
    group = resolve_group(group)
    units, inner, seen = [], [], set()
    for k, g in enumerate(groups):
        mine = [p for p in g["params"] if p.requires_grad and id(p) not in seen and not seen.add(id(p))]
        if not mine:
            continue
        entries = [((f"group{k}.param{i}",), [], p) for i, p in enumerate(mine)]
        u = FlatUnit(entries, 1, group, dist.get_world_size(group), label=f"parameter group {k}")
        units.append(u)
        inner.append(dict({k: v for k, v in g.items() if k != "params"}, params=[q for *_, q in u.pieces]))
    return ZeroOptimizer(None, units, optimizer_cls, 1, groups=inner, **optimizer_kwargs)


# ---- 4. stages 2 and 3: hooks that reduce (2), and gather and free (3), as forward and backward run ---

class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once their gradients exist: the unit's backward
    is done (autograd accumulates parameter gradients first)."""

    @staticmethod
    def forward(ctx, hook, *xs):
        ctx.hook = hook
        return xs

    @staticmethod
    def backward(ctx, *grads):
        ctx.hook()
        return (None, *grads)


def _tensors(out):
    """Every tensor in a forward's output: a tensor, or any nesting of tuples, lists, dicts (a Hugging Face
    ModelOutput is one) and dataclasses."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for x in out:
            yield from _tensors(x)
    elif isinstance(out, Mapping):
        for x in out.values():
            yield from _tensors(x)
    elif dataclasses.is_dataclass(out) and not isinstance(out, type):
        for f in dataclasses.fields(out):
            yield from _tensors(getattr(out, f.name))


class _ReduceHooks:
    """Stage 2 on a model's units [((module, ...), [FlatUnit per group])]: each unit's gradient is reduced as
    soon as its backward is done (a _PostBackward on its inputs marks the end); at the end of backward every
    unit not reduced yet, in one order on every rank (a branch some ranks skip can neither hang nor skip a
    reduction). A unit of several modules (the final norm and the head) runs as one: its backward's end is
    marked on its first module's inputs."""

    def __init__(self, opt, units, root):
        self.opt, self.units, self.root, self.done = opt, units, root, set()

    def install(self):
        for i, (modules, _) in enumerate(self.units):
            for m in modules:
                m.register_forward_pre_hook(lambda m, args, kwargs, i=i, first=m is modules[0]:
                                            self.pre_forward(i, first, args, kwargs), with_kwargs=True)
                m.register_forward_hook(lambda m, args, out, i=i, last=m is modules[-1]:
                                        self.post_forward(i, last, out))

    # -- the module hooks
    def pre_forward(self, i, first, args, kwargs):
        return self.mark_end_of_backward(i, args, kwargs) if first else None

    def post_forward(self, i, last, output):
        for t in _tensors(output):  # every tensor the output holds, however nested (a dict, a dataclass)
            if t.requires_grad:
                t.register_hook(lambda g: self.pre_backward(i))  # runs before the unit's backward

    def pre_backward(self, i):
        if not self.opt.in_backward:  # the first unit of this backward: finish every unit at its end
            self.opt.in_backward = self.opt.saw_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_of_backward)

    # -- the end of a unit's backward, and of the whole backward
    def mark_end_of_backward(self, i, args, kwargs):
        want = [(args, k) for k, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        want += [(kwargs, k) for k, a in kwargs.items() if isinstance(a, torch.Tensor) and a.requires_grad]
        if not (want and torch.is_grad_enabled()):
            return None  # no input gradient will mark the end of its backward: end_of_backward reduces it
        args, kwargs = list(args), dict(kwargs)
        where = [(args if box is not kwargs else kwargs, k) for box, k in want]
        for (box, k), a in zip(where, _PostBackward.apply(lambda: self.post_backward(i), *[box[k] for box, k in where])):
            box[k] = a
        return tuple(args), kwargs

    def post_backward(self, i):
        self.done.add(i)
        for u in self.units[i][1]:
            if self.opt.deferring:
                u.unreduced = True  # inside opt.accumulating(): the full gradient stays
            else:
                self.opt.reduce_unit(u)

    def end_of_backward(self):
        for i in [i for i in range(len(self.units)) if i not in self.done]:  # one order on every rank
            self.post_backward(i)
        self.done.clear()
        self.opt.in_backward = False
        if not self.opt.deferring:
            self.opt.finish_reduction()


class _GatherHooks(_ReduceHooks):
    """Stage 3: stage 2's hooks, and a unit (all its groups together) gathered before its forward and its
    backward and freed after each — with the next unit in the pass's direction prefetched behind it. A unit
    of several modules is gathered before its first module runs and freed after its last one's forward."""

    def __init__(self, opt, units, root, reshard_after_forward, prefetch):
        super().__init__(opt, units, root)
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self.order = []  # units by first forward, for the prefetch
        self.forwards = [0] * len(units)  # forwards of each unit since the last backward (in errors: mesh.agree)

    def gather(self, i, step):  # unit i now; the next unit in this pass's direction behind it (overlap)
        j = self.order.index(i) + step  # (pre_forward listed i before its first gather)
        units, order = self.units, self.order
        ahead = units[order[j]][1] if self.prefetch and 0 <= j < len(order) and units[order[j]][0][0] is not self.root \
            else []
        way = "forward" if step > 0 else "backward"
        again = step > 0 and self.forwards[i] > 1  # (a unit run twice: the same on every rank, or an error below)
        why = f"for {way}" + (f", its {_nth(self.forwards[i])} forward since the last backward" if again else "")
        for u in units[i][1]:
            u.unshard(why)
        for u in ahead:
            u.unshard(f"ahead of its {way} (prefetch)")
        for u in units[i][1]:
            u.wait()

    def free(self, i):
        for u in self.units[i][1]:
            u.free()

    def pre_forward(self, i, first, args, kwargs):
        if i not in self.order:
            self.order.append(i)
        self.forwards[i] += first
        self.gather(i, +1)  # (a unit's later modules find it gathered already)
        return super().pre_forward(i, first, args, kwargs)

    def post_forward(self, i, last, output):
        # The root's backward starts right after its forward: keep it gathered, unless none follows.
        if last and self.reshard_after_forward and (self.units[i][0][0] is not self.root or not torch.is_grad_enabled()):
            self.free(i)
        super().post_forward(i, last, output)

    def pre_backward(self, i):
        super().pre_backward(i)
        self.gather(i, -1)

    def post_backward(self, i):
        super().post_backward(i)
        if self.reshard_after_forward or not self.opt.deferring:
            self.free(i)

    def end_of_backward(self):
        super().end_of_backward()
        self.forwards = [0] * len(self.units)


def _nth(k: int) -> str:
    return f"{k}{'th' if 10 <= k % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(k % 10, 'th')}"


def _add_hooks(opt, units, root, reshard_after_forward, prefetch):
    """units [((module, ...), [FlatUnit per group])]: stage 2's hooks, or stage 3's, on each unit's modules."""
    hooks = _GatherHooks(opt, units, root, reshard_after_forward, prefetch) if opt.stage == 3 else \
        _ReduceHooks(opt, units, root)
    hooks.install()
    return hooks


# ---- 5. the entry point ------------------------------------------------------------------------------

@dataclasses.dataclass
class Seams:
    """What the other lessons plug into shard_model — a model of your own needs none of it:

    divide_by      what summed gradients are divided by (default: the number of ranks in `group`); train.py:
                   dp·cp, also for expert weights reduced over fewer ranks
    after_reduce   after_reduce(t) runs on each reduced gradient shard and on the used-flags, before the
                   division: hybrid sharding all-reduces them across replicas there (hsdp.py, lesson 3)
    groups_of      groups_of(name, param) -> None | (group, divide_by): parameters replicated over other
                   ranks (expert weights, lesson 7) get flat buffers of their own, sharded over that group
    before_reduce  before_reduce(params) runs right before a unit's gradients are packed (stages 0-1 at
                   step(), 2-3 in backward): tensor parallel sums partial gradients over tp there (train.py)
    averaged       stage 0: the gradients arrive averaged already — train.py wraps the model in ddp.py's
                   BucketedDDP, which all-reduces them in buckets during backward — so the optimizer moves
                   nothing: it packs them, (before_reduce,) and steps
    shapes_only    a model on the meta device stays there: every buffer its sizes and no memory (a memory
                   plan, with a fake process group: train.py --plan, lab/plan.py)"""
    divide_by: int | None = None
    after_reduce: object = None
    groups_of: object = None
    before_reduce: object = None
    averaged: bool = False
    shapes_only: bool = False


def shard_model(model: nn.Module, stage: int, optimizer_cls=torch.optim.AdamW, *, group=None, units=None,
                param_dtype=None, reshard_after_forward=True, prefetch=True, max_grad_norm=None, init_fn=None,
                offload=False, seams: Seams | None = None, **optimizer_kwargs) -> ZeroOptimizer:
    """Shard `model` in place by ZeRO stage 0-3 and return the optimizer that owns the shards.

    units          what is gathered, reduced and freed together (unit_groups): a module class (units=
                   LlamaDecoderLayer), a tuple or list of classes — every submodule of them, one unit each —
                   or a list of submodules, where an item may be a list of sibling modules forming ONE unit,
                   in the order they run ([model.emb, *model.layers, [model.norm, model.head]], as FSDP2's
                   FSDP2 wrapping norm and head together). None: default_units' rule — each block of the largest
                   nn.ModuleList, each embedding before it, the modules after it (final norm + head) as one;
                   a model without an nn.ModuleList must name them (ValueError, never one silent unit).
                   A parameter goes to the innermost unit containing every module that holds it (a tied
                   weight: the unit enclosing both uses); frozen ones stay whole. The root unit is the model
                   itself with every parameter no unit encloses: nothing for the course's model; a weight
                   tied across units (transformers' tied embedding and head), or parameters of the model's
                   own. Its backward starts right after its forward (the loss), so stage 3 keeps it gathered
                   from forward into backward instead of freeing and re-gathering it at once (as FSDP2's root).
    max_grad_norm  clip the global gradient norm to this in step() (opt.clip_grad_norm_, torch's formula over
                   the averaged gradients of every rank). NOT torch.nn.utils.clip_grad_norm_(model.parameters()):
                   between backward and step a parameter's .grad is this rank's own, unaveraged gradient
                   (stages 0-1; they are reduced in step()) or None (stages 2-3: the reduced gradient lives
                   in the optimizer's flat shard), so torch's utility clips by a local norm, or clips
                   nothing; call opt.clip_grad_norm_(max_norm) there instead (it returns the global norm)
    group          the ranks parameters are sharded over (stage 0: averaged over); default the world
    param_dtype    compute dtype (bf16): master, optimizer state and gradient reduction stay fp32
    reshard_after_forward, prefetch   stage 3: free a unit after its forward (else keep it gathered into its
                   backward: b_p·Ψ gathered instead of 2b_p·Ψ, more memory); gather the next unit early
    init_fn        init_fn(name, shape): values for a meta-device model (only my slice is made)
    offload        ZeRO-Offload: the fp32 master and the optimizer state live in host memory (pinned on a GPU
                   machine) and the optimizer steps there; per step each reduced gradient slice comes down,
                   b_m·n bytes, and the new compute slice goes up, b_p·n (Ren et al. 2021, arXiv:2101.06840)
    seams          Seams(...): what hybrid sharding, tensor and expert parallel, lesson 1's buckets and the
                   memory planner plug in (see Seams); None: none of it
    **optimizer_kwargs   for optimizer_cls (lr=..., weight_decay=...)
    """
    seams = seams or Seams()
    misplaced = sorted(set(optimizer_kwargs) & {f.name for f in dataclasses.fields(Seams)})
    if misplaced:
        raise ValueError(f"{', '.join(misplaced)} go in seams=fsdp.Seams({misplaced[0]}=...), not as keyword "
                         f"arguments of shard_model (those that are not its own go to the optimizer)")
    divide_by, after_reduce, groups_of = seams.divide_by, seams.after_reduce, seams.groups_of
    before_reduce, averaged, shapes_only = seams.before_reduce, seams.averaged, seams.shapes_only
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if averaged and stage != 0:
        raise ValueError(f"averaged=True means data parallel averaged every gradient already, which is stage 0; "
                         f"stage {stage} reduce-scatters them itself: drop averaged")
    if stage == 0 and after_reduce is not None:
        raise ValueError("stage 0 all-reduces every gradient over its group already: after_reduce (hybrid "
                         "sharding's all-reduce across a replicate_group) goes with stage 1, 2 or 3")
    if param_dtype is not None and not param_dtype.is_floating_point:
        raise ValueError(f"param_dtype must be a floating dtype such as torch.bfloat16, got {param_dtype}")
    if init_fn is None and not shapes_only and any(p.is_meta for p in model.parameters()):
        raise ValueError("the model is on the meta device: pass init_fn(name, shape) to materialise the shards")
    group = resolve_group(group)
    divide_by = divide_by or dist.get_world_size(group)
    units = unit_groups(model, units)  # [(module, ...)]: one unit each (before any collective: errors alike)

    trainable = {}  # every trainable parameter once: its names and every (module, attribute) holding it
    for mname, m in model.named_modules(remove_duplicate=False):
        for attr, p in m._parameters.items():
            if p is not None and p.requires_grad:
                names, holders, _ = trainable.setdefault(id(p), ([], [], p))
                names.append(f"{mname}.{attr}" if mname else attr)
                holders.append((m, attr))
    inside = [{id(m) for member in um for m in member.modules()} for um in units]
    units = [*units, (model,)]  # the root unit last: every parameter no unit encloses
    buffers_of = {id(um): {} for um in units}  # unit -> {(group, divide_by, after_reduce): entries}
    for names, holders, p in trainable.values():
        enclosing = [(len(s), k) for k, s in enumerate(inside) if {id(m) for m, _ in holders} <= s]
        g = groups_of(names[0], p) if groups_of is not None else None
        if g is not None and not (isinstance(g, tuple) and len(g) == 2 and isinstance(g[0], dist.ProcessGroup)
                                  and g[1] > 0 and dist.get_rank(g[0]) >= 0):
            raise ValueError(f"groups_of({names[0]!r}) must return None or (a process group holding this rank, "
                             f"divide_by > 0), got {g!r}")
        key = (group, divide_by, after_reduce) if g is None else (*g, None)
        unit = units[min(enclosing)[1] if enclosing else -1]
        buffers_of[id(unit)].setdefault(key, []).append((tuple(names), holders, p))
    for mname, m in model.named_modules():  # frozen parameters stay whole on every rank
        for attr, p in m._parameters.items():
            if p is not None and not p.requires_grad and (p.is_meta or param_dtype is not None) and not shapes_only:
                full = init_fn(f"{mname}.{attr}" if mname else attr, p.shape) if p.is_meta else p.detach()
                m._parameters[attr] = nn.Parameter(full.to(collective_device(group), param_dtype or full.dtype), False)

    unit_cls = OffloadedUnit if offload else FlatUnit
    module_names = {id(m): n for n, m in model.named_modules()}
    label = lambda k, um: f"unit {k} ({', '.join(module_names[id(m)] for m in um)})" if um[0] is not model \
        else f"the root unit ({type(model).__name__}'s own parameters)"  # noqa: E731
    flat_units = [(um, [unit_cls(entries, stage, g, d, a, param_dtype, init_fn, label(k, um))
                        for (g, d, a), entries in buffers_of[id(um)].items()])
                  for k, um in enumerate(units) if buffers_of[id(um)]]
    for u in flat_units[-1][1] if flat_units and flat_units[-1][0][0] is model else []:
        u.root = True
    for u in (u for _, us in flat_units for u in us):
        if averaged:
            u.averaged, u.divide_by = True, 1
    opt = ZeroOptimizer(model, [u for _, us in flat_units for u in us], optimizer_cls, stage, max_grad_norm,
                        before_reduce, **optimizer_kwargs)
    if stage >= 2:
        _add_hooks(opt, flat_units, model, reshard_after_forward, prefetch)
    return opt


def default_units(model: nn.Module) -> list:
    """shard_model's units when none are named, found by one rule that fits the course's model, transformers'
    decoders (Llama, Mistral, Qwen, GPT-2, Mixtral) and nanoGPT alike:
      - the blocks: each child of the model's largest nn.ModuleList (by trainable parameters), one unit each
        (lab.model's `layers`, Llama's `model.layers`, GPT-2's `transformer.h`);
      - the input side: each module outside the blocks that holds a trainable parameter and is registered
        before them (the token embedding; GPT-2's position embedding too), one unit each;
      - the output side: the modules that hold a trainable parameter and are registered after them (the
        final norm and the head), ONE unit together, in the order registered, which must be the order they
        run (as FSDP2 users wrap the norm and the head together).
    A model with no nn.ModuleList holding trainable parameters (an nn.Sequential, a hand-written net) has no
    blocks to find: ValueError naming units=, never one silent unit of everything."""
    lists = [m for m in model.modules()
             if isinstance(m, nn.ModuleList) and any(p.requires_grad for p in m.parameters())]
    if not lists:
        raise ValueError(f"shard_model found no repeated blocks in {type(model).__name__} (no nn.ModuleList with "
                         f"trainable parameters): name the units, e.g. units=MyBlock (a class), units=[model.a, "
                         f"model.b] (submodules) or units=[model.emb, [model.norm, model.head]] (a list is one unit)")
    blocks = max(lists, key=lambda l: sum(p.numel() for p in l.parameters() if p.requires_grad))
    in_blocks = {id(m) for m in blocks.modules()}
    before, after, seen = [], [], False
    for m in model.modules():
        if m is blocks:
            seen = True
        elif id(m) not in in_blocks and m is not model and any(p is not None and p.requires_grad
                                                               for p in m._parameters.values()):
            (after if seen else before).append(m)
    return [(m,) for m in before] + [(b,) for b in blocks] + ([tuple(after)] if after else [])


def unit_groups(model: nn.Module, units) -> list:
    """shard_model's `units` as [(module, ...)], one tuple per unit: None -> default_units(model); a module
    class or a tuple/list of classes -> every submodule of those classes, one unit each; a list of submodules,
    where an item may itself be a list or tuple of sibling modules forming ONE unit (in the order they run)."""
    if units is None:
        return default_units(model)
    items = [units] if isinstance(units, type) else list(units) if isinstance(units, (list, tuple)) else None
    if items and all(isinstance(c, type) and issubclass(c, nn.Module) for c in items):
        found = [(m,) for m in model.modules() if isinstance(m, tuple(items)) and m is not model]
        if not found:
            raise ValueError(f"no submodule of {type(model).__name__} is a {' or '.join(c.__name__ for c in items)}: "
                             f"units= names the classes (or the submodules) of the model's repeated blocks")
        return found
    mine = {id(m) for m in model.modules()}
    groups = [tuple(i) if isinstance(i, (list, tuple)) else (i,) for i in items or []]
    flat = [m for g in groups for m in g]
    if not groups or not all(g and all(isinstance(m, nn.Module) and id(m) in mine and m is not model for m in g)
                             for g in groups):
        raise ValueError("units must be a module class, a tuple or list of module classes, or a list of the "
                         "model's submodules (an item may be a list of submodules forming one unit, e.g. "
                         f"[model.norm, model.output]); got {units!r:.200}")
    if len({id(m) for m in flat}) != len(flat):
        raise ValueError("units lists a module twice: each module belongs to one unit")
    return groups


# ---- 6. state dicts: full (the plain model's) and sharded (this rank's, for the same layout) ----------
#
#   full     {name: whole tensor}, the same on every rank, as the plain model's state_dict() has it (a tied
#            weight under each of its names; frozen parameters and buffers too), so it loads with
#            load_state_dict(strict=True) into an unsharded model. Making it all-gathers every unit's
#            master slices: API bytes b_m·Ψ (b_m = 4 for fp32 masters).
#   sharded  this rank's master slices [n] and its optimizer's state: no collective at all, and it
#            reloads only into the same layout (same P, same units) — what a resumed run needs.
# Either load writes the master slices and then refreshes every compute copy (FlatUnit.publish):
# stages 1-2 all-gather the new parameters, stage 3 drops any gathered copy, which would be stale.

def _unsharded(opt) -> dict:
    """The module's frozen parameters and buffers: every rank keeps them whole."""
    sharded = {n for u in opt.units for names in u.aliases for n in names}
    return {} if opt.module is None else {k: v.detach() for k, v in opt.module.state_dict(keep_vars=True).items()
                                          if k not in sharded}  # (keep_vars: a stage-3 parameter is not read)


@torch.no_grad()
def full_state_dict(opt) -> dict:
    """{name: whole tensor} on every rank: each parameter gathered from the master slices, under every
    name the plain model's state_dict() has for it, and the frozen parameters and buffers."""
    out = {k: v.detach().clone() for k, v in _unsharded(opt).items()}
    for u in opt.units:
        full = u.master.detach()  # stage 0: the whole buffer (its views are cloned below)
        if opt.stage > 0:
            mine = full.to(u.used.device)  # (an offloaded master: gathered on the device our groups use)
            full = mine.new_empty(u.flat_numel)
            _agree(u.group, f"gathers {u.label} for full_state_dict", full)
            all_gather_single(full, mine, group=u.group)
        out.update((n, v.clone()) for names, v in zip(u.aliases, u.views(full)) for n in names)
    return out


@torch.no_grad()
def load_full_state_dict(opt, sd: dict) -> None:
    """Load a full state dict (the same on every rank): each rank takes its slices and refreshes its
    compute copies (any gathered copy is dropped); frozen parameters and buffers are copied whole."""
    for u in opt.units:
        full = torch.cat([sd[name].reshape(-1).to(u.master) for name in u.names]
                         + [u.master.new_zeros(u.flat_numel - sum(u.numels))])
        u.master.copy_(full[u.rank * u.shard_numel:(u.rank + 1) * u.shard_numel])
        u.publish()
    for k, v in _unsharded(opt).items():
        v.copy_(sd[k])


def shard_state_dict(opt) -> dict:
    """This rank's training state, for a checkpoint the same layout reloads: its master slices and the
    inner optimizer's state (frozen parameters and buffers never change: they are not in it)."""
    return copy.deepcopy(dict(masters=[u.master.detach() for u in opt.units], optimizer=opt.inner.state_dict()))


@torch.no_grad()
def load_shard_state_dict(opt, sd: dict) -> None:
    for u, m in zip(opt.units, sd["masters"], strict=True):
        u.master.copy_(m)
        u.publish()  # compute copies refreshed; stage 3 drops any gathered (now stale) buffer
    opt.inner.load_state_dict(sd["optimizer"])


# ---- 7. a stage-3 parameter between uses: one clear error for whoever reads it -----------------------

class _Resharded(nn.Parameter):
    """What a stage-3 parameter is while its unit is freed: the same Parameter object (autograd, the
    optimizer's hooks and every module holding it keep it), its class switched to this one and its data to
    one element of the unit's shard broadcast to its shape (nothing can read past its bytes, which a view of
    the freed buffer would; no new memory). Its shape, dtype, device, requires_grad and grad stay readable
    (numel() counts, loops over parameters work), and autograd takes it by identity (zero bubble's W);
    anything that reads its values — model.state_dict(), torch.save, print, arithmetic — raises one error
    naming fsdp.full_state_dict, which gathers the true values on every rank. The unit's next gather gives
    it back its class and its view of the gathered buffer (the trick FSDP1 played with .data)."""

    _metadata = {"shape", "dtype", "device", "requires_grad", "grad", "size", "dim", "numel", "ndim", "is_leaf",
                 "layout", "__hash__", "is_meta", "is_cuda", "untyped_storage", "is_floating_point", "is_complex",
                 "element_size", "nelement", "grad_fn", "_version", "is_sparse", "names", "_base", "requires_grad_",
                 "new_zeros", "new_empty", "apply",  # apply, grad (torch.autograd.grad): autograd, by identity
                 "register_hook", "register_post_accumulate_grad_hook",  # hooks: PyTorch's MemTracker, DDP-like tools
                 "data_ptr", "storage_offset", "stride", "is_contiguous"}  # where it lives, not what it holds

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        prop = getattr(getattr(func, "__self__", None), "__name__", "")  # a property's getter or setter
        if name in cls._metadata or name == "__set__" or (name == "__get__" and prop in cls._metadata):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        what = prop if name in ("__get__", "__set__") else name
        raise RuntimeError(
            f"{getattr(args[0], '_resharded_name', 'this parameter') if args else 'this parameter'} is sharded by "
            f"ZeRO-3: between uses each rank keeps only its slice, so its values cannot be read here ({what}). "
            f"fsdp.full_state_dict(opt) (opt.full_state_dict()) gathers every parameter's true values — call it on "
            f"every rank, then save or print that; opt.load_full_state_dict(sd) loads one")

    @staticmethod
    def mark(p, name, shard):
        if type(p) is nn.Parameter:
            with torch._C.DisableTorchFunctionSubclass():  # (the shard's bytes: no new memory; same dtype, device)
                p.data = shard.detach()[:1].expand(p.shape)
            p.__class__, p._resharded_name = _Resharded, name

    @staticmethod
    def restore(p, view):
        if type(p) is _Resharded:
            p.__class__ = nn.Parameter
            with torch._C.DisableTorchFunctionSubclass():
                p.data = view


# ---- for lesson 8: ZeRO-Offload, the master and the optimizer state in host memory ----------------------

class OffloadedUnit(FlatUnit):
    """A FlatUnit whose fp32 master slice — and so the optimizer state made beside it — lives in host memory
    (pinned on a GPU machine), where the optimizer steps (Ren et al. 2021, "ZeRO-Offload", arXiv:2101.06840).
    Per step each reduced gradient slice comes down, b_m·n bytes (download), and the new compute slice goes
    up, b_p·n (upload). shard_model(..., offload=True) makes these; train.py --offload."""

    offload = True

    def home(self, master):
        if master.is_meta:  # (a memory plan: shapes only, apart from the shard all the same)
            return torch.empty_like(master)
        return master.to("cpu").pin_memory() if master.device.type == "cuda" else master.to("cpu", copy=True)

    def receive(self, grad):
        return self.download(grad)

    def download(self, grad):
        """A reduced gradient [n] (stage 0: [N]) from the device to the host: b_m·n bytes."""
        return grad.to(self.master.device, non_blocking=False)

    def upload(self):
        """The new master, cast to the compute dtype on the host, to the device: b_p·n bytes."""
        self.shard.copy_(self.master.detach().to(self.dtype))
        return self.shard

    @torch.no_grad()
    def refresh_shard(self):
        self.upload()


if __name__ == "__main__":  # the demo (stages 0-3 against the formulas, one process and FSDP2) is in the package
    from lab.fsdp_demo import main
    main()
