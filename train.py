"""Capstone — every strategy composed by mesh sizes, with the same losses as one process on every layout.

    torchrun --nproc_per_node N train.py --pp P --dp-replicate R --dp-shard D --cp C --tp T [--ep E]

The mesh is [pp, dp_replicate, dp_shard, cp, tp] (mesh.py), P·R·D·C·T = N; expert parallel borrows E
of the R·D data-parallel ranks. For a fixed seed and global batch every layout computes the losses
of one process. The global batch of step s is drawn from (seed, s) alone; data-parallel rank d takes
its rows, context-parallel rank c its zigzag chunks of every sequence, and the pipeline (or gradient
accumulation) cuts a rank's rows into m micro-batches. The loss is the mean over every COUNTED token
of the global batch (padded targets count nowhere, --pad-share):

    L = Σ_t CE_t / N_count          N_count: counted targets of the global batch, which every rank
                                    computes from (seed, s) alone — no communication

Each rank's micro-batch loss is its own SUM of CE over its counted tokens divided by N_count/(dp·cp·m);
after the 1/m of accumulation, the data-parallel average over the dp·cp ranks (sum, then ÷ dp·cp) is
exactly ∇L — also when ranks hold different numbers of counted tokens, where the mean of the ranks'
mean losses would weigh a token on a sparsely filled rank more than one on a full rank. (With experts
the auxiliary load-balancing loss is per forward: over one micro-batch's tokens on every rank.)

The order the lessons are applied in (each sees the model the one before left):
  1. pipeline split   pipeline.Stage: cuts whole layers (v chunks per rank when interleaved), so it
                      must see the unmodified model; everything after works on this rank's layers
  2. tensor parallel  tensor_parallel.apply_tensor_parallel: slices the weights of the layers kept
  3. context parallel ring_attention.ContextParallelAttention in each block's attn.sdpa (ring, Ulysses,
                      or Ulysses inside a ring): only the attention core changes, whatever tp did to heads
  4. expert parallel  expert_parallel.parallelize_experts: each MoE dispatches its tokens over the ep
                      group; under tp each tp rank takes 1/tp of the (replicated) tokens, so a token
                      goes to the experts once, not tp times
  5. checkpointing    each block's forward recomputed in backward, inside ZeRO-3's gather hooks
  6. ZeRO / HSDP      fsdp.shard_model, last: it flattens, shards and reduces exactly the parameters
                      the steps above left on this rank — dense ones over dp_shard×cp (replicas
                      across dp_replicate), expert ones over edp_cp (every copy of my experts)

Gradients. Dense: Σ over dp·cp ranks, ÷ dp·cp. Experts: the backward all-to-all already summed the
ep group's contributions on the expert's owner, so Σ over edp_cp, ÷ dp·cp too (÷ |edp_cp| = dp·cp/ep
would count each rank's tokens ep times). Partial over tp (replicated kv heads when tp > n_kv_heads,
sequence-parallel norms, a MoE's router and experts whose tp ranks saw different tokens): summed over
tp first, unit by unit, right before ZeRO reduces them (fsdp's before_reduce). Clipping uses the
norm of the WHOLE model: each rank adds the squares of the gradient elements it holds, weighted by
1/(ranks holding a copy), one all-reduce over the world — each element counted once.

Communication per step, per rank (API bytes; b bytes per element; Ψ' = parameters of my stage's tp
slice, Ψ'_E of them expert weights; B' = B/dp rows; m micro-batches; S' = S/cp tokens):
  ZeRO-3 (dense, group dp_shard·cp)   all-gather b·(2Ψ' − Ψ'_root), reduce-scatter 4Ψ'; a pipeline
                                      keeps units gathered over its m micro-batches: b·Ψ' and 4Ψ' once
  ZeRO-1/2                            reduce-scatter 4Ψ', all-gather b·Ψ';   ZeRO-0: all-reduce 4Ψ'
  HSDP                                + all-reduce 4Ψ'/(dp_shard·cp) over dp_replicate
  experts (group edp_cp)              the same per stage on Ψ'_E, and per MoE layer four all-to-alls
                                      of the routed rows (expert_parallel.py)
  tp                                  per layer 4 all-reduces of [B', S', H] (SP: as many all-gathers
                                      and reduce-scatters, the same wire bytes), + the embedding's,
                                      the head's and the loss's 3 of [B'·S']
  pp                                  per stage boundary B'·S'·H·b each way (SP: B'·S'·H·b/tp)
  cp (ring)                           per layer (cp−1)·2·B'·S'·d_kv·b forward, again + dk, dv home
  clipping                            one all-reduce of one float64 over the world
Model state per rank (ZeRO-3, K bytes of optimizer state per element): (b_p + b_g + K)·(Ψ' − Ψ'_E)/
(dp_shard·cp) + (b_p + b_g + K)·Ψ'_E/(dp·cp/ep), plus the norm weights every tp rank keeps whole.

    --check    afterwards rank 0 trains the model in ONE process (demo.single_process) and compares
    --compare  afterwards the same layout under PyTorch's FSDP2 + DTensor TP, losses and step times
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

import expert_parallel
import fsdp
import pipeline
import ring_attention
import tensor_parallel
from data import IGNORE, get_batch, load_corpus
from demo import finish, main, single_process
from instruments import peak_memory_bytes
from mesh import DIMS, Mesh, init_distributed
from model import build_model, flops_per_token, init_tensor, num_params
from train_cli import CP_LAYOUT, check_args, config_of, layout_of, parse_args, store_dtype  # noqa: F401  (tests use them from here)
from zero_measure import held_bytes  # the model state a rank holds, each step

PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16, from the vendors' data sheets


# ---- the command line is train_cli.py: every flag, and every invalid layout named before any collective --

def lr_at(step: int, args) -> float:
    """Linear warm-up to --lr over --warmup steps, then cosine decay to 10% at --steps (step from 1)."""
    if step <= args.warmup:
        return args.lr * step / max(1, args.warmup)
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


# ---- this rank's part of the model, lesson by lesson -------------------------------------------------

class Trainer:
    """Everything one rank needs to take a training step of its part of the model."""

    def __init__(self, args, mesh: Mesh, device):
        self.args, self.mesh, self.device = args, mesh, device
        self.cfg = cfg = config_of(args)
        store = store_dtype(args)
        self.dp, self.cp, self.tp, self.m = mesh.size("dp"), mesh.size("cp"), mesh.size("tp"), args.microbatches
        sp = args.sequence_parallel and self.tp > 1
        # Meta device: shapes only, each rank materialises just its ZeRO-3 shards (fp32 models; the
        # flat units' masters are fp32, so float64 runs are built for real).
        self.meta = args.zero_stage == 3 and self.dp * self.cp > 1 and store == torch.float32 and args.pp == 1

        # 1. pipeline split: this rank's layers (v chunks), named as in the whole model
        if args.pp > 1:
            self.pg = pipeline.PipeGroup.from_ranks(mesh.ranks("pp"))
            self.actions = pipeline.SCHEDULES[args.schedule](args.pp, self.m, args.virtual_stages)[self.pg.r]
            model = pipeline.Stage(cfg, self.pg.r, args.pp, args.seed, device, store, v=args.virtual_stages)
        else:
            self.pg = None
            model = build_model(cfg, seed=args.seed, dtype=store, device="meta" if self.meta else device)
        full_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        blocks = list(model.layers.values() if self.pg is not None else model.layers)
        # 2. tensor parallel: my slice of every weight (the MoE MLPs are left to expert parallel)
        if self.tp > 1:
            tensor_parallel.apply_tensor_parallel(model, mesh.group("tp"), sequence_parallel=sp)
        # 3. context parallel: only the attention core changes
        self.positions = None
        if self.cp > 1:
            u = args.cp_ulysses
            # 1 < u < cp: Ulysses inside groups of u cp ranks, a ring across those groups
            ring, group = (ring_attention.ring_ulysses_groups(mesh.groups_along(("cp",)), u) if 1 < u < self.cp
                           else (None, mesh.group("cp")))
            method = "ulysses" if u > 1 else "ring"
            for block in blocks:
                block.attn.sdpa = ring_attention.ContextParallelAttention(group, method, CP_LAYOUT, ring_group=ring)
            self.positions = ring_attention.shard_positions(args.seq_len, self.cp, mesh.rank("cp"), CP_LAYOUT).to(device)
        if self.pg is not None:  # the runner calls the stage without positions (and under sequence
            # parallel a stage's input holds S/tp tokens: it needs those of all S)
            model.positions = self.positions if self.cp > 1 else torch.arange(args.seq_len, device=device)
        # 4. expert parallel: a MoE dispatches each token once (under tp: each tp rank 1/tp of them)
        expert_names = set()
        if cfg.n_experts:
            expert_parallel.parallelize_experts(model, mesh, sequence_parallel=sp)
            name_of = {id(p): n for n, p in model.named_parameters()}
            expert_names = {name_of[id(p)] for p in expert_parallel.expert_parameters(model)}
            if self.tp > 1:  # each tp rank routed its own tokens: router and expert gradients are partial
                for p in expert_parallel.tp_partial_parameters(model):
                    tensor_parallel.mark_partial(model, name_of[id(p)])
        # 5. activation checkpointing (inside the module call: ZeRO-3's gather hooks cover the recompute)
        if args.activation_checkpointing == "full":
            for block in blocks:
                _checkpointed(block)
        # (how many ranks hold each gradient element, read before ZeRO replaces the parameters)
        self.copies = {n: self._copies(model, n, p, expert_names) for n, p in model.named_parameters()}
        # 6. ZeRO / HSDP, last: dense parameters over dp_shard x cp (replicas across dp_replicate),
        #    expert weights over edp_cp (every copy of my experts), all gradients divided by dp·cp
        z, dpcp = args.zero_stage, self.dp * self.cp
        named = dict(model.named_parameters())

        def init_fn(name, shape):  # my tp slice (or my experts) of the parameter's initial value
            full, p = init_tensor(cfg, name, full_shapes[name], args.seed), named[name]
            sl = getattr(p, "tp_slice", None) or getattr(p, "ep_slice", None)
            return full.narrow(sl[0], sl[1], sl[2] - sl[1]) if sl else full

        def groups_of(name, p):
            return (mesh.group("edp_cp"), dpcp) if name in expert_names else None

        partial_grads = self.tp > 1 and bool(getattr(model, "tp_partial_grads", None))
        self.opt = fsdp.shard_model(
            model, z, torch.optim.AdamW, group=mesh.group("dp_shard_cp" if z > 0 else "dp_cp"),
            replicate_group=mesh.group("dp_replicate") if z > 0 and mesh.size("dp_replicate") > 1 else None,
            divide_by=dpcp, groups_of=groups_of if expert_names else None,
            units=None if self.pg is None else _pipeline_units(model),
            reshard_after_forward=self.pg is None,  # a pipeline keeps units gathered over its micro-batches
            before_reduce=(lambda params: tensor_parallel.finish_grads(model, params)) if partial_grads else None,
            param_dtype=torch.bfloat16 if args.dtype == "bfloat16" else None,
            init_fn=init_fn if self.meta else None, lr=args.lr)
        self.model, self.loss_fn = model, getattr(model, "loss_fn", None)  # a pipeline: its last stage only
        self.grad_norm = None

    def _copies(self, model, name, p, expert_names) -> int:
        """How many ranks hold the same reduced gradient element of `name` (it counts once in the norm):
        tp — a slice 1, a kv head shared by t/n_kv ranks t/n_kv, a whole tensor (norm, router) t;
        data — stage 0 every rank that reduced it, stages 1-3 the replicas of a master slice."""
        partial = getattr(model, "tp_partial_grads", None) or {}
        if name in partial:  # summed over tp into n_slots slots: tp/n_slots ranks hold each
            tp = self.tp // partial[name][1]
        elif hasattr(p, "tp_slice"):
            tp = 1
        else:
            tp = self.tp
        if name in expert_names:
            data = self.mesh.size("edp_cp") if self.args.zero_stage == 0 else 1
        else:
            data = self.mesh.size("dp_cp") if self.args.zero_stage == 0 else self.mesh.size("dp_replicate")
        return tp * data

    # ---- one optimizer step ---------------------------------------------------------------------------
    def batch(self, step: int, tokens):
        """This rank's rows (dp) and tokens (cp) of the global batch of `step`, and the global batch's
        number of counted targets (every rank draws the same global batch: no communication)."""
        a = self.args
        x, y = get_batch(tokens, step, a.global_batch_size, a.seq_len, a.seed, pad_share=a.pad_share)
        counted = int((y != IGNORE).sum())
        x, y = (t.chunk(self.dp)[self.mesh.rank("dp")].to(self.device) for t in (x, y))  # my rows
        if self.cp > 1:
            x, y = (ring_attention.shard_sequence(t, self.cp, self.mesh.rank("cp"), CP_LAYOUT) for t in (x, y))
        return x, y, counted

    def step(self, step: int, tokens) -> torch.Tensor:
        """Forward, backward, reduction, clipping, AdamW. Returns this rank's share of the global loss
        (summed over the ranks of one tp group's rank 0, it is the global loss)."""
        a, model, m = self.args, self.model, self.m
        for g in self.opt.param_groups:
            g["lr"] = lr_at(step + 1, a)
        x, y, counted = self.batch(step, tokens)
        if self.loss_fn is not None:  # Σ CE / divide_by per micro-batch; ÷m, then ÷dp·cp: Σ CE / counted
            self.loss_fn.divide_by = max(counted, 1) / (self.dp * self.cp * m)
        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        # Several backwards per step (micro-batches, a pipeline): ZeRO reduces once, after the last one
        # (and zero bubble's deferred W); one backward: ZeRO-2/3 reduce unit by unit during it.
        several = self.pg is not None or m > 1
        with self.opt.accumulating() if several else contextlib.nullcontext():
            if self.pg is not None:
                out = pipeline.pipeline_step(model, self.actions, self.pg, x, y, m)
                loss += sum(v.double() for v in (out["loss"], out["aux"]) if v is not None)
            else:
                for xm, ym in zip(x.chunk(m), y.chunk(m)):  # gradient accumulation
                    lm = model(xm, ym, positions=self.positions)
                    (lm / m).backward()
                    loss += lm.detach().double() / m
        self.opt.reduce_gradients()   # (tp partial sums first, unit by unit: before_reduce)
        if a.grad_clip:
            self.grad_norm = self.opt.clip_grad_norm_(a.grad_clip, group=dist.group.WORLD,
                                                      weight_of=lambda n: 1.0 / self.copies[n])
        self.opt.step()
        self.state = held_bytes(self.opt)  # model state held between steps (gradients included)
        self.opt.zero_grad(set_to_none=True)
        return loss / (self.dp * self.cp)

    def global_loss(self, share: torch.Tensor) -> float:
        """Σ of the ranks' shares (tp ranks hold the same numbers: tp rank 0 counts for its group)."""
        v = share.clone() if self.mesh.rank("tp") == 0 else torch.zeros_like(share)
        dist.all_reduce(v)
        return v.item()

    # ---- checkpoints: each rank its own shards ----------------------------------------------------------
    def save(self, path: str, step: int) -> None:
        """Each rank writes its shards and optimizer state; rank 0 writes meta.json LAST (complete)."""
        os.makedirs(path, exist_ok=True)
        cuda = self.device.type == "cuda"
        torch.save(dict(step=step, shards=self.opt.shard_state_dict(), rng=torch.get_rng_state(),
                        cuda_rng=torch.cuda.get_rng_state(self.device) if cuda else None),
                   os.path.join(path, f"rank{dist.get_rank()}.pt"))
        dist.barrier()
        if dist.get_rank() == 0:
            with open(os.path.join(path, "meta.json"), "w") as f:
                json.dump(dict(step=step, world_size=dist.get_world_size(), layout=layout_of(self.args)), f)
        dist.barrier()

    def load(self, path: str) -> int:
        state = torch.load(os.path.join(path, f"rank{dist.get_rank()}.pt"), map_location=self.device,
                           weights_only=False)
        self.opt.load_shard_state_dict(state["shards"])
        torch.set_rng_state(state["rng"])
        if state["cuda_rng"] is not None:
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        return state["step"]


def _checkpointed(block):
    """Full activation checkpointing of one block: only its input is saved; its forward runs again in
    backward. The wrapper sits INSIDE the module call, so ZeRO-3's gather hooks cover the recompute."""
    inner = block.forward
    block.forward = lambda h, cos, sin: checkpoint(inner, h, cos, sin, use_reentrant=False)


def _pipeline_units(stage):
    """In a pipeline every module with parameters is a ZeRO unit (blocks, embedding, norm, head)."""
    return list(stage.layers.values()) + [m for m in (stage.tok_embeddings, getattr(stage, "norm", None),
                                                      getattr(stage, "output", None)) if m is not None]


# ---- the loop ------------------------------------------------------------------------------------------

def _peak_memory(device) -> int:
    """CUDA allocator peak on a GPU; the process's peak resident set size on CPU."""
    return peak_memory_bytes(device) or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _peak_flops(device) -> float | None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def train(args, device=None, verbose: bool = True) -> dict:
    """Train on every rank of an initialised process group; returns (on every rank) the global losses
    per step and this rank's measurements."""
    from instruments import CommCounter, sync
    device = device or torch.device("cpu")
    check_args(args, dist.get_world_size())                    # every rank, before any collective
    mesh = Mesh(**{d: getattr(args, d) for d in DIMS}, ep=args.ep)
    tokens = load_corpus(args.data)
    trainer = Trainer(args, mesh, device)
    start = trainer.load(args.resume) if args.resume else 0
    rank0, world, cuda = dist.get_rank() == 0, dist.get_world_size(), device.type == "cuda"
    fpt, peak = flops_per_token(trainer.cfg, args.seq_len), _peak_flops(device) if args.dtype == "bfloat16" else None
    if verbose and rank0:
        print(f"train.py: {mesh}, zero stage {args.zero_stage}, model {args.model} ({num_params(trainer.cfg):,} "
              f"parameters), {args.dtype}, global batch {args.global_batch_size}x{args.seq_len}, {device}"
              + (f", resuming after step {start}" if start else ""), flush=True)
    out = dict(losses=[], tokens_per_s=[], comm_bytes=[], peak_memory_bytes=[], grad_norms=[], start=start)
    last = args.stop_at or args.steps
    comm = CommCounter()
    for s in range(start, last):
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        sync(device)
        t0 = time.perf_counter()
        comm.reset()
        with comm if world > 1 else contextlib.nullcontext():  # one process has nothing to count
            share = trainer.step(s, tokens)
        sync(device)
        tps = args.global_batch_size * args.seq_len / (time.perf_counter() - t0)
        loss, lr, mem, nbytes = trainer.global_loss(share), lr_at(s + 1, args), _peak_memory(device), comm.bytes()
        wire = comm.wire_bytes()
        mfu = fpt * tps / (peak * world) if peak else None
        norm = None if trainer.grad_norm is None else float(trainer.grad_norm)
        for k, v in [("losses", loss), ("tokens_per_s", tps), ("comm_bytes", nbytes), ("peak_memory_bytes", mem),
                     ("grad_norms", norm)]:
            out[k].append(v)
        if rank0 and verbose and not args.quiet:
            print(f"step {s + 1:4d}  loss {loss:.6f}  lr {lr:.2e}  {tps:10.0f} tokens/s"
                  + (f"  MFU {mfu:5.1%}" if mfu is not None else "")
                  + f"  peak mem {mem / 2**20:7.1f} MiB  comm {nbytes / 2**20:.3f} MiB (ring {wire / 2**20:.3f}, rank 0)",
                  flush=True)
        if rank0 and args.log_file:
            with open(args.log_file, "a") as f:
                f.write(json.dumps(dict(step=s + 1, loss=loss, lr=lr, tokens_per_s=tps, peak_memory_bytes=mem,
                                        comm_bytes=nbytes, mfu=mfu)) + "\n")
    state = getattr(trainer, "state", None) or held_bytes(trainer.opt)
    if rank0 and verbose:
        print("model state on rank 0 after a step: " + ", ".join(f"{k} {v / 2**10:.1f} KiB" for k, v in state.items()),
              flush=True)
    out.update(comm_summary=comm.summary(), comm_events=[(e.op, e.group_ranks, e.api_bytes) for e in comm.events],
               state_bytes=state, coords=dict(mesh.coords), meta_init=trainer.meta,
               zero_units=[(u.N, u.names[0], dist.get_world_size(u.group), len(u.params)) for u in trainer.opt.units])
    if args.save:
        trainer.save(args.save, last)
    if args.check:
        ok = True
        if rank0:
            want = reference_losses(args, range(start, last), device)
            err = max(abs(a - b) for a, b in zip(out["losses"], want))
            tol = {"float64": 1e-9, "float32": 1e-4, "bfloat16": 5e-2}[args.dtype]
            ok = err < tol
            print(f"losses vs the single-process run: max |diff| {err:.2e} (tolerance {tol}) -> "
                  f"{'ok' if ok else 'MISMATCH'}", flush=True)
        from demo import all_agree
        out["check_ok"] = all_agree(ok)
    return out


# ---- the single-process reference ------------------------------------------------------------------------

def reference_losses(args, steps: range = None, device=None) -> list[float]:
    """model.py's model in ONE process on the whole global batch (demo.single_process): AdamW, torch's
    own clip_grad_norm_, the same learning rate (bf16 runs are compared with fp32). With experts and
    m > 1 micro-batches it accumulates over the same micro-batches a parallel run makes — micro-batch
    i gathers the i-th rows of every data-parallel rank — since the aux loss is per forward."""
    steps = steps or range(args.steps)
    model = build_model(config_of(args), seed=args.seed, device=device,
                        dtype=store_dtype(args))
    tokens = load_corpus(args.data)
    batches = [get_batch(tokens, s, args.global_batch_size, args.seq_len, args.seed, pad_share=args.pad_share,
                         device=device or "cpu") for s in range(steps.stop)]
    dp, m = args.dp_replicate * args.dp_shard, args.microbatches

    def loss_fn(model, batch):
        x, y = batch
        if not args.experts or m == 1:
            return model(x, y)
        model.loss_fn.divide_by = max(int((y != IGNORE).sum()), 1) / m   # Σ CE over micro-batch / (counted/m)
        rows = torch.arange(len(x)).view(dp, m, -1).transpose(0, 1).reshape(m, -1)  # [m, rows of mb i]
        loss = sum(model(x[r], y[r]) for r in rows) / m
        model.loss_fn.divide_by = None
        return loss
    out = single_process(model, batches, lr=args.lr, lr_at=lambda s: lr_at(s, args),
                         clip=args.grad_clip or None, loss_fn=loss_fn)
    return out["losses"][steps.start:]


def run_layouts(layouts: list[list[str]], common: list[str] = ()) -> list[dict]:
    """A rank function (launch.run_ranks): train each layout in turn on the same ranks; every layout's
    flags are `common + layout`. Returns each layout's result on this rank."""
    return [dict(train(parse_args([*common, *flags, "--quiet"]), verbose=False), flags=" ".join(flags))
            for flags in layouts]


def run(argv=None, compare=None) -> int:
    """torchrun entry point. compare(args, device) -> (losses, seconds per step): the same layout under
    PyTorch's own FSDP2 + DTensor TP (references.train_fsdp2_tp, handed in below __main__), for --compare."""
    args = parse_args(argv)
    check_args(args, int(os.environ.get("WORLD_SIZE", "1")))  # before joining: every rank alike, no hang
    device = init_distributed()
    out = train(args, device)
    if args.compare and compare is not None:
        t_ours = statistics.median(args.global_batch_size * args.seq_len / t for t in out["tokens_per_s"][1:]
                                   or out["tokens_per_s"])
        theirs, step_time = compare(args, device)
        err = max(abs(a - b) for a, b in zip(out["losses"], theirs))
        if dist.get_rank() == 0:
            print(f"PyTorch FSDP2 + DTensor TP, same layout: max |loss diff| {err:.2e}; median step "
                  f"{t_ours * 1e3:.1f} ms (ours) vs {step_time * 1e3:.1f} ms (PyTorch) -> our throughput "
                  f"{step_time / t_ours:.2f}x PyTorch's", flush=True)
    return finish(out.get("check_ok", True))


if __name__ == "__main__":  # PyTorch's own version only here, handed to run as what --compare runs
    from references import train_fsdp2_tp
    main(lambda argv: run(argv, compare=train_fsdp2_tp))
