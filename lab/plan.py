"""The memory planner: will my model fit? (train.py --plan)

For a layout and model train.py accepts, on P ranks, without P processes or any memory: the process joins a
FAKE process group of P ranks as one of them (PyTorch's fake backend: every collective returns at once and
moves nothing), builds the real sharded model the way train.py does — pipeline split, tensor, context and
expert parallel, ZeRO's flat units with their padding — on the meta device (shapes, no values), and reads
off what that rank holds, by category:

    parameters   the compute copies: b_p·N of each unit (stage 3: b_p·n, its slice)
    master       an fp32 master where the compute dtype differs: b_m·N (stages 1-3: b_m·n)
    gradients    held between steps: stages 0-1 the local gradient b_p per parameter, 2-3 the reduced slice b_m·n
    optimizer    AdamW's two moments, 2·b_m per element of its pieces, and a 4-byte step per piece
    activations  step_activations below: one micro-batch's forward and backward run on the meta device
                 through the real model, what autograd keeps for the backward counted, × the micro-batches the
                 rank holds at once (pipeline.held_formula), and once the tensors every micro-batch shares
                 (ALiBi's bias: alibi_formula); beside it the formula: activation_formula (measured to the byte
                 per block) × layers × tokens, plus each layer's input and the head's logits (b·H and 2·4·V/t
                 per token) — dense models
    buffers      the reduce's packed gradient of the largest unit, b_m·N; under stage 3 the peak of a unit's
                 backward: it gathered and its local gradients (2·b_p·N), the unit before it prefetched
                 (b_p·N_prev) and its packed gradient (b_m·N), plus a root unit kept gathered (_buffers); at
                 stage 0 in bf16, data parallel's fp32 buckets, 4 bytes per parameter (in fp32 the gradients
                 live in them)

next to ZeRO's formula (Rajbhandari et al. 2020 §5) for the same Ψ and P, and the bytes per step on each
mesh dimension from the lessons' formulas. The planned model state equals what a real run holds, to the
byte (tests/test_memory.py, at P = 2, 4, 8); the activations are the formula the tests measured.
"""
from __future__ import annotations

import gc
import math
from contextlib import contextmanager, nullcontext
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

import train
from lab.fsdp_demo import zero_comm_formula, zero_state_formula
from lab.pipeline_demo import held_formula
from lab.ring_attention_demo import ring_bytes, ulysses_bytes
from lab.tensor_parallel_demo import comm_formula
from mesh import DIMS, Mesh


def activation_formula(cfg, how: str, b: int, tp: int = 1, sp: bool = False) -> float:
    """Bytes per token (of the B·S the layer sees) that one block of lab/model.py keeps for its backward,
    beyond its input — computing in b bytes per element, statistics (the norms', SDPA's) in w = max(b, 4),
    fp32 for 16-bit compute — counted from what
    autograd saves, op by op. H = dim, a = n_heads,
    F = ffn_dim, t = tp, K = the kv width a tp rank keeps, max(n_kv_heads·head_dim/t, head_dim);
    H' = H/t and t' = t under sequence parallel (the norms see S/t tokens), else H and 1.
      none       per norm     w/t' (1/rms; LayerNorm: 2w/t', its mean too) + b·H' (x/rms, for the weight's
                              gradient) + b·H (its output as the matmuls read it: whole, all-gathered under SP)
                 their inputs w·H' with b = w (the residual between attention and MLP is the MLP norm's
                              input) or 2w·H' with b < 4 (each norm keeps an fp32 copy of its input)
                 attention    b(H/t + 2K + H/t): q, k, v after rotary and SDPA's output; w·a/t its log-sum-exp
                 SwiGLU       4bF/t: w1 x, silu(w1 x), w3 x and their product; GPT's GELU MLP 2bF/t: w1 x, gelu
      selective  what train.SAVED_BY_SELECTIVE's ops return: the q, k, v, w1, w3 projections and SDPA's output
                 b(H/t + 2K + H/t + 2F/t) (GELU MLP: w1 alone, F/t) and its log-sum-exp w·a/t, and wo's and w2's
                 outputs b·2H (partial sums of the whole width under tp, before their all-reduce)
    Biases, learned positions and ALiBi keep nothing per token in a block (ALiBi's bias, [a/t, S, S], is one tensor
    every layer shares, outside the formula: S·a/t·b bytes per sequence once)
      full       nothing: checkpointing keeps only the block's input (b·H', the previous block's output)
    Korthikanti et al. 2022 count sbh(34 + 5as/h) bytes (16-bit) for a GPT layer: a GELU MLP of 4h (19sbh),
    dropout masks, and the s×s attention scores (5as²b); here SDPA keeps a per-row log-sum-exp instead of
    the scores, there is no dropout, SwiGLU keeps four F-wide tensors, and GQA's k, v are K wide, not h."""
    H, a, F, hd, w = cfg.dim, cfg.n_heads, cfg.ffn_dim, cfg.head_dim, max(b, 4)
    K = max(cfg.n_kv_heads * hd // tp, hd)
    t_norm = tp if sp else 1
    H_norm = H / t_norm
    if how == "full":
        return 0.0
    gated, stats = cfg.mlp == "swiglu", 1 if cfg.norm == "rms" else 2   # (LayerNorm keeps mean and 1/std)
    if how == "selective":
        return b * (H / tp + 2 * K + H / tp + (2 if gated else 1) * F / tp + 2 * H) + w * a / tp
    norms = 2 * (stats * w / t_norm + b * H_norm + b * H) + (w * H_norm if b == w else 2 * w * H_norm)
    return norms + b * (2 * H / tp + 2 * K) + w * a / tp + (4 if gated else 2) * b * F / tp


def layer_formula(cfg, how: str, b: int, tp: int = 1, sp: bool = False, cp: str | None = None) -> float:
    """Bytes per token (of the B·S a rank sees) one block keeps while its backward waits, its input included where
    it is kept: activation_formula, plus the block's input b·H/t' (t' = tp under sequence parallel, else 1) —
    checkpointing (selective, full) keeps it to run the block again from it; without, a block in fp32 (b = w)
    keeps it as its first norm's input, where 16-bit keeps that norm's fp32 copy instead. Context parallel
    (cp: "ring" or "ulysses"): without checkpointing the ring's autograd function also saves its fp32 output,
    w·H/tp, and Ulysses its output before the all-to-all, b·H/tp; under selective the ring's function saves
    nothing (its output and log-sum-exp are recomputed: less b·H/tp + w·a/tp). (Measured on meta for medium,
    fp32 and bf16, with tp, sp, ring, Ulysses and each checkpointing: equal.)"""
    w, t_norm, H, a = max(b, 4), tp if sp else 1, cfg.dim, cfg.n_heads
    kept_input = b * H / t_norm if how != "none" or b == w else 0
    extra = {("ring", "none"): w * H / tp, ("ulysses", "none"): b * H / tp,
             ("ring", "selective"): -(b * H + w * a) / tp}.get((cp, how), 0)
    return activation_formula(cfg, how, b, tp, sp) + kept_input + extra


def rest_formula(cfg, b: int, tp: int = 1, sp: bool = False) -> float:
    """Bytes per token the last stage keeps beyond its blocks: the final norm's input in fp32 (w·H), 1/rms (w;
    LayerNorm 2w) and x/rms (b·H), /tp under sequence parallel; the head's input b·H (whole: all-gathered); the
    loss's fp32 log-probabilities 4·V/tp (vocabulary parallel; V padded under tp). (Measured on meta: within 40
    bytes of it.)"""
    w, t_norm, stats = max(b, 4), tp if sp else 1, 1 if cfg.norm == "rms" else 2
    vocab = cfg.padded_vocab if tp > 1 else cfg.vocab_size
    return (w * cfg.dim + stats * w + b * cfg.dim) / t_norm + b * cfg.dim + 4 * vocab / tp


def first_formula(cfg, b: int, tp: int = 1, sp: bool = False) -> float:
    """Bytes per token the first stage keeps before its blocks: with BLOOM's embedding norm (a LayerNorm) its fp32
    input w·H, mean and 1/std 2w and x/std b·H, /tp under sequence parallel; else nothing (the lookups and learned
    positions' add keep nothing but the token ids)."""
    w, t_norm = max(b, 4), tp if sp else 1
    return (w * cfg.dim + 2 * w + b * cfg.dim) / t_norm if cfg.embed_norm else 0.0


def alibi_formula(cfg, b: int, tp: int = 1, seq: int = 0) -> float:
    """Bytes a rank keeps ONCE, beside the per-token ones: ALiBi's bias, [1, a/t, S, S] in the compute dtype, which
    lab.model.alibi_bias makes once and keeps (every layer's attention, every micro-batch, checkpointing's rerun use,
    and save for their backward, that one tensor — BLOOM's 112 heads at S = 2,048 on one rank: 0.94 GB); else
    nothing."""
    return b * (cfg.n_heads // tp) * seq * seq if cfg.positions == "alibi" else 0


@contextmanager
def _fused_attention_on_meta():
    """On the meta device SDPA would take its math fallback, which keeps the S×S scores; a real run takes a
    fused kernel (flash on GPUs, its CPU twin here), which keeps the output and a log-sum-exp per row. Plan
    for the fused kernel: while inside, F.scaled_dot_product_attention on meta tensors without a mask calls it
    (every caller — the model's attention, Ulysses' — in the forward and in checkpointing's recompute alike), and
    with ALiBi's 4-D float bias too (GPUs' memory-efficient kernel takes it, and keeps it for its backward)."""
    sdpa, fused = F.scaled_dot_product_attention, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def planned(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        bias = attn_mask is not None and attn_mask.dim() == 4 and attn_mask.is_floating_point()
        if q.is_meta and (attn_mask is None or bias) and dropout_p == 0.0:   # (the fused kernel takes GQA's k, v)
            return fused(q, k, v, 0.0, is_causal, attn_mask=attn_mask, scale=scale)[0]
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)
    F.scaled_dot_product_attention = planned
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa


def step_activations(trainer, args, mesh) -> int:
    """Bytes this rank keeps for the backward of ONE micro-batch, measured by running it: the real forward of
    its model (or pipeline stage, every chunk of it) through every hook and collective (ZeRO-3's gathers,
    tensor parallel's; under the fake group they move nothing), counting with instruments.SavedBytes what
    autograd, and activation checkpointing, keep for the backward when the forward ends — but for the
    parameters and ZeRO's buffers (model state), the chunk's input (the tokens, or the activation the previous
    stage sent) and the output the next stage receives; then its backward (the reductions wait:
    opt.accumulating). On the meta device nothing is allocated; on real tensors (tests) the same function
    measures a real run, to the byte: what autograd saves does not depend on when a collective's thread lets
    go of its buffers. Not for experts: tokens are routed by value, which meta tensors do not have."""
    from lab.instruments import SavedBytes
    model, opt = trainer.model, trainer.opt
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype   # (the compute copy's)
    b, S = args.global_batch_size // (mesh.size("dp") * args.microbatches), args.seq_len // mesh.size("cp")
    keep = [*model.parameters(), *(t for u in opt.units for t in (u.buf, u.shard, u.master)),
            *shared_tensors(trainer, mesh, S, device, dtype)]   # (held once, not per micro-batch: _read adds it)
    x, kept, outs = torch.zeros(b, S, dtype=torch.long, device=device), 0, []
    with opt.accumulating(), _fused_attention_on_meta() if device.type == "meta" else nullcontext():
        for chunk in range(getattr(model, "v", 1)):
            if trainer.pipe is None:
                inp, last = x, True
            else:
                first, last = model.is_first and chunk == 0, model.is_last and chunk == model.v - 1
                t = mesh.size("tp") if getattr(model, "sequence_parallel", False) else 1
                inp = x if first else torch.zeros(b, S // t, model.cfg.dim, dtype=dtype, device=device,
                                                   requires_grad=True)   # a stage boundary [b, S/t, H]
            with SavedBytes() as saved:
                out = (model(inp, x, positions=trainer.positions) if trainer.pipe is None
                       else model(inp, x if last else None, chunk=chunk))
            kept += saved.held(exclude=keep + [inp] + ([] if last else [out]))
            outs.append((out, None if last else torch.zeros_like(out)))
        for out, grad in outs:
            out.backward(grad)
    opt.zero_grad(set_to_none=True)
    return kept


def shared_tensors(trainer, mesh, S: int, device, dtype) -> list:
    """The tensors every micro-batch's backward saves that the rank holds once, whatever it holds of micro-batches:
    ALiBi's bias (lab.model.alibi_bias's one tensor for this rank's heads at S tokens, made on first use and kept)."""
    from lab.model import ALiBi, alibi_bias
    heads = trainer.cfg.n_heads // mesh.size("tp")
    return [alibi_bias(m.n_heads, m.first, heads, S, S, device, dtype)
            for m in trainer.model.modules() if isinstance(m, ALiBi)]


def _distinct_bytes(tensors) -> int:
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


def _bytes_of(dtype) -> int:
    return torch.finfo(dtype).bits // 8


def plan_rank(args, rank: int) -> dict:
    """Join a fake process group of P ranks as `rank`, build train.py's Trainer with shapes only, and read off
    this rank's bytes by category, the formulas beside them, and the bytes per step on each mesh dimension."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    world = math.prod(getattr(args, d) for d in DIMS)
    devices = dist.Backend.backend_capability["fake"]
    dist.Backend.backend_capability["fake"] = devices + ["meta"]   # the step runs on meta: the fake group takes it
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    # what existed before this plan set aside from the collector (gc.freeze): SavedBytes.held's full collection then
    # walks only what the plan made (the step's graph and its cycles) — 0.16 s a plan in a small process, more in a
    # test run's — and nothing of the caller's is kept alive by it; given back as it was
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    try:
        mesh = Mesh(**{d: getattr(args, d) for d in DIMS}, ep=args.ep)
        trainer = train.Trainer(args, mesh, None, shapes_only=True)
        measurable = not trainer.cfg.n_experts  # (a Hugging Face directory gives its experts in its config)
        return _read(args, trainer, mesh, step_activations(trainer, args, mesh) if measurable else None)
    finally:
        if freeze:
            gc.unfreeze()
        dist.destroy_process_group()
        dist.Backend.backend_capability["fake"] = devices


def _read(args, trainer, mesh, measured=None) -> dict:
    opt, cfg, z = trainer.opt, trainer.cfg, args.zero_stage
    b_p = _bytes_of(torch.bfloat16 if args.dtype == "bfloat16" else train.store_dtype(args))
    state = dict(parameters=0, master=0, gradients=0, optimizer=0)
    for u in opt.units:
        b_m, apart = u.master.element_size(), u.offload or u.master.dtype != u.dtype
        state["parameters"] += b_p * (u.shard_numel if z == 3 else u.flat_numel)
        state["master"] += b_m * u.master.numel() if apart else 0
        state["gradients"] += b_p * sum(u.numels) if z <= 1 else b_m * u.shard_numel
        state["optimizer"] += sum(2 * b_m * (b - a) + 4 for _, a, b, _ in u.pieces)
    host = dict(master=state["master"], optimizer=state["optimizer"]) if args.offload else {}
    # activations: this rank's layers, tokens and the micro-batches it holds at once
    layers = sum(1 for _ in (trainer.model.layers.values() if trainer.pipe is not None else trainer.model.layers))
    tokens = args.global_batch_size // (mesh.size("dp") * args.microbatches) * args.seq_len // mesh.size("cp")
    t, sp, b_c = mesh.size("tp"), args.sequence_parallel and mesh.size("tp") > 1, b_p
    held = 1 if trainer.pipe is None else held_formula(args.schedule, args.pp, args.microbatches, trainer.pipe.r,
                                                       args.virtual_stages) / args.virtual_stages
    cp = None if mesh.size("cp") == 1 else "ring" if args.cp_ulysses < mesh.size("cp") else "ulysses"
    per_token = layers * layer_formula(cfg, args.activation_checkpointing, b_c, t, sp, cp)
    if trainer.pipe is None or trainer.pipe.r == args.pp - 1:
        per_token += rest_formula(cfg, b_c, t, sp)   # the final norm, the head's input, the loss
    if trainer.pipe is None or trainer.pipe.r == 0:
        per_token += first_formula(cfg, b_c, t, sp)  # the embedding's norm (BLOOM)
    S = args.seq_len // mesh.size("cp")
    device, dtype = next(trainer.model.parameters()).device, next(trainer.model.parameters()).dtype
    shared = _distinct_bytes(shared_tensors(trainer, mesh, S, device, dtype))   # ALiBi's bias: once
    formula_activations = None if cfg.n_experts else per_token * tokens * held + alibi_formula(cfg, b_c, t, S)
    activations = formula_activations if measured is None else measured * held + shared
    buffers = _buffers(opt.units, z, b_p, keep_gathered=trainer.pipe is not None)
    if z == 0 and mesh.size("dp_cp") > 1 and args.dtype == "bfloat16":  # ddp.BucketedDDP's fp32 buckets
        buffers += 4 * sum(sum(u.numels) for u in opt.units)
    device = {k: v for k, v in state.items() if k not in host}
    total = sum(device.values()) + (activations or 0) + buffers
    # ZeRO's formula for the dense units of this rank's group (stage 0: no sharding)
    dense = [u for u in opt.units if u.group is mesh.group("dp_shard_cp" if z else "dp_cp")]  # not the experts
    psi, P = sum(u.flat_numel for u in dense), dist.get_world_size(dense[0].group) if dense else 1
    master_b = 4 if args.dtype == "bfloat16" else 0
    formula = zero_state_formula(z, psi, P if z else 1, b_p, master_b, b_p if z <= 1 else (4 if master_b else b_p),
                                 2 * (4 if master_b else b_p)) if dense else {}
    return dict(rank=dist.get_rank(), coords=dict(mesh.coords), state=state, host=host, activations=activations,
                building=_building(args, trainer, mesh, state),
                activations_measured=measured, activations_formula=formula_activations, activations_shared=shared,
                buffers=buffers, total=total, formula=formula, psi=psi, group=P, per_step=_per_step(args, trainer, mesh),
                layers=layers, tokens=tokens, held=held)


def _building(args, trainer, mesh, state) -> dict:
    """The most this rank holds while train.Trainer builds its part of the model. Every layout is built on the
    meta device (shapes, no values) and ZeRO makes each flat unit from my slice alone (fsdp.shard_model's
    init_fn), so a rank holds what it keeps — its compute copies and master, and at ZeRO-0 under data parallel
    ddp.BucketedDDP's buckets — plus, for a moment, one unit's flat buffer and one whole parameter (init_tensor
    draws it whole from its seed, then the rank takes its slice). Built whole and then cut, as before, a rank
    held its whole model (or pipeline stage) first: `whole` beside it."""
    from lab.model import num_params
    b_p = _bytes_of(torch.bfloat16 if args.dtype == "bfloat16" else train.store_dtype(args))
    opt, z = trainer.opt, args.zero_stage
    kept = state["parameters"] + state["master"]   # (an offloaded master: in host memory, counted all the same)
    if z == 0 and mesh.size("dp_cp") > 1:   # data parallel's buckets, made with the model: fp32 under bf16
        kept += (4 if args.dtype == "bfloat16" else b_p) * sum(sum(u.numels) for u in opt.units)
    unit = max(max(u.flat_numel * _bytes_of(u.dtype), u.master.numel() * u.master.element_size()) for u in opt.units)
    param = 4 * max(math.prod(s) for s in train.model_shapes(args).values())
    whole = train.store_dtype(args).itemsize * num_params(trainer.cfg)
    return dict(kept=kept, peak=kept + unit + param, whole=whole)


def _buffers(units, z, b_p, keep_gathered=False) -> int:
    """The transient bytes of a step beyond the model state, at their peak (units in forward order, the root's
    last). Every stage packs a unit's gradient into one flat [N] in the master dtype to reduce it, b_m·N. At
    stages 0-1 that happens at step(), one unit at a time: b_m·N of the largest. At stage 2 it happens in
    backward, beside the unit's local gradients, b_p·N, which it then drops. At stage 3 a unit's reduction
    happens at the end of its backward, while it is gathered (b_p·N), its local gradients still exist (b_p·N,
    packed, then dropped) and the unit before it is being prefetched (b_p·N_prev): the peak over units of
    b_p·(2N_i + N_(i-1)) + b_m·N_i, plus the root unit's b_p·N_root, which stays gathered from its forward
    through backward (the course's model has no root parameters: embedding and norm + head are units).
    A pipeline keeps every unit gathered over its micro-batches: b_p·ΣN + the largest packed gradient."""
    packed = max(u.master.element_size() * u.flat_numel for u in units)
    if z < 2:
        return packed
    if z == 2:  # a unit's local gradients (b_p·N) meet its packed one at its reduction, in backward
        return max((b_p + u.master.element_size()) * u.flat_numel for u in units)
    if keep_gathered:
        return b_p * sum(u.flat_numel for u in units) + packed
    root = b_p * sum(u.flat_numel for u in units if u.root)
    order = [u for u in units if not u.root]
    return root + max(b_p * (2 * u.flat_numel + (order[i - 1].flat_numel if i else 0)) + u.master.element_size()
                      * u.flat_numel for i, u in enumerate(order))


def _per_step(args, trainer, mesh) -> dict:
    """API bytes per step on each mesh dimension this rank talks on, from the lessons' formulas."""
    cfg, z, opt = trainer.cfg, args.zero_stage, trainer.opt
    b = _bytes_of(torch.bfloat16 if args.dtype == "bfloat16" else train.store_dtype(args))
    B = args.global_batch_size // mesh.size("dp")
    S = args.seq_len // mesh.size("cp")
    out, t = {}, mesh.size("tp")
    groups = {}
    for u in opt.units:
        groups.setdefault((tuple(dist.get_process_group_ranks(u.group)), u.after_reduce is not None), []).append(u)
    for (ranks, hybrid), us in groups.items():
        if len(ranks) > 1 or hybrid:
            root = sum(u.flat_numel for u in us if u.root)
            f = zero_comm_formula(z, sum(u.flat_numel for u in us), len(ranks) if z else len(ranks), b, root,
                                  trainer.pipe is None, mesh.size("dp_replicate") if hybrid else 1,
                                  sum(len(u.params) for u in us), us[0].master.element_size(), args.microbatches
                                  if trainer.pipe is None and args.microbatches > 1 and z == 3 else 1)
            out[f"ZeRO group of {len(ranks)}"] = f
    if t > 1:
        local = replace(cfg, n_layers=len(list(trainer.model.layers.values() if trainer.pipe is not None
                                                else trainer.model.layers)))
        out["tp"] = {op: n for op, (_, n) in comm_formula(local, B, S, b, t, args.sequence_parallel).items()}
    if args.pp > 1:
        boundary = B * S * cfg.dim * b // (t if args.sequence_parallel and t > 1 else 1)
        out["pp"] = {"send": boundary, "recv": boundary}
    if mesh.size("cp") > 1:
        c, cp, hkv = S, mesh.size("cp"), max(cfg.n_kv_heads // t, 1)
        layers = len(list(trainer.model.layers.values() if trainer.pipe is not None else trainer.model.layers))
        if args.cp_ulysses > 1:
            out["cp"] = {"all_to_all": 2 * layers * ulysses_bytes(B, c, cfg.n_heads // t, hkv, cfg.head_dim, cp, b)}
        else:
            out["cp"] = {"send": layers * sum(ring_bytes(B, c, hkv, cfg.head_dim, cp, b))}
    return out


def plan(args, ranks=None) -> list[dict]:
    """plan_rank for rank 0 and the first rank of every other pipeline stage (they hold different layers). Stages
    of one kind (_stage_kind: the same layers' shapes, neither first nor last) are built on meta once: the others
    take its numbers at their own schedule's held micro-batches (_restaged) — a 64-stage pipeline plans three.
    Without a pipeline, a deep model's layers are alike too: it is planned at 2 and 3 layers and every number
    carried on to its depth (_by_layers) — a 126-layer model's meta step takes seconds, not a minute."""
    if ranks is not None:
        return [plan_rank(args, r) for r in ranks]
    if args.pp == 1:
        return [_by_layers(args, 0)]
    per_stage = math.prod(getattr(args, d) for d in DIMS[1:])
    planned, out = {}, []
    for s in range(args.pp):
        kind = _stage_kind(args, s)
        if kind not in planned:
            planned[kind] = plan_rank(args, s * per_stage)
            out.append(planned[kind])
        else:
            out.append(_restaged(args, planned[kind], s, s * per_stage))
    return out


@contextmanager
def _shaped(cfg):
    """train.py builds the model of config_of(args): while inside, that is `cfg` (cut to some layers, whatever
    --model or --init-from named)."""
    real = train.config_of
    train.config_of = lambda args: cfg
    try:
        yield
    finally:
        train.config_of = real


def _by_layers(args, rank: int) -> dict:
    """plan_rank of a model of L alike layers, from plan_rank at 2 and 3 layers: every number is a + (L - 2)·d,
    d its difference (each layer adds its state, its activations, its bytes per step; the largest unit and the
    buffers are a layer's, the same at any depth) — equal to planning all L (tests/test_memory.py checks)."""
    cfg = train.config_of(args)
    if cfg.n_layers <= 3:
        return plan_rank(args, rank)
    two, three = (_planned_at(args, rank, replace(cfg, n_layers=n)) for n in (2, 3))

    def carry(a, b):
        if isinstance(a, dict):
            return {k: carry(a[k], b[k]) for k in a}
        if isinstance(a, bool) or not isinstance(a, (int, float)):
            return a
        out = a + (b - a) * (cfg.n_layers - 2)
        return round(out) if isinstance(a, int) and isinstance(b, int) else out
    out = carry(two, three)
    out["coords"], out["rank"] = two["coords"], two["rank"]
    return out


def _planned_at(args, rank, cfg) -> dict:
    with _shaped(cfg):
        return plan_rank(args, rank)


def _stage_kind(args, s: int) -> tuple:
    """What a pipeline stage's plan depends on beyond its held micro-batches: the layers of each of its chunks
    (pipeline.Stage's split), and whether it holds the embedding (the first) or the head and loss (the last)."""
    from pipeline import split_layers
    chunks = split_layers(train.config_of(args).n_layers, args.pp * args.virtual_stages)
    return tuple(len(chunks[c * args.pp + s]) for c in range(args.virtual_stages)), s == 0, s == args.pp - 1


def _restaged(args, p: dict, s: int, rank: int) -> dict:
    """Stage s's plan from the plan `p` of a stage of its kind: the same model state, buffers, per-micro-batch
    activations and bytes per step; its own rank, place on the mesh, and micro-batches held at once."""
    held = held_formula(args.schedule, args.pp, args.microbatches, s, args.virtual_stages) / args.virtual_stages
    shared = p["activations_shared"]     # (held once, whatever the micro-batches)
    scale = lambda x: None if x is None else (x - shared) * held / p["held"] + shared   # noqa: E731 (x held)
    activations = scale(p["activations"])
    total = p["total"] - (p["activations"] or 0) + (activations or 0)
    return dict(p, rank=rank, coords=dict(p["coords"], pp=s), held=held, activations=activations,
                activations_formula=scale(p["activations_formula"]), total=total)


def parse_memory(text: str) -> float:
    """'80GB', '80GiB', '24e9' -> bytes (GB = 1e9, GiB = 2^30)."""
    units = {"GIB": 2**30, "GB": 1e9, "MIB": 2**20, "MB": 1e6, "TB": 1e12, "TIB": 2**40}
    t = text.strip().upper()
    for unit, scale in units.items():
        if t.endswith(unit):
            return float(t[:-len(unit)]) * scale
    return float(t)


def print_plan(args, plans: list[dict]) -> None:
    from lab.model import num_params
    cfg, gb = train.config_of(args), 1e9
    world = math.prod(getattr(args, d) for d in DIMS)
    limit = parse_memory(args.device_memory) if args.device_memory else None
    print(f"plan: {train.model_name(args)} ({num_params(cfg) / 1e9:.2f}B parameters) on {world} ranks: "
          + ", ".join(f"{d}={getattr(args, d)}" for d in DIMS) + f", ep={args.ep}; ZeRO-{args.zero_stage}, {args.dtype}"
          + (", offload" if args.offload else "") + f", activation checkpointing {args.activation_checkpointing}; "
          f"global batch {args.global_batch_size} x {args.seq_len}, {args.microbatches} micro-batch(es)")
    for p in plans:
        f = p["formula"]
        print(f"rank {p['rank']} {p['coords']}: {p['layers']} layers, {p['tokens']:,} tokens per micro-batch, "
              f"{p['held']:g} held at once")
        print(f"  {'':14s} {'GB on the device':>17s} {'formula':>13s}   (Ψ = {p['psi'] / 1e9:.3f}B over "
              f"{p['group']} ranks)")
        for k in ("parameters", "master", "gradients", "optimizer"):
            where = " (host)" if k in p["host"] else ""
            print(f"  {k:14s} {p['state'][k] / gb:17.3f} {f.get(k, 0) / gb:13.3f}{where}")
        act = "not modelled (experts)" if p["activations"] is None else f"{p['activations'] / gb:.3f}"
        formula = "" if p["activations_formula"] is None else f"{p['activations_formula'] / gb:13.3f}"
        how = "   (one micro-batch run on meta, x the micro-batches held" + (
            f", + ALiBi's bias once: {p['activations_shared'] / gb:.3f})" if p["activations_shared"] else ")") \
            if p["activations_measured"] is not None else ""
        print(f"  {'activations':14s} {act:>17s} {formula}{how}\n  {'buffers':14s} {p['buffers'] / gb:17.3f}\n"
              f"  {'total':14s} {p['total'] / gb:17.3f}"
              + ("" if limit is None else f"   fits {args.device_memory}: "
                 + ("yes" if p["total"] <= limit else f"NO, {p['total'] / limit:.2f}x of it")))
        b = p["building"]
        print(f"  {'building':14s} {b['peak'] / gb:17.3f}   (at most: what it keeps {b['kept'] / gb:.3f} + one unit and one "
              f"parameter; built on the meta device, never the whole model, {b['whole'] / gb:.3f})")
        for dim, ops in p["per_step"].items():
            print(f"  bytes per step, {dim}: " + ", ".join(f"{op} {n / gb:.3f} GB" for op, n in ops.items()))
