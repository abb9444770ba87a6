"""Measuring instruments: communication, memory and time — what the theory predicts.

CommCounter   counts every collective and point-to-point op a region issues, per rank,
              with its bytes. It is a TorchDispatchMode (the mechanism behind PyTorch's
              CommDebugMode), so it sees `dist.*` calls, functional collectives (DTensor)
              and PyTorch's own FSDP2 alike, in forward and backward. Two byte counts:
                api_bytes   the bytes handed to the op (all-gather: the gathered output;
                            reduce-scatter: the full input; all-reduce: the tensor);
                wire_bytes  a model of what this rank sends over a ring: lesson 0's ring factors (README
                            section "Lesson 0 — ranks", its conventions; `wire_bytes`); recv 0.
model_state_bytes   parameters, gradients and optimizer state held by this rank, by category.
memory_tracker      PyTorch's MemTracker (torch.distributed._tools) around a region: peak by category.
peak_memory_bytes   the CUDA allocator's peak on a GPU.
SavedActivations    which micro-batches still hold saved activations (weak references), and their bytes;
SavedBytes          the bytes autograd (and activation checkpointing) keeps for a region's backward, to the byte
                    and on the meta device too: what the activation tests and the planner count;
HeldBytes           the bytes of every tensor a region made that is still alive, whoever holds it;
idle_share, ascii_timeline   a step's idle share per rank, and its timeline as text, from Timeline spans.
Timeline            named (start, end) spans on this rank, for timelines and overlap.
time_calls, watch_calls   seconds (and host memory) of each call of a method, wrapped from outside.
BuildPeak           the most bytes a region held at once, of the storages it made (building a model).
"""
from __future__ import annotations

import bisect
import gc
import math
import os
import time
import weakref
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass
class CommEvent:
    op: str               # all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, send, recv, ...
    api_bytes: int
    wire_bytes: float
    group_ranks: tuple    # global ranks of the group it ran on


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _group_ranks(pg) -> tuple:
    if isinstance(pg, str):  # functional collectives name their group
        pg = dist.distributed_c10d._resolve_process_group(pg)
    elif isinstance(pg, torch.ScriptObject):
        pg = dist.ProcessGroup.unbox(pg)
    return tuple(dist.get_process_group_ranks(pg))


# op name -> (our name, index of the tensor argument whose bytes count, index of the group argument)
_C10D = {
    "allreduce_": ("all_reduce", 0, 1), "allreduce_coalesced_": ("all_reduce", 0, 1),
    "_allgather_base_": ("all_gather", 0, 2), "allgather_": ("all_gather", 0, 2),
    "allgather_into_tensor_coalesced_": ("all_gather", 0, 2), "allgather_coalesced_": ("all_gather", 0, 2),
    "_reduce_scatter_base_": ("reduce_scatter", 1, 2), "reduce_scatter_": ("reduce_scatter", 1, 2),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, 2),
    "alltoall_base_": ("all_to_all", 1, 2), "alltoall_": ("all_to_all", 1, 2),
    "broadcast_": ("broadcast", 0, 1), "reduce_": ("reduce", 0, 1),
    "gather_": ("gather", 1, 2), "scatter_": ("scatter", 1, 2),
    "send": ("send", 0, 1), "recv_": ("recv", 0, 1), "recv_any_source_": ("recv", 0, 1),
}
# functional collectives: (our name, tensor arg, group-name arg); all_gather's bytes are scaled by P below
_FUNCOL = {
    "all_reduce": ("all_reduce", 0, 2), "all_reduce_coalesced": ("all_reduce", 0, 2),
    "all_gather_into_tensor": ("all_gather", 0, 2), "all_gather_into_tensor_coalesced": ("all_gather", 0, 2),
    "reduce_scatter_tensor": ("reduce_scatter", 0, 3), "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0, 3),
    "all_to_all_single": ("all_to_all", 0, 3), "broadcast": ("broadcast", 0, 2),
}


def wire_bytes(op: str, n_bytes: int, group_size: int) -> float:
    """Bytes one rank sends for an op of n_bytes on a ring of group_size ranks (see module doc)."""
    P = group_size
    if op == "all_reduce":
        return 2 * (P - 1) / P * n_bytes
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (P - 1) / P * n_bytes
    if op == "recv":
        return 0.0
    return float(n_bytes) if P > 1 else 0.0


class CommCounter(TorchDispatchMode):
    """with CommCounter() as c: ...;  c.calls("all_reduce"), c.bytes(), c.wire_bytes(), c.summary()."""

    def __init__(self):
        super().__init__()
        self.events: list[CommEvent] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns, name = func.namespace, func._opname
        if ns == "c10d" and name in _C10D:
            self._record(*_C10D[name], args, functional=False)
        elif ns in ("_c10d_functional", "_c10d_functional_autograd") and name in _FUNCOL:
            self._record(*_FUNCOL[name], args, functional=True)
        return func(*args, **kwargs)

    def _record(self, op, t_idx, g_idx, args, functional):
        ranks = _group_ranks(args[g_idx])
        n = _nbytes(args[t_idx])
        if functional and op == "all_gather":  # the input is one shard: count the gathered size
            n *= len(ranks)
        wire = wire_bytes(op, n, len(ranks))
        if op == "all_to_all":
            in_splits = args[2] if functional else args[4]
            if in_splits:  # uneven: count exactly what leaves this rank
                wire = _all_to_all_sent(args[t_idx], in_splits, ranks)
        self.events.append(CommEvent(op, n, wire, ranks))

    # ---- readings -------------------------------------------------------------------
    def _select(self, op=None, group=None):
        return [e for e in self.events
                if (op is None or e.op == op) and (group is None or e.group_ranks == tuple(group))]

    def calls(self, op: str | None = None, group=None) -> int:
        return len(self._select(op, group))

    def bytes(self, op: str | None = None, group=None) -> int:
        return sum(e.api_bytes for e in self._select(op, group))

    def wire_bytes(self, op: str | None = None, group=None) -> float:
        return sum(e.wire_bytes for e in self._select(op, group))

    def summary(self) -> dict:
        """{op: {"calls", "bytes", "wire_bytes"}}"""
        out = defaultdict(lambda: dict(calls=0, bytes=0, wire_bytes=0.0))
        for e in self.events:
            s = out[e.op]
            s["calls"] += 1
            s["bytes"] += e.api_bytes
            s["wire_bytes"] += e.wire_bytes
        return dict(out)

    def reset(self):
        self.events.clear()


def _all_to_all_sent(inp: torch.Tensor, in_splits, ranks) -> float:
    """Bytes an uneven all-to-all sends to *other* ranks (its own chunk stays home)."""
    me = ranks.index(dist.get_rank())
    row = math.prod(inp.shape[1:]) * inp.element_size()  # bytes of one row (an input may have none)
    return float(sum(s for i, s in enumerate(in_splits) if i != me) * row)


# ---- memory ------------------------------------------------------------------------

def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one flat buffer count once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.is_meta:
            continue
        s = t.untyped_storage()
        if s.data_ptr() in seen or s.nbytes() == 0:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


def model_state_bytes(params, optimizer=None, extra: dict | None = None) -> dict:
    """Bytes of parameters, gradients and optimizer state on this rank, by category.

    params: the tensors this rank holds as parameters (a module's .parameters(), or the
    flat shards a sharded lesson keeps). extra: more named categories, e.g.
    {"master": [fp32 shards]} for mixed precision. Storage-based: views share bytes.
    """
    params = list(params)
    out = {"parameters": _storage_bytes(params),
           "gradients": _storage_bytes(p.grad for p in params if isinstance(p, torch.Tensor))}
    state = []
    if optimizer is not None:
        for s in optimizer.state.values():
            state += [v for v in s.values() if isinstance(v, torch.Tensor)]
    out["optimizer"] = _storage_bytes(state)
    for k, ts in (extra or {}).items():
        out[k] = _storage_bytes(ts)
    out["total"] = sum(out.values())
    return out


@contextmanager
def memory_tracker(*modules_or_optimizers):
    """PyTorch's MemTracker around a region (CPU or CUDA): yields the tracker; afterwards
    `tracker.get_tracker_snapshot("peak")` gives peak bytes by category per device."""
    from torch.distributed._tools.mem_tracker import MemTracker
    mt = MemTracker()
    mt.track_external(*modules_or_optimizers)
    with mt:
        yield mt


def peak_memory_bytes(device) -> int | None:
    """The CUDA allocator's peak since the last reset, or None on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return None


# ---- pipeline: activations held per micro-batch ------------------------------------

class SavedActivations:
    """Which micro-batches still hold activations, measured rather than assumed.

    Tensors autograd saves while `track(key)` is entered (floating point, not parameters) are
    followed by weak references; a key counts as held while any of them is alive — so until autograd
    (or whatever kept them, e.g. a deferred weight gradient) has really let go. Call `sample()`
    whenever the count may have changed; `peak_keys` and `peak_bytes` keep the maxima."""

    def __init__(self, params=()):
        self.param_ptrs = {q.untyped_storage().data_ptr() for q in params}
        self.refs: dict = {}
        self.peak_keys, self.peak_bytes = 0, 0

    def track(self, key):
        refs = self.refs.setdefault(key, [])

        def pack(t):
            if t.is_floating_point() and t.untyped_storage().data_ptr() not in self.param_ptrs:
                refs.append(weakref.ref(t))
            return t
        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def sample(self):
        live = [t for ws in self.refs.values() for t in (w() for w in ws) if t is not None]
        held = sum(any(w() is not None for w in ws) for ws in self.refs.values())
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in live}
        self.peak_keys = max(self.peak_keys, held)
        self.peak_bytes = max(self.peak_bytes, sum(storages.values()))


class HeldBytes(TorchDispatchMode):
    """The bytes a region leaves allocated: every tensor an op makes inside it is followed by a weak
    reference, and `held()` sums the distinct storages still alive (views count once) — after a forward,
    what autograd (or activation checkpointing) keeps for the backward. `exclude`: tensors not to count
    (the region's output, which the next layer keeps). Storages are told apart by identity, not address,
    so it counts tensors on the meta device too (shapes, no memory: what a run would hold). It counts what
    anyone holds — a finished gloo collective's buffer its thread has not let go of yet too, so on gloo ranks
    its reading can vary with the machine's load: byte-exact activation counts use SavedBytes."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                self.made.append(weakref.ref(t))
        return out

    def held(self, exclude=()) -> int:
        """Bytes still allocated of what the region made, but for the storages of `exclude` (its output, the
        parameters and inputs that views made inside point to)."""
        skip = {t.untyped_storage()._cdata for t in exclude}
        live = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in (w() for w in self.made)
                if t is not None}
        return sum(n for ptr, n in live.items() if ptr not in skip)


class _Kept:
    """What autograd keeps in place of a saved tensor while SavedBytes counts: the tensor, detached (the same
    storage and version counter; without its grad_fn, so an op's saved output makes no reference cycle)."""
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


class SavedBytes:
    """The bytes autograd keeps for the backward of a region: `with SavedBytes() as saved: out = f(x)`, then
    `saved.held(exclude=...)` sums the distinct storages (a view, or a tensor two ops save, counts once) of

      1. every tensor autograd saves inside it: ops', autograd.Functions' save_for_backward, non-reentrant
         checkpointing's inputs (torch.autograd.graph.saved_tensors_hooks: its pack hook sees each one);
      2. what selective checkpointing caches: the outputs of the ops its policy keeps. It stores them in its
         own dispatch mode, not through autograd's saving, and inside a checkpoint PyTorch applies only the
         innermost saved-tensor hooks, the checkpoint's own (they keep nothing: backward recomputes). So while
         counting, torch.utils.checkpoint's caching mode is a subclass that hands its cache to the counter.

    still held when `held()` reads them: autograd holds a small object per saved tensor, the counter only a
    weak reference to it, so a part of the graph freed by then does not count. Only what the backward needs
    counts, never a tensor only something else holds — a finished gloo collective's buffer its thread has not
    let go of yet: on a busy machine the same bytes as on an idle one. Storages are told apart by identity, not
    address, and sized by their nbytes, so it counts meta tensors too (shapes, no memory: what a run keeps).
    `exclude`: tensors whose storages do not count — the parameters (model state, not activations), the
    region's input (its producer's activation) and its output (what the next layer keeps).
    Not seen: a tensor an autograd.Function stashes on ctx as an attribute (ctx.x = ...) instead of saving it
    (the lessons' Functions stash groups, shapes and flags; tensor_parallel.VocabParallelCE its 8-byte count
    of targets), and the 5 KB CPU random-number state each checkpointed region keeps to replay its forward."""

    def __init__(self):
        self.kept: list = []    # weak references to the _Kept objects autograd holds
        self.cached: list = []  # weak references to selective checkpointing's cached tensors (after exit)
        self._caches: list = []

    def _pack(self, t):
        k = _Kept(t.detach())
        self.kept.append(weakref.ref(k))
        return k

    def __enter__(self):
        import torch.utils.checkpoint as ckpt
        caching, caches = ckpt._CachingTorchDispatchMode, self._caches

        class Counted(caching):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                caches.append(self.storage)   # {op key: {call index: its output (wrapped) or a marker}}

        self._restore = (ckpt, caching)
        ckpt._CachingTorchDispatchMode = Counted
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda k: k.t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        ckpt, caching = self._restore
        ckpt._CachingTorchDispatchMode = caching
        from torch.utils._pytree import tree_leaves
        for storage in self._caches:   # follow the cached tensors, not the caches (no reference kept)
            for entry in (e for per_op in storage.values() for e in per_op.values()):
                for leaf in tree_leaves(entry):
                    if isinstance(getattr(leaf, "val", None), torch.Tensor):   # a _VersionWrapper
                        self.cached.append(weakref.ref(leaf.val))
        self._caches = []
        return False

    def tensors(self) -> list:
        """The saved and cached tensors still held."""
        kept = [k.t for k in (w() for w in self.kept) if k is not None]
        return kept + [t for t in (w() for w in self.cached) if t is not None]

    def held(self, exclude=()) -> int:
        """Bytes of the distinct storages autograd (and checkpointing) still keeps, but for those of `exclude`."""
        gc.collect()   # a part of the graph only a reference cycle kept: gone, whenever the collector last ran
        skip = {t.untyped_storage()._cdata for t in exclude}
        live = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in self.tensors()}
        return sum(n for key, n in live.items() if key not in skip)


def idle_share(spans_per_rank, busy=("F", "B", "W")) -> tuple[list[float], float]:
    """Each rank's idle share of a step from its Timeline spans (one list per rank, one time origin):
    1 - (time in spans named in `busy`) / (the common origin to the last end). Returns it and that step time."""
    total = max(s["end"] for spans in spans_per_rank for s in spans)
    return [1 - sum(s["end"] - s["start"] for s in sp if s["name"] in busy) / total for sp in spans_per_rank], total


def ascii_timeline(spans_per_rank, busy=("F", "B", "W"), width: int = 72) -> str:
    """One text row per rank: the first letter of each busy span's name where it ran, '.' elsewhere."""
    total, rows = max(s["end"] for spans in spans_per_rank for s in spans), []
    for r, spans in enumerate(spans_per_rank):
        row = ["."] * width
        for s in (s for s in spans if s["name"] in busy):
            a = min(int(s["start"] / total * width), width - 1)
            for c in range(a, max(int(s["end"] / total * width), a + 1)):
                row[min(c, width - 1)] = s["name"][0]
        rows.append(f"  rank {r}  " + "".join(row))
    return "\n".join(rows)


# ---- data parallel (ddp.py): when backward computed and when each collective ran -----------

# C++ type names the profiler gives for a collective's input -> bytes per element
_ELEMENT_BYTES = {"double": 8, "long int": 8, "float": 4, "int": 4, "c10::BFloat16": 2, "c10::Half": 2,
                  "short int": 2, "unsigned char": 1, "signed char": 1, "bool": 1}
# NCCL kernel names (on a GPU) -> our op names
_NCCL_KERNELS = {"AllReduce": "all_reduce", "AllGather": "all_gather", "ReduceScatter": "reduce_scatter",
                 "Broadcast": "broadcast", "SendRecv": "send_recv"}


class ProfileSpans:
    """What a region computed and communicated, and when, read afterwards from torch.profiler — so
    nothing in the code being measured records anything.

        with ProfileSpans() as prof:  loss.backward()
        prof.spans   [dict(name, start, end, bytes)], sorted by start; seconds on the host's clock
                     (ranks of one machine share it)

    name="backward" (`compute`): from the first to the last autograd function the region ran (on CPU
    the engine's evaluate_function events; on CUDA the first to the last non-NCCL kernel, so profile
    the backward alone there). One span per collective, named like CommCounter's ops ("all_reduce"):
    on gloo its "gloo:all_reduce" event, from the moment a gloo worker thread starts it until it
    completes — so it includes waiting for a slower peer; on NCCL its kernel. bytes: the tensor
    handed to it (None for a kernel).
        prof.issued  [dict(name, at, done)]: each collective as the calling thread launched it ("c10d::…"),
                     with how many of the region's autograd functions had begun by then, and their total
                     (CPU): how far into backward it was issued, counted in work rather than time, so a busy
                     machine's late-running gloo thread does not change it
    """

    def __init__(self, compute: str = "backward"):
        self.compute, self.spans, self.issued = compute, [], []

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # else kineto prints two lines per region on stderr
        self._cuda = torch.cuda.is_available()
        self._prof = profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * self._cuda,
                             record_shapes=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        self._prof.__exit__(*exc)
        from torch.autograd import DeviceType
        compute, issued = [], []
        for e in self._prof.profiler.kineto_results.events():
            name, start, end = e.name(), e.start_ns() / 1e9, (e.start_ns() + e.duration_ns()) / 1e9
            if name.startswith("c10d::") and name[len("c10d::"):] in _C10D:
                issued.append((_C10D[name[len("c10d::"):]][0], start))
            if e.device_type() == DeviceType.CUDA:
                op = next((v for k, v in _NCCL_KERNELS.items() if k in name), None) if "nccl" in name else None
                if op:
                    self.spans.append(dict(name=op, start=start, end=end, bytes=None))
                else:
                    compute.append((start, end))
            elif name.startswith("gloo:"):
                shape, dtype = (e.shapes() or [[]])[0], (e.dtypes() or ["?"])[0]
                size = _ELEMENT_BYTES.get(dtype)
                self.spans.append(dict(name=name[len("gloo:"):], start=start, end=end,
                                       bytes=None if size is None else math.prod(shape) * size))
            elif name.startswith("autograd::engine::evaluate_function") and not self._cuda:
                compute.append((start, end))
        if compute:
            self.spans.append(dict(name=self.compute, start=min(s for s, _ in compute),
                                   end=max(e for _, e in compute), bytes=None))
        self.spans.sort(key=lambda s: s["start"])
        begun = sorted(s for s, _ in compute)
        self.issued = [dict(name=n, at=t, done=bisect.bisect_left(begun, t), of=len(begun)) for n, t in sorted(
            issued, key=lambda i: i[1])]
        return False


def overlap_fraction(spans, comm: str = "all_reduce", compute: str = "backward") -> float:
    """Share of the time spent in `comm` spans (their union) that lay inside `compute` spans."""
    def union(intervals):
        out = []
        for s, e in sorted(intervals):
            if out and s <= out[-1][1]:
                out[-1][1] = max(out[-1][1], e)
            else:
                out.append([s, e])
        return out
    busy = union([(s["start"], s["end"]) for s in spans if s["name"] == comm])
    work = union([(s["start"], s["end"]) for s in spans if s["name"] == compute])
    total = sum(e - s for s, e in busy)
    inside = sum(max(0.0, min(e, we) - max(s, ws)) for s, e in busy for ws, we in work)
    return inside / total if total > 0 else 0.0


# ---- context parallel (ring_attention.py): time spent inside one function ------------------

@contextmanager
def time_calls(owner, name: str):
    """Seconds spent in each call of `owner.name` (a class's method, a module's function) inside the
    region, measured by wrapping it from outside, so the code measured records nothing. Yields the
    list each call's duration is appended to; the original is put back on exit.

        with time_calls(RingPass, "wait") as waits:  attn(q, k, v)   # sum(waits): time blocked"""
    inner, spent = getattr(owner, name), []

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - t0)
    setattr(owner, name, timed)
    try:
        yield spent
    finally:
        setattr(owner, name, inner)


# ---- host memory of one call (checkpoints: what a rank holds while it saves or loads) ------------------

def host_bytes() -> int:
    """The host memory this process holds now: its anonymous resident memory (Linux's RssAnon) — what it
    allocated, not the file pages a memory-mapped read brings in, which the kernel may drop at any time.
    Elsewhere: the process's peak resident size so far."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))
    except (OSError, StopIteration):
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def resident_high_water() -> tuple | None:
    """Linux: reset the kernel's high-water mark of this process's resident size (VmHWM) to what it holds
    now, and return a function giving the growth since, in bytes — a peak no sampling can miss on a busy
    machine (it counts mapped file pages too). None where /proc does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        now = _status_kib("VmRSS")
    except (OSError, StopIteration):
        return None
    return lambda: (_status_kib("VmHWM") - now) * 1024


@contextmanager
def watch_calls(owner, name: str, every: float = 0.001, memory: bool = True):
    """Each call of `owner.name` inside the region, measured by wrapping it from outside: yields the list
    each call appends dict(seconds, rss_before, rss_peak, rss_growth, result) to — host_bytes() before the
    call, and its peak sampled every `every` seconds by a thread while the call runs (the peak of THIS call);
    rss_growth: the kernel's high-water mark of the resident size over the call, above its start (None where
    not available: resident_high_water). memory=False: seconds and result only."""
    import threading
    inner, calls = getattr(owner, name), []

    def watched(*args, **kwargs):
        if not memory:
            t0 = time.perf_counter()
            result = inner(*args, **kwargs)
            calls.append(dict(seconds=time.perf_counter() - t0, result=result))
            return result
        before, peak, done = host_bytes(), [0], threading.Event()
        growth = resident_high_water()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], host_bytes())
                done.wait(every)
        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        t0 = time.perf_counter()
        try:
            result = inner(*args, **kwargs)
        finally:
            seconds = time.perf_counter() - t0
            done.set()
            thread.join()
        calls.append(dict(seconds=seconds, rss_before=before, rss_peak=max(peak[0], host_bytes()),
                          rss_growth=growth() if growth else None, result=result))
        return result
    setattr(owner, name, watched)
    try:
        yield calls
    finally:
        setattr(owner, name, inner)


# ---- time ----------------------------------------------------------------------------

def sync(device=None):
    """Wait for queued GPU work, so a wall-clock reading means what it says."""
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize(device)


class Timeline:
    """Named spans (name, start, end) in seconds since the timeline began, on this rank."""

    def __init__(self, device=None):
        self.device, self.t0, self.spans = device, time.perf_counter(), []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    @contextmanager
    def span(self, name: str, **info):
        sync(self.device)
        start = self.now()
        yield
        sync(self.device)
        self.spans.append(dict(name=name, start=start, end=self.now(), **info))

    def add(self, name: str, start: float, end: float, **info):
        self.spans.append(dict(name=name, start=start, end=end, **info))


def time_steps(step_fn, n_steps: int, warmup: int = 1, device=None) -> float:
    """Median seconds per call of step_fn() after `warmup` calls."""
    for _ in range(warmup):
        step_fn()
    times = []
    for _ in range(n_steps):
        sync(device)
        t = time.perf_counter()
        step_fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def time_side_by_side(steps: dict, rounds: int = 3, per_round: int = 2, group=None, device=None) -> dict:
    """{name: median seconds per call} of several step functions timed in ALTERNATING rounds (the
    order rotates each round), so a drift in the machine's load hits every contender alike; the
    ranks of `group` start each timing together. Ratios of these medians are what demos report."""
    import statistics
    names, times = list(steps), {k: [] for k in steps}
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            if dist.is_initialized():
                dist.barrier(group=group)
            times[k].append(time_steps(steps[k], per_round, warmup=1 if r == 0 else 0, device=device))
    return {k: statistics.median(v) for k, v in times.items()}


# ---- memory while a model is built -----------------------------------------------------------------

class BuildPeak(TorchDispatchMode):
    """The most bytes held at once by the storages a region makes (every op's outputs, told apart by storage
    identity: views count once; each storage at its size then, so a buffer ZeRO-3 frees with resize_(0) stops
    counting), and what is still held at the end — building a sharded model: the whole model materialised on
    every rank first shows as a peak far above what the rank keeps. `meta`: count meta-device storages too (a
    plan's, which stand for real memory); by default they are shapes only and count nothing. Checked after
    every op: for building models, not for training steps."""

    def __init__(self, meta: bool = False):
        super().__init__()
        self.meta, self.live, self.peak = meta, {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor) and (self.meta or not t.is_meta):
                s = t.untyped_storage()  # (one Python object per storage while it lives: a weak reference
                self.live.setdefault(s._cdata, weakref.ref(s))  # to it dies with the storage)
        self.peak = max(self.peak, self.held())
        return out

    def held(self) -> int:
        """Bytes of the storages made so far that are alive now."""
        alive = [(k, w()) for k, w in self.live.items()]
        self.live = {k: w for k, w in self.live.items() if w() is not None}
        return sum(s.nbytes() for _, s in alive if s is not None)
