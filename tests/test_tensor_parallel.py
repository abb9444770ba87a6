"""tensor_parallel.py: equal to the single-process model, the collectives Megatron predicts,
sequence parallel at the same bytes, the vocab-parallel loss, DTensor parity, clear errors."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness import global_batches, reference_model, run_ranks, run_script, train_reference
from instruments import CommCounter
from model import build_model, get_config
import tensor_parallel as tp

B, S = 2, 16


def _batch():
    x, y = global_batches(1, B, S, seed=3)[0]
    y = y.clone()
    y[0, :5] = -100  # ignored labels: the loss averages over the other tokens only
    return x, y


def _slice(full, p):
    if not hasattr(p, "tp_slice"):
        return full
    dim, a, b = p.tp_slice
    return full.narrow(dim, a, b - a)


def _one_config(cfg, dtype, sp):
    """One forward/backward against the single-process model: errors and counted collectives."""
    x, y = _batch()
    ref = build_model(cfg, seed=0, dtype=dtype)
    ref_loss = ref(x, y)
    ref_loss.backward()
    ref_logits = ref(x).detach()
    model = tp.apply_tensor_parallel(copy.deepcopy(ref), None, sequence_parallel=sp)
    with CommCounter() as fwd:
        loss = model(x, y)
    with CommCounter() as bwd:
        loss.backward()
    with CommCounter() as fin:
        tp.finish_grads(model)
    logits = tp.gather_last_dim(model(x).detach(), dist.group.WORLD)
    ref_grads = dict(ref.named_parameters())
    grad_err = max((p.grad - _slice(ref_grads[n].grad, p)).abs().max().item()
                   for n, p in model.named_parameters())
    local = sum(p.numel() for p in model.parameters())
    return dict(loss=abs(loss.item() - ref_loss.item()), logits=(logits - ref_logits).abs().max().item(),
                grads=grad_err, fwd=fwd.summary(), bwd=bwd.summary(), fin=fin.summary(),
                local_params=local, loss_value=loss.item())


def _parity_rank():
    """Everything one group of ranks checks (one spawn per tp size: spawning costs seconds)."""
    out = {}
    # float32 (tight tolerance) at tp=2; float64 (exact) everywhere
    for dtype in (torch.float64, torch.float32) if dist.get_world_size() == 2 else (torch.float64,):
        for sp in (False, True):
            out[(str(dtype), sp, 2)] = _one_config(get_config("tiny"), dtype, sp)
    for sp in (False, True):  # one more layer: the per-layer count is the difference
        out[("torch.float64", sp, 3)] = _one_config(get_config("tiny", n_layers=3), torch.float64, sp)
    extra = _train_vs_dtensor_rank(3) if dist.get_world_size() == 2 else _vocab_ce_and_errors_rank()
    return out, extra


_RESULTS = {}


def _results(t):
    """Run the tp=t group once per session; several tests read its results."""
    if t not in _RESULTS:
        _RESULTS[t] = run_ranks(_parity_rank, t, timeout=300)
    return _RESULTS[t]


def _calls(summary, op):
    return summary.get(op, {}).get("calls", 0)


def _bytes(summary, op):
    return summary.get(op, {}).get("bytes", 0)


def _wire(summary):
    return sum(s["wire_bytes"] for s in summary.values())


@pytest.mark.parametrize("t", [2, 4])
def test_matches_single_process_and_counts_collectives(t):
    cfg = get_config("tiny")
    H, N = cfg.dim, B * S
    for res, _ in _results(t):
        for (dtype, sp, L), r in res.items():
            tol = 1e-12 if dtype == "torch.float64" else 2e-6
            assert r["loss"] < tol and r["logits"] < tol and r["grads"] < tol, ((dtype, sp, L), r)
            b = 8 if dtype == "torch.float64" else 4
            act = N * H * b                         # one [B, S, H] activation
            fwd, bwd, fin = r["fwd"], r["bwd"], r["fin"]
            if not sp:   # Megatron: embedding + 2 per layer + 3 loss reductions forward; 2L + head backward
                assert set(fwd) == {"all_reduce"} and set(bwd) == {"all_reduce"}
                assert _calls(fwd, "all_reduce") == 2 * L + 4
                assert _bytes(fwd, "all_reduce") == (2 * L + 1) * act + 3 * N * b
                assert _calls(bwd, "all_reduce") == 2 * L + 1
                assert _bytes(bwd, "all_reduce") == (2 * L + 1) * act
            else:        # each activation all-reduce became an all-gather + a reduce-scatter
                assert _calls(fwd, "all_gather") == _calls(fwd, "reduce_scatter") == 2 * L + 1
                assert _calls(bwd, "all_gather") == _calls(bwd, "reduce_scatter") == 2 * L + 1
                assert _calls(fwd, "all_reduce") == 3 and _calls(bwd, "all_reduce") == 0
                assert _bytes(fwd, "all_gather") == _bytes(fwd, "reduce_scatter") == (2 * L + 1) * act
                # same wire bytes per step as without sequence parallel, forward and backward
                plain = res[(dtype, False, L)]
                assert _wire(fwd) == pytest.approx(_wire(plain["fwd"]), rel=1e-12)
                assert _wire(bwd) == pytest.approx(_wire(plain["bwd"]), rel=1e-12)
                assert r["loss_value"] == pytest.approx(plain["loss_value"], abs=1e-12 if b == 8 else 1e-6)
            # finish_grads: replicated kv heads (zero-padded to n_kv slots) + SP norm weights
            kv = L * 2 * cfg.n_kv_heads * cfg.head_dim * H if cfg.n_kv_heads % t else 0
            norms = (2 * L + 1) * H if sp else 0
            assert _calls(fin, "all_reduce") == (1 if kv + norms else 0)
            assert _bytes(fin, "all_reduce") == (kv + norms) * b
        for sp in (False, True):  # exactly two more of each per extra layer
            two, three = res[("torch.float64", sp, 2)], res[("torch.float64", sp, 3)]
            for phase in ("fwd", "bwd"):
                for op in ("all_reduce", "all_gather", "reduce_scatter"):
                    want = 2 if (op == "all_reduce") != sp else 0  # SP trades each all-reduce for AG + RS
                    assert _calls(three[phase], op) - _calls(two[phase], op) == want, (sp, phase, op)
        # every matmul weight is split t ways (kv heads replicated past n_kv); norms replicated
        kv_rows = max(cfg.n_kv_heads // t, 1) * cfg.head_dim
        per_layer = 2 * H * H // t + 2 * kv_rows * H + 3 * H * cfg.ffn_dim // t + 2 * H
        assert res[("torch.float64", False, 2)]["local_params"] == \
            2 * cfg.vocab_size * H // t + cfg.n_layers * per_layer + H


def _dtensor_tensor_parallel(model, group, sp=False):
    """PyTorch's reference: the same split with DTensor's parallelize_module (torchtitan's plan)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    seq = Shard(1) if sp else Replicate()
    plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "output": ColwiseParallel(input_layouts=seq, output_layouts=Replicate())}
    if sp:
        plan["norm"] = SequenceParallel()
    for i in range(len(model.layers)):
        p = f"layers.{i}."
        plan.update({p + n: ColwiseParallel() for n in ("attn.wq", "attn.wk", "attn.wv", "mlp.w1", "mlp.w3")})
        plan.update({p + n: RowwiseParallel(output_layouts=seq) for n in ("attn.wo", "mlp.w2")})
        if sp:
            plan.update({p + "attn_norm": SequenceParallel(), p + "mlp_norm": SequenceParallel(),
                         p + "attn": PrepareModuleInput(input_layouts=(seq, None, None),
                                                        desired_input_layouts=(Replicate(), None, None)),
                         p + "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))})
    return parallelize_module(model, DeviceMesh.from_group(group, device_type="cpu"), plan)


def _train_vs_dtensor_rank(steps):
    """A few AdamW steps: by hand (TP and TP+SP) and DTensor, all against one process."""
    cfg = get_config("tiny")
    ref = reference_model(cfg, dtype=torch.float64)  # float64: Adam's sign-like early steps amplify fp32 noise
    batches = global_batches(steps, B, S, seed=1)
    ref_losses, trained = train_reference(ref, batches, lr=1e-2)
    out = {}
    for name in ("tp", "tp_sp", "dtensor", "dtensor_sp"):
        if name.startswith("dtensor"):
            m = _dtensor_tensor_parallel(copy.deepcopy(ref), dist.group.WORLD, sp=name == "dtensor_sp")
        else:
            m = tp.apply_tensor_parallel(copy.deepcopy(ref), None, name == "tp_sp")
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False)
        losses = [tp.train_step(m, opt, x, y).item() for x, y in batches]
        full = dict(trained.named_parameters())
        err = 0.0
        for n, p in m.named_parameters():
            mine = p.full_tensor() if hasattr(p, "full_tensor") else p
            err = max(err, (mine.detach() - _slice(full[n].detach(), p)).abs().max().item())
        out[name] = dict(losses=losses, param_err=err)
    out["ref"] = ref_losses
    return out


def test_training_equals_single_process_and_dtensor():
    for _, res in _results(2):
        ref = res["ref"]
        assert ref[0] != pytest.approx(ref[-1], abs=1e-3)  # training moved
        for name in ("tp", "tp_sp", "dtensor", "dtensor_sp"):
            assert res[name]["losses"] == pytest.approx(ref, abs=1e-12), name
            assert res[name]["param_err"] < 1e-12, (name, res[name]["param_err"])
        assert res["tp"]["losses"] == pytest.approx(res["dtensor"]["losses"], abs=1e-12)
        assert res["tp_sp"]["losses"] == pytest.approx(res["dtensor_sp"]["losses"], abs=1e-12)


def _vocab_ce_and_errors_rank():
    t, r = dist.get_world_size(), dist.get_rank()
    out = {}
    # vocab-parallel cross-entropy vs F.cross_entropy on the whole logits, value and gradient
    gen = torch.Generator().manual_seed(0)
    N, V = 24, 256
    full = (torch.randn(N, V, generator=gen, dtype=torch.float64) * 4).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=gen)
    targets[::5] = -100
    ref = F.cross_entropy(full, targets)
    ref.backward()
    a, b = r * V // t, (r + 1) * V // t
    local = full.detach()[:, a:b].clone().requires_grad_()
    with CommCounter() as c:
        loss = tp.VocabParallelCE.apply(local, targets, a, dist.group.WORLD, -100)
    loss.backward()
    out["ce"] = (abs(loss.item() - ref.item()), (local.grad - full.grad[:, a:b]).abs().max().item(),
                 c.calls("all_reduce"), c.bytes("all_reduce"))
    # every indivisible size: one ValueError naming the fix, before any collective
    bad = {"n_heads": get_config("tiny", dim=48, n_heads=6, n_kv_heads=2),
           "n_kv_heads": get_config("tiny", dim=96, n_heads=12, n_kv_heads=3),
           "ffn_dim": get_config("tiny", ffn_dim=66),
           "vocab_size": get_config("tiny", vocab_size=258),
           "expert": get_config("tiny", n_experts=4)}
    errors = {}
    for key, cfg in bad.items():
        with CommCounter() as c:
            try:
                tp.apply_tensor_parallel(build_model(cfg), None)
                errors[key] = None
            except ValueError as e:
                errors[key] = (str(e), c.calls())
    m = tp.apply_tensor_parallel(build_model("tiny"), None, sequence_parallel=True)
    with CommCounter() as c:
        try:
            x = torch.randint(0, 256, (2, 18))  # 18 tokens over 4 ranks
            m(x, x)
            errors["sequence"] = None
        except ValueError as e:
            errors["sequence"] = (str(e), c.calls())
    out["errors"] = errors
    # inside a 2-D mesh: tp=2 groups {0,1}, {2,3} next to data parallel (same batch here)
    from mesh import Mesh
    mesh = Mesh(dp_shard=2, tp=2)
    x, y = _batch()
    ref = build_model("tiny", dtype=torch.float64)
    ref_loss = ref(x, y)
    ref_loss.backward()
    m = tp.apply_tensor_parallel(copy.deepcopy(ref), mesh, sequence_parallel=True)
    with CommCounter() as c:
        loss = m(x, y)
        loss.backward()
        tp.finish_grads(m)
    full = dict(ref.named_parameters())
    out["mesh"] = (abs(loss.item() - ref_loss.item()),
                   max((p.grad - _slice(full[n].grad, p)).abs().max().item() for n, p in m.named_parameters()),
                   {e.group_ranks for e in c.events}, mesh.ranks("tp"))
    # a pipeline Stage (layers in a ModuleDict; no head on the first, no embedding on the last):
    # the two stages of a 2-stage split, made tensor parallel and run one after the other
    from pipeline import Stage
    stages = [tp.apply_tensor_parallel(Stage(get_config("tiny"), s, 2, dtype=torch.float64), None) for s in (0, 1)]
    loss = stages[1](stages[0](x), y)
    loss.backward()
    for st in stages:
        tp.finish_grads(st)
    out["stage"] = (abs(loss.item() - ref_loss.item()),
                    max((p.grad - _slice(full[n].grad, p)).abs().max().item()
                        for st in stages for n, p in st.named_parameters()),
                    sorted(n for st in stages for n, p in st.named_parameters() if hasattr(p, "tp_slice")))
    return out


def test_vocab_parallel_cross_entropy_errors_and_mesh():
    for _, res in _results(4):
        loss_err, grad_err, calls, nbytes = res["ce"]
        assert loss_err < 1e-13 and grad_err < 1e-15
        assert calls == 3 and nbytes == 3 * 24 * 8  # max, target logit, sum of exponentials
        words = {"n_heads": "n_heads=6", "n_kv_heads": "n_kv_heads=3", "ffn_dim": "ffn_dim",
                 "vocab_size": "vocab_size=258", "expert": "expert parallel", "sequence": "multiple of 4"}
        for key, word in words.items():
            assert res["errors"][key] is not None, key
            msg, calls = res["errors"][key]
            assert word in msg and calls == 0, (key, msg, calls)
        loss_err, grad_err, groups, tp_ranks = res["mesh"]
        assert loss_err < 1e-12 and grad_err < 1e-12
        assert groups == {tuple(tp_ranks)} and len(tp_ranks) == 2  # only the tp group talks
        loss_err, grad_err, sliced = res["stage"]
        assert loss_err < 1e-12 and grad_err < 1e-12
        assert sliced == sorted(["tok_embeddings.weight", "output.weight"] + [
            f"layers.{i}.{n}.weight" for i in range(2) for n in ("attn.wq", "attn.wk", "attn.wv", "attn.wo",
                                                                  "mlp.w1", "mlp.w2", "mlp.w3")])


def test_demo_runs_under_torchrun_and_plain_python():
    out = run_script("tensor_parallel.py", "--model", "tiny", "--seq", "32", "--steps", "2", "--rounds", "1",
                     "--sp", nproc=2)
    assert "vs single process" in out and "throughput ratio" in out
    assert "one layer, by hand:  forward: 2 all_gather, 2 reduce_scatter | backward: 2 all_gather, 2 reduce_scatter" in out
    out = run_script("tensor_parallel.py", "--model", "tiny", "--seq", "16", "--steps", "1",
                     "--rounds", "1", "--no-compare")
    assert "tp=1" in out and "ms/step" in out
