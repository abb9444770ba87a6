"""Tensor parallel measured (tensor_parallel.py's demo and tests): the formulas for the collectives one
step issues (Megatron's 4L + 2 activation collectives, the loss's 3 all-reduces, sequence parallel at
the same ring bytes) and for the elements finish_grads sums; step 1 of a model counted by phase with
CommCounter, and compared with the formulas; float32 step times of several implementations side by
side. The lesson itself is tensor_parallel.py (its docstring states the formulas and their sources).
"""
from __future__ import annotations

import copy

import torch

from tensor_parallel import finish_grads, train_step


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
    from instruments import CommCounter
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
    from demo import bytes_table
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
    from instruments import time_side_by_side
    models = {k: make(copy.deepcopy(ref).float()) for k, make in impls.items()}  # ref itself stays as it is
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}
    med = time_side_by_side({k: lambda k=k: train_step(models[k], opts[k], *batch).item() for k in impls},
                            rounds, per_round, group, device)
    tokens = batch[0].numel()
    return ("float32: " + ", ".join(f"{k}{' +SP' if sp else ''} {s * 1e3:.1f} ms/step ({tokens / s:.0f} tokens/s)"
                                    for k, s in med.items())
            + (f"; throughput by hand / DTensor {med['DTensor'] / med['by hand']:.2f}x" if len(med) == 2 else ""))
