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
gradient, 3Ψ. The tests count API bytes, what is handed to a collective (a reduce-scatter of 4Ψ for fp32
gradients, an all-gather of b_p·Ψ); a ring sends (P-1)/P of that per rank (all-reduce: 2(P-1)/P).
Exactly, stage 3 gathers b_p·(2Ψ − Ψ_root): the root unit (embedding, final norm, head) stays gathered
into its backward, which follows its forward at once (as FSDP2's root); with reshard_after_forward=False
every unit does: b_p·Ψ. Each step also all-reduces one int32 per parameter tensor, which parameters got
a gradient on any rank (as DDP's find_unused_parameters), so one no rank used gets none.

How (Zhao et al. 2023, "PyTorch FSDP", arXiv:2304.11277 §3-4): a unit's parameters are views of one flat
buffer [N], N padded to a multiple of P, so a shard is one slice and a unit moves in one collective
(FSDP's FlatParameter). The optimizer steps one 1-D piece per parameter (as FSDP2), so AdamW skips a
parameter without gradient as in one process. Stages 2-3 reduce a unit once its backward is done, and
at the end of backward every unit not reduced yet, in one order on every rank: a branch some ranks skip
can neither hang nor skip a reduction. `with opt.accumulating():` defers the reduction over several
backwards (FSDP §3.4). The loop stays as it was — opt = shard_model(model, stage), then
loss.backward(); opt.step(); opt.zero_grad(). A unit's flat buffer, its slice and its collectives:
flat_unit.py. The shards saved and loaded: checkpoint.py. The formulas as functions, the bytes a rank
holds and the measured run the demo, tests and notebook use: zero_measure.py.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

import checkpoint
from flat_unit import FlatUnit
from mesh import collective_device, resolve_group


# ---- stages 2-3: hooks that gather, free and reduce while forward and backward run ---------------

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


def _add_hooks(opt, units, root, reshard_after_forward, prefetch):
    """units [(module, [FlatUnit per group])]. Stage 3 gathers a unit (all its groups together) before
    its forward and before its backward and frees it after each. Stages 2-3 reduce a unit when its
    backward is done; at the end of backward every unit not reduced yet, in one order on every rank."""
    stage3, order, done = opt.stage == 3, [], set()  # order: units by first forward, for the prefetch

    def gather(i, step):  # unit i now; the next unit in this pass's direction behind it (overlap)
        j = order.index(i) + step  # (pre_forward listed i before its first gather)
        ahead = units[order[j]][1] if prefetch and 0 <= j < len(order) and units[order[j]][0] is not root else []
        for u in units[i][1] + ahead:
            u.unshard()
        for u in units[i][1]:
            u.wait()

    def free(i):
        for u in units[i][1]:
            u.free()

    def pre_forward(i, args):
        if stage3:
            if i not in order:
                order.append(i)
            gather(i, +1)
        want = [k for k, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        if not (want and torch.is_grad_enabled()):
            return None  # no input gradient will mark the end of its backward: end_of_backward reduces it
        args = list(args)
        for k, a in zip(want, _PostBackward.apply(lambda: post_backward(i), *[args[k] for k in want])):
            args[k] = a
        return tuple(args)

    def post_forward(i, output):
        # The root's backward starts right after its forward: keep it gathered, unless none follows.
        if stage3 and reshard_after_forward and (units[i][0] is not root or not torch.is_grad_enabled()):
            free(i)
        for t in output if isinstance(output, (tuple, list)) else [output]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda g: pre_backward(i))  # runs before the unit's backward

    def pre_backward(i):
        if not opt.in_backward:  # the first unit of this backward: finish every unit at its end
            opt.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(end_of_backward)
        if stage3:
            gather(i, -1)

    def post_backward(i):
        done.add(i)
        for u in units[i][1]:
            if opt.deferring:
                u.unreduced = True  # inside opt.accumulating(): the full gradient stays
            else:
                opt.reduce_unit(u)
        if stage3 and (reshard_after_forward or not opt.deferring):
            free(i)

    def end_of_backward():
        for i in [i for i in range(len(units)) if i not in done]:  # one order on every rank
            post_backward(i)
        done.clear()
        opt.in_backward = False
        if not opt.deferring:
            opt.finish_reduction()

    for i, (module, _) in enumerate(units):
        module.register_forward_pre_hook(lambda m, args, i=i: pre_forward(i, args))
        module.register_forward_hook(lambda m, args, out, i=i: post_forward(i, out))


# ---- the optimizer that owns the shards ------------------------------------------------------------

class ZeroOptimizer:
    """Steps this rank's pieces with any torch.optim class once their gradients are reduced: at step()
    for stages 0-1 (all-reduce; reduce-scatter), during backward for 2-3. Stages 1-2 then all-gather the
    new parameters; stage 3 leaves that to the next forward."""

    def __init__(self, module, units, optimizer_cls, stage, max_grad_norm=None, before_reduce=None, **optimizer_kw):
        self.module, self.units, self.stage = module, units, stage  # module: for its frozen params and buffers
        self.max_grad_norm, self.before_reduce = max_grad_norm, before_reduce
        self.inner = optimizer_cls([q for u in units for *_, q in u.pieces], **optimizer_kw)
        # Reductions run behind the rest of backward only on NCCL (its own CUDA stream); on gloo their CPU
        # threads would compete with compute (measured slower when ranks share cores): wait at once.
        self.async_reduce = all(dist.get_backend(u.group) == "nccl" for u in units)
        self.pending, self.deferring, self.in_backward, self.reduced, self.grad_norm = [], False, False, False, None

    param_groups = property(lambda self: self.inner.param_groups)  # what LR schedulers set
    full_state_dict, load_full_state_dict = checkpoint.full_state_dict, checkpoint.load_full_state_dict
    shard_state_dict, load_shard_state_dict = checkpoint.shard_state_dict, checkpoint.load_shard_state_dict

    def zero_grad(self, set_to_none=True):
        for u in self.units:
            for p in u.params + [u.master] + [q for *_, q in u.pieces]:
                p.grad = None
            u.used.zero_()
        self.reduced = self.in_backward = False

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
            if u.across is not None:
                u.across(out)  # HSDP: the shard, summed over my shard group, now across replicas
            out.div_(u.divide_by)  # gloo has no ReduceOp.AVG: sum, then divide
            u.master.grad = out if u.master.grad is None else u.master.grad.add_(out)
        self.pending.clear()
        late = [n for u in self.units for n, p in zip(u.names, u.params) if self.stage >= 2 and p.grad is not None]
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
        groups = {}
        for u in self.units:  # one order on every rank
            groups.setdefault((u.group, u.across), []).append(u)
        for (group, across), us in groups.items():
            used = torch.cat([u.used for u in us])
            if dist.get_world_size(group) > 1:
                dist.all_reduce(used, group=group)
            if across is not None:
                across(used)
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
        self.inner.step()
        for u in self.units:
            if self.stage <= 1:  # the reduced gradient lived for this step only
                for *_, q in u.pieces:
                    q.grad = None
                u.master.grad = None
            u.publish()  # my new compute slice; stages 1-2 gather the others', stage 3 drops a gathered copy
        self.reduced = False

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
                                torch.zeros((), dtype=torch.float64, device=u.master.device))
            for i, _, _, q in [p for p in u.pieces if p[3].grad is not None]:
                s += q.grad.double().pow(2).sum() * (1.0 if weight_of is None else weight_of(u.names[i]))
        for g, s in sums.items():
            if g is not None:
                dist.all_reduce(s, group=g)
        self.grad_norm = sum(sums.values()).sqrt()
        for u in [u for u in self.units if u.master.grad is not None]:
            u.master.grad.mul_((max_norm / (self.grad_norm + 1e-6)).clamp(max=1.0).to(u.master.grad.dtype))
        return self.grad_norm


# ---- the entry point ---------------------------------------------------------------------------------

def shard_model(model: nn.Module, stage: int, optimizer_cls=torch.optim.AdamW, *, group=None, replicate_group=None,
                units=None, param_dtype=None, reshard_after_forward=True, prefetch=True, max_grad_norm=None,
                init_fn=None, groups_of=None, reduce_shard=None, divide_by=None, before_reduce=None,
                **optimizer_kwargs) -> ZeroOptimizer:
    """Shard `model` in place by ZeRO stage 0-3 and return the optimizer that owns the shards.

    units          module classes (default: model.Block) or a list of submodules, one unit each; the rest
                   is the root unit. A parameter goes to the innermost unit containing every module that
                   holds it (a tied weight: the unit enclosing both uses); frozen ones stay whole.
    group          the ranks parameters are sharded over (stage 0: averaged over); default the world
    divide_by      what summed gradients are divided by (default: the number of ranks they came from)
    reduce_shard   reduce_shard(t) runs on each reduced gradient shard (and the used-flags) before the
                   division: HSDP all-reduces across replicas (hsdp.py). replicate_group=R is short for
                   reduce_shard=hsdp.across_replicas(R), divide_by=|group|·|R|.
    groups_of      groups_of(name, param) -> None | (group, divide_by): parameters replicated over other
                   ranks (expert weights) get flat buffers of their own, sharded over that group
    before_reduce  before_reduce(params) runs right before a unit's gradients are packed (stages 0-1 at
                   step(), 2-3 in backward): tensor parallel sums partial gradients over tp there
    param_dtype    compute dtype (bf16): master, optimizer state and gradient reduction stay fp32
    init_fn        init_fn(name, shape): values for a meta-device model (only my slice is made)
    """
    from model import Block
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if stage == 0 and (replicate_group is not None or reduce_shard is not None):
        raise ValueError("stage 0 already replicates everything: pass replicate_group only with stage 1, 2 or 3")
    if param_dtype is not None and not param_dtype.is_floating_point:
        raise ValueError(f"param_dtype must be a floating dtype such as torch.bfloat16, got {param_dtype}")
    if init_fn is None and any(p.is_meta for p in model.parameters()):
        raise ValueError("the model is on the meta device: pass init_fn(name, shape) to materialise the shards")
    group = resolve_group(group)
    if replicate_group is not None:
        from hsdp import across_replicas  # lesson 3: the one all-reduce that makes sharding hybrid
        reduce_shard = across_replicas(replicate_group)
        divide_by = divide_by or dist.get_world_size(group) * dist.get_world_size(replicate_group)
    divide_by = divide_by or dist.get_world_size(group)
    units = (Block,) if units is None else units
    if isinstance(units, tuple) and all(isinstance(c, type) for c in units):
        units = [m for m in model.modules() if isinstance(m, units) and m is not model]
    elif not all(isinstance(m, nn.Module) and any(m is k for k in model.modules()) and m is not model for m in units):
        raise ValueError("units must be module classes or a list of submodules of the model")
    units = list(dict.fromkeys(units))  # each module once

    held = {}  # every trainable parameter once: its names and every (module, attribute) holding it
    for mname, m in model.named_modules(remove_duplicate=False):
        for attr, p in m._parameters.items():
            if p is not None and p.requires_grad:
                names, holders, _ = held.setdefault(id(p), ([], [], p))
                names.append(f"{mname}.{attr}" if mname else attr)
                holders.append((m, attr))
    inside = [{id(m) for m in um.modules()} for um in units]
    plan = {id(um): {} for um in [*units, model]}  # unit -> {(group, divide_by, across): entries}
    for names, holders, p in held.values():
        fits = [(len(s), k) for k, s in enumerate(inside) if {id(m) for m, _ in holders} <= s]
        g = groups_of(names[0], p) if groups_of is not None else None
        if g is not None and not (isinstance(g, tuple) and len(g) == 2 and isinstance(g[0], dist.ProcessGroup)
                                  and g[1] > 0 and dist.get_rank(g[0]) >= 0):
            raise ValueError(f"groups_of({names[0]!r}) must return None or (a process group holding this rank, "
                             f"divide_by > 0), got {g!r}")
        key = (group, divide_by, reduce_shard) if g is None else (*g, None)
        plan[id(units[min(fits)[1]] if fits else model)].setdefault(key, []).append((tuple(names), holders, p))
    for mname, m in model.named_modules():  # frozen parameters stay whole on every rank
        for attr, p in m._parameters.items():
            if p is not None and not p.requires_grad and (p.is_meta or param_dtype is not None):
                full = init_fn(f"{mname}.{attr}" if mname else attr, p.shape) if p.is_meta else p.detach()
                m._parameters[attr] = nn.Parameter(full.to(collective_device(group), param_dtype or full.dtype), False)

    made = [(um, [FlatUnit(e, stage, g, d, a, param_dtype, init_fn) for (g, d, a), e in plan[id(um)].items()])
            for um in [*units, model] if plan[id(um)]]
    opt = ZeroOptimizer(model, [u for _, us in made for u in us], optimizer_cls, stage, max_grad_norm, before_reduce,
                        **optimizer_kwargs)
    if stage >= 2:
        _add_hooks(opt, made, model, reshard_after_forward, prefetch)
    return opt


# ---- the demo: torchrun --nproc_per_node 4 fsdp.py --stage 3 --compare ----------------------------

def _demo(argv=None, reference=None) -> int:
    import argparse
    import os

    from data import get_batch, load_corpus
    from demo import bytes_table, finish, max_diff, print_by_rank
    from instruments import time_side_by_side
    from mesh import init_distributed, print0
    from model import build_model
    from zero_measure import one_process_check, train_and_measure
    dtypes = {"fp32": None, "bf16": torch.bfloat16}  # None: compute in the parameters' own fp32
    ap = argparse.ArgumentParser(description="ZeRO stage 0-3 on the shared model, measured against the formulas")
    ap.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8, help="global batch (a multiple of the number of ranks)")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--param-dtype", default="fp32", choices=sorted(dtypes))
    ap.add_argument("--no-reshard", action="store_true", help="keep units gathered from forward to backward")
    ap.add_argument("--no-prefetch", action="store_true")
    ap.add_argument("--peak", action="store_true", help="measure the last step's peak with MemTracker (slow)")
    ap.add_argument("--compare", action="store_true", help="also time PyTorch's FSDP2 fully_shard, side by side")
    args = ap.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.batch % world or args.steps < 1:  # arithmetic only: every rank says it, before any collective
        raise ValueError(f"--batch {args.batch} must be a multiple of the {world} ranks and --steps at least 1: "
                         f"try --batch {world * max(1, args.batch // world)} --steps {max(1, args.steps)}")
    device = init_distributed()
    pd, mib = dtypes[args.param_dtype], 1 / 2**20
    kw = dict(param_dtype=pd, reshard_after_forward=not args.no_reshard, prefetch=not args.no_prefetch)
    res = train_and_measure(args.stage, args.model, args.steps, args.batch, args.seq, args.lr, track_peak=args.peak,
                            **kw)
    print0(f"ZeRO stage {args.stage}, {world} ranks, model {args.model} (Ψ = {res['numel']:,} elements padded), "
           f"compute {args.param_dtype}; losses {[round(x, 4) for x in res['losses']]}")
    lines = [f"rank {dist.get_rank()}: model state at rest, MiB (measured | formula)"]
    lines += [f"    {k:10s} {res['memory'][k] * mib:9.4f} | {v * mib:9.4f}" for k, v in res["memory_formula"].items()]
    lines[-1] += f"   ({res['memory']['total'] / res['numel']:.2f} bytes per parameter)"
    lines += ["  bytes per step, last step (API measured | formula; ring bytes this rank sent | formula)"]
    lines += bytes_table(res["comm"], res["comm_formula"], world)
    if res["peak"]:
        lines.append(f"  MemTracker peak {res['peak'] * mib:.3f} MiB (model state + activations + temporaries)")
    print_by_rank("\n".join(lines))
    ok = one_process_check(res["state"], args.model, args.steps, args.batch, args.seq, args.lr, pd, device)
    if args.compare and reference is not None:  # PyTorch's FSDP2 beside a fresh copy of ours, in alternating rounds
        ours, theirs = (build_model(args.model, seed=0, device=device) for _ in range(2))
        reference(theirs, param_dtype=pd, reshard_after_forward=not args.no_reshard)
        runs = {"ours": (ours, shard_model(ours, args.stage, lr=args.lr, **kw)),
                "FSDP2": (theirs, torch.optim.AdamW(theirs.parameters(), lr=args.lr))}
        x, y = get_batch(load_corpus(), 0, args.batch, args.seq, 0, dist.get_rank(), world, device=device)

        def step(model, opt):
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        t = time_side_by_side({k: lambda r=r: step(*r) for k, r in runs.items()}, rounds=args.steps, per_round=1,
                              device=device)
        same = max_diff({n: p.full_tensor() for n, p in theirs.named_parameters()}, runs["ours"][1].full_state_dict())
        print0(f"PyTorch FSDP2 fully_shard: max |diff| to ours = {same:.2e}; step time ours {t['ours'] * 1e3:.1f} ms "
               f"vs FSDP2 {t['FSDP2'] * 1e3:.1f} ms -> our throughput = {t['FSDP2'] / t['ours']:.2f}x FSDP2's")
        del runs, ours, theirs  # FSDP2's state goes while the process group still exists
    return finish(ok)


if __name__ == "__main__":  # PyTorch's own version only here, handed to the demo as what it compares with
    from demo import main
    from references import fsdp2
    main(lambda argv: _demo(argv, reference=fsdp2))
