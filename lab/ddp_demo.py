"""ddp.py's demo and measurements: naive, bucketed and PyTorch's DDP trained side by side on the same
batches, each checked against one process; per rank the step time, all-reduce calls and bytes, when the
first all-reduce began and the share of all-reduce time inside backward (torch.profiler, from outside).
`profile_buckets` is what notebooks/ddp.ipynb plots.

    torchrun --nproc_per_node 2 ddp.py [--model tiny] [--bucket-mb 25] [--first-bucket-mb 1]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch
import torch.distributed as dist

from ddp import MiB, BucketedDDP, NaiveDDP, check_buckets
from lab import references
from lab.baseline import TOL64, adamw_reach, max_diff, single_process
from lab.data import get_batch, load_corpus
from lab.instruments import ProfileSpans, overlap_fraction, sync, time_steps, wire_bytes
from lab.launch import finish, main as run_main, parse
from lab.model import build_model, get_config
from lab.report import all_agree, print0, print_by_rank
from mesh import Mesh, init_distributed


def train_step(model, opt, x, y, measure=None) -> float:
    """One step; `measure` (e.g. instruments.ProfileSpans()) is entered around backward and the
    gradient all-reduces (NaiveDDP is the only version that needs the extra call)."""
    loss = model(x, y)
    with measure or contextlib.nullcontext():
        loss.backward()
        if isinstance(model, NaiveDDP):
            model.all_reduce_gradients()
    opt.step()
    opt.zero_grad(set_to_none=False)  # keep the gradients' storage: for BucketedDDP, the bucket views
    return loss.item()


def profile_buckets(model="small", bucket_mbs=(0, 1, 4, 16, 64), steps=4, batch=8, seq=32) -> dict:
    """Per rank (run it under launch.run_ranks; for the notebook): for naive DDP and bucketed DDP at
    each cap (first bucket = cap), the median step seconds and the spans of one more, profiled, step."""
    rank, P = dist.get_rank(), dist.get_world_size()
    tokens = load_corpus()
    batches = [get_batch(tokens, s, batch, seq, dp_rank=rank, dp_size=P) for s in range(steps + 2)]
    out = {}
    for mb in ["naive", *bucket_mbs]:
        m = NaiveDDP(build_model(model)) if mb == "naive" else BucketedDDP(build_model(model), None, mb, mb)
        opt, it, prof = torch.optim.AdamW(m.parameters(), lr=1e-3), iter(batches), ProfileSpans()
        step_s = time_steps(lambda: train_step(m, opt, *next(it)), steps, warmup=1)
        train_step(m, opt, *next(it), measure=prof)
        out[mb] = dict(step_s=step_s, spans=prof.spans, n_buckets=len(m.params) if mb == "naive" else len(m.buckets))
    return out


def demo(argv=None, reference=references.ddp) -> int:
    """Naive, bucketed and PyTorch's own DDP (reference: references.ddp) on the same batches."""
    ap = argparse.ArgumentParser(description="Naive, bucketed and PyTorch's DDP side by side on the shared model.")
    ap.add_argument("--model", default="small", help="tiny | small | medium | large (default small, ~10M)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps (after a warm-up and a profiled step)")
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences), divisible by the world size")
    ap.add_argument("--seq", type=int, default=64, help="sequence length")
    ap.add_argument("--bucket-mb", type=float, default=25, help="bucket cap in MiB (0: one per parameter)")
    ap.add_argument("--first-bucket-mb", type=float, default=1, help="the first bucket's cap in MiB")
    ap.add_argument("--lr", type=float, default=1e-3)
    args = parse(ap, argv)  # (+ --watch, --patience)
    cfg = get_config(args.model)  # raises on an unknown name
    P = int(os.environ.get("WORLD_SIZE", "1"))
    if args.batch < P or args.batch % P or args.steps < 1 or args.seq < 1:
        raise ValueError(f"--batch {args.batch} must be a multiple of the world size {P}, and --steps "
                         f"({args.steps}) and --seq ({args.seq}) at least 1")
    check_buckets(args.bucket_mb, args.first_bucket_mb, None)
    device = init_distributed()  # everything above is arithmetic: bad input fails before any collective
    rank, mesh = dist.get_rank(), Mesh(dp_shard=P)
    tokens = load_corpus()
    n = args.steps + 2  # step 0 warms up (PyTorch's DDP re-buckets after it), step 1 is profiled
    batches = [get_batch(tokens, s, args.batch, args.seq, device=device) for s in range(n)]
    local = [(x.chunk(P)[rank], y.chunk(P)[rank]) for x, y in batches]

    # Each rank starts from its own initialisation (seed = rank): the wrappers' broadcast fixes it.
    kw = dict(device_ids=[device]) if device.type == "cuda" else {}
    if (args.bucket_mb, args.first_bucket_mb) != (25, 1):  # PyTorch keeps a 1 MiB first bucket only by default
        kw["bucket_cap_mb"] = args.bucket_mb

    def wrappers(dtype=torch.float32):  # float64: our caps doubled, so each bucket holds the same parameters
        new, caps = (lambda: build_model(cfg, seed=rank, dtype=dtype, device=device)), dtype.itemsize // 4
        return {"naive": NaiveDDP(new(), mesh),
                f"bucketed {args.bucket_mb:g} MiB": BucketedDDP(new(), mesh, caps * args.bucket_mb,
                                                                caps * args.first_bucket_mb),
                "PyTorch DDP": reference(new(), mesh.group("dp"), **kw)}
    models = wrappers()
    names = list(models)
    opts = {k: torch.optim.AdamW(m.parameters(), lr=args.lr) for k, m in models.items()}
    times, profs = {k: [] for k in names}, {k: ProfileSpans() for k in names}
    for step, (x, y) in enumerate(local):
        for k in names[step % 3:] + names[:step % 3]:  # rotate who goes first: none always runs on a cold cache
            dist.barrier(group=mesh.group("dp"))
            sync(device)
            t = time.perf_counter()
            train_step(models[k], opts[k], x, y, measure=profs[k] if step == 1 else None)
            sync(device)
            times[k].append(time.perf_counter() - t)

    # The verdict: each wrapper retrained in float64 equals one process to rounding (TOL64) — on the first two
    # batches, the second on PyTorch DDP's rebuilt buckets and AdamW's carried state (cheaper than all n); the fp32
    # runs above only within AdamW's reach, since rounding on a ~0 gradient can become a step (lab/baseline.py)
    models64, n64 = wrappers(torch.float64), min(n, 2)
    opts64 = {k: torch.optim.AdamW(m.parameters(), lr=args.lr) for k, m in models64.items()}
    for x, y in local[:n64]:
        for k in names:
            train_step(models64[k], opts64[k], x, y)
    ref = single_process(build_model(cfg, seed=0, device=device), batches, lr=args.lr)["model"]
    ref64 = single_process(build_model(cfg, seed=0, dtype=torch.float64, device=device), batches[:n64],
                           lr=args.lr)["model"]
    reach = adamw_reach(args.lr, n)
    grad_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    print0(f"{P} rank(s), model {args.model} ({sum(p.numel() for p in ref.parameters()):,} parameters, gradient "
           f"{grad_bytes / MiB:.2f} MiB), global batch {args.batch}x{args.seq}, {args.steps} timed steps\n"
           f"rank {'':18s} {'step ms':>8s} {'all-reduces':>11s} {'MiB/step':>9s} {'ring MiB sent':>13s} "
           f"{'1st starts':>10s} {'overlap':>8s} {'max |dp - 1 proc|: fp64':>24s} {'fp32':>8s}")
    rows, ok = [], True
    for k in names:
        spans = [s for s in profs[k].spans if s["name"] == "all_reduce"]
        launched = [i for i in profs[k].issued if i["name"] == "all_reduce"]
        first = -1 if not launched or not launched[0]["of"] else \
            2 if launched[0]["done"] == launched[0]["of"] else launched[0]["done"] / launched[0]["of"]
        sent = sum(s["bytes"] or 0 for s in spans)
        diff, diff64 = max_diff(models[k].module, ref), max_diff(models64[k].module, ref64)
        ok &= diff64 < TOL64 and diff < reach
        rows.append(f"{rank:<4d} {k:18s} {1e3 * statistics.median(times[k][2:]):8.1f} {len(spans):11d} "
                    f"{sent / MiB:9.3f} {wire_bytes('all_reduce', sent, P) / MiB:13.3f} "
                    + (f"{'after':>10s}" if first > 1 else f"{100 * first:9.0f}%" if first >= 0 else f"{'-':>10s}")
                    + f" {100 * overlap_fraction(profs[k].spans):7.0f}% {diff64:24.2e} {diff:8.1e}")
    print_by_rank("\n".join(rows))
    bucketed = models[names[1]]
    ratio = statistics.median(t / b for t, b in zip(times[names[2]][2:], times[names[1]][2:]))
    print0(f"1st starts: when the first all-reduce was launched, as the share of backward's autograd functions\n"
           f"begun by then (after: once all had); overlap: the share of all-reduce time inside backward\n"
           f"(both from torch.profiler, one step)\n"
           f"max |dp - 1 proc|: the parameters against one process's: the same wrapper retrained {n64} steps in\n"
           f"float64 (the verdict: within {TOL64:.0e}) and this fp32 run, {n} steps (within AdamW's reach\n"
           f"{reach:.1e}: rounding on a gradient that is ~0 can become a whole step, where depends on the CPU)\n"
           f"bucketed / PyTorch DDP throughput: {ratio:.2f}x (step by step, median)\n"
           f"formula: Ψ·b = {grad_bytes / MiB:.3f} MiB of gradient per step, ring sends 2(P-1)/P of it = "
           f"{wire_bytes('all_reduce', grad_bytes, P) / MiB:.3f} MiB per rank, plus {len(bucketed.params)} bytes "
           f"of used flags in 1 all-reduce\n{len(bucketed.buckets)} buckets, in reverse parameter order (MiB): "
           f"{[round(b.nbytes / MiB, 3) for b in bucketed.buckets][:8]}" + (" ..." if len(bucketed.buckets) > 8 else ""))
    ok = all_agree(ok)
    print0("all three match the single-process run" if ok else "MISMATCH")
    return finish(ok)


def main(argv=None) -> None:
    run_main(demo, argv)
