"""Lesson 1 — data parallel: the whole model on every rank, 1/P of the batch, gradients averaged.

The idea
--------
P ranks hold identical copies of the parameters (the group's first rank broadcasts its own once, when
the model is wrapped). Rank r runs forward and backward on its B/P rows of the global batch of B rows
and gets g_r, the gradient of its own mean loss. With equal shares the gradient of the global mean
loss is exactly their average,

    g = (1/P) · Σ_r g_r

so one all-reduce — a sum, then ÷P (gloo has no ReduceOp.AVG; average_gradients divides the sum, the
wrappers divide each rank's part before sending it: the same average) — leaves g on every rank, every
rank takes the same optimizer step, and the copies stay identical without a parameter ever being sent
again.

Naive and bucketed
------------------
(Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB,
arXiv:2006.15704: §3.2 bucketing and overlap, §4.2 the reverse order and unused parameters.)
NaiveDDP waits for backward to end, then all-reduces the gradients one tensor at a time: the network
idles while backward computes, then the compute idles while the network works. BucketedDDP packs the
gradients into flat buckets of about `bucket_cap_mb` MiB (PyTorch's default 25, its first bucket 1),
in REVERSE parameter order — roughly the order backward produces them — and starts a bucket's
all-reduce, asynchronously, the moment its last gradient is ready, while backward goes on with the
earlier layers. Big buckets: few calls, but the first starts late and a long tail is left after
backward. Small buckets: an early start, but many calls, each paying a fixed latency. At the end of
backward it waits for what is still in flight, so the loop is PyTorch's:
`loss = model(x, y); loss.backward(); opt.step()`. The file reads in that order: `average_gradients`,
the idea in a few lines (one flat all-reduce after backward, which the later lessons call where replicas
agree), then NaiveDDP, then BucketedDDP, then what the composition adds.

Tied, frozen and unused parameters: a tied weight is one Parameter (one gradient, one all-reduce); a
frozen one is not sent; one the batch of SOME ranks missed gets zeros from them and the average of all P.
One that NO rank used must end the step with grad None, as in one process (with zeros, AdamW would still
move it), and whether anyone used it is known only when backward ends: each rank sends one byte per
parameter tensor in one all-reduce with MAX (= or) after the last bucket — Li et al.'s "globally unused
parameters" bitmap, §4.2, which PyTorch's DDP pays only under find_unused_parameters=True.

For the composition (train.py, ZeRO stage 0): `sync_next_backward(False)` before each micro-batch's backward
but the last, so only the last all-reduces (overlapped with it) — a pipeline calls it before the rank's last
backward of its schedule — `synchronize()` for what is left, and `groups_of` for parameters averaged over a
group of their own (an expert's weights: the ranks holding that expert).

Communication per step (Ψ gradient elements of b bytes each, n parameter tensors; API bytes, handed to
the collective — what one rank sends on a ring is mesh.py's all-reduce factor of them, lesson 0)
    gradients                   Ψ·b           naive: n calls;  bucketed: one call per bucket
    used flags                  n             one call (uint8, MAX)
    once, when wrapping         a broadcast of the parameters and buffers from the first rank
b is the reduce dtype: compute_dtype=bf16 (autocast) keeps fp32 gradients, b = 4; reduce_dtype=bf16
sums in bf16, b = 2 (half the bytes, less precise sums).
Memory saved: none — every rank holds all parameters, gradients and optimizer state (fsdp.py's stage 0,
lesson 2, which shards them). Gradients kept as
views into their flat bucket avoid a second gradient-sized buffer: Ψ·b saved.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
import torch.nn as nn

from mesh import all_reduce_flat, resolve_group

MiB = 1024 * 1024


# ---- 1. the idea: one all-reduce of the gradients after backward ------------------------------------

@torch.no_grad()
def average_gradients(params, group=None, divide_by: int | None = None) -> None:
    """Data parallel in its plainest form, called after loss.backward(): every gradient of `params` summed
    over `group` in ONE flat all-reduce and divided by `divide_by` (default: the group's size) —
    g = (1/P)·Σ_r g_r on every rank. A parameter without a gradient on this rank sends zeros (every rank must
    hand over the same sizes) and receives the others' average — zeros if no rank used it, where the wrappers
    below agree on who used what and leave it None. Later lessons call it where replicas must agree outside a
    wrapper (expert_parallel.sync_gradients; the demos' training loops)."""
    group = resolve_group(group, "dp")
    params = [p for p in params if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    all_reduce_flat([p.grad for p in params], group, divide_by or dist.get_world_size(group))


# ---- 2. a wrapper: the first broadcast, no_sync, unused parameters; naive, one tensor at a time -------

class _Replicated(nn.Module):
    """What both versions share: the first broadcast, forward, no_sync, and agreeing on what was used.

    divide_by   what the summed gradients are divided by (default: the group's size)
    where       {parameter: (group, divide_by)} for parameters averaged over a group of their own (section 4,
                for the composition); by default every parameter is averaged over `group`"""

    def __init__(self, module: nn.Module, group=None, compute_dtype: torch.dtype | None = None,
                 divide_by: int | None = None, where: dict | None = None):
        _check_module(module, compute_dtype)  # every check before the first collective: all ranks fail alike
        group = resolve_group(group, "dp")
        super().__init__()
        self.module, self.group, self.world = module, group, dist.get_world_size(group)
        self.params = [p for p in module.parameters() if p.requires_grad]  # a tied weight once, no frozen one
        self.names = {p: n for n, p in module.named_parameters()}
        self.compute_dtype, self.device = compute_dtype, self.params[0].device
        self._sync = self._sync_backward = True  # _sync: False inside no_sync()
        self.where = where or {p: (group, divide_by or self.world) for p in module.parameters()}  # -> (group, ÷)
        with torch.no_grad():  # the ranks may have been initialised differently
            for t in [*module.parameters(), *module.buffers()]:
                g = self.where.get(t, (group,))[0]
                dist.broadcast(t.detach(), src=dist.get_global_rank(g, 0), group=g)

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():  # as in PyTorch the forward decides; an eval forward decides nothing
            self._sync_backward = self._sync
        # Mixed precision: matmuls in compute_dtype, parameters and gradients in their own (fp32).
        with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=self.compute_dtype is not None):
            return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: a backward of a forward run inside sends nothing; gradients add up
        locally, and the next backward outside all-reduces their sum."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    def sync_next_backward(self, sync: bool = True) -> None:
        """Decide whether the next backward all-reduces, for a caller that runs the module itself rather
        than through this wrapper's forward (a pipeline schedule calls its stage; train.py's micro-batches)."""
        self._sync_backward = sync

    def _agree_on_used(self) -> list[bool]:
        """Per parameter: does ANY rank hold a gradient for it? One byte each, one all-reduce (MAX = or)
        per group (one, unless groups_of gave some parameters their own)."""
        by_group = {}
        for i, p in enumerate(self.params):  # (the same order on every rank)
            by_group.setdefault(self.where[p][0], []).append(i)
        used = [False] * len(self.params)
        for group, idx in by_group.items():
            flags = torch.tensor([self.params[i].grad is not None for i in idx], dtype=torch.uint8, device=self.device)
            if dist.get_world_size(group) > 1:
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
            for i, f in zip(idx, flags.tolist()):
                used[i] = bool(f)
        return used


class NaiveDDP(_Replicated):
    """All-reduce every gradient after backward, one parameter tensor at a time.

    loop:  loss = model(x, y); loss.backward(); model.all_reduce_gradients(); opt.step()
    """

    @torch.no_grad()
    def all_reduce_gradients(self) -> None:
        if not self._sync_backward:  # the forward ran inside no_sync(): keep accumulating locally
            return
        for p, used in zip(self.params, self._agree_on_used()):
            if not used:
                continue  # no rank used it: grad stays None, as in one process, and AdamW skips it
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # another rank used it: this one adds nothing
            group, divide_by = self.where[p]
            p.grad.div_(divide_by)  # sum of g_r / P = the average
            dist.all_reduce(p.grad, group=group)


# ---- 3. the full version: buckets all-reduced while backward runs ------------------------------------

class BucketedDDP(_Replicated):
    """All-reduce buckets of gradients asynchronously while backward is still running.

    bucket_cap_mb: bucket size in MiB (0: one bucket per parameter); first_bucket_mb: the first
    bucket's (PyTorch's defaults: 25 and 1). reduce_dtype: the dtype gradients are summed in
    (default: the parameters'; e.g. bfloat16 to halve the bytes). groups_of: for the composition (section 4).
    loop:  loss = model(x, y); loss.backward(); opt.step()     — exactly as with PyTorch's DDP.
    """

    def __init__(self, module: nn.Module, group=None, bucket_cap_mb: float = 25, first_bucket_mb: float = 1,
                 compute_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                 divide_by: int | None = None, groups_of=None):
        check_buckets(bucket_cap_mb, first_bucket_mb, reduce_dtype)
        where = placement(module, resolve_group(group, "dp"), divide_by, groups_of) if groups_of else None
        super().__init__(module, group, compute_dtype, divide_by, where)
        self.reduce_dtype = reduce_dtype
        self.buckets = self._make_buckets(bucket_cap_mb * MiB, min(first_bucket_mb, bucket_cap_mb) * MiB)
        for b, bucket in enumerate(self.buckets):
            for i, p in enumerate(bucket.params):
                p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, b, i))
        self._next = 0  # the next bucket to launch: every rank launches in this order
        self._in_backward, self._task = False, None
        self.averaged = True  # False while gradients that were not all-reduced sit in the buckets

    def _make_buckets(self, cap: float, first_cap: float) -> list[Bucket]:
        buckets, cur, size, limit = [], [], 0, first_cap
        kind = lambda p: (self.reduce_dtype or p.dtype, p.dtype, p.device, self.where[p])  # noqa: E731
        for p in reversed(self.params):  # backward produces the last layers' gradients first
            if cur and kind(p) != kind(cur[0]):  # a bucket is one dtype, on one group
                buckets.append(Bucket(cur, kind(cur[0])[0], *self.where[cur[0]]))
                cur, size, limit = [], 0, cap
            cur.append(p)
            size += p.numel() * kind(p)[0].itemsize
            if size >= limit:
                buckets.append(Bucket(cur, kind(p)[0], *self.where[p]))
                cur, size, limit = [], 0, cap
        if cur:
            buckets.append(Bucket(cur, kind(cur[0])[0], *self.where[cur[0]]))
        return buckets

    def synchronize(self) -> None:
        """All-reduce now whatever backwards left unreduced (they ran with sync_next_backward(False), or
        inside no_sync()): every bucket, after the fact, as a backward's end would. A no-op if the last
        backward all-reduced already."""
        if not self.averaged:
            self._finish_backward()

    @torch.no_grad()
    def _on_grad_ready(self, b: int, i: int, p: torch.Tensor) -> None:
        """Runs once p.grad holds everything this backward adds to it (every use of a tied weight)."""
        bucket, view = self.buckets[b], self.buckets[b].views[i]
        if bucket.as_view and p.grad.data_ptr() != view.data_ptr():
            # First step, or the optimizer set grads to None: move the gradient into the bucket once;
            # from then on (zero_grad(set_to_none=False)) backward accumulates straight into it.
            view.copy_(p.grad)
            p.grad = view
        self.averaged = False
        if not self._sync_backward:
            return
        task = torch._C._current_graph_task_id()  # which backward pass runs this hook
        if not self._in_backward:  # the first hook of this backward: finish the buckets at its end
            self._in_backward, self._task = True, task
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        if task != self._task or bucket.ready[i]:
            # A backward nested inside ours (reentrant checkpointing) would end, and finish the
            # buckets, before the outer backward had produced all gradients.
            raise RuntimeError(f"the gradient of {self.names[p]!r} arrived from a second backward pass "
                               f"inside this one (torch.utils.checkpoint with use_reentrant=True?): "
                               f"use torch.utils.checkpoint(..., use_reentrant=False)")
        if not bucket.as_view:
            view.copy_(p.grad)  # cast into the reduce dtype
        bucket.ready[i] = True
        if all(bucket.ready):
            self._launch_in_order()

    def _launch_in_order(self) -> None:
        # Collectives on a group are matched by the order they are issued. A bucket may fill before
        # the one ahead of it on one rank and after it on another (a branch), so launch in bucket order.
        while self._next < len(self.buckets) and all(self.buckets[self._next].ready):
            bucket = self.buckets[self._next]
            bucket.flat.div_(bucket.divide_by)  # divide first: the sum is then the average
            if dist.get_world_size(bucket.group) > 1:
                bucket.work = dist.all_reduce(bucket.flat, group=bucket.group, async_op=True)
            self._next += 1

    @torch.no_grad()
    def _finish_backward(self) -> None:
        """Autograd calls this once, at the end of the backward pass (queued by its first hook)."""
        # A parameter whose hook did not fire got no gradient on this rank in this backward. It sends
        # what it holds (zeros, or what no_sync steps accumulated) so every rank launches every bucket.
        for bucket in self.buckets[self._next:]:
            for i, p in enumerate(bucket.params):
                if not bucket.ready[i]:
                    if p.grad is None:
                        bucket.views[i].zero_()
                    elif p.grad.data_ptr() != bucket.views[i].data_ptr():
                        bucket.views[i].copy_(p.grad)
                    bucket.ready[i] = True
        self._launch_in_order()
        used = dict(zip(self.params, self._agree_on_used()))  # after the last bucket, on every rank
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            for i, p in enumerate(bucket.params):
                if not used[p]:
                    p.grad = None  # no rank used it: as in one process
                elif bucket.as_view:
                    p.grad = bucket.views[i]
                elif p.grad is None:
                    p.grad = bucket.views[i].to(p.dtype)
                else:
                    p.grad.copy_(bucket.views[i])
            bucket.ready, bucket.work = [False] * len(bucket.params), None
        self._next, self._in_backward, self.averaged = 0, False, True


class Bucket:
    """Parameters whose gradients are all-reduced together, in one flat buffer, over one group."""

    def __init__(self, params, dtype, group, divide_by):
        self.params, self.group, self.divide_by = params, group, divide_by
        numels = [p.numel() for p in params]
        self.flat = torch.zeros(sum(numels), dtype=dtype, device=params[0].device)  # [Σ numel]
        self.views = [part.view(p.shape) for part, p in zip(self.flat.split(numels), params)]
        # Gradients live *inside* the bucket when the dtypes agree: backward then accumulates straight
        # into the buffer we send, and no separate gradient tensor (Ψ·b bytes) exists.
        self.as_view = all(p.dtype == dtype for p in params)
        self.ready, self.work = [False] * len(params), None

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


# ---- 4. for the composition: parameters on groups of their own (train.py's experts, lesson 7) ----------

def placement(module: nn.Module, group, divide_by: int | None = None, groups_of=None) -> dict:
    """{parameter: (the group it is averaged over, what its sum is divided by)}: `group` and its size for all,
    unless groups_of(name, param) names another — an expert's weights, held only by the ranks holding that
    expert (train.py passes groups_of to BucketedDDP; the lesson alone never does). Such a parameter is
    broadcast, averaged and agreed on over its own group."""
    default = (group, divide_by or dist.get_world_size(group))
    return {p: (groups_of(n, p) if groups_of else None) or default for n, p in module.named_parameters()}


# ---- checks, before any collective ------------------------------------------------------------------------

def _check_module(module, compute_dtype) -> None:
    if not isinstance(module, nn.Module):
        raise ValueError(f"module must be an nn.Module, got {type(module).__name__}")
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError("the module has no parameter with requires_grad=True: there is nothing to "
                         "average; unfreeze some parameters or do not wrap it")
    if compute_dtype is not None and not (isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point):
        raise ValueError(f"compute_dtype must be a floating torch.dtype such as torch.bfloat16 "
                         f"(or None for the parameters' dtype), got {compute_dtype!r}")


def check_buckets(bucket_cap_mb, first_bucket_mb, reduce_dtype) -> None:
    for name, v in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_mb", first_bucket_mb)):
        if not isinstance(v, (int, float)) or v < 0:
            raise ValueError(f"{name} must be a number of MiB >= 0 (0 puts each parameter in its own "
                             f"bucket), got {v!r}")
    if reduce_dtype is not None and not (isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point):
        raise ValueError(f"reduce_dtype must be a floating torch.dtype (or None for the parameters' "
                         f"dtype), got {reduce_dtype!r}")


if __name__ == "__main__":  # the demo (naive, bucketed and PyTorch's DDP side by side) is in the package
    from lab.ddp_demo import main
    main()
