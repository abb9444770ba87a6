"""fsdp.py's demo and measurements: the ZeRO formulas for the model-state bytes a rank holds and the
bytes it hands to each collective per step, the bytes a ZeroOptimizer's rank holds (`held_bytes`), one
training run that measures both (`train_and_measure`, also hsdp_demo's and the zero_memory notebook's),
and the demo that prints them side by side, checks the parameters against one process and, with
--compare, against PyTorch's FSDP2 `fully_shard`.

    torchrun --nproc_per_node 4 fsdp.py --stage 3 [--param-dtype bf16] [--no-reshard] [--compare]

The formulas are lesson 2's (fsdp.py's docstring; README section "Lesson 2 — ZeRO stages 1–3"):
`zero_state_formula` computes its model state per rank for a stage, `zero_comm_formula` its API bytes per step,
plus one int32 per parameter tensor (which parameters got a gradient).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import warnings
from types import SimpleNamespace

import torch
import torch.distributed as dist

import hsdp
from fsdp import shard_model
from lab import references
from lab.baseline import TOL64, adamw_reach, max_diff, single_process
from lab.data import get_batch, load_corpus
from lab.instruments import CommCounter, memory_tracker, model_state_bytes, time_side_by_side
from lab.launch import finish, main as run_main, parse
from lab.model import build_model, get_config, init_tensor
from lab.report import all_agree, bytes_table, print0, print_by_rank
from mesh import collective_device, init_distributed, resolve_group


# ---- the formulas the measurements are compared with ---------------------------------------------

def zero_state_formula(stage: int, numel: int, P: int, param_bytes: int = 4, master_bytes: int = 0,
                       grad_bytes: int | None = None, state_bytes: int = 8) -> dict:
    """Model-state bytes per rank by category (ZeRO §5; K = master_bytes + state_bytes) for numel elements
    sharded P ways. grad_bytes: what a *held* gradient element takes; stages 0-1 hold the local gradient in
    the compute dtype (default param_bytes), stages 2-3 the reduced fp32 shard (4)."""
    grad_bytes = (param_bytes if stage <= 1 else 4) if grad_bytes is None else grad_bytes
    sharded = lambda on: numel / P if on else numel  # noqa: E731  (Ψ/P once the stage shards it)
    out = dict(parameters=param_bytes * sharded(stage >= 3), master=master_bytes * sharded(stage >= 1),
               gradients=grad_bytes * sharded(stage >= 2), optimizer=state_bytes * sharded(stage >= 1))
    return dict(out, total=sum(out.values()))


def zero_comm_formula(stage: int, numel: int, P: int, param_bytes: int = 4, root_numel: int = 0,
                      reshard_after_forward: bool = True, replicas: int = 1, n_params: int = 0,
                      grad_bytes: int = 4, microbatches: int = 1) -> dict:
    """API bytes per step by collective for one group: numel = Ψ padded, root_numel the root unit's part,
    gradients reduced in grad_bytes, n_params parameter tensors (one int32 used-flag each); replicas > 1
    (HSDP): shards and flags are all-reduced across replicas too; microbatches: backwards inside
    opt.accumulating() before one step (stage 3 gathers again for each one unless it keeps its units)."""
    flags = 4 * n_params if P > 1 else 0  # (a group of one agrees with itself: no collective)
    if stage == 0:
        return {"all_reduce": grad_bytes * numel + flags} if P > 1 else {}
    gathered = microbatches * (2 * numel - root_numel) if stage == 3 and reshard_after_forward else numel
    out = {"reduce_scatter": grad_bytes * numel, "all_gather": param_bytes * gathered,
           "all_reduce": flags + (grad_bytes * numel // P + 4 * n_params if replicas > 1 else 0)}
    return {k: v for k, v in out.items() if v}


# ---- what a rank holds, and a measured run (the demos, the tests and the notebook call it) ----------

def held_bytes(opt, units=None) -> dict:
    """Model-state bytes a ZeroOptimizer's rank holds, by category (storage-based: views count once);
    units: only these of opt.units (e.g. one process group's), with their optimizer state."""
    units = opt.units if units is None else units
    mine = {id(q) for u in units for *_, q in u.pieces}
    state = SimpleNamespace(state={q: s for q, s in opt.inner.state.items() if id(q) in mine})
    masters = [u.master for u in units if u.master.data_ptr() != u.shard.data_ptr()]  # a cast apart
    grads = [u.master.grad for u in units if u.master.grad is not None]  # reduced (stages 2-3: held)
    ms = model_state_bytes([p for u in units for p in u.params] + [u.shard for u in units], state,
                           extra={"master": masters, "g": grads})
    ms["gradients"] += ms.pop("g")
    return ms


def offload_formula(opt) -> tuple[int, int]:
    """Bytes an offloading rank moves per step (ZeRO-Offload, Ren et al. 2021): every reduced gradient slice
    down to the host, b_m·n per unit (stage 0: its whole b_m·N), and every new compute slice up, b_p·n."""
    down = sum(u.master.numel() * u.master.element_size() for u in opt.units if u.offload)
    up = sum(u.shard.numel() * u.shard.element_size() for u in opt.units if u.offload)
    return down, up


def train_and_measure(stage, model_name="tiny", steps=3, batch=8, seq=32, lr=1e-2, group=None, replicate_group=None,
                      meta=False, seed=0, dtype=torch.float32, track_peak=False, microbatches=1, **shard_kwargs):
    """Shard the shared model, train `steps` global batches with AdamW (microbatches > 1: that many backwards
    inside opt.accumulating() per step); return the full parameters, the losses and what the last step
    measured (bytes by collective; model state at rest; MemTracker's peak if track_peak) beside the formulas.
    replicate_group: hybrid sharding (hsdp.shard_hybrid) with `group` as the shard group."""
    cfg, group, device = get_config(model_name), resolve_group(group), collective_device(group)
    P, R = dist.get_world_size(group), dist.get_world_size(replicate_group) if replicate_group is not None else 1
    dp_rank = dist.get_rank(group) + P * (dist.get_rank(replicate_group) if R > 1 else 0)  # replica-major
    model = build_model(cfg, seed, dtype, device="meta" if meta else device)
    init_fn = (lambda name, shape: init_tensor(cfg, name, shape, seed)) if meta else None
    if R > 1:
        opt = hsdp.shard_hybrid(model, stage=stage, shard_group=group, replicate_group=replicate_group, lr=lr,
                                init_fn=init_fn, **shard_kwargs)
    else:
        opt = shard_model(model, stage, group=group, lr=lr, init_fn=init_fn, **shard_kwargs)
    tokens, losses, peak, m = load_corpus(), [], None, microbatches
    for s in range(steps):
        x, y = get_batch(tokens, s, batch, seq, seed, dp_rank, P * R, device=device)
        tracked = track_peak and s == steps - 1
        with memory_tracker(model, opt.inner) if tracked else contextlib.nullcontext() as mt, \
                warnings.catch_warnings(), CommCounter() as comm:  # MemTracker: "no .grad" (ours are sharded)
            warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper")
            loss = 0.0
            for xm, ym in zip(x.chunk(m), y.chunk(m)):
                with opt.accumulating() if m > 1 else contextlib.nullcontext():
                    (part := model(xm, ym) / m).backward()
                loss = loss + part.detach()
            opt.step()
        peak = next(iter(mt.get_tracker_snapshot("peak").values()))["Total"] if tracked else peak
        memory = held_bytes(opt)  # at rest, after the step (before zero_grad)
        opt.zero_grad()
        dist.all_reduce(loss := loss.double())  # the global batch's loss, for printing (outside the counter)
        losses.append(loss.item() / (P * R))
    numel, k, root = sum(u.flat_numel for u in opt.units), sum(len(u.params) for u in opt.units), opt.units[-1]
    root_numel = sum(u.flat_numel for u in opt.units if u.root)  # the course's model: 0 (no parameter outside a unit)
    pb, gb, mb = root.buf.element_size(), root.master.element_size(), 0 if root.dtype == root.master.dtype else 4
    rs = shard_kwargs.get("reshard_after_forward", True)
    return dict(state={k: v.cpu() for k, v in opt.full_state_dict().items()}, losses=losses, peak=peak, stage=stage,
                comm=comm.summary(), events=[(e.op, e.group_ranks, e.api_bytes) for e in comm.events], memory=memory,
                numel=numel, root_numel=root_numel, n_params=k, P=P, param_bytes=pb,
                memory_formula=zero_state_formula(stage, numel, P, pb, mb, pb if stage <= 1 else gb, 2 * gb),
                comm_formula=zero_comm_formula(stage, numel, P, pb, root_numel, rs, R, k, gb, microbatches),
                grad_norm=None if opt.grad_norm is None else opt.grad_norm.item())


def measure_runs(configs, **kwargs) -> list[dict]:
    """A rank function for the notebook: train_and_measure(**config, **kwargs) for each config, without the
    parameters; each result carries its config."""
    return [{k: v for k, v in train_and_measure(**c, **kwargs).items() if k not in ("state", "events")} | c
            for c in configs]


# ---- the demos' check (fsdp.py, hsdp.py) ---------------------------------------------------------

def one_process_check(runs, model_name, steps, batch, seq, lr, param_dtype, device) -> bool:
    """Each run's full parameters after `steps` against the single-process run on the same global batches,
    printed. runs: [(label, state, state64)], a run's parameters and those of the same strategy retrained with
    float64 parameters (computing in float64, also under bf16: the casts are FSDP2's to check, --compare).

    The verdict is float64's: there the parameters equal one process's to rounding, within TOL64 (1e-9). The run
    itself (fp32, or bf16 compute on fp32 masters, against one process with the same casts) cannot be held that
    tight — AdamW turns a rounding-level gradient difference on an element whose gradient is ~0 into up to a whole
    step, at places that depend on the CPU's kernels (lab/baseline.py) — so it is held to adamw_reach: what AdamW
    can move an element at all in two runs, which no rounding exceeds and a misplaced shard does."""
    tokens = load_corpus()
    batches = [get_batch(tokens, s, batch, seq, 0, device=device) for s in range(steps)]
    ref = single_process(build_model(model_name, seed=0, device=device), batches, lr=lr, compute_dtype=param_dtype)
    ref64 = single_process(build_model(model_name, seed=0, dtype=torch.float64, device=device), batches, lr=lr)
    reach, name, ok = adamw_reach(lr, steps), "fp32" if param_dtype is None else "bf16", True
    print0(f"parameters vs the single-process run on the same batches:\n"
           f"  the same strategy in float64 within {TOL64:.0e}: its rounding (~1e-16) is far below AdamW's eps (1e-8)\n"
           f"  this {name} run within AdamW's reach 2·lr·Σc_t = {reach:.1e}: rounding on a gradient that is ~0 can "
           f"become a whole step, CPU by CPU")
    for label, state, state64 in runs:
        err64, err = max_diff(state64, ref64["model"].state_dict()), max_diff(state, ref["model"].state_dict())
        good = all_agree(err64 < TOL64 and err < reach)
        print0(f"  {label}float64 max |diff| = {err64:.2e}, {name} max |diff| = {err:.2e} -> "
               f"{'ok' if good else 'MISMATCH'}")
        ok &= good
    return ok


# ---- the demo: torchrun --nproc_per_node 4 fsdp.py --stage 3 --compare ----------------------------

def demo(argv=None, reference=references.fsdp2) -> int:
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
    ap.add_argument("--stages", type=int, nargs="+", choices=[0, 1, 2, 3], default=None,
                    help="compare these stages in one table instead: memory, step time, and the parameters they "
                         "reach (e.g. 0 2 3: PyTorch FSDP's NO_SHARD, SHARD_GRAD_OP, FULL_SHARD)")
    args = parse(ap, argv)  # (+ --watch, --patience)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.batch % world or args.steps < 1:  # arithmetic only: every rank says it, before any collective
        raise ValueError(f"--batch {args.batch} must be a multiple of the {world} ranks and --steps at least 1: "
                         f"try --batch {world * max(1, args.batch // world)} --steps {max(1, args.steps)}")
    device = init_distributed()
    pd, mib = dtypes[args.param_dtype], 1 / 2**20
    kw = dict(param_dtype=pd, reshard_after_forward=not args.no_reshard, prefetch=not args.no_prefetch)
    if args.stages:
        return finish(compare_stages(args, pd, kw, device))
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
    res64 = train_and_measure(args.stage, args.model, args.steps, args.batch, args.seq, args.lr, dtype=torch.float64,
                              **dict(kw, param_dtype=None))  # the same strategy in float64: the verdict (see there)
    ok = one_process_check([("", res["state"], res64["state"])], args.model, args.steps, args.batch, args.seq,
                           args.lr, pd, device)
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


FSDP_NAMES = {0: "NO_SHARD", 1: "-", 2: "SHARD_GRAD_OP", 3: "FULL_SHARD"}  # (stage 1: ZeroRedundancyOptimizer)


def compare_stages(args, pd, kw, device) -> bool:
    """--stages: each stage trained on the same batches (train_and_measure, MemTracker's peak of its last step),
    one step of each timed in alternating rounds, and the parameters each reaches against one process and
    against each other: one table, rank 0's numbers."""
    world, mib, results, runs = dist.get_world_size(), 1 / 2**20, {}, {}
    for s in args.stages:
        results[s] = train_and_measure(s, args.model, args.steps, args.batch, args.seq, args.lr, track_peak=True, **kw)
        model = build_model(args.model, seed=0, device=device)
        runs[s] = (model, shard_model(model, s, lr=args.lr, **kw))
    x, y = get_batch(load_corpus(), 0, args.batch, args.seq, 0, dist.get_rank(), world, device=device)

    def step(model, opt):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    t = time_side_by_side({s: lambda r=r: step(*r) for s, r in runs.items()}, rounds=3, per_round=1, device=device)
    first = results[args.stages[0]]["state"]
    print0(f"ZeRO stages {args.stages} on {world} ranks, model {args.model}, compute {args.param_dtype} (rank 0):\n"
           f"  {'stage':6s} {'PyTorch FSDP':14s} {'state MiB':>10s} {'B/param':>8s} {'peak MiB':>9s} {'step ms':>8s} "
           f"{'max |diff| to stage ' + str(args.stages[0]):>22s}")
    for s, res in results.items():
        print0(f"  {s:<6d} {FSDP_NAMES[s]:14s} {res['memory']['total'] * mib:10.3f} "
               f"{res['memory']['total'] / res['numel']:8.2f} {res['peak'] * mib:9.3f} {t[s] * 1e3:8.1f} "
               f"{max_diff(res['state'], first):22.2e}")
    del runs
    runs64 = [train_and_measure(s, args.model, args.steps, args.batch, args.seq, args.lr, dtype=torch.float64,
                                **dict(kw, param_dtype=None))["state"] for s in args.stages]
    ok = one_process_check([(f"stage {s}: ", res["state"], st64) for (s, res), st64 in zip(results.items(), runs64)],
                           args.model, args.steps, args.batch, args.seq, args.lr, pd, device)
    return ok


def main(argv=None) -> None:
    run_main(demo, argv)
