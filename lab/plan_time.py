"""The time planner: of the layouts that fit, which is fastest, and why? (train.py --plan --device, --search)

One step's time on one rank, from what the real code path does (the same fake process group and meta device
as lab/plan.py), at a device's rates (lab/devices.py), with the mechanisms a GPU run adds to the course's code
(lab/frameworks.py: MECHANISMS, and the frameworks' bundles that set them). step_time times each pipeline stage
with stage_time, which adds one function per mechanism, each naming its source:

    compute      compute_time: the FLOPs the real step performs on this rank — PyTorch's FLOP formulas over one
                 micro-batch's forward and backward of the real model on meta tensors (probe), checkpointing's
                 recompute included, causal attention at half — at kernel_rates (matmuls at the peak × the
                 measured efficiency, fused attention's forward and backward kernels at theirs); the bytes of the
                 operations without FLOPs (elementwise, norms, copies) at bandwidth() (compiled: each run of them
                 one kernel); every launch's host cost (a GPU launches ahead: the longer of the two). Within it:
                 recomputed_linears, fused_ring_attention, unfused_attention, float8_casts
    tp, cp       layer_collectives: the bytes the same run hands to each collective (instruments.CommCounter) at
                 collective_time — α per step + wire bytes/β (instruments.wire_bytes) on the link the group
                 crosses, from where its ranks sit (ranks_per_node: tp fastest, then cp, dp_shard, dp_replicate,
                 pp); tp_gradient_sums: tp's partial gradients summed unit by unit
    ep           expert_collectives: the experts' all-to-alls (_moe: their FLOPs and bytes for uniform routing,
                 which meta tensors cannot route)
    pp           pipeline_boundary: each micro-batch's boundary, each way; the bubble: pipeline_total
                 (pipeline.simulate of the schedule itself, by closed form where one holds)
    dp           dp_collectives: the lessons' formulas (fsdp_demo.zero_comm_formula), one call per ZeRO unit
                 (ZeRO-3: per micro-batch, forward and backward) or DDP bucket; dp_exposed: what no compute hides
    overlap      hide_behind_windows and dp_exposed, by Assumptions.overlap (ZeRO-3's prefetched gathers behind the
                 step's compute, DDP's buckets behind the last backward, tp behind the phase's matmuls, cp's ring
                 behind the attention); each second hidden costs overlap_price (the compute beside it slower)
    the step     clip_all_reduce (the clip's norm over every rank); collective_checks (lesson 0's mesh.agree before
                 each of fsdp.py's collectives); optimizer_time (AdamW and the clip's arithmetic, per element of the
                 local shard and per tensor piece)
    frameworks'  fsdp2_copies (torchtitan's FSDP2), fsdp1_copies (PyTorch's FSDP1, llm-foundry's), fp32_accumulation
    extras       (DeepSpeed's)

A probe runs ONE block and the head (a model of one layer, one sequence) per distinct (tp, cp, sp, cp method,
checkpointing, sequence): the block's FLOPs and collective bytes scale with its layers and the micro-batch's
sequences, so the search runs one small meta step per probe, not one per layout. Every assumption the model
makes is a field of Assumptions; every rate a field of Device.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import itertools
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass, field, replace
from functools import lru_cache

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper

import pipeline
import train
from lab.devices import (ATTENTION_KERNELS, DEVICES, NCCL_BASE_LATENCY, NCCL_LL_CROSSING, NCCL_NET_LATENCY,
                         NCCL_NVLINK_LATENCY, NCCL_NVLS_EFFICIENCY, NCCL_PROTOCOLS, NCCL_RING_BANDWIDTH,
                         NCCL_RING_PLATEAU, NCCL_TREE_BANDWIDTH, NCCL_TREE_CORRECTION, Device)
from lab.frameworks import (ALIBI_SCORE_BYTES, FP32_ACCUMULATE_BYTES, FRAMEWORKS, MECHANISMS, TORCH_CP_STEP_BYTES,
                            UNFUSED_SCORE_BYTES)
from lab.fsdp_demo import zero_comm_formula, zero_state_formula
from lab.instruments import CommCounter, wire_bytes
from lab.pipeline_demo import held_formula
from lab.published_runs import FURTHER, PUBLISHED, PUBLISHED_MODELS, TARGET_BAND, Published
from mesh import DIMS


# ---- the assumptions: everything a reader may change (the devices' rates: lab/devices.py) ------------------

@dataclass(frozen=True)
class Assumptions:
    """Every assumption of the time model, in one place.
    efficiency  None: matmuls and attention at the device's measured efficiencies (Device.matmul_efficiency,
                attention_efficiency); a number: that share of the peak for both
    overlap     per strategy, the share of its window of compute that hides the collective: 1 fully behind
                it (what is longer than the window is exposed), 0 exposed. zero3: gathers prefetched behind
                the step's compute, its reduce-scatter behind a single backward — both on one group, so
                their sum behind the step's compute; ddp: buckets behind the last
                backward; zero2: the reduce-scatter behind a single backward; tp: behind the phase's matmuls
                (async TP, tp-comm-overlap; the first of its tp pieces cannot hide); cp: the ring's sends behind
                its attention (ring_attention.RingPass starts the next block's before computing); pp (the
                sends), replicas (HSDP's all-reduce after the reduce-scatter), step (ZeRO-1/2's gathers and
                reductions at the step) exposed unless measured otherwise.
    weight_grad_share  zero bubble splits a backward into B (input gradient) and W (weight gradient): W's share
    optimizer_bytes    bytes AdamW moves per element of its shard (read p, g, m, v; write p, m, v in fp32: 28)
    inter_beta, intra_beta: None, or a value that replaces the device's
    verify_top  the search runs the full meta plan (lab/plan.py) on its best layouts to confirm they fit
                (each builds every pipeline stage on meta: seconds apiece, so 1 by default)
    tp_cp_span  the search keeps tp·cp within this many ranks (None: a node's): their collectives run every
                layer, on the critical path — across nodes they lose to any layout that keeps them inside
    The mechanisms a GPU run adds to what the course's code does (MECHANISMS says what each changes, its
    source, its default; FRAMEWORKS sets them as torchtitan and Megatron run):
    framework   the bundle applied first (FRAMEWORKS): course, torchtitan, megatron2021, megatron
    attention   code: as the course's code runs (SDPA's fused kernel; ring attention's blocks by hand, fp32
                score blocks in memory); fused: a fused kernel (flash) per ring step too; unfused: scores in
                memory for every attention (QKᵀ, softmax, dropout, ·V as separate kernels: Megatron-LM 2021)
    compile     None: as --compile says; 1: fused elementwise work (each run of memory-bound operations between
                matmuls one kernel); 0: eager
    float8      None: as --float8 says; 1: the blocks' linears at the device's float8 rate, plus their casts
    selective_every  under selective checkpointing, every k-th matmul of a block is recomputed, not kept (0: none,
                the course's policy; 2: torchtitan's per-op policy)
    pp_scatter  1: a pipeline boundary crosses nodes as 1/tp of it per tp rank, all-gathered inside the node
                (Megatron's scatter/gather, Narayanan et al. 2021 §4.1)
    recompute_whole  1: full checkpointing reruns a block's whole forward, its last linear too (a reentrant
                checkpoint: Megatron-LM's CheckpointFunction); 0: PyTorch's non-reentrant checkpoint (the course's,
                torchtitan's) stops once the backward's saved tensors are made, before the last linear
    fsdp2_copies  1: ZeRO-3 as FSDP2 runs it, copying around each collective: the shard cast into the gather's
                input (copy-in), the gathered buffer split into each parameter (copy-out), the gradients cast to
                the reduce dtype into the reduce-scatter's input (chunk_cat); 0: the course's flat parameter, whose
                tensors are views of the gathered buffer
    torch_cp    1: under attention=fused, context parallel as torch's context_parallel runs it around each ring
                step's flash kernel (TORCH_CP_STEP_BYTES: the merges in fp32, the K/V and gradient concatenations);
                0: a fused ring's own merges (12 bytes a query element a step forward, 24 backward)
    attention_kernel  the fused attention kernel: fa2 (FlashAttention-2, SDPA's flash backend), fa3
                (FlashAttention-3: Hopper), fa1 (FlashAttention, and the 2022 Triton port of it llm-foundry runs),
                triton (the Triton tutorial's), sdpa_math (unfused, in one call): ATTENTION_KERNELS' rates
    fsdp1       1: ZeRO-2 and ZeRO-3 as PyTorch's FSDP1 runs them with every micro-batch synchronised (llm-foundry
                through Composer): each unit gathered in the next forward, prefetched behind the compute, and its
                gradients reduce-scattered in each micro-batch's backward (fsdp1_exposed)
    fsdp1_copies  1: FSDP1's memory-bound work around its collectives under mixed precision (fsdp1_copies): the shard
                cast before each gather, the flat gradient concatenated, cast to the reduce dtype and divided before
                each reduce-scatter
    fp32_accumulation  1: each micro-batch's bf16 gradients added into fp32 buffers after its backward
                (DeepSpeed's BF16_Optimizer under its pipeline engine: FP32_ACCUMULATE_BYTES a parameter)"""
    efficiency: float | None = None
    overlap: dict = field(default_factory=lambda: dict(zero3=1.0, ddp=1.0, zero2=1.0, tp=0.0, tp_b=0.0, cp=1.0,
                                                       pp=0.0, replicas=0.0, step=0.0))
    weight_grad_share: float = 0.5
    optimizer_bytes: int = 28
    inter_beta: float | None = None
    intra_beta: float | None = None
    verify_top: int = 1
    tp_cp_span: int | None = None
    framework: str = "course"
    attention: str = "code"
    compile: float | None = None
    float8: float | None = None
    selective_every: int = 0
    pp_scatter: float = 0.0
    recompute_whole: float = 0.0
    fsdp2_copies: float = 0.0
    torch_cp: float = 0.0
    hbm_efficiency: float | None = None
    overlap_slowdown: float | None = None
    attention_kernel: str = "fa2"
    fsdp1: float = 0.0
    fsdp1_copies: float = 0.0
    fp32_accumulation: float = 0.0


_TEXT = ("framework", "attention", "attention_kernel")
_CHOICES = dict(framework=tuple(FRAMEWORKS), attention=("code", "fused", "unfused"),
                attention_kernel=tuple(ATTENTION_KERNELS))


def assumptions(pairs: list[str] = ()) -> Assumptions:
    """Assumptions with fields replaced by train.py's --assume KEY=VALUE (repeatable): a field's name
    (efficiency=0.3, inter_beta=12.5e9, verify_top=3; none for a field that may be None), one overlap
    share (overlap.tp=0.5), or a framework's bundle (framework=torchtitan: FRAMEWORKS, applied before the other
    pairs, which override it). Raises one ValueError naming the known keys."""
    import dataclasses
    base = Assumptions()
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(Assumptions)}
    known = [k for k in fields if k != "overlap"] + [f"overlap.{k}" for k in base.overlap]
    split = []
    for pair in pairs:
        key, _, value = pair.partition("=")
        key = key.strip()
        if key not in known or not value:
            raise ValueError(f"--assume {pair!r}: give KEY=VALUE with KEY one of {', '.join(known)}")
        if key in _CHOICES and value not in _CHOICES[key]:
            raise ValueError(f"--assume {pair!r}: {key} is one of {', '.join(_CHOICES[key])}")
        split.append((key, value))
    bundle = dict(FRAMEWORKS[next((v for k, v in split if k == "framework"), "course")])
    overlap = {**base.overlap, **bundle.pop("overlap", {})}
    changes = bundle
    for key, value in split:
        try:
            if key.startswith("overlap."):
                overlap[key.split(".", 1)[1]] = float(value)
            elif key in _TEXT:
                changes[key] = value
            elif value.lower() == "none" and key in ("inter_beta", "intra_beta", "tp_cp_span", "efficiency",
                                                     "compile", "float8", "hbm_efficiency", "overlap_slowdown"):
                changes[key] = None
            else:
                changes[key] = int(float(value)) if key in ("optimizer_bytes", "verify_top", "tp_cp_span",
                                                            "selective_every") else float(value)
        except ValueError:
            raise ValueError(f"--assume {key}={value!r}: {value!r} is not a number") from None
    return replace(base, overlap=overlap, **changes)


def assumed(assume: Assumptions) -> str:
    """The fields that differ from the defaults, for the output's first lines."""
    base = Assumptions()
    diff = [f"{k}={v}" for k, v in vars(assume).items() if k != "overlap" and v != getattr(base, k)]
    diff += [f"overlap.{k}={v}" for k, v in assume.overlap.items() if v != base.overlap.get(k)]
    return ", ".join(diff) or "the defaults"


def device_named(name: str, assume: Assumptions = Assumptions()) -> Device:
    if name not in DEVICES:
        raise ValueError(f"unknown --device {name!r}: choose one of {sorted(DEVICES)}")
    d = DEVICES[name]
    return replace(d, inter_beta=assume.inter_beta or d.inter_beta, intra_beta=assume.intra_beta or d.intra_beta)


# ---- the probe: one block and the head, run on the meta device --------------------------------------------

def _sdpa_cpu_flops(q, k, v, *a, out_shape=None, **kw):     # FlopCounterMode knows the GPU kernels, not the CPU one
    return sdpa_flop_count(q, k, v)


def _sdpa_cpu_backward_flops(g, q, k, v, *a, out_shape=None, **kw):
    return sdpa_backward_flop_count(g, q, k, v)


@lru_cache(maxsize=None)
def _flop_formulas() -> dict:
    """{op: its FLOPs(*args, out_val=out)}: PyTorch's formulas (torch.utils.flop_counter's registry, those
    FlopCounterMode applies) and the CPU attention kernel's, which it lacks. Attention's are halved where the
    call is causal (_causal_half)."""
    aten = torch.ops.aten
    formulas = {**flop_registry, aten._scaled_dot_product_flash_attention_for_cpu: shape_wrapper(_sdpa_cpu_flops),
                aten._scaled_dot_product_flash_attention_for_cpu_backward: shape_wrapper(_sdpa_cpu_backward_flops)}
    return {op: _causal_half(op, f) if "scaled_dot_product" in op.__name__ else f for op, f in formulas.items()}


def _causal_half(op, formula):
    """A fused attention kernel called with is_causal=True computes the blocks on and below the diagonal only:
    half of the S×S products PyTorch's formula counts (it ignores is_causal: 'we aren't accounting for causal
    attention'), forward and backward. The flag is read from the op's schema (each kernel has it elsewhere)."""
    names = [a.name for a in op.default._schema.arguments] if hasattr(op, "default") else []
    where = names.index("is_causal") if "is_causal" in names else None
    if where is None:
        return formula

    def counted(*args, **kwargs):
        causal = kwargs.get("is_causal", args[where] if len(args) > where else False)
        return formula(*args, **kwargs) // (2 if causal else 1)
    return counted


# what a probe counts in each phase (forward f, backward b): every key below, per phase ("ops_f", "mem_b", ...)
COUNTS = ("flops", "mm", "mm32", "attn", "attn_bwd", "ops", "mem", "kernels", "fused", "core", "core_ops", "core_mem")
PHASES = tuple(f"{k}_{p}" for k in COUNTS for p in "fb")


class _OpCount(TorchDispatchMode):
    """What a region dispatches: its FLOPs (PyTorch's formulas, _flop_formulas — FlopCounterMode's sums without
    its per-module tracking, which took most of a probe's time); its operations, each costing
    Device.op_overhead beyond its FLOPs (a launch, Python); and the bytes the ones without FLOPs (elementwise,
    norms, copies: memory-bound) read and write, at the device's memory bandwidth. Views move nothing.
    Beside them, for the mechanisms a GPU run adds (Assumptions):
      mm, mm32    matmul FLOPs (the linears, in the compute dtype; mm32: in fp32, e.g. ring attention's blocks)
      attn        FLOPs of fused attention kernels (SDPA); attn_bwd: those of its backward kernels
      kernels, fused   compile: each run of memory-bound operations between two others (a matmul, attention,
                  a collective) becomes one kernel (torch.compile's inductor fuses them), which reads the
                  tensors that enter the run once and writes those that leave it (consumed after the run, or
                  kept) — intermediates stay on chip; `kernels` counts those and the others, `fused` their bytes
      core, core_ops, core_mem   inside `attention_core` (set by the probe around ring attention's autograd
                  function, forward and backward): FLOPs, operations and bytes a fused kernel would replace"""

    attention_core = False      # set while the probe runs inside an attention core (_core)

    def __enter__(self):
        self.n = self.bytes = self.flops = self.mm = self.mm32 = self.attn = self.attn_bwd = 0
        self.core = self.core_ops = self.core_mem = 0
        self.kernels, self.run, self.kernel_run, self.read = 0, 0, -1, 0
        self.seen = set()
        # a tensor's serial number (set on it when first seen: never reused, unlike id(), and no reference held —
        # a held reference would change what the code does: autograd steals a gradient no one else holds, and
        # copies one that is held) -> [the run that made it, its bytes, consumed outside that run, consumed]
        self.made = {}
        self.base = {}      # serial of a view -> serial of its base
        return super().__enter__()

    def __exit__(self, *exc):
        self.fused = self.read + sum(m[1] for m in self.made.values() if m[2] or not m[3])
        self.made, self.base, self.seen = {}, {}, set()
        return super().__exit__(*exc)

    def _core(self) -> bool:
        if _OpCount.attention_core:
            return True
        node = torch._C._current_autograd_node()
        return node is not None and type(node).__name__.startswith(_CORE_NODES)

    def _key(self, t) -> int:
        serial = getattr(t, "_op_count_serial", None)
        if serial is None:
            serial = next(_SERIALS)
            t._op_count_serial = serial
        return self.base.get(serial, serial)

    def _made(self, t):
        return self.made.get(self._key(t))

    def _boundary(self, tensors_in):
        """A matmul, attention, a collective or a core operation: its own kernel; what it reads leaves its run."""
        for t in tensors_in:
            made = self._made(t)
            if made is not None:
                made[2] = made[3] = True
        self.run += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = _flop_formulas().get(func.overloadpacket)
        flops = formula(*args, **kwargs, out_val=out) if formula is not None else 0
        memory_bound = func.overloadpacket not in flop_registry and not func.is_view and func.namespace == "aten"
        tensors_in = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        tensors_out = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        nbytes = sum(t.numel() * t.element_size() for t in tensors_in + tensors_out) if memory_bound else 0
        if func.is_view and tensors_in:
            for t in tensors_out:
                self.base[self._key(t)] = self._key(tensors_in[0])
        if self._core():
            self.core_ops, self.core, self.core_mem = self.core_ops + 1, self.core + flops, self.core_mem + nbytes
            self._boundary(tensors_in)
            return out
        self.n, self.flops, self.bytes = self.n + 1, self.flops + flops, self.bytes + nbytes
        if "scaled_dot_product" in func.__name__:
            self.attn += flops
            self.attn_bwd += flops if "backward" in func.__name__ else 0
        elif flops and any(t.dtype in (torch.float32, torch.float64) for t in tensors_in):
            self.mm32 += flops
        else:
            self.mm += flops
        if func.is_view:
            return out
        if not memory_bound:
            self.kernels += 1
            self._boundary(tensors_in)
            return out
        if self.kernel_run != self.run:             # the first memory-bound operation of a run: one fused kernel
            self.kernels, self.kernel_run = self.kernels + 1, self.run
        for t in tensors_in:
            made = self._made(t)
            if made is not None and made[0] == self.run:
                made[3] = True                      # made and consumed in this run: stays on chip
                continue
            if made is not None:
                made[2] = made[3] = True
            key = (self.run, self._key(t))
            if key not in self.seen:                # entering the run: read once
                self.seen.add(key)
                self.read += t.numel() * t.element_size()
        for t in tensors_out:
            self.made[self._key(t)] = [self.run, t.numel() * t.element_size(), False, False]
        return out


_CORE_NODES = ("RingAttentionBackward",)
_SERIALS = itertools.count(1)   # _OpCount's serial numbers of tensors   # the autograd node whose backward is an attention core


def _dim_of(ranks: tuple, mesh) -> str:
    for d in ("tp", "cp", "pp"):
        if tuple(mesh.ranks(d)) == tuple(ranks):
            return d
    return "world"


def probe(model, experts: int, top_k: int, dtype: str, seq_len: int, tp: int, cp: int, sp: bool,
          cp_method: str, cp_ulysses: int, checkpointing: str) -> dict:
    """One sequence through the real model of `model` (a ModelConfig: the shape the run trains, from --model or
    from --init-from's config.json; or a registered name) cut to one layer, and to two, on a fake group of tp·cp
    ranks (meta tensors), forward then backward, under FlopCounterMode and CommCounter. Their difference is one
    block; the one-layer run less a block is the rest (the embedding, final norm, head and loss — checkpointing
    wraps blocks only, so the rest is measured once without it):
    {"block"|"rest": {"f"|"b": flops}, "comm": {("f"|"b", "block"|"rest", dim, op): (calls, API bytes)}}.
    A pipeline's layer split and the micro-batch's sequences scale these."""
    return _probe(_probe_shape(model), experts, top_k, dtype, seq_len, tp, cp, sp, cp_method, cp_ulysses,
                  checkpointing)


def _probe_shape(model):
    """The shape a probe runs: the model's config, one layer (the probe cuts it to one and two), its name gone —
    so --model, a directory's config.json and any depth of the same widths share one probe."""
    from lab.model import get_config
    cfg = get_config(model) if isinstance(model, str) else model
    return replace(cfg, n_layers=1)


@lru_cache(maxsize=None)
def _probe(model, experts, top_k, dtype, seq_len, tp, cp, sp, cp_method, cp_ulysses, checkpointing) -> dict:
    key = (model, experts, top_k, dtype, seq_len, tp, cp, sp, cp_method, cp_ulysses)
    rest = _rest(*key)
    one = _run_probe(*key, checkpointing, 1)
    flops = dict(block={p: one["flops"][p] - rest["flops"][p] for p in PHASES}, rest=rest["flops"])
    comm = {k: v for k, v in rest["comm"].items()}
    for (phase, dim, op), (calls, n) in one["comm"].items():
        c, b = rest["comm"].get((phase, "rest", dim, op), (0, 0))
        if calls - c or n - b:
            comm[(phase, "block", dim, op)] = (calls - c, n - b)
    return dict(flops, comm=comm)


@lru_cache(maxsize=None)
def _rest(*key) -> dict:
    one, two = (_run_probe(*key, "none", layers) for layers in (1, 2))
    comm = {}
    for k in set(one["comm"]) | set(two["comm"]):
        (c1, n1), (c2, n2) = one["comm"].get(k, (0, 0)), two["comm"].get(k, (0, 0))
        if 2 * c1 - c2 or 2 * n1 - n2:
            comm[(k[0], "rest", *k[1:])] = (2 * c1 - c2, 2 * n1 - n2)
    return dict(flops={p: 2 * one["flops"][p] - two["flops"][p] for p in PHASES}, comm=comm)


@lru_cache(maxsize=None)
def _code_digest() -> str:
    """What a probe's result depends on: the course's code (every .py at the root and in lab/)."""
    root = os.path.dirname(os.path.abspath(train.__file__))
    h = hashlib.sha256(torch.__version__.encode())
    for path in sorted(glob.glob(os.path.join(root, "*.py")) + glob.glob(os.path.join(root, "lab", "*.py"))):
        with open(path, "rb") as f:
            h.update(os.path.basename(path).encode() + f.read())
    return h.hexdigest()[:16]


def cache_dir() -> str | None:
    """Where probes are kept between runs: $PLAN_TIME_CACHE, else ~/.cache/plan_time; "off": nowhere. A file
    is named by its probe and by the digest of the code, so a change to the code is never read stale."""
    d = os.environ.get("PLAN_TIME_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "plan_time"))
    return None if d == "off" else d


def _cache_file(name: str) -> str | None:
    """cache_dir()'s file for `name` under this code's digest (None: no cache)."""
    d = cache_dir()
    return d and os.path.join(d, f"{name}-{_code_digest()}.json")


def _write_json(path: str, obj) -> None:
    """Written whole or not at all, by any number of processes at once (two searches starting together): each
    writes its own temporary file and renames it into place — a reader never sees half a file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=os.path.basename(path), suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@lru_cache(maxsize=None)   # probe's one-layer run without checkpointing is _rest's: run once
def _run_probe(*key) -> dict:
    """_probe_run, kept on disk (cache_dir): a search's probes are most of its time, the same every run."""
    path = _cache_file("probe-" + hashlib.sha256(repr(key).encode()).hexdigest()[:24])
    if path and os.path.exists(path):
        with open(path) as f:
            got = json.load(f)
        return dict(flops=got["flops"], comm={tuple(k): tuple(v) for k, v in got["comm"]})
    out = _probe_run(*key)
    if path:
        _write_json(path, dict(key=repr(key), flops=out["flops"],
                               comm=[[list(k), list(v)] for k, v in out["comm"].items()]))
    return out


@contextlib.contextmanager
def _counting_batches():
    """[ops per call] of dist.batch_isend_irecv while inside (its sends run together, and wait once)."""
    real, batches = dist.batch_isend_irecv, []

    def counted(ops):
        batches.append(len(ops))
        return real(ops)
    dist.batch_isend_irecv = counted
    try:
        yield batches
    finally:
        dist.batch_isend_irecv = real


def _attention_core(forward):
    """forward, run with _OpCount.attention_core set (the probe's mark of ring attention's blocks)."""
    def marked(*a, **kw):
        _OpCount.attention_core = True
        try:
            return forward(*a, **kw)
        finally:
            _OpCount.attention_core = False
    return marked


def _probe_run(model, experts, top_k, dtype, seq_len, tp, cp, sp, cp_method, cp_ulysses, checkpointing,
               layers) -> dict:
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from lab.plan import _fused_attention_on_meta, _shaped, shared_tensors
    from mesh import Mesh
    model = _probe_shape(model)
    args = train.parse_args(["--layers", str(layers), "--tp", str(tp), "--cp", str(cp),
                             "--seq-len", str(seq_len), "--global-batch-size", "1", "--dtype", dtype,
                             "--activation-checkpointing", checkpointing, "--cp-method", cp_method, "--cp-ulysses",
                             str(cp_ulysses), "--experts", str(experts), "--top-k", str(top_k)]
                            + (["--sequence-parallel"] if sp else []))
    devices = dist.Backend.backend_capability["fake"]
    dist.Backend.backend_capability["fake"] = devices + ["meta"]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp * cp)
    try:
        mesh = Mesh(**{d: getattr(args, d) for d in DIMS}, ep=1)
        with _shaped(replace(model, n_layers=layers, n_experts=experts, top_k=top_k)):
            trainer = train.Trainer(args, mesh, None, shapes_only=True)
        if cp > 1 and cp_ulysses < cp:   # ring attention: what a fused kernel per block would replace
            for block in trainer.model.layers:
                block.attn.sdpa.forward = _attention_core(block.attn.sdpa.forward)
        # a step's work: ALiBi's bias is made on first use and kept for every later step (lab.model.alibi_bias), so
        # it is made here, before the counting, and each run of the probe counts the same whatever ran before it
        param = next(trainer.model.parameters())
        shared_tensors(trainer, mesh, seq_len // cp, param.device, param.dtype)
        x = torch.zeros(1, seq_len // cp, dtype=torch.long, device="meta")
        flops, comm = {}, {}
        with trainer.opt.accumulating(), _fused_attention_on_meta(), _counting_batches() as batches:
            for phase in ("f", "b"):
                batches.clear()
                with CommCounter() as cc, _OpCount() as ops:
                    if phase == "f":
                        loss = trainer.model(x, x, positions=trainer.positions)
                    else:
                        loss.backward()
                for k, v in dict(flops=ops.flops, mm=ops.mm, mm32=ops.mm32, attn=ops.attn, attn_bwd=ops.attn_bwd,
                                 ops=ops.n, mem=ops.bytes,
                                 kernels=ops.kernels, fused=ops.fused, core=ops.core, core_ops=ops.core_ops,
                                 core_mem=ops.core_mem).items():
                    flops[f"{k}_{phase}"] = v
                for e in cc.events:
                    key = (phase, _dim_of(e.group_ranks, mesh), e.op)
                    calls, n = comm.get(key, (0, 0))
                    comm[key] = (calls + 1, n + e.api_bytes)
                # the ring's sends of one hop (k and v; dk and dv) go in one batch, which waits once: one call
                for key in [k for k in comm if k[0] == phase and k[2] == "send" and batches]:
                    comm[key] = (len(batches), comm[key][1])
        trainer.opt.zero_grad(set_to_none=True)
    finally:
        dist.destroy_process_group()
        dist.Backend.backend_capability["fake"] = devices
    return dict(flops=flops, comm=comm)


# ---- where a group's ranks sit, and what a collective costs ----------------------------------------------

def stride_of(sizes: dict, dim: str) -> int:
    """Ranks are numbered with tp fastest (mesh.DIMS order): a dim's neighbours are `stride` ranks apart."""
    return math.prod(sizes[d] for d in DIMS[DIMS.index(dim) + 1:])


def crosses_nodes(sizes: dict, dims: tuple, G: int) -> bool:
    """Does a group along `dims` (adjacent in DIMS) span more than one node of G ranks?"""
    return ranks_per_node(sizes, dims, G) > 0


def ranks_per_node(sizes: dict, dims: tuple, G: int) -> int:
    """How a group along `dims` sits on nodes of G ranks: 0 when it fits inside one node, else how many of its
    ranks share each node (1 when its neighbours are a node or more apart: data parallel beside tp = 8)."""
    stride, n = stride_of(sizes, dims[-1]), math.prod(sizes[d] for d in dims)
    return 0 if stride * n <= G else max(1, min(n, G // stride))


def collective_time(op: str, n_bytes: float, calls: int, group: int, dev: Device, inter: int) -> float:
    """A ring: α per ring step (all-reduce 2(n-1) of them, gather/scatter/all-to-all n-1, a send 1) + wire
    bytes/β — or, for an all-reduce where NCCL's cost model picks a tree or NVLS for it (nccl_all_reduce), that
    algorithm's time. inter: 0 inside a node; k >= 1 (True is 1) when the group crosses nodes with k of its ranks
    in each (link_bandwidth)."""
    if group <= 1 and op not in ("send", "recv"):
        return 0.0
    k = int(inter)
    if op == "all_reduce" and dev.nccl and calls:
        algorithm, _, seconds = nccl_all_reduce(n_bytes / calls, group, k, dev)
        if algorithm != "ring":
            return calls * seconds
    steps = {"all_reduce": 2 * (group - 1), "send": 1, "recv": 0}.get(op, group - 1)
    wire = n_bytes if op == "send" else wire_bytes(op, n_bytes, group)
    # every call pays α per ring step; the bytes at the link's rate, times how far this device's implementation of
    # the op is from a ring (Device.collective_factor)
    seconds = wire / link_bandwidth(dev, k) * dev.collective_factor.get(op, 1.0)
    return calls * steps * (dev.inter_alpha if k else dev.intra_alpha) + seconds


def link_bandwidth(dev: Device, inter: int) -> float:
    """The bytes per second a ring over the group moves per rank: NVLink's inside a node (Device.intra_beta);
    across nodes with k ranks in each, the node's k NICs together, while the other k-1 of every k hops ride NVLink
    (NCCL runs the ring on several channels, each leaving the node at a different rank's NIC: Bekman, Machine
    Learning Engineering, network/README.md, "Inter-node speed depends on intra-node speed": 4 x 8 B200, a 4 GiB
    all-reduce within 6% of the flat ring over the node's 8 x 50 GB/s; one NIC's rate would be 7.5x slower)."""
    k = int(inter)
    if not k:
        return dev.intra_beta
    return 1 / max(1 / (k * dev.inter_beta), (k - 1) / k / dev.intra_beta)


def nccl_all_reduce(n_bytes: float, group: int, inter: int, dev: Device) -> tuple[str, str, float]:
    """The algorithm and protocol NCCL's cost model picks for one all-reduce of n_bytes over `group` ranks, `inter`
    of them a node (0: one node), and the seconds it predicts: (algorithm, protocol, seconds) — the least of a ring,
    a tree (log2 of the nodes' hops: the clip's 8 bytes over 16,384 ranks pay ~0.13 ms, where a ring's 2(n-1)
    steps pay ~0.3 s) and, inside a node with NVLink SHARP (Device.nvls), NVLS, each over LL, LL128 and Simple.
    Its constants and their source: lab/devices.py, NCCL_*; the bus bandwidth: link_bandwidth."""
    key = (id(dev), n_bytes, group, inter)
    seen = _NCCL_SEEN.get(key)
    if seen is not None and seen[0] is dev:
        return seen[1]
    _NCCL_SEEN[key] = (dev, _nccl_all_reduce(n_bytes, group, inter, dev))
    return _NCCL_SEEN[key][1]


_NCCL_SEEN: dict = {}   # (id(dev), bytes, group, inter) -> (dev, answer): a search asks it ~175,000 times, mostly the same


def _nccl_all_reduce(n_bytes: float, group: int, inter: int, dev: Device) -> tuple[str, str, float]:
    nodes, per_node = (group // inter, inter) if inter else (1, group)
    steps, crossing = 2 * (group - 1), 2 * (nodes - 1)
    bus, size = link_bandwidth(dev, inter), int(n_bytes) >> 6
    log_size = size.bit_length() - 1 if size else 0
    best = ("ring", "Simple", math.inf)
    for i, proto in enumerate(NCCL_PROTOCOLS):
        ll = NCCL_LL_CROSSING if proto == "LL" and nodes > 1 else 1.0
        ring = NCCL_BASE_LATENCY["ring"][i] + (steps - crossing) * NCCL_NVLINK_LATENCY["ring"][i] * ll + \
            crossing * NCCL_NET_LATENCY["ring"][i]
        if proto == "Simple" and nodes > 1 and n_bytes >= group / 16 * 65536:
            ring *= NCCL_RING_PLATEAU
        tree = NCCL_BASE_LATENCY["tree"][i] + 2 * ((per_node - 1) * NCCL_NVLINK_LATENCY["tree"][i] * ll
                                                   + int(math.log2(nodes)) * NCCL_NET_LATENCY["tree"][i])
        tree_share = {"LL": 1 / 3.8, "LL128": 7 / 9 if nodes == 1 else 120 / 128}.get(proto, 1.0)
        correction = NCCL_TREE_CORRECTION[i][log_size] if log_size < len(NCCL_TREE_CORRECTION[i]) else 1.0
        options = [("ring", ring, bus * NCCL_RING_BANDWIDTH[i] * group / steps),
                   ("tree", tree, bus * NCCL_TREE_BANDWIDTH * tree_share * 0.5 * correction)]
        if dev.nvls and nodes == 1 and NCCL_NVLINK_LATENCY["nvls"][i] is not None:
            options.append(("nvls", NCCL_NVLINK_LATENCY["nvls"][i],
                            dev.intra_beta * NCCL_NVLS_EFFICIENCY * 2 * group / steps))
        for algorithm, latency, bandwidth in options:
            seconds = latency * 1e-6 + n_bytes / bandwidth
            if seconds < best[2]:
                best = (algorithm, proto, seconds)
    return best


# ---- the model of one step ----------------------------------------------------------------------------------

def _config(args):
    """train.config_of, once per model (a search asks for it per layout)."""
    return _config_of(args.model, args.layers, args.experts, args.top_k, getattr(args, "init_from", None))


@lru_cache(maxsize=None)
def _config_of(model, layers, experts, top_k, init_from):
    return train.config_of(argparse.Namespace(model=model, layers=layers, experts=experts, top_k=top_k,
                                              init_from=init_from))


def _stage_layers(args) -> list[int]:
    return _split(_config(args).n_layers, args.pp, args.virtual_stages)


@lru_cache(maxsize=None)
def _split(n_layers: int, pp: int, v: int) -> list[int]:
    chunks = pipeline.split_layers(n_layers, pp * v)
    return [sum(len(chunks[c * pp + s]) for c in range(v)) for s in range(pp)]


# Schedules whose total, for equal stages and free transfers, is (m + (p - 1)/v)·(t_f + t_b) — the bubble of
# Huang et al. 2019 (GPipe), Narayanan et al. 2021 (1F1B, and interleaved with v chunks, m a multiple of p); equal
# to pipeline.simulate's (tests/test_plan_time.py), and so not played: a 64-stage zero-bubble schedule still is
CLOSED = ("1f1b", "gpipe", "interleaved")
BUBBLE_GRID = 1.005     # where no line is found, t_b/t_f is rounded to this ratio's powers (total within 0.25%)
LINE = (0.25, 4.25)     # the range of t_b/t_f searched for lines


def _bubble(schedule: str, p: int, m: int, v: int, t_f: float, t_b: float, w: float) -> float:
    """pipeline.simulate's total for forward t_f and backward t_b, a share w of it the weight gradient (zb).
    The simulation is max and + of its compute times (a max over paths of sums): the total scales with them
    (total(c·t) = c·total(t)) and, along r = t_b/t_f, is convex and piecewise linear. Where it is played at
    both ends of an interval and its middle lies on the chord between them, convexity leaves no room for a
    bend inside: the total is exactly t_f·chord(r) there. The interval holding r is halved until that holds
    (1F1B, GPipe, interleaved: at once; ZB-H1: a few halvings), so a schedule is played a few times per search,
    not once per layout; past 10 halvings, or outside LINE, r is rounded (BUBBLE_GRID)."""
    if schedule in CLOSED and (schedule != "interleaved" or m % p == 0):
        return (m + (p - 1) / v) * (t_f + t_b)
    if t_f <= 0 or t_b <= 0:
        return pipeline.simulate(_schedule(schedule, p, m, v), t_f, t_b * (1 - w), t_b * w)["total"]
    r, (lo, hi) = t_b / t_f, LINE
    total = lambda x: _unit_total(schedule, p, m, v, w, x)
    chord = lambda x: total(lo) + (total(hi) - total(lo)) * (x - lo) / (hi - lo)
    for _ in range(10 if lo <= r <= hi else 0):
        mid = (lo + hi) / 2
        if abs(chord(mid) - total(mid)) <= 1e-9 * total(hi):
            return t_f * chord(r)
        lo, hi = (lo, mid) if r <= mid else (mid, hi)
    return t_f * total(BUBBLE_GRID ** round(math.log(r, BUBBLE_GRID)))


_PLAYED: dict = {}   # {repr of a _unit_total key: total}, read from and written to cache_dir with the probes


def _load_played() -> None:
    path = _cache_file("schedules")
    if path and not _PLAYED and os.path.exists(path):
        with open(path) as f:
            _PLAYED.update(json.load(f))
    _PLAYED.setdefault("", 0.0)   # loaded (an empty file too)


def _save_played() -> None:
    path = _cache_file("schedules")
    if path:
        _write_json(path, _PLAYED)


@lru_cache(maxsize=None)
def _unit_total(schedule: str, p: int, m: int, v: int, w: float, r: float) -> float:
    """_play_total, kept on disk beside the probes (a search's schedules are the same every run)."""
    if "" not in _PLAYED:
        _load_played()
    key = repr((schedule, p, m, v, w, r))
    if key not in _PLAYED:
        _PLAYED[key] = _play_total(schedule, p, m, v, w, r)
    return _PLAYED[key]


def _play_total(schedule: str, p: int, m: int, v: int, w: float, r: float) -> float:
    """The total at t_f = 1, t_b = r. Past 2p micro-batches every rank is in its steady state and each further
    micro-batch adds the same time (1F1B, GPipe, interleaved: t_f + t_b; ZB-H1 here a little more): the
    total is a line in m through 2p and 3p (tests/test_plan_time.py checks it against a full simulation)."""
    play = lambda k: pipeline.simulate(_schedule(schedule, p, k, v), 1.0, r * (1 - w), r * w)["total"]
    if p > ZB_PLAYED and m % p == 0:   # a line in p too, at c = m/p micro-batches a stage: played at 4 and 8 stages
        return _unit_total(schedule, 4, 4 * m // p, v, w, r) + (p - 4) / 4 * (
            _unit_total(schedule, 8, 8 * m // p, v, w, r) - _unit_total(schedule, 4, 4 * m // p, v, w, r))
    if m <= 3 * p:
        return play(m)
    a, b = play(2 * p), play(3 * p)
    return a + (b - a) * (m - 2 * p) / p


ZB_PLAYED = 8   # zero bubble's total at m = c·p micro-batches is a line in p from p = 4 on (tested against
                # pipeline.simulate): a deeper pipeline is not played, its total is drawn from 4 and 8 stages


@lru_cache(maxsize=None)
def _schedule(schedule: str, p: int, m: int, v: int):
    return pipeline.SCHEDULES[schedule](p, m, v)


def _local_psi(args, stage: int) -> tuple[float, float]:
    """(this stage's dense parameters on one tp rank, its largest unit) from the model's shapes: a block's
    parameters /tp (an MoE block: its attention /tp, its router whole; a GELU MLP's two matrices, a SwiGLU's three;
    biases of column-parallel linears /tp, of row-parallel ones whole; LayerNorm's biases); the embedding (and
    learned positions, BLOOM's embedding norm) on the first stage, the norm and head on the last, /tp (vocab
    parallel) — a tied head is the embedding's matrix, held once without a pipeline. The experts: _expert_psi."""
    cfg = _config(args)
    H, F, hd, kv, tp = cfg.dim, cfg.ffn_dim, cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, args.tp
    gated = cfg.mlp == "swiglu"
    mlp = H * cfg.n_experts * tp if cfg.n_experts else (3 if gated else 2) * H * F   # (router: whole on every rank)
    norm = H * (2 if cfg.norm_bias else 1)
    bias = ((H + 2 * kv + (0 if cfg.n_experts else (2 if gated else 1) * F)) / tp + 2 * H) if cfg.bias else 0
    block = (2 * H * H + 2 * H * kv + mlp) / tp + 2 * norm + bias
    emb = cfg.padded_vocab * H / tp
    first = emb + (cfg.max_seq_len * H if cfg.positions == "learned" else 0) + (norm if cfg.embed_norm else 0)
    head = 0 if cfg.tie_embeddings and args.pp == 1 else emb
    layers = _stage_layers(args)[stage]
    psi = layers * block + (first if stage == 0 else 0) + (head + norm if stage == args.pp - 1 else 0)
    unit = max(block, first, _expert_psi(args, stage)[1])
    return psi, unit


def _expert_psi(args, stage: int) -> tuple[float, int]:
    """(this stage's expert parameters on one rank, one layer's): E/ep experts of 3·H·F each, whole on every tp
    rank (tensor parallel leaves them to expert parallel), sharded by ZeRO over the dp·cp/ep ranks holding a copy
    (train.py's edp_cp group)."""
    cfg = _config(args)
    if not cfg.n_experts:
        return 0.0, 0
    per_layer = 3 * cfg.dim * cfg.ffn_dim * cfg.n_experts // args.ep
    return _stage_layers(args)[stage] * per_layer, per_layer


def _unit_tensors(args, stage: int) -> list[int]:
    """The parameter tensors of each ZeRO unit of a stage (train.py's units): a block each (2 norms, 4 attention
    projections, 3 MLP weights — a GELU MLP's 2, an MoE's 3 stacked expert weights and a router; LayerNorm's and
    the linears' biases), the embedding (with learned positions and BLOOM's norm), and the final norm with the head
    (one unit; a pipeline's last stage: two; a tied head is the embedding's)."""
    cfg = _config(args)
    matrices = 3 if cfg.mlp == "swiglu" else 2
    norms = 2 * (2 if cfg.norm_bias else 1)
    block = norms + 4 + matrices + (1 if cfg.n_experts else 0) + ((4 + matrices) if cfg.bias else 0)
    first = 1 + (cfg.positions == "learned") + (norms // 2 if cfg.embed_norm else 0)
    last = [norms // 2, 0 if cfg.tie_embeddings else 1] if args.pp > 1 else \
        [norms // 2 + (0 if cfg.tie_embeddings else 1)]
    units = [block] * _stage_layers(args)[stage] + ([first] if stage == 0 else [])
    return units + ([t for t in last if t] if stage == args.pp - 1 else [])


@lru_cache(maxsize=None)
def _moe_ops(model, experts: int, top_k: int) -> tuple:
    """(routing's operations, one expert's) beyond a dense block's, forward and backward: expert_parallel.py's
    layer run for real (routing by value needs real tensors) on a narrow copy of the model (its counts do not
    depend on the widths), on a group of one gloo rank (its all-to-alls copy), at E and 2E experts — so
    routing = at E less E experts, one expert = (at 2E less at E)/E. ((f, b), (f, b))."""
    import dataclasses
    from expert_parallel import ExpertParallelMoE
    from lab.model import build_model
    cfg = replace(_probe_shape(model), n_experts=experts, top_k=top_k)
    x = torch.zeros(1, 32, dtype=torch.long)

    def count(e):
        c = dataclasses.replace(cfg, n_layers=1, dim=8 * cfg.n_heads, ffn_dim=16, vocab_size=32, n_experts=e,
                                max_seq_len=32)
        torch.manual_seed(0)
        net = build_model(c)
        if e:
            net.layers[0].mlp = ExpertParallelMoE(net.layers[0].mlp, dist.group.WORLD)
        with _OpCount() as f:
            loss = net(x, x)
        with _OpCount() as b:
            loss.backward()
        return f.n, b.n
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dense, one, two = count(0), count(experts), count(2 * experts)
    finally:
        dist.destroy_process_group()
    per = tuple((t - o) / experts for t, o in zip(two, one))
    return tuple(o - d - experts * e for o, d, e in zip(one, dense, per)), per


def _moe(args, b: int, dev: Device, link: bool, aux_link: bool) -> dict | None:
    """An MoE layer beyond the dense MLP the probe ran in its place (tokens are routed by value, which meta
    tensors do not have, so the probe runs the dense model and this adds the difference analytically, for
    UNIFORM routing): per micro-batch and layer on one rank, T = b·S/cp tokens, T/tp of them dispatched
    (expert_parallel.py: each tp rank sends its share once). Its local E/ep experts receive, from the ep
    ranks, T/tp·k rows in all, each through an expert's 3 matmuls (2·3·H·F FLOPs forward, twice that
    backward); the dense probe counted one MLP per token at 1/tp of its width, which is taken off; the router
    adds 2·T·H·E forward; the operations routing and each local expert dispatch: _moe_ops. Communication: dispatch and combine
    all-to-alls of T/tp·k·H·b bytes each forward (wire (ep−1)/ep of it), both again backward, the counts'
    small all-to-all forward, and the aux loss's all-reduce of 2E + 1 float64 over every rank holding other
    tokens (dp·cp, ·tp under tp) forward. link: the ep group crosses nodes; aux_link: that group does."""
    cfg = _config(args)
    if not cfg.n_experts:
        return None
    H, F, E, k, tp = cfg.dim, cfg.ffn_dim, cfg.n_experts, args.top_k, args.tp
    T = b * args.seq_len // args.cp
    rows = T / tp * k                                      # rows my local experts run, uniform routing
    mlp = 2 * 3 * H * F                                    # one row through one expert (or a dense MLP), forward
    f = rows * mlp - T * mlp / tp + 2 * T * H * E          # the experts less the dense MLP the probe counted
    n = rows * H * _elem(args)                             # one all-to-all's API bytes (dispatch or combine)
    a2a = lambda calls, nb: collective_time("all_to_all", nb, calls, args.ep, dev, link)
    counts = args.ep * (E // args.ep + 1) * 8
    routing, expert = _moe_ops(replace(cfg, n_experts=0), E, k)   # operations: the routing's, my E/ep experts'
    ops = {p: routing[i] + E // args.ep * expert[i] for i, p in enumerate("fb")}
    aux_ranks = args.dp_replicate * args.dp_shard * args.cp * tp
    aux = collective_time("all_reduce", (2 * E + 1) * 8, 1, aux_ranks, dev, aux_link)
    out = dict(f=f, b=2 * f, comm_f=a2a(2, 2 * n) + a2a(1, counts) + aux, comm_b=a2a(2, 2 * n), ops_f=ops["f"],
               ops_b=ops["b"])
    # checkpointing reruns the layer's forward in backward, collectives and all (selective keeps the matmuls'
    # outputs: the experts' FLOPs are not spent again)
    if args.activation_checkpointing != "none":
        out.update(comm_b=out["comm_b"] + out["comm_f"], ops_b=out["ops_b"] + out["ops_f"])
        if args.activation_checkpointing == "full":
            out["b"] += f
    return out


COMPUTE_PARTS = ("matmul", "attention", "memory", "launch")   # compute's breakdown (step_time's "parts")


def _linear_flops(cfg, tp: int) -> list[float]:
    """FLOPs per token of a block's linears on one tp rank, in the order the forward runs them (wq, wk, wv, wo,
    w1, w3, w2; a GELU MLP w1, w2): 2 per multiply-add of the rank's slice (kv heads shared by tp ranks: one
    head's width each)."""
    H, F, kv = cfg.dim, cfg.ffn_dim, max(cfg.n_kv_heads * cfg.head_dim // tp, cfg.head_dim)
    mlp = [] if cfg.n_experts else [2 * H * F / tp] * (3 if cfg.mlp == "swiglu" else 2)   # (GELU: w1, w2)
    return [2 * H * w for w in (H / tp, kv, kv, H / tp)] + mlp


def compute_time(args, dev: Device, assume: Assumptions, pr: dict, b: int, layers: int, last: bool, moe) -> dict:
    """One micro-batch's forward (f) and backward (b) on one rank of a stage, beyond its collectives: {phase:
    {seconds, flops, linears (the block matmuls' seconds: tp's window), attention (cp's window), and
    COMPUTE_PARTS}}. The probe's counts (one sequence, one block and the rest), priced with the mechanisms:
      matmuls    the linears at the dtype's peak × Device.matmul_efficiency (float8: the blocks' linears at the
                 float8 rate, the head in the compute dtype) and fp32 ones at fp32's; the experts' (_moe) alike;
                 recomputed_linears: what a framework's recompute runs again in the backward
      attention  SDPA's fused kernels, forward at attention_efficiency and backward at attention_backward
                 (causal: half the products); ring attention's blocks as the code runs them (fp32 products, score
                 blocks in memory) or fused (fused_ring_attention); unfused_attention
      memory     the memory-bound operations' bytes at bandwidth(): eager as counted, compiled as the fused runs
                 read and write them; float8_casts
      launch     the host's cost per launch (Device.op_overhead): every operation eager, every kernel compiled;
                 on a GPU it runs ahead of the device: a phase takes the longer of the two"""
    cfg, blk, rst = _config(args), pr["block"], pr["rest"]
    compiled = args.compile if assume.compile is None else bool(assume.compile)
    float8 = (args.float8 if assume.float8 is None else bool(assume.float8)) and "float8" in dev.flops
    rate = kernel_rates(args, dev, assume, float8)
    # the ring's blocks run again in the backward (checkpointing's recompute): the code's backward counted 3.5x
    # its forward's products (5 per block pair against 2, and the forward's again), not 2.5x
    recompute = blk["core_f"] > 0 and blk["core_b"] / blk["core_f"] > 3
    out = {}
    for p in "fb":
        def count(key, scale=b):
            return scale * (layers * blk[f"{key}_{p}"] + (rst[f"{key}_{p}"] if last else 0))
        mm_block, mm_rest = b * layers * blk[f"mm_{p}"], (b * rst[f"mm_{p}"] if last else 0)
        extra = recomputed_linears(args, assume, b, layers, p)
        t_lin = (mm_block + extra) / rate["linear"]
        matmul = t_lin + mm_rest / rate["mm"] + count("mm32") / rate["wide"] + \
            (layers * moe[p] / rate["mm"] if moe else 0)
        flops = count("flops") + extra + count("core") + (layers * moe[p] if moe else 0)
        # compile: each block's forward (train.py --compile, torchtitan's per-block compile); head and loss eager
        mem = (b * layers * blk[f"fused_{p}"] + (b * rst[f"mem_{p}"] if last else 0)) if compiled else count("mem")
        launches = (layers * blk[f"kernels_{p}"] + (rst[f"ops_{p}"] if last else 0)) if compiled else count("ops", 1)
        launches += layers * moe["ops_" + p] if moe else 0
        # attention: SDPA's kernel, and ring attention's core
        attn_flops, attn_bwd = count("attn"), count("attn_bwd")
        fused = (attn_flops - attn_bwd) / rate["attn_f"] + attn_bwd / rate["attn_b"]
        attention = fused
        core = count("core")
        if assume.attention == "code" or not core:
            attention += core / rate["wide"]
            mem += count("core_mem")
            launches += count("core_ops", 1)
        else:
            t, fl, nbytes, n = fused_ring_attention(args, assume, rate, b, layers, p, recompute)
            attention, flops, mem, launches = attention + t, flops + fl - core, mem + nbytes, launches + n
        if assume.attention == "unfused" and attn_flops:
            t, fl, nbytes, n = unfused_attention(args, rate, pr, b, layers, p)
            attention, flops, mem, launches = attention + t - fused, flops + fl - attn_flops, mem + nbytes, \
                launches + n
        if float8:
            nbytes, n = float8_casts(args, b, layers, p, compiled, recompute)
            mem, launches = mem + nbytes, launches + n
        memory = mem / bandwidth(dev, assume)
        launch = launches * dev.op_overhead
        busy = matmul + attention + memory
        seconds = max(busy, launch) if dev.async_launch else busy + launch
        out[p] = dict(seconds=seconds, flops=flops, linears=t_lin, attention=attention, matmul=matmul,
                      memory=memory, launch=max(0.0, seconds - busy))
    return out


def kernel_rates(args, dev: Device, assume: Assumptions, float8: bool) -> dict:
    """FLOP/s of each kind of kernel (measured kernel rates): mm, the compute dtype's matmuls at its peak ×
    Device.matmul_efficiency (a sustained cuBLASLt or MSMF rate); wide, fp32's (fp64's); linear, the blocks'
    linears (float8's rate under float8); attn_f and attn_b, fused attention's forward and backward kernels
    (FlashAttention-2's measured rates: Device.attention_efficiency, attention_backward). Assumptions.efficiency
    replaces every share."""
    eff = (lambda dt: assume.efficiency) if assume.efficiency is not None else \
        (lambda dt: dev.matmul_efficiency.get(dt, 1.0))
    peak, wide = dev.flops[args.dtype], "float64" if args.dtype == "float64" else "float32"
    mm = peak * eff(args.dtype)
    kernel = attention_kernel_ratio(dev, assume)
    return dict(mm=mm, wide=dev.flops[wide] * eff(wide),
                linear=dev.flops["float8"] * eff("float8") if float8 else mm,
                attn_f=peak * (dev.attention_efficiency * kernel[0] if assume.efficiency is None
                               else assume.efficiency),
                attn_b=peak * ((dev.attention_backward or dev.attention_efficiency) * kernel[1]
                               if assume.efficiency is None else assume.efficiency))


def attention_kernel_ratio(dev: Device, assume: Assumptions) -> tuple[float, float]:
    """The attention kernel (Assumptions.attention_kernel): its forward and backward rates over FlashAttention-2's,
    as measured side by side on an H100 (lab/devices.py, ATTENTION_KERNELS: the FlashAttention-3 paper's Fig. 5-6),
    scaling the device's own FlashAttention-2 rates. FlashAttention-3 runs on Hopper GPUs only."""
    name = assume.attention_kernel
    if name == "fa3" and not dev.hopper:
        raise ValueError(f"--assume attention_kernel=fa3: FlashAttention-3 runs on Hopper GPUs (h100, h200), not "
                         f"{dev.name}")
    (f, b), (f2, b2) = ATTENTION_KERNELS[name], ATTENTION_KERNELS["fa2"]
    return f / f2, b / b2


def recomputed_linears(args, assume: Assumptions, b: int, layers: int, p: str) -> float:
    """The backward's FLOPs a framework's recompute adds to what the probe counted (the course's policies):
    torchtitan's selective policy reruns every k-th matmul of a block (selective_every; its
    _apply_ac_to_transformer_block), a reentrant full checkpoint the block's last linear too (recompute_whole;
    Megatron-LM 2021's CheckpointFunction, where PyTorch's non-reentrant one stops before it)."""
    if p != "b":
        return 0.0
    linears, tokens = _linear_flops(_config(args), args.tp), b * layers * args.seq_len // args.cp
    if args.activation_checkpointing == "selective" and assume.selective_every > 0:
        return tokens * sum(linears[assume.selective_every - 1::assume.selective_every])
    if args.activation_checkpointing == "full" and assume.recompute_whole:
        return tokens * linears[-1]
    return 0.0


def fused_ring_attention(args, assume: Assumptions, rate: dict, b: int, layers: int, p: str,
                         recompute: bool) -> tuple:
    """attention=fused under ring attention: a flash kernel per ring step over this rank's share of the causal
    attention (zigzag: 1/cp), in place of the code's fp32 blocks; around it a fused ring's merges of each step's
    output (12 bytes a query element forward, 24 backward) or, torch_cp, what torch's context_parallel does
    (TORCH_CP_STEP_BYTES). (seconds, FLOPs, bytes, launches)."""
    cfg, S, cp, tp = _config(args), args.seq_len, args.cp, args.tp
    heads_w = cfg.n_heads * cfg.head_dim / tp
    fwd = b * 2 * S * S * heads_w / cp                          # causal: half of 4·S²·H per sequence
    fl = fwd if p == "f" else 2.5 * fwd + (fwd if recompute else 0)
    seconds = layers * (fwd / rate["attn_f"] if p == "f" else 2.5 * fwd / rate["attn_b"]
                        + (fwd / rate["attn_f"] if recompute else 0))
    if assume.torch_cp:   # torch's context_parallel around each step's kernel (TORCH_CP_STEP_BYTES)
        per = TORCH_CP_STEP_BYTES[p] + (TORCH_CP_STEP_BYTES["f"] if p == "b" and recompute else 0)
        nbytes = assume.torch_cp * layers * cp * b * (S // cp) * heads_w * per
    else:
        nbytes = layers * 3 * 4 * b * S * heads_w * (2 if p == "b" else 1)   # the merges of each step's output
    return seconds, layers * fl, nbytes, layers * 2 * cp * (2 if p == "b" else 1)


def unfused_attention(args, rate: dict, pr: dict, b: int, layers: int, p: str) -> tuple:
    """attention=unfused (Megatron-LM 2021, Megatron-DeepSpeed): QKᵀ, softmax, dropout and ·V as separate kernels,
    every product of the S×S scores computed at the matmul rate (a causal triangle or a mask skips none: 4·S·S·d a
    head forward, twice that backward, the forward's again where the backward reruns it) and every score in memory
    (UNFUSED_SCORE_BYTES; under ALiBi the bias added inside QKᵀ too, ALIBI_SCORE_BYTES). (seconds, FLOPs, bytes,
    launches) in place of the fused kernel's. The products come from the shapes, not from the probe's fused count,
    which is the causal half for is_causal but every score for ALiBi's masked call."""
    cfg, blk, S, cp = _config(args), pr["block"], args.seq_len, args.cp
    again = blk["attn_b"] / blk["attn_f"] > 3 if blk["attn_f"] else False   # backward recomputes the forward
    scores = b * layers * cfg.n_heads / args.tp * (S / cp) * S
    forward = 4 * scores * cfg.head_dim                                  # QKᵀ and ·V
    full = forward if p == "f" else (2 + (1 if again else 0)) * forward   # dS·K, dSᵀ·Q, dO·Vᵀ, Pᵀ·dO
    per_score = {k: v + (ALIBI_SCORE_BYTES[k] if cfg.positions == "alibi" else 0)
                 for k, v in UNFUSED_SCORE_BYTES.items()}
    nbytes = scores * (per_score[p] + (per_score["f"] if p == "b" and again else 0))
    return full / rate["mm"], full, nbytes, layers * (6 if p == "f" else 9)


def float8_casts(args, b: int, layers: int, p: str, compiled: bool, recompute: bool) -> tuple:
    """float8's casts (torchao tensorwise): each linear's input, weight and output gradient read for its amax and
    again to scale and cast to 1 byte (compiled: read once), and the 1-byte transposes the backward's matmuls
    read. (bytes, launches)."""
    cfg, b_el = _config(args), _elem(args)
    T = b * args.seq_len // args.cp                                    # tokens a micro-batch brings this rank
    per_byte = (b_el + 1) if compiled else (2 * b_el + 1)
    H = cfg.dim
    sizes = [(H, n / 2 / H) for n in _linear_flops(cfg, args.tp)]     # (in, out) of each linear on this rank
    sizes = [(i, o) if j != 3 and j != len(sizes) - 1 else (o, i) for j, (i, o) in enumerate(sizes)]   # wo, w2
    nbytes = 0.0
    if p == "f" or recompute:
        nbytes += layers * sum(T * i + i * o for i, o in sizes) * per_byte
    if p == "b":   # the output gradient cast; the 1-byte transposes the backward's matmuls read
        nbytes += layers * sum(T * o * per_byte + 2 * (T * i + T * o + i * o) for i, o in sizes)
    return nbytes, layers * len(sizes) * (2 if p == "f" else 3)


# ---- one step, composed of its mechanisms (published_runs.ipynb lists them), one function each -----------------

@dataclass(frozen=True)
class _Step:
    """What every mechanism of one step reads: the run's flags, the device, the assumptions, the mesh's sizes and
    where its groups sit (link: per dim, 0 inside a node or the ranks each node holds; everyone: the world's), the
    sequences per micro-batch b, the probe's counts, the experts' layer (_moe) and overlap's price per hidden
    second (slow)."""
    args: object
    dev: Device
    assume: Assumptions
    G: int
    sizes: dict
    world: int
    b: int
    link: dict
    everyone: int
    slow: float
    pr: dict
    moe: dict | None


def _setting(args, dev: Device, assume: Assumptions, gpus_per_node: int | None) -> _Step:
    G = gpus_per_node or dev.gpus_per_node
    sizes = {d: getattr(args, d) for d in DIMS}
    dp, tp, cp, m = args.dp_replicate * args.dp_shard, args.tp, args.cp, args.microbatches
    # an MoE model: the dense model probed (experts 0), the experts added by _moe (routing needs values)
    pr = probe(_config(args), 0, args.top_k, args.dtype, args.seq_len, tp, cp, args.sequence_parallel and tp > 1,
               args.cp_method, args.cp_ulysses, args.activation_checkpointing)
    if args.global_batch_size % (dp * m):                      # (train.check_args says so before a run)
        raise ValueError(f"--global-batch-size {args.global_batch_size} is not a multiple of the data-parallel "
                         f"size {dp} times --microbatches {m}: no whole micro-batch to time")
    b = args.global_batch_size // (dp * m)                     # sequences per micro-batch
    link = {d: ranks_per_node(sizes, (d,), G) for d in DIMS}
    moe = _moe(args, b, dev, link["dp_shard"], ranks_per_node(sizes, ("dp_replicate", "dp_shard", "cp", "tp"), G))
    return _Step(args, dev, assume, G, sizes, math.prod(sizes.values()), b, link,
                 ranks_per_node(sizes, DIMS, G), overlap_price(dev, assume), pr, moe)


def overlap_price(dev: Device, assume: Assumptions) -> float:
    """Compute beside a collective that hides behind it runs Device.overlap_slowdown slower (NCCL's kernels hold
    SMs and memory bandwidth: Lee et al. 2025, arXiv:2507.03114, 18.9% on average): each second of collective
    hidden costs s/(1 + s) of a second ("overlap" in the breakdown)."""
    slow = dev.overlap_slowdown if assume.overlap_slowdown is None else assume.overlap_slowdown
    return slow / (1 + slow)


def layer_collectives(st: _Step, layers: int, last: bool) -> dict:
    """tp's and cp's collectives (and any over their joint group), as the probe counted the real block and head
    issue them (instruments.CommCounter: calls and bytes per phase), each at collective_time on the link its
    group crosses: {(phase, dim): seconds}, once per layer for the block's, on the last stage for the head's."""
    raw = {(p, d): 0.0 for p in "fb" for d in ("tp", "cp", "pp", "ep", "world")}
    for (phase, where, dim, op), (calls, n) in st.pr["comm"].items():
        t = collective_time(op, st.b * n, calls, st.sizes.get(dim, st.world), st.dev,
                            st.link.get(dim, st.everyone))
        t *= layers if where == "block" else (1 if last else 0)
        raw[(phase, dim if dim in ("tp", "cp", "pp", "ep") else "world")] += t
    return raw


def hide_behind_windows(st: _Step, raw: dict, work: dict) -> tuple[dict, dict, float]:
    """Overlap of the layer's collectives (Assumptions.overlap): tp's behind the phase's matmuls (async TP,
    Megatron's tp-comm-overlap; its first of tp pieces cannot hide: Wang et al., ASPLOS 2023), the ring's sends
    behind its attention (ring_attention.RingPass starts the next block's first: Liu et al. 2023), the rest by its
    share. (exposed per dim, seconds added to each phase, overlap's price per micro-batch)."""
    comm = {"tp": 0.0, "cp": 0.0, "pp": 0.0, "ep": 0.0, "world": 0.0}
    per_phase, beside, o = {"f": 0.0, "b": 0.0}, 0.0, st.assume.overlap
    for (phase, dim), t in raw.items():
        window = {"tp": work[phase]["linears"], "cp": work[phase]["attention"]}.get(dim)
        share = o.get("tp_b" if dim == "tp" and phase == "b" else dim, 0.0)
        if window is None:
            exposed = t * (1 - share)
        else:
            floor = t / st.sizes[dim] if dim == "tp" and share else 0.0
            exposed = max(floor, t - share * window)
        comm[dim] += exposed
        per_phase[phase] += exposed + st.slow * (t - exposed)
        beside += st.slow * (t - exposed)
    return comm, per_phase, beside


def expert_collectives(st: _Step, layers: int) -> dict:
    """ep: the experts' dispatch and combine all-to-alls, the counts' and the aux loss's all-reduce (_moe, uniform
    routing), exposed: seconds per phase of one micro-batch."""
    return {p: layers * st.moe["comm_" + p] if st.moe else 0.0 for p in "fb"}


def pipeline_boundary(st: _Step) -> float:
    """pp: one micro-batch's stage boundary [b, S/cp(/tp under sp), H] sent each way, once per chunk a rank holds
    (interleaved: virtual_stages); with pp_scatter 1/tp of it crosses and an all-gather over the node's tp group
    rebuilds it (Narayanan et al. 2021 §4.1). Seconds of one direction."""
    args, dev, tp = st.args, st.dev, st.args.tp
    sp = args.sequence_parallel and tp > 1
    boundary = st.b * args.seq_len // args.cp * _config(args).dim * _elem(args) // (tp if sp else 1)
    if st.assume.pp_scatter and tp > 1 and not sp:
        hop = collective_time("send", boundary / tp, 1, 2, dev, st.link["pp"]) + \
            collective_time("all_gather", boundary, 1, tp, dev, st.link["tp"])
    else:
        hop = collective_time("send", boundary, 1, 2, dev, st.link["pp"])
    return hop * args.virtual_stages


def pipeline_total(st: _Step, t_f: float, t_b: float) -> float:
    """The micro-batches' forward and backward through the schedule: its bubble included (_bubble:
    pipeline.simulate's total, by closed form where one holds), or m·(t_f + t_b) without a pipeline."""
    a = st.args
    if a.pp == 1:
        return a.microbatches * (t_f + t_b)
    w = st.assume.weight_grad_share if a.schedule == "zb" else 0.0
    return _bubble(a.schedule, a.pp, a.microbatches, a.virtual_stages, t_f, t_b, w)


def dp_collectives(st: _Step, s: int, dp_bytes: dict | None) -> dict:
    """Data parallel's collectives of stage s, from the lessons' formulas (zero_comm_formula: its bytes, {op:
    bytes} or dp_bytes), one call per ZeRO unit (ZeRO-3 without a pipeline: per micro-batch, forward and backward),
    DDP bucket (and the used flags' all-reduce), each at collective_time over the group's link; HSDP's all-reduce
    across replicas per unit. Returns {seconds: {op: s}, replicas, units, shard, psi, psi_e, n_e, regather, calls}
    (psi: this rank's parameters, experts included; psi_e the experts', held by n_e ranks)."""
    args, z, cp, m, pp = st.args, st.args.zero_stage, st.args.cp, st.args.microbatches, st.args.pp
    dp = args.dp_replicate * args.dp_shard
    psi = _local_psi(args, s)[0]
    psi_e = _expert_psi(args, s)[0]
    units = _unit_tensors(args, s)
    shard = args.dp_shard * cp if z else 1
    n_e = dp * cp // args.ep if _config(args).n_experts else 1   # ranks holding a copy of my experts
    ops = dp_bytes if dp_bytes is not None else \
        _dp_formula(args, psi + (psi_e if n_e > 1 else 0), shard)   # experts alone on their ranks: no reduction
    psi += psi_e
    group = dict(reduce_scatter=shard, all_gather=shard, all_reduce=shard if z else dp * cp)
    grad_bytes = psi * train.store_dtype(args).itemsize
    buckets = 1 + math.ceil(max(grad_bytes - 2**20, 0) / (args.bucket_mb * 2**20))
    regather = 2 * m if z == 3 and pp == 1 else 1     # ZeRO-3 gathers for the forward and again the backward
    calls = dict(reduce_scatter=len(units), all_gather=len(units) * regather,
                 all_reduce=buckets + 1 if z == 0 else 1)   # (+ the used-flags' all-reduce, once a step)
    inter = ranks_per_node(st.sizes, ("dp_replicate", "dp_shard", "cp") if not z else ("dp_shard", "cp"), st.G)
    seconds = {op: collective_time(op, n, calls[op], group[op], st.dev, inter) for op, n in ops.items()}
    if st.assume.fsdp1 and z >= 2 and pp == 1:   # FSDP1: each micro-batch reduce-scatters (and, ZeRO-2, gathers)
        seconds = {op: t * (m if op == "reduce_scatter" or (op == "all_gather" and z == 2) else 1)
                   for op, t in seconds.items()}
    replicas = 0.0
    if z and args.dp_replicate > 1:   # HSDP: the shard's all-reduce across replicas
        replicas = collective_time("all_reduce", ops.get("all_reduce", 0), len(units), args.dp_replicate, st.dev,
                                   ranks_per_node(st.sizes, ("dp_replicate",), st.G))
        seconds["all_reduce"] = replicas * (1 - st.assume.overlap["replicas"])
    return dict(seconds=seconds, replicas=replicas, units=units, shard=shard, psi=psi, psi_e=psi_e, n_e=n_e,
                regather=regather, calls=calls, ops=ops)


def dp_exposed(st: _Step, dpt: dict, compute: float, t_b: float) -> float:
    """What of data parallel's collectives no compute hides (Assumptions.overlap): DDP's buckets behind the last
    backward (Li et al. 2020); ZeRO-3's prefetched gathers behind the step's compute and, without micro-batches,
    its reduce-scatters behind the backward on the same group and link (Zhao et al. 2023, FSDP); ZeRO-2's
    reduce-scatter behind a single backward; ZeRO-1/2's work at the step exposed (overlap.step: Megatron's
    distributed optimizer)."""
    z, o = st.args.zero_stage, st.assume.overlap
    several = st.args.pp > 1 or st.args.microbatches > 1
    if st.assume.fsdp1 and z >= 2 and st.args.pp == 1:
        return fsdp1_exposed(st, dpt, compute, t_b)
    if z == 0:
        return max(0.0, dpt.get("all_reduce", 0) - o["ddp"] * t_b)
    if z == 3:
        ag, rs = dpt.get("all_gather", 0), dpt.get("reduce_scatter", 0)
        if several:   # the reduce-scatter deferred over the micro-batches, to the step
            out = max(0.0, ag - o["zero3"] * compute) + rs * (1 - o["step"])
        else:         # gathers and reduce-scatters queue on one group, one link: their sum hides behind the
                      # step's compute, the reduce-scatter's part behind the backward only
            out = max(0.0, ag + rs - o["zero3"] * compute, rs - o["zero3"] * t_b)
        return out + dpt.get("all_reduce", 0)
    rs = dpt.get("reduce_scatter", 0)
    rs = max(0.0, rs - o["zero2"] * t_b) if z == 2 and not several else rs * (1 - o["step"])
    return rs + dpt.get("all_gather", 0) * (1 - o["step"]) + dpt.get("all_reduce", 0)


def fsdp1_exposed(st: _Step, dpt: dict, compute: float, t_b: float) -> float:
    """FSDP1's schedule (Assumptions.fsdp1; torch/distributed/fsdp/_runtime_utils.py, _pre_forward_unshard and
    _post_backward_reshard), every micro-batch synchronised (llm-foundry through Composer: FORCED_SYNC), where the
    course's ZeRO-2 moves its parameters and gradients at the step and its ZeRO-3 defers the reduce-scatters:
      SHARD_GRAD_OP (ZeRO-2)  each unit gathered in each micro-batch's forward, just before it runs (the next unit's
                   gather issued behind the current unit's compute: prefetched), kept through the backward, and its
                   gradients reduce-scattered in that backward: m gathers hidden behind the m forwards, m
                   reduce-scatters behind the m backwards
      FULL_SHARD (ZeRO-3)  gathered again for the backward (its backward prefetch), reduce-scattered in each
                   micro-batch's backward: the gathers and reduce-scatters on one group and link behind the step's
                   compute, the reduce-scatters' part behind the backwards
    dpt: the seconds of FSDP1's collectives (dp_collectives: m reduce-scatter sets; m gather sets at ZeRO-2)."""
    o, m = st.assume.overlap, st.args.microbatches
    ag, rs = dpt.get("all_gather", 0), dpt.get("reduce_scatter", 0)
    backward = min(m * t_b, compute)
    if st.args.zero_stage == 2:
        out = max(0.0, ag - o["zero3"] * (compute - backward)) + max(0.0, rs - o["zero3"] * backward)
    else:
        out = max(0.0, ag + rs - o["zero3"] * compute, rs - o["zero3"] * backward)
    return out + dpt.get("all_reduce", 0)


def fp32_accumulation(st: _Step, psi: float) -> float:
    """DeepSpeed's extra (Assumptions.fp32_accumulation): after each micro-batch's backward, its bf16 gradients are
    added into fp32 buffers, one parameter tensor at a time (deepspeed/runtime/bf16_optimizer.py, update_hp_grads:
    hp_grad.add_(lp.grad.to(fp32)); then the bf16 gradients zeroed: FP32_ACCUMULATE_BYTES a parameter) —
    memory-bound, on the compute stream, in every micro-batch's backward (and so in the pipeline's bubble). Seconds a
    micro-batch for this rank's psi parameters."""
    if not st.assume.fp32_accumulation:
        return 0.0
    return st.assume.fp32_accumulation * psi * FP32_ACCUMULATE_BYTES / bandwidth(st.dev, st.assume)


def fsdp2_copies(st: _Step, dp: dict) -> float:
    """torchtitan's extra (Assumptions.fsdp2_copies): FSDP2 copies around each collective
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py): per gather of the stage's parameters the shard cast
    in (read in the store dtype, written in the compute dtype) and the gathered buffer copied out (read and
    written); per reduce-scatter the gradients read and written again in the reduce dtype (the store's) —
    memory-bound, on the step's path. The course's flat parameter holds views: none."""
    a = st.args
    if a.zero_stage != 3 or dp["shard"] <= 1 or not st.assume.fsdp2_copies:
        return 0.0
    pb, sb, psi = _elem(a), train.store_dtype(a).itemsize, dp["psi"]
    nbytes = dp["regather"] * (2 * psi * pb + psi / dp["shard"] * (sb + pb)) + psi * (pb + sb)
    return st.assume.fsdp2_copies * nbytes / bandwidth(st.dev, st.assume)


def fsdp1_copies(st: _Step, dp: dict) -> float:
    """PyTorch FSDP1's extra (Assumptions.fsdp1_copies), as it runs ZeRO-2 and ZeRO-3 under mixed precision
    (Composer's DEFAULT: parameters gathered in the compute dtype, gradients reduced in the store dtype), every
    micro-batch synchronised. Per gather (ZeRO-3: each micro-batch's forward and backward; ZeRO-2: its forward) the
    fp32 shard cast into the low-precision shard the gather reads (_flat_param.py, _use_low_precision_shard); per
    micro-batch, the unsharded flat gradient made of the parameters' gradients (each parameter is a view split off the
    flat parameter, and split's backward concatenates their gradients: read and written), then on the post-backward
    stream cast to the reduce dtype and divided in place by the pre-divide factor before the reduce-scatter, the shard
    divided by the post-divide factor after it (_runtime_utils.py, _post_backward_hook and _reduce_grad), and from the
    second micro-batch on added into the saved gradient shard (_accumulate_sharded_grad). Memory-bound, taken from the
    step's memory bandwidth as FSDP2's copies are. Seconds a step; 0 without sharding."""
    a = st.args
    if a.zero_stage < 2 or dp["shard"] <= 1 or a.pp > 1 or not st.assume.fsdp1_copies:
        return 0.0
    pb, sb, psi, n, m = _elem(a), train.store_dtype(a).itemsize, dp["psi"], dp["shard"], a.microbatches
    cast = pb + sb if pb != sb else 0                         # a cast between the dtypes (none when they are one)
    gathers = 2 * m if a.zero_stage == 3 else m
    nbytes = gathers * psi / n * cast + m * psi * (2 * pb + cast + 2 * sb) + \
        m * psi / n * 2 * sb + (m - 1) * psi / n * 3 * sb
    return st.assume.fsdp1_copies * nbytes / bandwidth(st.dev, st.assume)


def tp_gradient_sums(st: _Step, layers: int, last: bool) -> float:
    """tp's partial gradients (sequence parallel's norm weights; k and v where tp ranks share a kv head), summed
    over tp unit by unit before ZeRO reduces them (tensor_parallel.finish_grads): one all-reduce a unit, exposed."""
    a, cfg, tp = st.args, _config(st.args), st.args.tp
    if tp <= 1:
        return 0.0
    sp = a.sequence_parallel
    shared_kv = cfg.n_kv_heads < tp
    per_block = (2 * cfg.dim if sp else 0) + (2 * cfg.n_kv_heads * cfg.head_dim * cfg.dim if shared_kv else 0)
    out = layers * collective_time("all_reduce", per_block * _elem(a), 1, tp, st.dev, st.link["tp"]) \
        if per_block else 0.0
    return out + (collective_time("all_reduce", cfg.dim * _elem(a), 1, tp, st.dev, st.link["tp"])
                  if sp and last else 0)


def clip_all_reduce(st: _Step) -> float:
    """The clip's norm: one all-reduce of a scalar over every rank, at the step (fsdp.ZeroOptimizer.clip_grad_norm_)."""
    return collective_time("all_reduce", 8, 1, st.world, st.dev, st.everyone) if st.args.grad_clip else 0.0


def collective_checks(st: _Step, dp: dict) -> int:
    """Lesson 0's check (mesh.agree, Device.agree each) before each of fsdp.py's collectives: ZeRO 1-3's gathers
    and reduce-scatters, one all-reduce of the used flags, HSDP's all-reduces across replicas (a unit's and the
    flags'), and the clip's all-reduce over every rank (ZeRO-0's buckets are ddp.py's: unchecked). How many a step
    makes (count_checks counts them in a real one)."""
    a = st.args
    checks = 1 if a.grad_clip and st.world > 1 else 0
    if a.zero_stage and dp["shard"] > 1:
        checks += sum(dp["calls"][op] for op in ("reduce_scatter", "all_gather") if op in dp["ops"]) + 1
    if a.zero_stage and a.dp_replicate > 1:
        checks += len(dp["units"]) + 1
    return checks


def optimizer_time(st: _Step, dp: dict) -> float:
    """AdamW and the clip's arithmetic: per element of the local shard (Device.optimizer_elem, else
    Assumptions.optimizer_bytes at the memory bandwidth) and per tensor piece it loops over (Device.optimizer_tensor;
    ZeRO: a unit's flat shard cuts its tensors; the most a rank holds: about half of them plus one)."""
    shard, dev = dp["shard"], st.dev
    pieces = sum(min(t, math.ceil(t / shard) + 1) if shard > 1 else t for t in dp["units"])
    per_elem = dev.optimizer_elem if dev.optimizer_elem is not None else \
        st.assume.optimizer_bytes / bandwidth(dev, st.assume)
    local = (dp["psi"] - dp["psi_e"]) / shard + dp["psi_e"] / (dp["n_e"] if st.args.zero_stage else 1)
    return local * per_elem + pieces * dev.optimizer_tensor


def stage_time(st: _Step, s: int, layers: int, dp_bytes: dict | None) -> dict:
    """Stage s's step, mechanism by mechanism: compute (compute_time), the layer's collectives and what hides them,
    the experts', the pipeline's boundary, the schedule (its bubble), data parallel's collectives and what hides
    them, a framework's extras, tp's gradient sums, the clip, the collective checks and the optimizer."""
    args, m, o, last = st.args, st.args.microbatches, st.assume.overlap, s == st.args.pp - 1
    work = compute_time(args, st.dev, st.assume, st.pr, st.b, layers, last, st.moe)
    comm, per_phase, beside = hide_behind_windows(st, layer_collectives(st, layers, last), work)
    if st.moe:
        ep = expert_collectives(st, layers)
        per_phase = {p: per_phase[p] + ep[p] for p in "fb"}
        comm["ep"] = ep["f"] + ep["b"]
    t_f = work["f"]["seconds"] + per_phase["f"]
    accumulate = fp32_accumulation(st, _local_psi(args, s)[0] + _expert_psi(args, s)[0])
    t_b = work["b"]["seconds"] + per_phase["b"] + accumulate
    if accumulate:
        comm["fp32 accumulation"] = accumulate
    if args.pp > 1:   # the boundary's sends, exposed unless overlap.pp says otherwise
        hop = pipeline_boundary(st)
        t_f, t_b = t_f + hop * (1 - o["pp"] + st.slow * o["pp"]), t_b + hop * (1 - o["pp"] + st.slow * o["pp"])
        comm["pp"] = 2 * hop * (1 - o["pp"])
        beside += 2 * hop * o["pp"] * st.slow
    total = pipeline_total(st, t_f, t_b)
    compute = m * (work["f"]["seconds"] + work["b"]["seconds"])
    exposed = {d: m * c for d, c in comm.items() if c}
    if beside:
        exposed["overlap"] = m * beside
    dp = dp_collectives(st, s, dp_bytes)
    dp_time = dp_exposed(st, dp["seconds"], compute, t_b)
    copies = fsdp2_copies(st, dp)
    if copies:
        exposed["fsdp2 copies"] = copies
    copies1 = fsdp1_copies(st, dp)
    if copies1:
        exposed["fsdp1 copies"] = copies1
        copies += copies1
    # what of the data-parallel collectives hid behind compute, slowing it
    dp_beside = st.slow * (sum(dp["seconds"].values()) + dp["replicas"] * o["replicas"] - dp_time)
    if dp_time:
        exposed["dp"] = dp_time
    if dp_beside > 1e-12:
        exposed["overlap"] = exposed.get("overlap", 0.0) + dp_beside
    finish = tp_gradient_sums(st, layers, last)
    if finish:
        exposed["tp"] = exposed.get("tp", 0.0) + finish
    clip = clip_all_reduce(st)
    if clip:
        exposed["clip"] = clip
    checks = collective_checks(st, dp) * st.dev.agree
    if checks:
        exposed["agree"] = checks
    optimizer = optimizer_time(st, dp)
    return dict(compute=compute, parts={k: m * (work["f"][k] + work["b"][k]) for k in COMPUTE_PARTS},
                exposed=exposed, optimizer=optimizer, stage=s, flops=m * (work["f"]["flops"] + work["b"]["flops"]),
                unit=t_f + t_b, total=total, rest=dp_time + dp_beside + finish + clip + checks + optimizer + copies,
                forward=t_f, backward=t_b)


def step_time(args, dev: Device, assume: Assumptions = Assumptions(), gpus_per_node: int | None = None,
              dp_bytes: dict | None = None) -> dict:
    """Predicted seconds of one step on the slowest pipeline stage, with its breakdown: compute (this rank's
    FLOPs at peak × efficiency), exposed collectives per mesh dimension, the pipeline's bubble, the optimizer;
    tokens/s and MFU (the model's 6·N·tokens + attention FLOPs over the world's peak × seconds). dp_bytes: the
    data-parallel collectives' bytes per step ({op: bytes}), else zero_comm_formula for the analytic Ψ. Each
    stage is timed by stage_time (a stage like one timed already: the same time)."""
    st = _setting(args, dev, assume, gpus_per_node)
    timed, unit_of = {}, []
    for s, layers in enumerate(_stage_layers(args)):
        kind = (layers, s == 0, s == args.pp - 1)
        if kind not in timed:
            timed[kind] = stage_time(st, s, layers, dp_bytes)
        unit_of.append(timed[kind]["unit"])
    # The schedule was played as if every stage took the slowest one's times; a faster stage (the first holds
    # the embedding, the last the head and the loss) gives back what it is faster by once, in the fill and drain
    # (1F1B, GPipe: about Σ_s t_s + (m − 1)·max_s t_s, t_s = t_f + t_b of stage s; equal stages: exact)
    slowest = max(timed.values(), key=lambda o: o["unit"])
    total = slowest["total"] - sum(slowest["unit"] - u for u in unit_of)
    best = None
    for out in timed.values():
        out.update(seconds=total + out.pop("rest"), bubble=total - args.microbatches * out["unit"])
        del out["total"], out["unit"]
        if best is None or out["seconds"] > best["seconds"]:
            best = out
    best["tokens_per_s"] = args.global_batch_size * args.seq_len / best["seconds"]
    best["mfu"] = model_flops(args) / (st.world * dev.flops[args.dtype] * best["seconds"])
    return best


def bandwidth(dev: Device, assume: Assumptions = Assumptions()) -> float:
    """The memory bandwidth memory-bound work runs at: the datasheet's x the share a streaming kernel reaches
    (Device.hbm_efficiency; Assumptions.hbm_efficiency replaces it)."""
    return dev.hbm * (dev.hbm_efficiency if assume.hbm_efficiency is None else assume.hbm_efficiency)


def _elem(args) -> int:
    return 2 if args.dtype == "bfloat16" else train.store_dtype(args).itemsize


def _dp_formula(args, psi: float, shard: int) -> dict:
    """zero_comm_formula for a stage of Ψ parameters on one rank (gradients reduced in the master dtype)."""
    z, dp = args.zero_stage, args.dp_replicate * args.dp_shard
    P = shard if z else dp * args.cp
    if P <= 1 and args.dp_replicate <= 1:
        return {}
    grad = train.store_dtype(args).itemsize
    several = args.microbatches if args.pp == 1 and args.microbatches > 1 and z == 3 else 1
    return zero_comm_formula(z, int(psi), P, _elem(args), 0, args.pp == 1,
                             args.dp_replicate if z and args.dp_replicate > 1 else 1, 0, grad, several)


def model_flops(args) -> float:
    """The model's FLOPs per step, for MFU: lab.model.flops_per_token (6 per parameter a token passes through,
    attention's causal half of 12·layers·H·S, no recompute: Chowdhery et al. 2022, PaLM, App. B) per token."""
    from lab.model import flops_per_token
    return args.global_batch_size * args.seq_len * flops_per_token(_config(args), args.seq_len)


# ---- memory from the formulas (to prune before any meta step) ---------------------------------------------

MEMORY_MARGIN = 0.05   # memory_formula is at most this much above the meta plan (tests/test_plan_time.py checks
                       # layouts with sp, cp, pp and ep); the search drops a layout above memory x (1 + it)


def memory_formula(args) -> float:
    """The most bytes a stage's rank holds, from the lessons' formulas: memory_parts' total."""
    return memory_parts(args)["total"]


def memory_parts(args) -> dict:
    """The stage whose rank holds the most, from the lessons' formulas (lab/plan.py measures them on meta): model
    state (zero_state_formula), activations (plan.layer_formula per layer and token, plan.rest_formula for the
    last stage's norm, head and loss, × the micro-batches a pipeline rank holds), the step's transient buffers
    (one unit's packed gradient; ZeRO-3 a unit gathered twice, the next prefetched; a pipeline keeps its units
    gathered): {state, activations, buffers, total}. Activations: per token plan.first_formula on the first stage
    (BLOOM's embedding norm), plan.layer_formula per layer, plan.rest_formula on the last; once per rank
    plan.alibi_formula (ALiBi's bias, one tensor every layer and micro-batch shares)."""
    from lab.plan import alibi_formula, first_formula, layer_formula, rest_formula
    cfg, z = _config(args), args.zero_stage
    b_p, bf16 = _elem(args), args.dtype == "bfloat16"
    b_m = 4 if bf16 else b_p
    shard = args.dp_shard * args.cp if z else 1
    tokens = args.global_batch_size // (args.dp_replicate * args.dp_shard * args.microbatches) * args.seq_len // args.cp
    sp = args.sequence_parallel and args.tp > 1
    cp = None if args.cp == 1 else "ring" if args.cp_ulysses < args.cp else "ulysses"
    worst, kinds = dict(total=-1.0), set()
    for s, layers in enumerate(_stage_layers(args)):
        if (layers, s == 0, s == args.pp - 1) in kinds:   # a stage like an earlier one, holding no more micro-
            continue                                       # batches (every schedule's held count falls with s)
        kinds.add((layers, s == 0, s == args.pp - 1))
        psi, unit = _local_psi(args, s)
        psi_e = _expert_psi(args, s)[0]
        n_e = args.dp_replicate * args.dp_shard * args.cp // args.ep if z else 1   # experts: sharded over edp_cp
        state = sum(zero_state_formula(z, n, p, b_p, 4 if bf16 else 0, b_p if z <= 1 else b_m, 2 * b_m)["total"]
                    for n, p in ((psi, shard), (psi_e, n_e)) if n)
        psi += psi_e
        held = 1 if args.pp == 1 else held_formula(args.schedule, args.pp, args.microbatches, s,
                                                  args.virtual_stages) / args.virtual_stages
        per_token = layers * layer_formula(cfg, args.activation_checkpointing, b_p, args.tp, sp, cp)
        if s == args.pp - 1:
            per_token += rest_formula(cfg, b_p, args.tp, sp)
        if s == 0:
            per_token += first_formula(cfg, b_p, args.tp, sp)
        buffers = b_m * unit if z < 2 else (b_p + b_m) * unit if z == 2 else \
            (b_p * psi + b_m * unit if args.pp > 1 else 3 * b_p * unit + b_m * unit)
        if z == 0 and bf16 and args.dp_replicate * args.dp_shard * args.cp > 1:
            buffers += 4 * psi
        act = per_token * tokens * held + alibi_formula(cfg, b_p, args.tp, args.seq_len // args.cp)
        if state + act + buffers > worst["total"]:
            worst = dict(state=state, activations=act, buffers=buffers, total=state + act + buffers)
    return worst


# ---- the search ----------------------------------------------------------------------------------------------

def _factorizations(n: int, k: int):
    if k == 1:
        yield (n,)
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in _factorizations(n // d, k - 1):
                yield (d, *rest)


def layouts(base, N: int, span: int = 8):
    """Every layout train.py accepts for N ranks (check_args decides), as argparse Namespaces: the mesh (pp,
    dp_replicate, dp_shard, cp, tp; ep for a mixture of experts), the ZeRO stage, activation checkpointing,
    sequence parallel, the schedule (interleaved with 2 chunks a rank; gpipe left out: 1F1B's bubble with more
    memory held) and the micro-batches (powers of two: pp·2^k with a pipeline, 2^k without). tp·cp at most
    `span` (a node's ranks: Assumptions.tp_cp_span)."""
    cfg = train.config_of(base)
    for pp, dr, ds, cp, tp in _factorizations(N, 5):
        dp = dr * ds
        if base.global_batch_size % dp or pp > cfg.n_layers or (cp > 1 and base.seq_len % (2 * cp)) \
                or tp * cp > span:   # tp's and cp's collectives run every layer: kept inside a node
            continue
        per_rank = base.global_batch_size // dp
        if pp > 1:
            ms = [pp * 2 ** k for k in range(12) if pp * 2 ** k <= per_rank and per_rank % (pp * 2 ** k) == 0]
            scheds = [("1f1b", 1), ("zb", 1)] + ([("interleaved", 2)] if cfg.n_layers >= 2 * pp else [])
        else:
            ms = [2 ** k for k in range(12) if 2 ** k <= per_rank and per_rank % 2 ** k == 0]
            scheds = [("1f1b", 1)]
        eps = [1] if not base.experts else [e for e in range(1, dp + 1) if dp % e == 0]
        for z in ([0, 1, 2, 3] if dp * cp > 1 else [0]):
            for ac in ("none", "selective", "full"):
                for sp in ([False, True] if tp > 1 else [False]):
                    for sched, v in scheds:
                        for m in ms:
                            for ep in eps:
                                yield argparse.Namespace(**{**vars(base), **dict(
                                    pp=pp, dp_replicate=dr, dp_shard=ds, cp=cp, tp=tp, ep=ep, zero_stage=z,
                                    activation_checkpointing=ac, sequence_parallel=sp, schedule=sched,
                                    virtual_stages=v, microbatches=m, cp_ulysses=1, cp_method="ring")})


def describe(a) -> str:
    dims = " ".join(f"{d.replace('_', '-')} {getattr(a, d)}" for d in DIMS + ("ep",) if getattr(a, d) > 1)
    return (f"{dims or 'one rank'}, ZeRO-{a.zero_stage}, ac {a.activation_checkpointing}"
            + (", sp" if a.sequence_parallel and a.tp > 1 else "") + f", m {a.microbatches}"
            + (f", {a.schedule}" + (f" v{a.virtual_stages}" if a.virtual_stages > 1 else "") if a.pp > 1 else ""))


def flags(a) -> str:
    """The train.py flags of a layout."""
    out = [f"--{d.replace('_', '-')} {getattr(a, d)}" for d in DIMS + ("ep",) if getattr(a, d) > 1]
    out += [f"--zero-stage {a.zero_stage}", f"--activation-checkpointing {a.activation_checkpointing}",
            f"--microbatches {a.microbatches}"]
    out += ["--sequence-parallel"] if a.sequence_parallel and a.tp > 1 else []
    out += [f"--schedule {a.schedule}"] + ([f"--virtual-stages {a.virtual_stages}"] if a.virtual_stages > 1 else []) \
        if a.pp > 1 else []
    return " ".join(out)


def search(base, N: int, dev: Device, gpus_per_node: int, memory: float, assume: Assumptions = Assumptions(),
           verify: bool = True) -> dict:
    """Every layout for N ranks: those train.py refuses dropped (check_args), those whose formula memory exceeds
    `memory` dropped with their bytes, the rest timed (step_time) and ranked; the best assume.verify_top
    confirmed by the meta plan (lab/plan.py: the real model built on a fake group), a layout that does not fit
    there dropped and the next one confirmed. Returns ranked [(seconds, args, breakdown, memory)], dropped
    {reason: count}, examples {reason: a layout}, seconds spent."""
    from lab import plan
    t0 = time.perf_counter()
    ranked, dropped, examples, seen = [], {}, {}, 0

    def drop(reason, a):
        dropped[reason] = dropped.get(reason, 0) + 1
        examples.setdefault(reason, describe(a))

    for a in layouts(base, N, assume.tp_cp_span or gpus_per_node):
        seen += 1
        if a.zero_stage == 0 and a.dp_replicate > 1:
            # ZeRO-0 all-reduces over dp_replicate × dp_shard × cp (train.py's "dp_cp" group): the same ranks,
            # bytes and state as dp-shard R·S; ranked once, as that
            drop("equivalent by construction: ZeRO-0 with dp-replicate R x dp-shard S is dp-shard R*S", a)
            continue
        try:
            train.check_args(a, N)
        except ValueError as e:
            drop("train.py refuses it: " + str(e).split("\n  - ")[1].split(":")[0][:70], a)
            continue
        mem = memory_formula(a)
        if mem > memory * (1 + MEMORY_MARGIN):   # (the formula: at most MEMORY_MARGIN above the meta plan)
            drop(f"does not fit {memory / 1e9:.0f} GB (formulas)", a)
            continue
        ranked.append((step_time(a, dev, assume, gpus_per_node), a, mem))
    ranked.sort(key=lambda r: r[0]["seconds"])
    _save_played()
    confirmed, tries = [], 0
    while verify and ranked and len(confirmed) < assume.verify_top and tries < 4 * assume.verify_top:
        r, tries = ranked.pop(0), tries + 1   # (each meta plan builds every stage's model: seconds apiece)
        planned = max(p["total"] for p in plan.plan(r[1])) if not r[1].experts else r[2]
        if planned > memory:
            drop(f"does not fit {memory / 1e9:.0f} GB (meta plan)", r[1])
            continue
        confirmed.append((r[0], r[1], planned))
    return dict(ranked=confirmed + ranked, verified=len(confirmed), dropped=dropped, examples=examples,
                layouts=seen, seconds=time.perf_counter() - t0, assume=assume, memory=memory)


def breakdown(r: dict) -> str:
    parts = [f"compute {r['compute']:.3f}"] + [f"{d} {t:.3f}" for d, t in r["exposed"].items()]
    parts += [f"bubble {r['bubble']:.3f}"] if r["bubble"] > 1e-9 else []
    parts += [f"optimizer {r['optimizer']:.3f}"]
    return ", ".join(parts)


def print_search(base, N, G, dev, found: dict, top: int = 10) -> None:
    from lab.model import num_params
    cfg = train.config_of(base)
    print(f"search: {train.model_name(base)} ({num_params(cfg) / 1e9:.2f}B) on {N} x {dev.name} ({G} per node), "
          f"{base.dtype}, "
          f"global batch {base.global_batch_size} x {base.seq_len}: {found['layouts']} layouts in "
          f"{found['seconds']:.1f} s, {len(found['ranked'])} fit; assumptions: {assumed(found['assume'])}")
    gb = f"{found['memory'] / 1e9:.0f} GB" if found["memory"] >= 1e9 else f"{found['memory']:,.0f} bytes"
    print(f"  fits: * <= {gb} by the meta plan; the rest <= {gb} + {MEMORY_MARGIN:.0%} by the lessons' formulas "
          f"(MEMORY_MARGIN: they read up to {MEMORY_MARGIN:.0%} above the meta plan)")
    for reason, n in sorted(found["dropped"].items(), key=lambda kv: -kv[1]):
        print(f"  dropped {n:6d}: {reason} (e.g. {found['examples'][reason]})")
    print(f"  {'#':>3s} {'step s':>8s} {'tokens/s':>10s} {'MFU':>5s} {'GB':>6s}  layout")
    for i, (r, a, mem) in enumerate(found["ranked"][:top]):
        mark = "*" if i < found["verified"] else " "
        print(f"  {i + 1:3d} {r['seconds']:8.3f} {r['tokens_per_s']:10.0f} {r['mfu']:5.2f} {mem / 1e9:5.1f}{mark} "
              f"{describe(a)}")
    for i, (r, a, mem) in enumerate(found["ranked"][:3]):
        print(f"  #{i + 1} {flags(a)}\n      seconds: {breakdown(r)}")


def print_time(args, dev: Device, G: int, plans, assume: Assumptions = Assumptions()) -> dict:
    """The one layout's predicted step beside its memory plan (its data-parallel bytes: the plan's)."""
    zero = [ops for dim, ops in plans[-1]["per_step"].items() if dim.startswith("ZeRO")]
    r = step_time(args, dev, assume, G, zero[0] if zero else None)
    print(f"time on {dev.name} ({G} per node, assumptions: {assumed(assume)}): {r['seconds']:.3f} s per step "
          f"(stage {r['stage']}), {r['tokens_per_s']:,.0f} tokens/s, MFU {r['mfu']:.2f}\n  seconds: {breakdown(r)}"
          f"\n  compute: " + ", ".join(f"{k} {v:.3f}" for k, v in r["parts"].items()))
    return r


# ---- proven on this machine: the cpu-gloo profile measured, then predicted against measured ----------------

# one small model, 2 gloo ranks (one core each), every kind of layout (ep's experts are added to the dense probe
# analytically, for uniform routing: _moe)
# (--lr 0: every round takes the same step from the same weights — a router that learns moves tokens between
#  experts: within two steps the busiest rank holds up to twice its uniform share of them)
CALIBRATION_MODEL = ["--model", "small", "--layers", "2", "--seq-len", "64", "--global-batch-size", "4",
                     "--dtype", "float32", "--lr", "0"]
# Every kind of layout, spread over the range (micro-batches and checkpointing added where two kinds measured
# alike — an order is only there to predict between steps further apart than a run's noise, ~10% here): measured
# 80-170 ms, neighbours 3-20% apart
CALIBRATED_LAYOUTS = {
    "dp ZeRO-0": ["--dp-shard", "2", "--zero-stage", "0"],
    "dp ZeRO-1": ["--dp-shard", "2", "--zero-stage", "1"],
    "dp ZeRO-2, 2 micro-batches": ["--dp-shard", "2", "--zero-stage", "2", "--microbatches", "2"],
    # (ZeRO-3 gathers every unit for each micro-batch's forward, its backward, and the recompute's)
    "dp ZeRO-3, 2 micro-batches, full checkpointing": ["--dp-shard", "2", "--zero-stage", "3", "--microbatches", "2",
                                                       "--activation-checkpointing", "full"],
    "tp": ["--tp", "2"],
    "tp + sp": ["--tp", "2", "--sequence-parallel"],
    "pp 1f1b, 2 micro-batches": ["--pp", "2", "--microbatches", "2"],
    "pp gpipe, 4 micro-batches, full checkpointing": ["--pp", "2", "--microbatches", "4", "--schedule", "gpipe",
                                                      "--activation-checkpointing", "full"],
    "cp ring": ["--cp", "2"],
    # every token goes to both experts, so both ranks' experts get the same rows: the uniform routing the model
    # assumes (4 experts top-2 measured 0.7-0.86x of its prediction: the rank whose experts drew more tokens
    # sets the pace at each all-to-all)
    "ep, 2 experts top-2, full checkpointing": ["--dp-shard", "2", "--zero-stage", "0", "--experts", "2", "--ep", "2",
                                                "--activation-checkpointing", "full"],
}
# one core per rank: gloo's thread and the compute share it, so nothing hides behind anything; the measured
# matmul rate is the peak (efficiency 1)
CPU_ASSUMPTIONS = Assumptions(efficiency=1.0, overlap=dict(zero3=0.0, ddp=0.0, zero2=0.0, tp=0.0, tp_b=0.0, cp=0.0,
                                                           pp=0.0, replicas=0.0, step=0.0))


def _optimizer_step(cfg):
    """(the step's optimizer work on the calibration model's parameters, its tensors, its elements): torch's
    AdamW (ZeroOptimizer's inner optimizer) after the clip's arithmetic (fsdp.ZeroOptimizer.clip_grad_norm_:
    each piece's squares summed in float64, then every gradient scaled)."""
    from lab.model import build_model
    params = list(build_model(cfg).parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params)

    @torch.no_grad()
    def step():
        norm = sum(p.grad.double().pow(2).sum() for p in params).sqrt()
        for p in params:
            p.grad.mul_((1.0 / (norm + 1e-6)).clamp(max=1.0).to(p.grad))
        opt.step()
    step()
    return step, len(params), sum(p.numel() for p in params)


IN_STEP = 12   # collectives (after matmuls) that measure alpha: a difference of two medians, noisy with fewer
AGREE_CALLS = 20   # mesh.agree calls, back to back, that measure one's cost


def calibration_steps(cfg) -> tuple[dict, callable]:
    """What measures the cpu-gloo profile, as step functions timed in the SAME alternating rounds as the
    layouts' steps (the machine's load drifts; each rate is the one the steps saw), and derive({name: seconds
    per call}) -> the profile's numbers:
      rate        matmuls at the calibration model's shapes ([B·S, H] @ [H, F])
      op          one operation's overhead in the real model: a forward and backward of one token (FLOPs next
                  to nothing), less its FLOPs at `rate`, over the operations it dispatches — Python, autograd
                  and the dispatcher around each kernel, several times a bare in-place add's
      hbm         y += x (3 passes over 16 MB)
      opt_tensor, opt_elem   the optimizer step (_optimizer_step): each tensor its operations' overhead (counted,
                  at `op`), the rest per element — eager single-tensor AdamW makes ~10 passes over a tensor
      alpha       per ring step, what a collective pays INSIDE a step: an all-reduce of an activation [B·S, H]
                  after matmuls, less the matmuls alone and its bytes at β (bare_alpha: 50 back-to-back 4-byte
                  all-reduces, 2 ring steps each — several times less: the ranks arrive apart and gloo's threads
                  wake from sleep). A step makes many collectives and pays each one's tail: means, not medians
      beta        an all-reduce of the model's gradient, Ψ·4 bytes: 2·bare_alpha + 2·(P-1)/P·n/β
      collective_factor  reduce-scatter, all-gather, all-to-all at that size over the ring formula's time
      agree       mesh.agree on the 2 ranks, back to back (0 with COURSE_CHECK_COLLECTIVES=0: the check is off)"""
    from lab.model import build_model
    from mesh import agree, all_gather_single, reduce_scatter_single
    P = dist.get_world_size()
    a, w = torch.randn(256, cfg.dim), torch.randn(cfg.dim, cfg.ffn_dim)
    model, one = build_model(cfg), torch.zeros(1, 1, dtype=torch.long)
    with _OpCount() as ops:
        model(one, one).backward()
    optimize, tensors, elements = _optimizer_step(cfg)
    with _OpCount() as opt_ops:
        optimize()
    x, y = torch.randn(2**22), torch.randn(2**22)
    act = torch.zeros(a.shape[0] * cfg.dim)
    small, big = torch.zeros(1), torch.zeros(elements // P * P)
    part, into, n = big.new_empty(big.numel() // P), torch.empty_like(big), big.numel() * 4
    steps = {"cal:op": lambda: [model(one, one).backward() for _ in range(5)],
             "cal:optimizer": optimize,
             "cal:memory": lambda: [y.add_(x) for _ in range(5)],
             "cal:alpha": lambda: [dist.all_reduce(small) for _ in range(50)],
             # a collective inside a step: after a layer's worth of matmuls (~[B·S, H] @ [H, F]), an all-reduce
             # of an activation [B·S, H]; less the matmuls alone
             "cal:in_step": lambda: [(a @ w, dist.all_reduce(act)) for _ in range(IN_STEP)],
             "cal:segment": lambda: [a @ w for _ in range(IN_STEP)],
             "cal:all_reduce": lambda: dist.all_reduce(big),
             "cal:reduce_scatter": lambda: reduce_scatter_single(part, big),
             "cal:all_gather": lambda: all_gather_single(big, part),
             "cal:all_to_all": lambda: dist.all_to_all_single(into, big),
             # last: the rounds run in a cycle, and each step follows the one before it — what follows a 13 MB
             # collective pays for it (its buffers, gloo's threads); what follows matmuls does not
             "cal:agree": lambda: [agree(None, "calibrates the check") for _ in range(AGREE_CALLS)],
             "cal:matmul": lambda: [a @ w for _ in range(10)]}

    def derive(t: dict) -> dict:
        rate = 10 * 2 * a.shape[0] * cfg.dim * cfg.ffn_dim / t["cal:matmul"]
        op = max(t["cal:op"] / 5 - ops.flops / rate, 0.0) / ops.n
        opt_tensor = opt_ops.n / tensors * op
        # α: what one collective pays inside a step beyond its bytes — the two ranks arrive apart (each was
        # descheduled at other moments by the machine's other jobs) and wake gloo's threads from sleep: measured
        # after matmuls, several times what 50 back-to-back all-reduces (cal:alpha) pay each
        bare = t["cal:alpha"] / 50 / 2
        wire = wire_bytes("all_reduce", act.numel() * 4, P)
        beta = wire_bytes("all_reduce", n, P) / max(t["cal:all_reduce"] - 2 * (P - 1) * bare, 1e-9)
        alpha = max((t["cal:in_step"] - t["cal:segment"]) / IN_STEP - wire / beta, 2 * (P - 1) * bare) / (2 * (P - 1))
        c = dict(bare_alpha=bare, rate=rate, hbm=3 * x.numel() * 4 * 5 / t["cal:memory"], alpha=alpha, beta=beta, op=op,
                 opt_elem=max(t["cal:optimizer"] - tensors * opt_tensor, 0.0) / elements, opt_tensor=opt_tensor,
                 agree=t["cal:agree"] / AGREE_CALLS)
        for name in ("reduce_scatter", "all_gather", "all_to_all"):
            c[name] = max(t["cal:" + name] - (P - 1) * bare, 1e-9) / (wire_bytes(name, n, P) / beta)
        return c
    return steps, derive


def calibrated_args(name: str):
    """A calibrated layout's arguments, checked as train.py checks a run's (an invalid one raises here)."""
    args = train.parse_args(CALIBRATION_MODEL + CALIBRATED_LAYOUTS[name])
    train.check_args(args, 2)
    return args


# glibc gives a freed block above its mmap threshold back to the system, and the next allocation of its size
# page-faults it in again: thousands of faults a step here (a dense ZeRO-0 step: ~4,000; with these, under 600),
# which a GPU's caching allocator never pays and the model does not price. The measured ranks keep their heap.
KEPT_HEAP = dict(MALLOC_MMAP_THRESHOLD_=str(32 * 2**20), MALLOC_TRIM_THRESHOLD_=str(2**32))


def measure_rank(names: list[str], rounds: int = 3, per_round: int = 2) -> dict:
    """Build every layout's Trainer on these ranks and time their steps, and the calibration's
    (calibration_steps), in alternating rounds (instruments.time_side_by_side): the slowest rank's medians."""
    from lab.data import load_corpus
    from lab.instruments import time_side_by_side
    from mesh import Mesh
    cfg = train.config_of(train.parse_args(CALIBRATION_MODEL))
    steps, derive = calibration_steps(cfg)
    tokens, layouts = load_corpus(None), {}
    for name in names:
        args = calibrated_args(name)
        trainer = train.Trainer(args, Mesh(**{d: getattr(args, d) for d in DIMS}, ep=args.ep), torch.device("cpu"))
        layouts[name] = (lambda tr: lambda: tr.step(0, tokens))(trainer)
    t = time_side_by_side(dict(layouts, **steps), rounds, per_round)
    slowest = torch.tensor(list(t.values()), dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    t = dict(zip(t, slowest.tolist()))
    return dict(calibration=derive(t), measured={n: t[n] for n in names})


def count_checks(names: list[str]) -> dict:
    """On 2 gloo ranks: how many collective checks (mesh.agree over a group of more than one rank) one step of
    each calibrated layout makes, counted in its second step (tests/test_plan_time.py holds step_time's count to
    it)."""
    import fsdp
    import hsdp
    from lab.data import load_corpus
    from mesh import Mesh
    counted = [0]

    def counting(real):
        def agree(group, *a, **kw):
            counted[0] += dist.get_world_size(group if group is not None else dist.group.WORLD) > 1
            return real(group, *a, **kw)
        return agree
    real = fsdp.agree, hsdp.agree
    fsdp.agree, hsdp.agree = counting(real[0]), counting(real[1])
    out, tokens = {}, load_corpus(None)
    try:
        for name in names:
            args = calibrated_args(name)
            trainer = train.Trainer(args, Mesh(**{d: getattr(args, d) for d in DIMS}, ep=args.ep),
                                    torch.device("cpu"))
            trainer.step(0, tokens)
            counted[0] = 0
            trainer.step(1, tokens)
            out[name] = counted[0]
    finally:
        fsdp.agree, hsdp.agree = real
    return out


def cpu_gloo(calibration: dict) -> Device:
    c = calibration
    return Device("cpu-gloo", {"float32": c["rate"], "float64": c["rate"] / 2, "bfloat16": c["rate"] / 10}, c["hbm"],
                  c["alpha"], c["beta"], c["alpha"], c["beta"], 8e9, 2, "measured here: calibration_steps", c["op"],
                  {k: c[k] for k in ("reduce_scatter", "all_gather", "all_to_all")}, c["opt_elem"],
                  c["opt_tensor"], agree=c.get("agree", 0.0))


def spearman(a: list, b: list) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for k, i in enumerate(order):
            r[i] = float(k)
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))


def predicted_vs_measured(names=None, rounds: int = 3, per_round: int = 2, timeout: float = 600) -> dict:
    """The comparison: measure (2 gloo ranks, run_ranks), then predict each layout with the measured cpu-gloo
    profile and CPU_ASSUMPTIONS. Returns calibration, rows [(name, predicted s, measured s)], spearman."""
    from lab.launch import run_ranks
    names = list(CALIBRATED_LAYOUTS) if names is None else names
    before = {k: os.environ.get(k) for k in KEPT_HEAP}
    os.environ.update(KEPT_HEAP)    # (not the environment the forkserver started with: the ranks are spawned)
    try:
        out = run_ranks(measure_rank, 2, names, rounds, per_round, timeout=timeout)[0]
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    dev = cpu_gloo(out["calibration"])
    rows = []
    for name in names:
        args = calibrated_args(name)
        rows.append((name, step_time(args, dev, CPU_ASSUMPTIONS, 2)["seconds"], out["measured"][name]))
    return dict(calibration=out["calibration"], rows=rows,
                spearman=spearman([r[1] for r in rows], [r[2] for r in rows]))


# ---- the benchmark: python -m lab.plan_time ------------------------------------------------------------------

TIGHT_BAND = (0.75, 4 / 3)    # each prediction within this of its measured step
TIGHT_SPEARMAN = 0.8          # and the layouts in the same order


def report(out: dict) -> list[str]:
    """predicted_vs_measured's result as lines: the measured profile, each layout's predicted and measured step
    with the predicted breakdown, and the verdict against the tight band."""
    c = out["calibration"]
    lines = [f"cpu-gloo: matmul {c['rate'] / 1e9:.1f} GFLOP/s, memory {c['hbm'] / 1e9:.1f} GB/s, one op "
             f"{c['op'] * 1e6:.1f} us, AdamW+clip {c['opt_elem'] * 1e9:.2f} ns/element + {c['opt_tensor'] * 1e6:.0f} "
             f"us/tensor",
             f"gloo: alpha {c['alpha'] * 1e6:.0f} us in a step ({c['bare_alpha'] * 1e6:.0f} back to back), beta "
             f"{c['beta'] / 1e9:.2f} GB/s; x ring: reduce-scatter {c['reduce_scatter']:.1f}, all-gather "
             f"{c['all_gather']:.1f}, all-to-all {c['all_to_all']:.1f}; a collective's check (mesh.agree) "
             f"{c.get('agree', 0) * 1e6:.0f} us",
             f"{'layout':47s} {'predicted ms':>12s} {'measured ms':>12s} {'ratio':>6s}  predicted breakdown (ms)"]
    dev = cpu_gloo(c)
    for name, p, m in out["rows"]:
        r = step_time(calibrated_args(name), dev, CPU_ASSUMPTIONS, 2)
        parts = dict(compute=r["compute"], bubble=r["bubble"], optimizer=r["optimizer"], **r["exposed"])
        lines.append(f"{name:47s} {p * 1e3:12.1f} {m * 1e3:12.1f} {p / m:6.2f}  "
                     + " ".join(f"{k} {v * 1e3:.{0 if v >= 0.01 else 1}f}" for k, v in parts.items() if v))
    lo, hi = TIGHT_BAND
    ratios = [p / m for _, p, m in out["rows"]]
    within = sum(lo <= x <= hi for x in ratios)
    lines.append(f"rank correlation (Spearman) {out['spearman']:.2f} (tight: >= {TIGHT_SPEARMAN}); within "
                 f"{lo:.2f}-{hi:.2f}x: {within} of {len(ratios)} ({min(ratios):.2f}-{max(ratios):.2f}x)")
    return lines


def tight(out: dict) -> bool:
    lo, hi = TIGHT_BAND
    return out["spearman"] >= TIGHT_SPEARMAN and all(lo <= p / m <= hi for _, p, m in out["rows"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="The time model against this machine: the cpu-gloo profile measured "
                                            "and every calibrated layout timed on 2 gloo ranks, side by side, then "
                                            "predicted; exit 1 outside the tight band.")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (each times every step per-round times)")
    p.add_argument("--per-round", type=int, default=2)
    p.add_argument("--published", action="store_true",
                   help="instead: every published GPU run (PUBLISHED) predicted beside its published tokens/s")
    a = p.parse_args(argv)
    if a.published:
        print("\n".join(published_report()[0]))
        return 0
    out = predicted_vs_measured(rounds=a.rounds, per_round=a.per_round)
    print("\n".join(report(out)))
    ok = tight(out)
    print("tight band: met" if ok else "tight band: NOT met")
    return 0 if ok else 1


# ---- the planner against the world: published GPU runs (the rows: lab/published_runs.py) ------------------------

def model_dir(name: str) -> str:
    """A Hugging Face directory holding PUBLISHED_MODELS[name]'s config.json alone (no weights: --plan reads the
    shape), written once under cache_dir() (else a temporary directory): --init-from it."""
    path = os.path.join(cache_dir() or tempfile.gettempdir(), "models", name)
    shape = PUBLISHED_MODELS[name]
    want = shape if "model_type" in shape else \
        dict(dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu", rms_norm_eps=1e-5,
                  rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False, mlp_bias=False), **shape)
    file = os.path.join(path, "config.json")
    if not os.path.exists(file) or json.load(open(file)) != want:
        _write_json(file, want)
    return path


def published_args(row: Published):
    """The row's train.py arguments, checked as train.py checks a plan's (--plan: config.json alone; a shape
    lab.model names, by its name)."""
    from lab.model import CONFIGS
    model = ["--model", row.model] if row.model in CONFIGS else ["--init-from", model_dir(row.model)]
    args = train.parse_args([*model, "--dtype", "bfloat16", "--plan", "--device", row.device, *row.flags])
    train.check_args(args, row.gpus)
    return args


def predict_published(row: Published) -> dict:
    """step_time for the row, its tokens/s per GPU and the ratio predicted/published."""
    assume = assumptions(list(row.assume))
    r = step_time(published_args(row), device_named(row.device, assume), assume, 8)
    return dict(r, per_gpu=r["tokens_per_s"] / row.gpus, ratio=r["tokens_per_s"] / row.gpus / row.tokens_per_gpu)


def published_report(rows=None) -> tuple[list[str], list[dict]]:
    """Every published run predicted: (lines of a table — run, device, published and predicted tokens/s per GPU,
    the ratio, the predicted step's breakdown — then the median and range against TARGET_BAND, for the table and
    for the further runs apart, [prediction])."""
    import statistics
    rows = PUBLISHED + FURTHER if rows is None else rows
    got = [predict_published(row) for row in rows]
    lines = [f"{'run':78s} {'device':>8s} {'published':>10s} {'predicted':>10s} {'ratio':>6s}  predicted step (s)"]
    for row, r in zip(rows, got):
        lines.append(f"{('(further) ' if row.further else '') + row.name:78s} {row.device:>8s} "
                     f"{row.tokens_per_gpu:10.0f} {r['per_gpu']:10.0f} {r['ratio']:6.2f}  {r['seconds']:.2f}: "
                     f"{breakdown(r)}; compute = " + ", ".join(f"{k} {v:.2f}" for k, v in r["parts"].items()
                                                               if v > 5e-4))
    lo, hi = TARGET_BAND
    for label, keep in (("the table", False), ("further runs", True)):
        ratios = [r["ratio"] for row, r in zip(rows, got) if row.further == keep]
        if ratios:
            lines.append(f"{label}: median {statistics.median(ratios):.2f}, range {min(ratios):.2f}-"
                         f"{max(ratios):.2f}; within {lo}-{hi}x: {sum(lo <= x <= hi for x in ratios)} of "
                         f"{len(ratios)}")
    return lines, got


if __name__ == "__main__":
    raise SystemExit(main())
