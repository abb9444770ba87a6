"""Lesson 1 — data parallel: whole model on every rank, 1/P of the batch, gradients averaged.

The idea
--------
P ranks hold identical copies of the parameters (broadcast from the group's first rank once, when
the model is wrapped). Rank r takes its own B/P rows of the global batch of B rows, runs forward
and backward, and gets g_r, the gradient of its own mean loss. With equal shares the gradient of
the global mean loss is exactly their average,

    g = (1/P) · Σ_r g_r

so after one all-reduce (a sum; gloo has no ReduceOp.AVG, so we divide by P by hand) every rank
holds g, takes the same optimizer step, and the copies stay identical with no parameter ever sent
again.

Communication per step (Ψ gradient elements of b bytes each):
    handed to all-reduce         Ψ·b                  (the whole gradient, once per step)
    sent by each rank (ring)     2(P-1)/P · Ψ·b       (reduce-scatter, then all-gather)
    all-reduce calls             naive: one per parameter tensor;  bucketed: one per bucket
    once, when wrapping          a broadcast of the parameters and buffers from the first rank
b is the bucket's dtype: compute_dtype=bf16 (autocast) keeps fp32 gradients, b = 4;
reduce_dtype=bf16 sums in bf16, b = 2 (half the bytes, less precise sums).
Memory saved: none — every rank holds all parameters, gradients and optimizer state, e.g.
(4 + 4 + 8)·Ψ bytes for fp32 AdamW. (ZeRO/FSDP, the next lessons, shard them.) Keeping each
gradient as a view into its flat bucket avoids a second gradient-sized buffer: Ψ·b saved.

Naive vs bucketed
-----------------
NaiveDDP waits for backward to end, then all-reduces the gradients one by one: the network idles
while backward computes, and the compute idles while the network works.
BucketedDDP packs gradients into flat buckets of about `bucket_cap_mb` MiB in *reverse* parameter
order (roughly the order backward produces them; the first bucket is small so the first all-reduce
starts early). A hook per parameter marks its gradient ready; the moment a bucket is complete its
all-reduce starts asynchronously while backward goes on with earlier layers. At the end of backward
we only wait for what is still in flight, so the training loop is PyTorch DDP's:
`loss = model(x, y); loss.backward(); opt.step()`.
Big buckets: few calls, but the first starts late and a long tail is left after backward.
Small buckets: an early start, but many small calls, each paying a fixed latency.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from instruments import CommCounter, Timeline, sync
from mesh import Mesh, init_distributed, print0

MiB = 1024 * 1024


def _resolve_group(group):
    """The data-parallel group: a Mesh's flattened "dp" group, a process group, or None (the world)."""
    if isinstance(group, Mesh):
        return group.group("dp")
    if group is None:
        return dist.group.WORLD
    if isinstance(group, dist.ProcessGroup):
        return group
    raise ValueError(f"group must be a Mesh (its 'dp' group is used), a ProcessGroup or None (the whole "
                     f"world), got {type(group).__name__}")


@torch.no_grad()
def broadcast_module(module: nn.Module, group) -> None:
    """Copy the first rank's parameters and buffers to every rank of `group` (in place)."""
    src = dist.get_global_rank(group, 0)
    for t in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(t.detach(), src=src, group=group)


class _DataParallel(nn.Module):
    """What both versions share: validation, the first broadcast, forward, no_sync, the timeline."""

    def __init__(self, module: nn.Module, group=None, compute_dtype: torch.dtype | None = None):
        # Every check comes before the first collective, so bad input fails alike on every rank.
        if not isinstance(module, nn.Module):
            raise ValueError(f"module must be an nn.Module, got {type(module).__name__}")
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the module has no parameter with requires_grad=True: there is nothing to "
                             "average; unfreeze some parameters or do not wrap it")
        if compute_dtype is not None and not (isinstance(compute_dtype, torch.dtype)
                                              and compute_dtype.is_floating_point):
            raise ValueError(f"compute_dtype must be a floating torch.dtype such as torch.bfloat16 "
                             f"(or None for the parameters' dtype), got {compute_dtype!r}")
        group = _resolve_group(group)
        super().__init__()
        self.module, self.group = module, group
        self.world = dist.get_world_size(group)
        self.params = params                     # module.parameters() lists a tied weight once
        self.names = {p: n for n, p in module.named_parameters()}
        self.compute_dtype = compute_dtype
        self.device = params[0].device
        self.timeline = Timeline()               # "backward" and "all_reduce" spans (seconds)
        self._sync = True             # False inside no_sync()
        self._sync_backward = True    # what the last forward decided for its backward
        self._bwd_start = None
        broadcast_module(module, group)          # the ranks may have been initialised differently

    def forward(self, *args, **kwargs):
        # Mixed precision: matmuls run in compute_dtype (autocast); parameters and their
        # gradients stay in their own dtype (fp32), so the all-reduce sums fp32 gradients.
        with torch.autocast(self.device.type, dtype=self.compute_dtype,
                            enabled=self.compute_dtype is not None):
            out = self.module(*args, **kwargs)
        self._sync_backward = self._sync  # as in PyTorch, the forward decides: no_sync must wrap it
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._mark_backward_start)  # the output's gradient comes first
        return out

    def _mark_backward_start(self, grad):
        self._bwd_start = self.timeline.now()

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: the backward of a forward run inside sends nothing, and gradients
        accumulate locally; the next backward outside all-reduces the sum of them all."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before


class NaiveDDP(_DataParallel):
    """All-reduce every gradient after backward, one parameter at a time.

    loop:  loss = model(x, y); loss.backward(); model.all_reduce_gradients(); opt.step()
    """

    @torch.no_grad()
    def all_reduce_gradients(self) -> None:
        if not self._sync_backward:  # forward ran inside no_sync(): keep accumulating locally
            return
        end = self.timeline.now()
        self.timeline.add("backward", end if self._bwd_start is None else self._bwd_start, end)
        for i, p in enumerate(self.params):
            if p.grad is None:  # unused on this rank: every rank must still make the same calls
                p.grad = torch.zeros_like(p)
            start = self.timeline.now()
            p.grad.div_(self.world)  # sum of g_r / P = the average
            dist.all_reduce(p.grad, group=self.group)
            self.timeline.add("all_reduce", start, self.timeline.now(), bucket=i,
                              bytes=p.grad.numel() * p.grad.element_size())
        self._bwd_start = None


class Bucket:
    """Parameters whose gradients are all-reduced together, in one flat buffer."""

    def __init__(self, params, dtype):
        self.params = params
        numels = [p.numel() for p in params]
        self.flat = torch.zeros(sum(numels), dtype=dtype, device=params[0].device)   # [sum of numel]
        offsets = [sum(numels[:i]) for i in range(len(params))]
        self.views = [self.flat[o:o + n].view(p.shape) for o, n, p in zip(offsets, numels, params)]
        # Gradients can live *inside* the bucket when the dtypes agree: backward then accumulates
        # straight into the buffer we send, and no separate gradient tensor (Ψ·b bytes) exists.
        self.as_view = all(p.dtype == dtype for p in params)
        self.ready = [False] * len(params)
        self.work = self.done = None

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def full(self) -> bool:
        return all(self.ready)


class BucketedDDP(_DataParallel):
    """All-reduce buckets of gradients asynchronously while backward is still running.

    bucket_cap_mb: bucket size in MiB (0: one bucket per parameter); first_bucket_mb: the first
    bucket's (PyTorch's defaults: 25 and 1). reduce_dtype: the dtype gradients are summed in
    (default: the parameters'; e.g. float32 for a bfloat16 model, or bfloat16 to halve the bytes).
    loop:  loss = model(x, y); loss.backward(); opt.step()     — exactly as with PyTorch's DDP.
    """

    def __init__(self, module: nn.Module, group=None, bucket_cap_mb: float = 25, first_bucket_mb: float = 1,
                 compute_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None):
        for name, v in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_mb", first_bucket_mb)):
            if not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"{name} must be a number of MiB >= 0 (0 puts each parameter in its own "
                                 f"bucket), got {v!r}")
        if reduce_dtype is not None and not (isinstance(reduce_dtype, torch.dtype)
                                             and reduce_dtype.is_floating_point):
            raise ValueError(f"reduce_dtype must be a floating torch.dtype (or None for the parameters' "
                             f"dtype), got {reduce_dtype!r}")
        super().__init__(module, group, compute_dtype)
        self.reduce_dtype = reduce_dtype
        self.buckets = self._make_buckets(bucket_cap_mb * MiB, min(first_bucket_mb, bucket_cap_mb) * MiB)
        for b, bucket in enumerate(self.buckets):
            for i, p in enumerate(bucket.params):
                p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, b, i))
        self._next = 0              # the next bucket to launch: every rank launches in this order
        self._in_backward, self._task = False, None

    def _make_buckets(self, cap: float, first_cap: float) -> list[Bucket]:
        buckets, cur, size, limit = [], [], 0, first_cap
        for p in reversed(self.params):  # backward produces the last layers' gradients first
            dtype = self.reduce_dtype or p.dtype
            if cur and (self.reduce_dtype or cur[0].dtype, cur[0].dtype, cur[0].device) != \
                    (dtype, p.dtype, p.device):
                buckets.append(Bucket(cur, self.reduce_dtype or cur[0].dtype))  # a bucket is one dtype
                cur, size, limit = [], 0, cap
            cur.append(p)
            size += p.numel() * torch.empty((), dtype=dtype).element_size()
            if size >= limit:
                buckets.append(Bucket(cur, dtype))
                cur, size, limit = [], 0, cap
        if cur:
            buckets.append(Bucket(cur, self.reduce_dtype or cur[0].dtype))
        return buckets

    # ---- during backward ------------------------------------------------------------------
    @torch.no_grad()
    def _on_grad_ready(self, b: int, i: int, p: torch.Tensor) -> None:
        """Runs once p.grad holds everything this backward accumulates into it (tied uses summed)."""
        bucket, view = self.buckets[b], self.buckets[b].views[i]
        if bucket.as_view and p.grad.data_ptr() != view.data_ptr():
            # First step, or the optimizer set grads to None: move the gradient into the bucket
            # once; from then on (zero_grad(set_to_none=False)) backward accumulates in place.
            view.copy_(p.grad)
            p.grad = view
        if not self._sync_backward:
            return
        task = torch._C._current_graph_task_id()  # which backward pass is running this hook
        if not self._in_backward:  # the first hook of this backward: wait for the rest at its end
            self._in_backward, self._task = True, task
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            if self._bwd_start is None:
                self._bwd_start = self.timeline.now()
        if task != self._task or bucket.ready[i]:
            # A backward nested inside ours (reentrant checkpointing) would end, and finish the
            # buckets, before the outer backward had produced all gradients.
            raise RuntimeError(f"the gradient of {self.names[p]!r} arrived from a second backward pass "
                               f"inside this one (torch.utils.checkpoint with use_reentrant=True?): "
                               f"use torch.utils.checkpoint(..., use_reentrant=False)")
        if not bucket.as_view:
            view.copy_(p.grad)  # cast into the reduce dtype
        bucket.ready[i] = True
        if bucket.full():
            self._launch_in_order()

    def _launch_in_order(self) -> None:
        # Collectives on a group are matched by the order they are issued. Bucket k may complete
        # before bucket k-1 on one rank and after it on another, so launch strictly in bucket order.
        while self._next < len(self.buckets) and self.buckets[self._next].full():
            bucket, k = self.buckets[self._next], self._next
            bucket.flat.div_(self.world)  # divide first: the sum is then the average (and stays in range)
            start = self.timeline.now()
            bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)
            # The future's callback runs when the all-reduce completes (on gloo: the moment it does).
            bucket.done = bucket.work.get_future().then(functools.partial(
                self._record, start=start, bucket=k, nbytes=bucket.nbytes))
            self._next += 1

    def _record(self, fut, start, bucket, nbytes):
        self.timeline.add("all_reduce", start, self.timeline.now(), bucket=bucket, bytes=nbytes)

    @torch.no_grad()
    def _finish_backward(self) -> None:
        """Autograd calls this once at the end of the backward pass (queued by the first hook)."""
        end = self.timeline.now()
        self.timeline.add("backward", self._bwd_start, end)
        # Parameters whose hook did not fire got no gradient on this rank in this backward (a branch
        # this rank's data did not take). Contribute what they hold — zeros, or what no_sync steps
        # accumulated — so every rank still launches every bucket. A parameter no rank used ends
        # with a zero gradient, not None (PyTorch's DDP spends an extra all-reduce to keep None).
        for bucket in self.buckets[self._next:]:
            for i, p in enumerate(bucket.params):
                if not bucket.ready[i]:
                    if p.grad is None:
                        bucket.views[i].zero_()
                    elif p.grad.data_ptr() != bucket.views[i].data_ptr():
                        bucket.views[i].copy_(p.grad)
                    bucket.ready[i] = True
        self._launch_in_order()
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.done.wait()
            for i, p in enumerate(bucket.params):
                if bucket.as_view:
                    p.grad = bucket.views[i]
                elif p.grad is None:
                    p.grad = bucket.views[i].to(p.dtype)
                else:
                    p.grad.copy_(bucket.views[i])
            bucket.ready = [False] * len(bucket.params)
            bucket.work = bucket.done = None
        self._next, self._in_backward, self._bwd_start = 0, False, None


def overlap_fraction(spans) -> float:
    """Share of the all-reduce time (union of spans) that ran while backward was computing."""
    def union(iv):
        out = []
        for s, e in sorted(iv):
            if out and s <= out[-1][1]:
                out[-1][1] = max(out[-1][1], e)
            else:
                out.append([s, e])
        return out
    comm = union([(s["start"], s["end"]) for s in spans if s["name"] == "all_reduce"])
    bwd = union([(s["start"], s["end"]) for s in spans if s["name"] == "backward"])
    total = sum(e - s for s, e in comm)
    inside = sum(max(0.0, min(e, be) - max(s, bs)) for s, e in comm for bs, be in bwd)
    return inside / total if total > 0 else 0.0


def train_step(model, opt, x, y) -> float:
    """One data-parallel step; the naive version is the only one that needs an extra call."""
    loss = model(x, y)
    loss.backward()
    if isinstance(model, NaiveDDP):
        model.all_reduce_gradients()
    opt.step()
    opt.zero_grad(set_to_none=False)  # keep the gradients' storage: for BucketedDDP, the bucket views
    return loss.item()


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def profile_buckets(model="small", bucket_mbs=(0, 1, 4, 16, 64), steps=3, batch=8, seq=32) -> dict:
    """Per rank (run under launch.run_ranks): median step seconds and the last step's timeline
    for naive DDP and bucketed DDP at each bucket cap (first bucket = cap). For the notebook."""
    from data import get_batch, load_corpus
    from model import build_model
    rank, P = dist.get_rank(), dist.get_world_size()
    tokens = load_corpus()
    batches = [get_batch(tokens, s, batch, seq, dp_rank=rank, dp_size=P) for s in range(steps + 1)]
    out = {}
    for mb in [None, *bucket_mbs]:
        m = NaiveDDP(build_model(model)) if mb is None else BucketedDDP(build_model(model), None, mb, mb)
        opt, times = torch.optim.AdamW(m.parameters(), lr=1e-3), []
        for x, y in batches:
            dist.barrier()
            m.timeline.spans.clear()
            t = time.perf_counter()
            train_step(m, opt, x, y)
            times.append(time.perf_counter() - t)
        out["naive" if mb is None else mb] = dict(
            step_s=sorted(times[1:])[len(times[1:]) // 2], spans=list(m.timeline.spans),
            n_calls=len(m.params) if mb is None else len(m.buckets))
    return out


def _demo(argv=None, reference_ddp=None) -> int:
    """reference_ddp: PyTorch's DistributedDataParallel, passed in from below the __main__ line."""
    ap = argparse.ArgumentParser(description="Naive, bucketed and PyTorch DDP side by side on the shared model.")
    ap.add_argument("--model", default="small", help="tiny | small | medium | large (default small, ~10M)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps (after a warm-up and a counted step)")
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences), divisible by the world size")
    ap.add_argument("--seq", type=int, default=64, help="sequence length")
    ap.add_argument("--bucket-mb", type=float, default=25, help="bucket cap in MiB (0: one per parameter)")
    ap.add_argument("--first-bucket-mb", type=float, default=1, help="the first bucket's cap in MiB")
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args(argv)
    from data import get_batch, load_corpus
    from model import build_model, get_config
    cfg = get_config(args.model)  # raises on an unknown name, before any collective
    device = init_distributed()
    P, rank = dist.get_world_size(), dist.get_rank()
    if args.batch % P or args.steps < 1:
        raise ValueError(f"--batch {args.batch} must be divisible by the world size {P} and --steps >= 1")
    mesh = Mesh(dp_shard=P)
    tokens = load_corpus()
    n = args.steps + 2  # step 0 warms up; step 1 is counted (PyTorch's DDP re-buckets after its first step)
    batches = [get_batch(tokens, s, args.batch, args.seq, dp_rank=rank, dp_size=P, device=device) for s in range(n)]

    # Each rank starts from a different initialisation (seed = rank): the wrappers' broadcast fixes it.
    ddp_kw = dict(device_ids=[device]) if device.type == "cuda" else {}
    if (args.bucket_mb, args.first_bucket_mb) != (25, 1):  # PyTorch keeps a 1 MiB first bucket only by default
        ddp_kw["bucket_cap_mb"] = args.bucket_mb
    models = {
        "naive": NaiveDDP(build_model(cfg, seed=rank, device=device), mesh),
        f"bucketed ({args.bucket_mb:g} MiB)": BucketedDDP(build_model(cfg, seed=rank, device=device), mesh,
                                                          args.bucket_mb, args.first_bucket_mb),
        "torch DDP": reference_ddp(build_model(cfg, seed=rank, device=device),
                                   process_group=mesh.group("dp"), **ddp_kw),
    }
    opts = {k: torch.optim.AdamW(m.parameters(), lr=args.lr) for k, m in models.items()}
    names = list(models)
    times = {k: [] for k in names}
    overlap = {k: [] for k in names}
    comm = {}
    for step, (x, y) in enumerate(batches):
        # Alternate who goes first, so no variant always runs on a cold (or warm) cache.
        for k in names[step % 3:] + names[:step % 3]:
            m = models[k]
            dist.barrier(group=mesh.group("dp"))
            if step < 2:  # untimed: a warm-up, then a step that counts the collectives (the counter
                with CommCounter() as c:  # slows every op down)
                    train_step(m, opts[k], x, y)
                comm[k] = c
                continue
            if hasattr(m, "timeline"):
                m.timeline.spans.clear()
            sync(device)
            t = time.perf_counter()
            train_step(m, opts[k], x, y)
            sync(device)
            times[k].append(time.perf_counter() - t)
            if hasattr(m, "timeline"):
                overlap[k].append(overlap_fraction(m.timeline.spans))

    # The check: one process, the whole global batch, the same steps (every rank computes it).
    ref = build_model(cfg, seed=0, device=device)
    opt = torch.optim.AdamW(ref.parameters(), lr=args.lr)
    for s in range(n):
        x, y = get_batch(tokens, s, args.batch, args.seq, device=device)
        ref(x, y).backward()
        opt.step()
        opt.zero_grad()
    tol = 1e-4  # fp32: Adam turns rounding in near-zero gradients into ~1e-6 parameter noise
    grad_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    print0(f"{P} rank(s), model {args.model} ({sum(p.numel() for p in ref.parameters()):,} parameters, "
           f"gradient {grad_bytes / MiB:.2f} MiB), global batch {args.batch}x{args.seq}, {args.steps} timed steps")
    print0(f"{'':24s} {'step ms':>9s} {'all-reduces':>11s} {'MiB/step':>9s} {'ring MiB sent':>13s} "
           f"{'overlap':>8s} {'max|dp - 1 proc|':>17s}")
    ok = True
    for k in names:
        m = models[k]
        med = sorted(times[k])[len(times[k]) // 2]
        diff = max_param_diff(m.module, ref)
        ok &= diff < tol
        c = comm[k]
        if c.calls("all_reduce"):
            cols = f"{c.calls('all_reduce'):>11d} {c.bytes('all_reduce') / MiB:>9.2f} " \
                   f"{c.wire_bytes('all_reduce') / MiB:>13.2f}"
        else:  # PyTorch's reducer is C++: its collectives never pass the Python dispatcher
            cols = f"{'(C++)':>11s} {'':>9s} {'':>13s}"
        ov = f"{100 * sum(overlap[k]) / len(overlap[k]):7.0f}%" if overlap[k] else f"{'-':>8s}"
        print0(f"{k:24s} {1e3 * med:9.1f} {cols} {ov} {diff:17.2e}")
    bucketed, torch_ddp = names[1], names[2]
    # Step by step (the two ran back to back on the same batch), then the median: robust to a busy machine.
    ratios = sorted(t / b for t, b in zip(times[torch_ddp], times[bucketed]))
    ratio = ratios[len(ratios) // 2]
    print0(f"bucketed DDP throughput / PyTorch DDP throughput: {ratio:.2f}x   "
           f"(formula: {grad_bytes / MiB:.2f} MiB handed to all-reduce per step, "
           f"ring sends 2(P-1)/P of it = {2 * (P - 1) / P * grad_bytes / MiB:.2f} MiB per rank)")
    print0(f"buckets: {[round(b.nbytes / MiB, 2) for b in models[bucketed].buckets]} MiB, "
           f"in reverse parameter order")
    flag = torch.tensor([float(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    print0("all three match the single-process run" if flag.item() == 1 else f"MISMATCH (tolerance {tol})")
    dist.destroy_process_group()
    return 0 if flag.item() == 1 else 1


if __name__ == "__main__":
    # PyTorch's own DDP: the reference the demo compares with, never part of the strategy above.
    sys.exit(_demo(reference_ddp=nn.parallel.DistributedDataParallel))
