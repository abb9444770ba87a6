"""ZeRO measured (fsdp.py, hsdp.py): the formulas for the model-state bytes a rank holds and the bytes
it hands to each collective per step, and one training run that measures both. The demos, the tests
and the notebook compare the one with the other; the lesson itself is fsdp.py.

Bytes per rank, for Ψ elements sharded over P ranks, b_p bytes per parameter, b_g per gradient and
K per element of optimizer state and fp32 master (Rajbhandari et al. 2020, "ZeRO", arXiv:1910.02054
§5): stage 0 (b_p + b_g + K)Ψ; stage 1 (b_p + b_g)Ψ + KΨ/P; stage 2 b_pΨ + (b_g + K)Ψ/P; stage 3
(b_p + b_g + K)Ψ/P. API bytes per step: stage 0 all-reduces 4Ψ; stages 1-2 reduce-scatter 4Ψ and
all-gather b_pΨ; stage 3 all-gathers b_p(2Ψ − Ψ_root) (b_pΨ if units stay gathered) and
reduce-scatters 4Ψ; plus one int32 per parameter tensor (which parameters got a gradient).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from fsdp import shard_model
from mesh import collective_device, resolve_group


# ---- the formulas the measurements are compared with ---------------------------------------------

def zero_state_formula(stage: int, numel: int, P: int, param_bytes: int = 4, master_bytes: int = 0,
                       grad_bytes: int | None = None, state_bytes: int = 8) -> dict:
    """Model-state bytes per rank by category (ZeRO §5; K = master_bytes + state_bytes) for numel elements
    sharded P ways. grad_bytes: what a *held* gradient element takes; stages 0-1 hold the local gradient in
    the compute dtype (default param_bytes), stages 2-3 the reduced fp32 shard (4)."""
    grad_bytes = (param_bytes if stage <= 1 else 4) if grad_bytes is None else grad_bytes
    sharded = lambda on: numel / P if on else numel  # noqa: E731  (Ψ/P once the stage shards it)
    out = dict(parameters=param_bytes * sharded(stage >= 3), master=master_bytes * sharded(stage >= 1),
               gradients=grad_bytes * sharded(stage >= 2), optimizer=state_bytes * sharded(stage >= 1))
    return dict(out, total=sum(out.values()))


def zero_comm_formula(stage: int, numel: int, P: int, param_bytes: int = 4, root_numel: int = 0,
                      reshard_after_forward: bool = True, replicas: int = 1, n_params: int = 0,
                      grad_bytes: int = 4, microbatches: int = 1) -> dict:
    """API bytes per step by collective for one group: numel = Ψ padded, root_numel the root unit's part,
    gradients reduced in grad_bytes, n_params parameter tensors (one int32 used-flag each); replicas > 1
    (HSDP): shards and flags are all-reduced across replicas too; microbatches: backwards inside
    opt.accumulating() before one step (stage 3 gathers again for each one unless it keeps its units)."""
    flags = 4 * n_params if P > 1 else 0  # (a group of one agrees with itself: no collective)
    if stage == 0:
        return {"all_reduce": grad_bytes * numel + flags} if P > 1 else {}
    gathered = microbatches * (2 * numel - root_numel) if stage == 3 and reshard_after_forward else numel
    out = {"reduce_scatter": grad_bytes * numel, "all_gather": param_bytes * gathered,
           "all_reduce": flags + (grad_bytes * numel // P + 4 * n_params if replicas > 1 else 0)}
    return {k: v for k, v in out.items() if v}


# ---- what a rank holds, and a measured run (the demos, the tests and the notebook call it) ----------

def held_bytes(opt, units=None) -> dict:
    """Model-state bytes a ZeroOptimizer's rank holds, by category (storage-based: views count once);
    units: only these of opt.units (e.g. one process group's), with their optimizer state."""
    from types import SimpleNamespace

    from instruments import model_state_bytes
    units = opt.units if units is None else units
    mine = {id(q) for u in units for *_, q in u.pieces}
    state = SimpleNamespace(state={q: s for q, s in opt.inner.state.items() if id(q) in mine})
    masters = [u.master for u in units if u.master.data_ptr() != u.shard.data_ptr()]  # a cast apart
    grads = [u.master.grad for u in units if u.master.grad is not None]  # reduced (stages 2-3: held)
    ms = model_state_bytes([p for u in units for p in u.params] + [u.shard for u in units], state,
                           extra={"master": masters, "g": grads})
    ms["gradients"] += ms.pop("g")
    return ms


def train_and_measure(stage, model_name="tiny", steps=3, batch=8, seq=32, lr=1e-2, group=None, replicate_group=None,
                      meta=False, seed=0, dtype=torch.float32, track_peak=False, microbatches=1, **shard_kwargs):
    """Shard the shared model, train `steps` global batches with AdamW (microbatches > 1: that many backwards
    inside opt.accumulating() per step); return the full parameters, the losses and what the last step
    measured (bytes by collective; model state at rest; MemTracker's peak if track_peak) beside the formulas."""
    import warnings

    from data import get_batch, load_corpus
    from instruments import CommCounter, memory_tracker
    from model import build_model, get_config, init_tensor
    cfg, group, device = get_config(model_name), resolve_group(group), collective_device(group)
    P, R = dist.get_world_size(group), dist.get_world_size(replicate_group) if replicate_group is not None else 1
    dp_rank = dist.get_rank(group) + P * (dist.get_rank(replicate_group) if R > 1 else 0)  # replica-major
    model = build_model(cfg, seed, dtype, device="meta" if meta else device)
    opt = shard_model(model, stage, group=group, replicate_group=replicate_group if R > 1 else None, lr=lr,
                      init_fn=(lambda name, shape: init_tensor(cfg, name, shape, seed)) if meta else None,
                      **shard_kwargs)
    tokens, losses, peak, m = load_corpus(), [], None, microbatches
    for s in range(steps):
        x, y = get_batch(tokens, s, batch, seq, seed, dp_rank, P * R, device=device)
        tracked = track_peak and s == steps - 1
        with memory_tracker(model, opt.inner) if tracked else contextlib.nullcontext() as mt, \
                warnings.catch_warnings(), CommCounter() as comm:  # MemTracker: "no .grad" (ours are sharded)
            warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper")
            loss = 0.0
            for xm, ym in zip(x.chunk(m), y.chunk(m)):
                with opt.accumulating() if m > 1 else contextlib.nullcontext():
                    (part := model(xm, ym) / m).backward()
                loss = loss + part.detach()
            opt.step()
        peak = next(iter(mt.get_tracker_snapshot("peak").values()))["Total"] if tracked else peak
        memory = held_bytes(opt)  # at rest, after the step (before zero_grad)
        opt.zero_grad()
        dist.all_reduce(loss := loss.double())  # the global batch's loss, for printing (outside the counter)
        losses.append(loss.item() / (P * R))
    numel, k, root = sum(u.N for u in opt.units), sum(len(u.params) for u in opt.units), opt.units[-1]
    root_numel = root.N if "tok_embeddings.weight" in root.names else 0
    pb, gb, mb = root.buf.element_size(), root.master.element_size(), 0 if root.dtype == root.master.dtype else 4
    rs = shard_kwargs.get("reshard_after_forward", True)
    return dict(state={k: v.cpu() for k, v in opt.full_state_dict().items()}, losses=losses, peak=peak, stage=stage,
                comm=comm.summary(), events=[(e.op, e.group_ranks, e.api_bytes) for e in comm.events], memory=memory,
                numel=numel, root_numel=root_numel, n_params=k, P=P, param_bytes=pb,
                memory_formula=zero_state_formula(stage, numel, P, pb, mb, pb if stage <= 1 else gb, 2 * gb),
                comm_formula=zero_comm_formula(stage, numel, P, pb, root_numel, rs, R, k, gb, microbatches),
                grad_norm=None if opt.grad_norm is None else opt.grad_norm.item())


def measure_runs(configs, **kwargs) -> list[dict]:
    """A rank function for the notebook: train_and_measure(**config, **kwargs) for each config, without the
    parameters; each result carries its config."""
    return [{k: v for k, v in train_and_measure(**c, **kwargs).items() if k not in ("state", "events")} | c
            for c in configs]


# ---- the demos' check (fsdp.py, hsdp.py) ---------------------------------------------------------

def one_process_check(state, model_name, steps, batch, seq, lr, param_dtype, device) -> bool:
    """Full parameters after `steps` against the single-process run on the same global batches, printed.
    Adam turns rounding-level gradient differences into up to a whole step (lr) on elements whose gradient
    is ~0: fp32 within 5% of a step per step, bf16 compute within 2 steps."""
    from data import get_batch, load_corpus
    from demo import all_agree, max_diff, single_process
    from mesh import print0
    from model import build_model
    tokens = load_corpus()
    batches = [get_batch(tokens, s, batch, seq, 0, device=device) for s in range(steps)]
    ref = single_process(build_model(model_name, seed=0, device=device), batches, lr=lr, compute_dtype=param_dtype)
    err, tol = max_diff(state, ref["model"].state_dict()), (0.05 if param_dtype is None else 2.0) * lr * steps
    ok = all_agree(err < tol)
    print0(f"parameters vs the single-process run: max |diff| = {err:.2e} (tolerance {tol:.1e}) -> "
           f"{'ok' if ok else 'MISMATCH'}")
    return ok
