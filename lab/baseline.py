"""The baseline every parallel strategy must equal: the same model trained in ONE process on whole
global batches, and how a parallel run is compared with it.

    single_process(model, batches, ...)   the one single-process training loop (losses, parameters,
                                          gradients, gradient norms)
    snapshot(module), max_diff(a, b)      parameters (or gradients) by name, and their largest difference
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn


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
