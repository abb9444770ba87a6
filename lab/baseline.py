"""The baseline every parallel strategy must equal: the same model trained in ONE process on whole
global batches, and how a parallel run is compared with it.

    single_process(model, batches, ...)   the one single-process training loop (losses, parameters,
                                          gradients, gradient norms); OneProcess: the same, a step at a time
    snapshot(module), max_diff(a, b)      parameters (or gradients) by name, and their largest difference
    TOL64, adamw_reach(lr, steps)         what "equal" can mean after AdamW steps: in float64, and in fp32/bf16
    LOSS_TOL                              what train.py --check holds a run's losses to, by dtype
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn


def _default_loss(model, batch):
    x, y = batch
    return model(x, y)


class OneProcess:
    """THE single-process training loop, one step at a time: `model` trained in ONE process on whole global
    batches, one optimizer step per batch (single_process runs it over a list; train.py's --check also looks
    inside each step: lab/mismatch.py).

    lr_at       step (1-based) -> learning rate, set before each step (None: `lr` throughout)
    clip        clip the gradient norm with torch's own clip_grad_norm_ (its norms are kept in `norms`)
    compute_dtype  run forward/backward on a copy in this dtype (bf16 mixed precision) and step the
                fp32 parameters with its gradients cast to fp32 — the casts a sharded bf16 run makes
    keep_grads  also keep every step's gradients by name (in `grads`)
    """

    def __init__(self, model: nn.Module, *, lr: float = 1e-3, optimizer=torch.optim.AdamW, lr_at=None,
                 clip: float | None = None, loss_fn=_default_loss, compute_dtype=None, keep_grads: bool = False,
                 copy_model: bool = True, **optimizer_kwargs):
        self.model = copy.deepcopy(model) if copy_model else model
        self.master = [p for p in self.model.parameters() if p.requires_grad]
        self.compute = copy.deepcopy(self.model).to(compute_dtype) if compute_dtype is not None else self.model
        self.opt = optimizer(self.master, lr=lr, **optimizer_kwargs)
        self.lr_at, self.clip, self.loss_fn, self.keep_grads = lr_at, clip, loss_fn, keep_grads
        self.losses, self.norms, self.grads, self.steps = [], [], [], 0

    def step(self, batch, after_backward=None) -> float:
        """One optimizer step on `batch`; after_backward(model), if given, sees the gradients before clipping
        and the optimizer. Returns the loss."""
        model, compute, opt = self.model, self.compute, self.opt
        self.steps += 1
        if self.lr_at is not None:
            for g in opt.param_groups:
                g["lr"] = self.lr_at(self.steps)
        loss = self.loss_fn(compute, batch)
        loss.backward()
        if compute is not model:  # bf16 gradients -> the fp32 parameters they belong to
            for p, c in zip(model.parameters(), compute.parameters()):
                if p.requires_grad:
                    p.grad, c.grad = None if c.grad is None else c.grad.to(p.dtype), None
        if after_backward is not None:
            after_backward(model)
        if self.clip is not None:
            self.norms.append(torch.nn.utils.clip_grad_norm_(self.master, self.clip).item())
        if self.keep_grads:
            self.grads.append(snapshot(model, grads=True))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if compute is not model:
            with torch.no_grad():
                for p, c in zip(model.parameters(), compute.parameters()):
                    c.copy_(p)
        self.losses.append(loss.item())
        return self.losses[-1]


def single_process(model: nn.Module, batches, *, lr: float = 1e-3, optimizer=torch.optim.AdamW,
                   lr_at=None, clip: float | None = None, loss_fn=_default_loss, compute_dtype=None,
                   keep_grads: bool = False, copy_model: bool = True, **optimizer_kwargs) -> dict:
    """Train `model` in ONE process on whole global batches [(inputs, targets)] (or whatever `loss_fn(model,
    batch)` takes), one optimizer step per batch: OneProcess over the list (its arguments are OneProcess's).

    Returns dict(losses, norms, grads, model): the trained model (a deep copy unless copy_model=False).
    """
    run = OneProcess(model, lr=lr, optimizer=optimizer, lr_at=lr_at, clip=clip, loss_fn=loss_fn,
                     compute_dtype=compute_dtype, keep_grads=keep_grads, copy_model=copy_model, **optimizer_kwargs)
    for batch in batches:
        run.step(batch)
    return dict(losses=run.losses, norms=run.norms, grads=run.grads, model=run.model)


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


# ---- what "equal" can mean after AdamW steps ------------------------------------------------------------
#
# AdamW moves each element by lr·m̂/(√v̂ + eps): its update is normalised by the root mean square of its own
# gradients. Where an element's true gradient is ~0, a rounding-level difference between two runs (a sum taken
# in another order, another CPU's kernels: AVX2, AVX-512, scalar) is all there is, and the normalisation turns
# it into a step of up to lr, in one run and not the other. So fp32 (or bf16) parameters after AdamW can differ
# by whole steps however correct the strategy is, and where that happens depends on the machine.
# In float64 the rounding (~1e-16 of a gradient) is eight orders below eps = 1e-8, so no update is amplified and
# parameters agree to ~1e-13 or better: TOL64 is far above that, and far below what a wrong gradient, shard or
# step does.

TOL64 = 1e-9

# What train.py --check holds a run's LOSSES (and gradient norms, relatively) to, by dtype. Losses, not parameters:
# AdamW turns fp32 rounding on a gradient that is ~0 into whole steps, CPU by CPU (above), but on exactly the elements
# the loss does not feel. float64: rounding; float32: a few units in the last place of the loss (measured 1e-6 on
# default, AVX2 and AVX-512 kernels); bf16 compute against fp32: bf16's rounding of the activations, 2^-8 relative
# each (measured ~1.4e-3).
LOSS_TOL = {"float64": TOL64, "float32": 1e-4, "bfloat16": 5e-2}


def adamw_reach(lr: float, steps: int, betas=(0.9, 0.999)) -> float:
    """The largest |difference| two AdamW runs with constant lr, from the same parameters, can reach in one
    element after `steps` steps, whatever their gradients: a bound rounding cannot exceed (only a parameter
    that is in the wrong place, or not AdamW's, can).

    By Cauchy-Schwarz on m_t = (1-b1)·Σ_k b1^k g_{t-k} against v_t = (1-b2)·Σ_k b2^k g²_{t-k}, one step moves
    an element by at most lr·c_t, c_t = (1-b1)/(1-b1^t) · √((1-b2^t)/(1-b2)) · √(Σ_{k<t} (b1²/b2)^k)
    (1 at t = 1, 1.007 at t = 4; eps only shrinks it); weight decay scales the difference by 1 - lr·wd <= 1.
    Two runs: 2·lr·Σ_t c_t."""
    b1, b2 = betas
    return 2 * lr * sum((1 - b1) / (1 - b1 ** t) * math.sqrt((1 - b2 ** t) / (1 - b2))
                        * math.sqrt(sum((b1 * b1 / b2) ** k for k in range(t))) for t in range(1, steps + 1))
