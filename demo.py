"""What every lesson's demo, test and notebook shares — kept here so each lesson file is its algorithm.

    single_process(model, batches, ...)   the one single-process reference training loop: the run
                                          every parallel strategy must equal (losses, parameters,
                                          gradients, gradient norms)
    snapshot(module), max_diff(a, b)      parameters (or gradients) by name, and their largest difference
    bytes_table(measured, formula, P)     a CommCounter summary next to a formula: API and ring bytes
    print_by_rank(text)                   each rank's lines, printed by rank 0 in rank order
    all_agree(ok)                         True on every rank only if `ok` held on every rank
    finish(ok), main(fn)                  the one clean end of a run, and a demo's __main__ (bad input:
                                          one line per rank and exit code 2, not a traceback)
(instruments.time_side_by_side times several step functions in alternating rounds.)

PyTorch's own parallel wrappers (DDP, FSDP2, DTensor, pipelining) are never used here: references.py
builds them on the same model and groups; a lesson's `__main__` block hands one to its demo.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from mesh import collective_device


# ---- the single-process reference ------------------------------------------------------------

def _default_loss(model, batch):
    x, y = batch
    return model(x, y)


def single_process(model: nn.Module, batches, *, lr: float = 1e-3, optimizer=torch.optim.AdamW,
                   lr_at=None, clip: float | None = None, loss_fn=_default_loss, compute_dtype=None,
                   keep_grads: bool = False, copy_model: bool = True, **optimizer_kwargs) -> dict:
    """Train `model` in ONE process on whole global batches, one optimizer step per batch.

    batches     [(inputs, targets)] global batches (or whatever `loss_fn(model, batch)` takes)
    lr_at       step (1-based) -> learning rate, set before each step (None: `lr` throughout)
    clip        clip the gradient norm with torch's own clip_grad_norm_ (its norms are returned)
    compute_dtype  run forward/backward on a copy in this dtype (bf16 mixed precision) and step the
                fp32 parameters with its gradients cast to fp32 — the casts a sharded bf16 run makes
    keep_grads  also return every step's gradients by name

    Returns dict(losses, norms, grads, model): the trained model (a deep copy unless copy_model=False).
    """
    model = copy.deepcopy(model) if copy_model else model
    master = [p for p in model.parameters() if p.requires_grad]
    compute = copy.deepcopy(model).to(compute_dtype) if compute_dtype is not None else model
    opt = optimizer(master, lr=lr, **optimizer_kwargs)
    out = dict(losses=[], norms=[], grads=[], model=model)
    for step, batch in enumerate(batches, start=1):
        if lr_at is not None:
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
        loss = loss_fn(compute, batch)
        loss.backward()
        if compute is not model:  # bf16 gradients -> the fp32 parameters they belong to
            for p, c in zip(model.parameters(), compute.parameters()):
                if p.requires_grad:
                    p.grad, c.grad = None if c.grad is None else c.grad.to(p.dtype), None
        if clip is not None:
            out["norms"].append(torch.nn.utils.clip_grad_norm_(master, clip).item())
        if keep_grads:
            out["grads"].append(snapshot(model, grads=True))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if compute is not model:
            with torch.no_grad():
                for p, c in zip(model.parameters(), compute.parameters()):
                    c.copy_(p)
        out["losses"].append(loss.item())
    return out


# ---- comparing ---------------------------------------------------------------------------------

def snapshot(module: nn.Module, grads: bool = False) -> dict:
    """{name: a detached copy} of the parameters (or of their gradients; None where there is none)."""
    if grads:
        return {n: None if p.grad is None else p.grad.detach().clone() for n, p in module.named_parameters()}
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def max_diff(a, b) -> float:
    """Largest |a - b| over the tensors two dicts (or modules) share by name; both must have the same names."""
    a = snapshot(a) if isinstance(a, nn.Module) else a
    b = snapshot(b) if isinstance(b, nn.Module) else b
    if set(a) != set(b):
        raise KeyError(f"different names: only in one {sorted(set(a) ^ set(b))}")
    return max(((torch.as_tensor(a[k]).double().cpu() - torch.as_tensor(b[k]).double().cpu()).abs().max().item()
                for k in a if a[k] is not None or b[k] is not None), default=0.0)


# ---- printing and agreeing across ranks ----------------------------------------------------------

def bytes_table(measured: dict, formula: dict, group_size: int, indent: str = "    ") -> list[str]:
    """Lines comparing a CommCounter.summary() with a formula {op: API bytes}: per collective the API
    bytes measured | formula, and the ring bytes this rank sent | the formula's (instruments.wire_bytes)."""
    from instruments import wire_bytes
    lines = []
    for op in sorted(set(measured) | set(formula)):
        got, want = measured.get(op, dict(bytes=0, wire_bytes=0.0, calls=0)), formula.get(op, 0)
        lines.append(f"{indent}{op:14s} API {got['bytes']:>11,} | {want:>11,}   ring {got['wire_bytes']:>12,.0f} | "
                     f"{wire_bytes(op, want, group_size):>12,.0f}   ({got['calls']} calls)")
    return lines


def print_by_rank(text: str, group=None) -> None:
    """Rank 0 prints every rank's text, in rank order (lines from several processes never interleave)."""
    if not dist.is_initialized():
        print(text, flush=True)
        return
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, text, group=group)
    if dist.get_rank() == (dist.get_global_rank(group, 0) if group is not None else 0):
        print("\n".join(every), flush=True)


def all_agree(ok: bool, group=None) -> bool:
    """True on every rank if `ok` is true on every rank of `group` (one MIN all-reduce)."""
    if not dist.is_initialized():
        return bool(ok)
    flag = torch.tensor([1.0 if ok else 0.0], device=collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return flag.item() == 1.0


def finish(ok: bool = True) -> int:
    """End a run the same way on every rank: wait until every rank is done, then tear the process
    groups down. Returns the exit code (0 if ok). `main` then leaves the process (see there)."""
    if dist.is_initialized():
        dist.barrier()  # after it no rank has a collective in flight: nothing is torn down under a peer
        dist.destroy_process_group()
    return 0 if ok else 1


def main(fn, argv=None) -> None:
    """Run a lesson's demo, `fn(argv) -> exit code`, as its `__main__`, and leave the process.

    Bad input raises ValueError on every rank alike, before any collective (each lesson checks its
    arguments by arithmetic first): it is printed as one line per rank, not a traceback, and the
    run exits with code 2. Under torchrun a rank lingers a moment before exiting, so that torchrun
    (which stops every rank once one has exited) does not cut the slower ranks off before they say it.

    Why the process is left with os._exit: a process group's backend threads (gloo's) live as long
    as the group object, and a model wrapper whose hooks refer back to it keeps it alive until the
    interpreter itself shuts down. A backend thread that then drops the last reference to a Python
    object (a tensor's wrapper, a future's callback) must take the GIL from a finalising
    interpreter, which ends the thread in a way C++ cannot unwind: `terminate called without an
    active exception`, SIGABRT, in a few runs out of a hundred. After `finish` every collective is
    done, so nothing is lost by skipping finalisation — and no backend thread can meet it.
    """
    import os
    import sys
    import time
    import traceback
    try:
        code = fn(argv)
    except ValueError as e:
        print(f"[rank {os.environ.get('RANK', '0')}] error: {e}", file=sys.stderr, flush=True)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            time.sleep(3)
        code = 2
    except SystemExit as e:  # argparse's --help and usage errors
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - a crash: report it, and still leave without finalisation
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
