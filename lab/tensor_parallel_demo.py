"""tensor_parallel.py's demo and measurements: the formulas for the collectives one step issues
(Megatron's 4L + 2 activation collectives, the loss's 3 all-reduces, sequence parallel at the same ring
bytes) and for the elements finish_grads sums; step 1 of a model counted by phase with CommCounter and
compared with the formulas; float32 step times of several implementations side by side; and the demo:
training by hand (and with PyTorch's DTensor TP) against one process in float64.

    torchrun --nproc_per_node 2 tensor_parallel.py [--sp] [--model tiny --seq 32]
"""
from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist

import tensor_parallel
from lab import references
from lab.baseline import single_process
from lab.data import get_batch, load_corpus
from lab.instruments import CommCounter, time_side_by_side
from lab.launch import finish, main as run_main, parse
from lab.model import build_model, get_config
from lab.report import all_agree, bytes_table, print0, print_by_rank
from mesh import init_distributed
from tensor_parallel import apply_tensor_parallel, check_divisible, finish_grads, full_slice, train_step


# ---- the formulas the demo and the tests measure against ----------------------------------------------

def comm_formula(cfg, B: int, S: int, b: int, t: int, sp: bool) -> dict:
    """{op: (calls, API bytes)} of one forward + backward (finish_grads apart), as in tensor_parallel.py's
    docstring."""
    n, act, loss = 4 * cfg.n_layers + 2, B * S * cfg.dim * b, 3 * B * S * max(b, 4)
    if t == 1:
        return {}
    return ({"all_gather": (n, n * act), "reduce_scatter": (n, n * act), "all_reduce": (3, loss)} if sp
            else {"all_reduce": (n + 3, n * act + loss)})


def partial_formula(cfg, t: int, sp: bool) -> int:
    """Elements finish_grads all-reduces per step: replicated kv weights (n_kv slots each) + SP norms."""
    L, H = cfg.n_layers, cfg.dim
    kv = 2 * L * cfg.n_kv_heads * cfg.head_dim * H if cfg.n_kv_heads % t else 0
    return 0 if t == 1 else kv + ((2 * L + 1) * H if sp else 0)


# ---- measured: step 1's collectives, step times ---------------------------------------------------------

def counted_step(model, x, y):
    """Forward, backward and finish_grads of one step, each under its own CommCounter (the optimizer step
    is the caller's). Returns the loss and {phase: counter}, plus "step": forward and backward together."""
    with CommCounter() as step:   # CommCounters nest: `step` sees what `forward` and `backward` see
        with CommCounter() as fwd:
            loss = model(x, y)
        with CommCounter() as bwd:
            loss.backward()
    with CommCounter() as fin:
        finish_grads(model)
    return loss, {"forward": fwd, "backward": bwd, "finish_grads": fin, "step": step}


def phase_lines(name: str, counted: dict) -> str:
    """One line per phase: the calls and API bytes of each collective."""
    return "\n".join(f"  {name:8s} {phase:12s} " + (", ".join(f"{s['calls']} {op} ({s['bytes']:,d} B)" for op, s in
                                                             counted[phase].summary().items()) or "-")
                     for phase in ("forward", "backward", "finish_grads"))


def check_formulas(counted: dict, cfg, B: int, S: int, t: int, sp: bool, b: int = 8) -> tuple[bool, str]:
    """Step 1 against comm_formula (calls and API bytes), the ring bytes of plain TP (the same with SP:
    a ring all-reduce is a reduce-scatter then an all-gather) and partial_formula. Returns (ok, text)."""
    step, fin, want = counted["step"], counted["finish_grads"], comm_formula(cfg, B, S, b, t, sp)
    wire = 2 * (t - 1) / t * sum(n for _, n in comm_formula(cfg, B, S, b, t, False).values())  # plain TP's
    table = bytes_table(step.summary(), {op: n for op, (_, n) in want.items()}, t)
    text = "\n".join(["by hand, forward + backward: measured | formula", *table]) + (
        f"\n  wire {step.wire_bytes():,.0f} bytes, formula {wire:,.0f} (with or without --sp); finish_grads "
        f"{fin.bytes() // b} elements, formula {partial_formula(cfg, t, sp)}")
    ok = {op: (s["calls"], s["bytes"]) for op, s in step.summary().items()} == want
    ok &= fin.bytes() == b * partial_formula(cfg, t, sp) and abs(step.wire_bytes() - wire) <= 1e-9 * wire
    return ok, text


def time_float32(impls: dict, ref, batch, rounds: int, per_round: int, group, device, sp: bool) -> str:
    """float32 train_step of each implementation (impls: {name: make(model)}) on a float32 copy of ref, timed
    in alternating rounds (instruments.time_side_by_side): one line of ms/step, tokens/s and the ratio."""
    models = {k: make(copy.deepcopy(ref).float()) for k, make in impls.items()}  # ref itself stays as it is
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}
    med = time_side_by_side({k: lambda k=k: train_step(models[k], opts[k], *batch).item() for k in impls},
                            rounds, per_round, group, device)
    tokens = batch[0].numel()
    return ("float32: " + ", ".join(f"{k}{' +SP' if sp else ''} {s * 1e3:.1f} ms/step ({tokens / s:.0f} tokens/s)"
                                    for k, s in med.items())
            + (f"; throughput by hand / DTensor {med['DTensor'] / med['by hand']:.2f}x" if len(med) == 2 else ""))


# ---- the demo: torchrun --nproc_per_node 2 tensor_parallel.py [--sp] ------------------------------------

def demo(argv=None, reference=references.dtensor_tp) -> int:
    """Train by hand (and with `reference`, PyTorch's DTensor TP) against one process in float64; count step
    1's collectives against the formulas; time float32 steps side by side."""
    ap = argparse.ArgumentParser(description=tensor_parallel.__doc__.split("\n")[0])
    ap.add_argument("--model", default="small", help="tiny | small | ...")
    for name, default in [("batch", 4), ("seq", 128), ("steps", 3), ("timed", 5), ("rounds", 3)]:
        ap.add_argument(f"--{name}", type=int, default=default)  # steps: checked; timed x rounds: timed
    ap.add_argument("--sp", action="store_true", help="sequence parallel")
    ap.add_argument("--no-compare", action="store_true", help="leave PyTorch's DTensor TP out")
    args = parse(ap, argv)  # (+ --watch, --patience)
    t, cfg, sp, B, S = int(os.environ.get("WORLD_SIZE", "1")), get_config(args.model), args.sp, args.batch, args.seq
    check_divisible(cfg, t)                                     # arithmetic, before any collective
    if sp and S % t:
        raise ValueError(f"--sp splits the sequence over tp={t} ranks: --seq {S} must be a multiple of {t}")
    device, group = init_distributed(), dist.group.WORLD
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // t))
    impls = {"by hand": lambda m: apply_tensor_parallel(copy.deepcopy(m), group, sp)}
    if reference is not None and not args.no_compare and cfg.n_kv_heads % t == 0:
        impls["DTensor"] = lambda m: reference(copy.deepcopy(m), group, sp)
    why = f": Colwise would cut {cfg.n_kv_heads} kv heads in {t}" if reference and not args.no_compare else ""
    print0(f"tensor parallel: tp={t}, model {args.model}, batch {B}x{S}, sequence parallel {'on' if sp else 'off'}, "
           f"{dist.get_backend()} on {device}; PyTorch's DTensor TP " + ("beside it" if len(impls) > 1 else
                                                                         "left out" + why))
    batches = [get_batch(load_corpus(), s, B, S, device=device) for s in range(args.steps)]

    def err(mine, full, p):   # my tensor (a DTensor's: the whole) against my slice of the one-process one
        mine = mine.full_tensor() if hasattr(mine, "full_tensor") else mine
        return (mine.detach() - full_slice(full, p)).abs().max().item()

    # Training in float64 against one process: losses, step 1's gradients, final parameters
    ref = build_model(cfg, seed=0, dtype=torch.float64, device=device)
    one, ok, counted = single_process(ref, batches, lr=1e-3, keep_grads=True), True, {}
    print0(f"{args.steps} AdamW steps in float64; collectives of step 1 (L={cfg.n_layers} layers; one [B,S,H] = "
           f"{B * S * cfg.dim * 8:,d} bytes):")
    for name, make in impls.items():
        m = make(ref)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        loss, counted[name] = counted_step(m, *batches[0])   # forward, backward, finish_grads
        off = [n for n, p in m.named_parameters() if err(p.grad, one["grads"][0][n], p) > 1e-10]
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses = [loss.item()] + [train_step(m, opt, x, y).item() for x, y in batches[1:]]
        dl = max(abs(a - b) for a, b in zip(losses, one["losses"]))
        dp = max(err(p, dict(one["model"].named_parameters())[n], p) for n, p in m.named_parameters())
        print0(f"{name:8s} vs one process: max |diff| loss {dl:.1e}, parameters {dp:.1e}\n"
               + phase_lines(name, counted[name]))
        print_by_rank(f"  rank {dist.get_rank()}: gradients of step 1 that differ: {', '.join(off) or 'none'}")
        ok &= dl < 1e-10 and dp < 1e-10 and not off
    formulas_ok, text = check_formulas(counted["by hand"], cfg, B, S, t, sp)   # SP: the same ring bytes
    print0(text)
    print0(time_float32(impls, ref, batches[0], args.rounds, args.timed, group, device, sp))
    ok = all_agree(ok and formulas_ok)
    print0("all checks", "ok" if ok else "FAILED")
    return finish(ok)


def main(argv=None) -> None:
    run_main(demo, argv)
