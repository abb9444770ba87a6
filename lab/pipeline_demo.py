"""pipeline.py's demo and measurements: the bubble and the micro-batches held, as formulas (from the
papers, see pipeline.py) and measured from outside the runner (a Timeline span and autograd's saved
tensors around each group of actions, through pipeline_step's `trace` hook); training a few steps
against one process; PyTorch's own schedule of the same name beside ours (--compare); and every
schedule played in time without a process (--simulate).

    torchrun --nproc_per_node 4 pipeline.py --schedule zb --microbatches 8 [--compare]
    python pipeline.py --simulate --p 4 --m 8          # every schedule, printed and played, no ranks
"""
from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager, nullcontext
from fractions import Fraction

import torch
import torch.distributed as dist

import pipeline
from ddp import average_gradients
from lab import references
from lab.baseline import single_process, snapshot
from lab.data import get_batch, load_corpus
from lab.instruments import SavedActivations, Timeline, ascii_timeline, idle_share
from lab.launch import finish, main as run_main, parse
from lab.model import build_model, get_config
from lab.report import all_agree, print0
from mesh import Mesh, init_distributed
from pipeline import (COMPUTE, SCHEDULES, PipeGroup, Stage, check_schedule, comm_batches, pipeline_step, simulate,
                      split_layers, validate)


# ---- the formulas the measurements are compared with -------------------------------------------------

def idle_formula(name: str, p: int, m: int, v: int = 1, t_f=1, t_b=1, t_w=1):
    """Each rank's idle time per step, from the papers (see the docstring); None for a schedule they do not cover."""
    full = (p - 1) * (t_f + t_b + t_w)
    return {"gpipe": full, "1f1b": full, "interleaved": full / v,
            "zb": (p - 1) * (t_f + t_b) - (min(m, p) - 1) * t_w}.get(name)


def held_formula(name: str, p: int, m: int, r: int, v: int = 1) -> int | None:
    """Micro-batches (interleaved: chunk-micro-batches) rank r holds at its peak; None as above."""
    return {"gpipe": m, "1f1b": min(p - r, m), "zb": min(p, m),
            "interleaved": min(2 * (p - r - 1) + (v - 1) * p + 1, v * m)}.get(name)


# ---- measuring from outside: the trace hook, and training with it --------------------------------

class StepTrace:
    """A `trace` for pipeline_step: one Timeline span per group of actions, and the micro-batches whose
    saved activations are alive after each group (instruments.SavedActivations)."""

    def __init__(self, stage):
        self.timeline, self.saved = Timeline(), SavedActivations(stage.parameters())

    @contextmanager
    def __call__(self, group):
        a = group[0]
        track = self.saved.track((a.mb, a.chunk)) if a.op == "F" else nullcontext()
        with self.timeline.span(a.op if a.op in COMPUTE else "comm", ops=[repr(g) for g in group]), track:
            yield
        self.saved.sample()


def train(cfg, schedule: str, m: int, batches, pp_ranks, v: int = 1, dp_group=None, dp_rank: int = 0,
          dp_size: int = 1, lr: float = 1e-3, seed: int = 0, dtype=torch.float32, device="cpu") -> dict:
    """Train this rank's stage on global batches [(x, y)], one AdamW step each (lr=0: none). Returns the
    losses (last rank), the first step's gradients by name, the last step's timeline and peak held.
    dp_group: data-parallel replicas of every stage, whose gradients are averaged after each step."""
    validate(len(pp_ranks), m, cfg.n_layers, batches[0][0].shape[0] // dp_size, schedule, v)  # before any send
    pipe = PipeGroup.from_ranks(pp_ranks)
    stage, actions = Stage(cfg, pipe.r, pipe.p, seed, device, dtype, v), SCHEDULES[schedule](pipe.p, m, v)[pipe.r]
    opt = torch.optim.AdamW(stage.parameters(), lr=lr) if lr else None
    out = dict(losses=[], grads=None, stage=stage, actions=actions, pipe=pipe)
    for x, y in batches:
        x, y = (t.chunk(dp_size)[dp_rank].to(device) for t in (x, y))   # this replica's share [B/dp, S]
        dist.barrier()   # every rank starts the step together: the timelines share an origin
        trace = StepTrace(stage)
        res = pipeline_step(stage, actions, pipe, x, y, m, trace=trace)
        if dp_group is not None and dist.get_world_size(dp_group) > 1:  # replicas of this stage: lesson 1
            average_gradients(stage.parameters(), dp_group)
        out["grads"] = out["grads"] or snapshot(stage, grads=True)
        if opt:
            opt.step()
        stage.zero_grad(set_to_none=True)
        out["losses"].append(None if res["loss"] is None else res["loss"].item())
        out.update(spans=trace.timeline.spans, peak_held=trace.saved.peak_keys, peak_bytes=trace.saved.peak_bytes)
    return out


def timeline_ranks(configs, model: str = "small", n_layers: int = 8, batch: int = 8, seq: int = 32) -> dict:
    """For launch.run_ranks (the notebook): per (schedule, m, v), two steps with lr=0; the second's spans."""
    batches = [get_batch(load_corpus(), s, batch, seq) for s in range(2)]
    return {c: {k: v for k, v in train(get_config(model, n_layers=n_layers), c[0], c[1], batches,
                                       list(range(dist.get_world_size())), c[2], lr=0).items()
                if k in ("spans", "peak_held", "peak_bytes")} for c in configs}


# ---- the demos -----------------------------------------------------------------------------------------

def demo(argv=None, reference=references.torch_pipelining) -> int:
    """The schedule trained on the ranks (--simulate: simulate_demo instead, no ranks needed)."""
    if "--simulate" in (sys.argv[1:] if argv is None else argv):
        return simulate_demo(argv)
    ap = argparse.ArgumentParser(description=pipeline.__doc__.splitlines()[0] + " (--simulate: every schedule "
                                 "played in time without ranks; --simulate --help for its options)")
    ap.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    ap.add_argument("--virtual-stages", type=int, default=None, help="chunks per rank (default: 2 interleaved, else 1)")
    ap.add_argument("--model", default="small")
    ap.add_argument("--layers", type=int, default=None, help="n_layers (default: 2 per chunk)")
    for name, default in [("microbatches", 8), ("batch", 8), ("seq", 32), ("steps", 2), ("dp", 1)]:
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--compare", action="store_true", help="also run PyTorch's own schedule of the same name")
    args = parse(ap, argv)  # (+ --watch, --patience)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    v = args.virtual_stages or (2 if args.schedule == "interleaved" else 1)
    if world % args.dp or args.batch % args.dp:
        raise ValueError(f"--dp {args.dp} must divide the world size {world} and --batch {args.batch}")
    p, m, name = world // args.dp, args.microbatches, args.schedule
    cfg = get_config(args.model, n_layers=args.layers or 2 * p * v)
    validate(p, m, cfg.n_layers, args.batch // args.dp, name, v)   # before any collective
    device = init_distributed()
    mesh = Mesh(pp=p, dp_replicate=args.dp)
    batches = [get_batch(load_corpus(), s, args.batch, args.seq) for s in range(args.steps)]
    out = train(cfg, name, m, batches, mesh.ranks("pp"), v, mesh.group("dp"), mesh.rank("dp"), args.dp, device=device)
    every = [None] * dist.get_world_size()   # rank 0 prints what every rank of replica 0 measured
    dist.all_gather_object(every, (mesh.coords["pp"], mesh.rank("dp"), out["spans"], out["peak_held"],
                                   out["peak_bytes"], out["losses"]))
    rows = sorted((e for e in every if e[1] == 0), key=lambda e: e[0])
    ok, diff = True, 0.0
    if dist.get_rank() == 0:
        ref = single_process(build_model(cfg, seed=0), batches)["losses"]   # the same model in one process
        diff = max(abs(a - b) for a, b in zip(rows[-1][5], ref))
        ok = diff < 1e-4  # fp32 losses, not parameters: AdamW moves those by whole steps on rounding (lab/baseline.py)
        measured, total = idle_share([e[2] for e in rows])
        idle, sim = idle_formula(name, p, m, v), simulate(SCHEDULES[name](p, m, v))
        print(f"{name}: p={p} ranks x v={v} chunks x dp={args.dp}, m={m} micro-batches of {args.batch // args.dp // m};"
              f" {cfg.n_layers} layers split {[len(s) for s in split_layers(cfg.n_layers, p * v)]}\n"
              f"last step {total * 1e3:.0f} ms (F forward, B backward, W weight gradient, . idle):\n"
              + ascii_timeline([e[2] for e in rows]) + "\n"
              f"  bubble, idle share of the step: formula {idle / (3 * m + idle):.3f}, "
              f"simulated {sim['bubble'][0]:.3f}, measured per rank " + " ".join(f"{b:.3f}" for b in measured) + "\n"
              "  micro-batches held at the peak, formula/measured from autograd's saved tensors: "
              + "  ".join(f"{held_formula(name, p, m, r, v)}/{e[3]}" for r, e in enumerate(rows))
              + "   activation MB: " + " ".join(f"{e[4] / 2**20:.1f}" for e in rows), flush=True)
    ok = all_agree(ok)
    if args.compare and reference is not None and args.dp == 1:  # PyTorch's schedule, side by side
        ok &= reference(out, cfg, name, m, batches[0], device, mesh.group("pp"))
    print0(f"loss matches the single-process model: {'ok' if ok else 'FAILED'} (max |diff| {diff:.1e} in fp32 losses, "
           f"tolerance 1e-4)")
    return finish(ok)


def simulate_demo(argv=None) -> int:
    """`python pipeline.py --simulate [--p 4 --m 8 --v 2 --times 1 1 1 --transfers]`: every schedule's
    actions, checked and played in time without starting a process, next to its formulas."""
    ap = argparse.ArgumentParser(description="every schedule's actions, played in time next to its formulas")
    ap.add_argument("--simulate", action="store_true", help="(this mode)")
    ap.add_argument("--p", type=int, default=4, help="pipeline ranks")
    ap.add_argument("--m", type=int, default=8, help="micro-batches")
    ap.add_argument("--v", type=int, default=2, help="chunks per rank of the interleaved schedule")
    ap.add_argument("--times", type=Fraction, nargs=3, default=[1, 1, 1], metavar=("F", "B", "W"),
                    help="t_f t_b t_w of one micro-batch on one stage (an unsplit backward takes t_b + t_w)")
    ap.add_argument("--transfers", action="store_true", help="list the transfers too: [one batch of them]")
    args = ap.parse_args(argv)
    p, m, t = args.p, args.m, args.times
    if p < 1 or m < 1 or min(t) <= 0:
        raise ValueError(f"need --p >= 1, --m >= 1 and positive --times, got p={p}, m={m}, times={t}")
    if os.environ.get("RANK", "0") != "0":   # under torchrun: rank 0 prints, the others have nothing to add
        return 0
    print(f"p={p} ranks, m={m} micro-batches, t_f:t_b:t_w = {':'.join(map(str, t))} (F forward, B backward, "
          f"W weight gradient, . idle)")
    for name, build in SCHEDULES.items():
        v = args.v if name == "interleaved" else 1
        try:
            validate(p, m, p * v, m, name, v)
        except ValueError as e:
            print(f"\n{name}: {e}")
            continue
        sched = build(p, m, v)
        check_schedule(sched)
        sim = simulate(sched, *t)
        print(f"\n{name}" + (f" (v={v} chunks per rank)" if v > 1 else "") + ": each rank's actions"
              + ("" if args.transfers else " (computes; --transfers for all)"))
        for r, acts in enumerate(sched):
            print(f"  rank {r}  " + " ".join(repr(g[0]) if g[0].op in COMPUTE else f"[{' '.join(map(repr, g))}]"
                                           for g in comm_batches(acts) if args.transfers or g[0].op in COMPUTE))
        print(ascii_timeline([[dict(name=a.op, start=s, end=e) for a, s, e in spans] for spans in sim["spans"]],
                             width=min(120, round(2 * sim["total"]))))   # 2 characters per unit of time
        idle = idle_formula(name, p, m, v, *t)
        bubble = sorted(set(sim["bubble"]))
        held = [held_formula(name, p, m, r, v) for r in range(p)]
        print("  bubble (idle share of the step): simulated " + " ".join(f"{float(b):.3f}" for b in bubble)
              + ", formula " + ("-" if idle is None else f"{float(idle / (m * sum(t) + idle)):.3f}")
              + "\n  micro-batches held at the peak per rank: simulated " + " ".join(map(str, sim["peak_in_flight"]))
              + ", formula " + ("-" if None in held else " ".join(map(str, held)))
              + (f" (chunk-micro-batches, each 1/{v} of a stage's)" if v > 1 else ""))
    return 0


def main(argv=None) -> None:
    run_main(demo, argv)
