"""expert_parallel.py against the single-device MoE: outputs, aux loss, every gradient,
bytes per all-to-all, training losses, and the errors — ep = 2 and 4 on gloo ranks."""
import copy

import pytest
import torch

from harness import global_batches, reference_model, run_ranks, run_script, train_reference
from instruments import CommCounter
from mesh import Mesh
from model import get_config, num_params

from expert_parallel import (ExpertParallelMoE, parallelize_experts, sync_gradients,
                             train_ep)

TOKENS = 24  # tokens per rank in the layer checks


# ---- what runs on every rank ----------------------------------------------------------

def _layer_case(mesh, cfg, dtype, seed=1, x_all=None, router=None):
    """One forward + backward of the ep layer on this rank's tokens, and the single-device
    MoE on the concatenation of all dp ranks' tokens (rank-major), everything returned."""
    D, r = mesh.size("dp"), mesh.rank("dp")
    ref = reference_model(cfg, seed=0, dtype=dtype).layers[0].mlp
    if router is not None:
        with torch.no_grad():
            ref.router.weight.copy_(router)
    layer = ExpertParallelMoE(copy.deepcopy(ref), mesh.group("ep"), mesh.group("dp"))
    g = torch.Generator().manual_seed(seed)
    if x_all is None:
        x_all = torch.randn(D * TOKENS, 1, cfg.dim, generator=g, dtype=dtype)
    dy = torch.randn(x_all.shape, generator=g, dtype=dtype)
    x_ref = x_all.clone().requires_grad_()
    out_ref = ref(x_ref)
    ((out_ref * dy).sum(-1).mean() + ref.aux_loss).backward()
    sl = slice(r * TOKENS, (r + 1) * TOKENS)
    x = x_all[sl].clone().requires_grad_()
    with CommCounter() as c:  # CommCounter, and an all-to-all of no rows
        out = layer(x)
        ((out * dy[sl]).sum(-1).mean() + layer.aux_loss).backward()
    sync_gradients(layer, mesh.group("dp"), mesh.group("edp"), D)
    lo, n = layer.first, layer.n_local
    pairs = dict(out=(out, out_ref[sl]), aux=(layer.aux_loss, ref.aux_loss), x_grad=(x.grad / D, x_ref.grad[sl]),
                 router_grad=(layer.router.weight.grad, ref.router.weight.grad))
    for name, p, q in zip(("w1", "w3", "w2"), layer.expert_parameters(), (ref.w1, ref.w3, ref.w2)):
        pairs[name + "_grad"] = (p.grad, q.grad[lo:lo + n])
    events = [(e.op, e.api_bytes, e.wire_bytes) for e in c.events]
    return dict(pairs={k: (a.detach(), b.detach()) for k, (a, b) in pairs.items()}, events=events,
                experts=ref.route(x_all.view(-1, cfg.dim))[2], cap=ref.capacity(D * TOKENS),
                dropped=layer.dropped, ref_dropped=ref.dropped, ep_rank=mesh.rank("ep"),
                n_local=n, load=layer.tokens_per_expert.clone())


def _uniform_case(mesh, E):
    """A router that sends global token t to experts t % E and (t+1) % E: perfectly uniform."""
    cfg = get_config("tiny", n_experts=E, top_k=2)
    W = torch.zeros(E, cfg.dim, dtype=torch.float64)
    W[:, :E] = torch.eye(E)
    t = torch.arange(mesh.size("dp") * TOKENS)
    x = torch.zeros(len(t), 1, cfg.dim, dtype=torch.float64)
    x[t, 0, t % E] = 3.0
    x[t, 0, (t + 1) % E] = 2.0
    return _layer_case(mesh, cfg, torch.float64, x_all=x, router=W)


def _errors(mesh):
    """Bad sizes: one ValueError each, raised before any collective."""
    msgs = []
    with CommCounter() as c:
        for kw, change in ((dict(n_experts=3, top_k=2), {}), (dict(n_experts=4, top_k=2), dict(top_k=5)),
                           (dict(n_experts=4, top_k=2), dict(capacity_factor=0.0))):
            model = reference_model(get_config("tiny", **kw))
            for block in model.layers:
                for k, v in change.items():
                    setattr(block.mlp, k, v)
            try:
                parallelize_experts(model, mesh)
                msgs.append(None)
            except ValueError as e:
                msgs.append(str(e))
            assert all(type(b.mlp).__name__ == "MoE" for b in model.layers)  # nothing half-replaced
    return msgs, c.calls()


def _two_ranks():
    mesh = Mesh(dp_shard=2, ep=2)
    cfg = dict(n_experts=4, top_k=2)
    out = dict(errors=_errors(mesh))
    out["layer"] = {(dt, cf): _layer_case(mesh, get_config("tiny", **cfg, capacity_factor=cf), dt)
                    for dt in (torch.float64, torch.float32) for cf in (None, 0.5)}
    # C = 2 per expert: rank 0's tokens fill every expert, rank 1 sends no rows at all
    out["layer"][torch.float64, 0.05] = _layer_case(mesh, get_config("tiny", **cfg, capacity_factor=0.05),
                                                    torch.float64)
    out["uniform"] = _uniform_case(mesh, 4)
    out["train"] = {cf: train_ep(get_config("tiny", **cfg, capacity_factor=cf), ep=2, steps=3,
                                 global_batch=4, seq_len=16) for cf in (None, 0.5)}
    return out


def _four_ranks():
    m4, m2 = Mesh(dp_shard=4, ep=4), Mesh(dp_shard=4, ep=2)
    out = dict(layer={})
    for cf in (None, 0.5):
        out["layer"][4, cf] = _layer_case(m4, get_config("tiny", n_experts=8, top_k=2, capacity_factor=cf),
                                          torch.float64)
    # ep = 2 inside dp = 4: two copies of every expert (edp = 2); dropless, so the reference
    # is the single-device MoE on all four ranks' tokens
    out["layer"][2, None] = _layer_case(m2, get_config("tiny", n_experts=4, top_k=2), torch.float64)
    out["uniform"] = _uniform_case(m4, 8)
    out["train"] = train_ep(get_config("tiny", n_experts=4, top_k=2), ep=2, steps=3, global_batch=8, seq_len=16)
    return out


@pytest.fixture(scope="module")
def two():
    return run_ranks(_two_ranks, 2, timeout=240)


@pytest.fixture(scope="module")
def four():
    return run_ranks(_four_ranks, 4, timeout=240)


# ---- the checks ------------------------------------------------------------------------

def _expected_rows(experts, cap, T, n_local, ep):
    """rows[d][j]: assignments of dp rank d's tokens kept by the experts of ep rank j of d's
    ep group — walking each ep group's concatenated tokens in order, every expert accepting
    its first `cap` (the ep groups are consecutive dp ranks: d // ep is the group)."""
    D = experts.shape[0] // T
    rows, taken = [[0] * ep for _ in range(D)], {}
    for t, chosen in enumerate(experts.tolist()):
        d = t // T
        for e in chosen:
            key = (d // ep, e)
            if cap is None or taken.get(key, 0) < cap:
                taken[key] = taken.get(key, 0) + 1
                rows[d][e // n_local] += 1
    return rows


def _check_layer(results, dtype, ep, capacity):
    tol = dict(rtol=1e-12, atol=1e-15) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-7)
    for res in results:
        for name, (got, want) in res["pairs"].items():
            torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{name}: {m}")
    total_dropped = sum(res["dropped"] for res in results)
    assert total_dropped == results[0]["ref_dropped"]
    assert (total_dropped > 0) == (capacity is not None)  # the capacity case really drops
    # bytes per all-to-all, for the routing the single-device reference made
    D, first = len(results), results[0]
    rows = _expected_rows(first["experts"], first["cap"], TOKENS, first["n_local"], ep)
    E, b = first["experts"].max().item() + 1, {torch.float64: 8, torch.float32: 4}[dtype]
    rb, El = 32 * b, first["n_local"]  # a row: H = 32 elements of b bytes
    for d, res in enumerate(results):
        me, group = res["ep_rank"], range(d - d % ep, d - d % ep + ep)
        assert me == d % ep
        sent, got = sum(rows[d]), sum(rows[s][me] for s in group)
        own = rows[d][me]
        want = [(ep * (El + 1) * 8, (ep - 1) * (El + 1) * 8)]           # counts (int64)
        if capacity is not None:
            want.append((ep * El * 8, (ep - 1) * El * 8))                 # the owners' verdicts
        # dispatch, combine, then backward: combine's (= dispatch sizes), dispatch's
        want += [(sent * rb, (sent - own) * rb), (got * rb, (got - own) * rb)] * 2
        assert [(api, wire) for op, api, wire in res["events"] if op == "all_to_all"] == want
        aux_bytes = (2 * E + 1) * b  # one all-reduce of routing statistics over dp
        assert [ev for ev in res["events"] if ev[0] != "all_to_all"] == [
            ("all_reduce", aux_bytes, 2 * (D - 1) / D * aux_bytes)]
        assert res["load"].sum().item() == got


def test_layer_matches_single_device_moe_two_ranks(two):
    for (dtype, cf) in two[0]["layer"]:
        _check_layer([r["layer"][dtype, cf] for r in two], dtype, 2, cf)
    # the edge case: a rank whose assignments are all dropped sends nothing, and nothing hangs
    assert two[1]["layer"][torch.float64, 0.05]["dropped"] == TOKENS * 2


def test_layer_matches_single_device_moe_four_ranks(four):
    for (ep, cf) in four[0]["layer"]:
        _check_layer([r["layer"][ep, cf] for r in four], torch.float64, ep, cf)


@pytest.mark.parametrize("world", [2, 4])
def test_uniform_routing_bytes_formula_and_aux_equals_coef(world, two, four):
    results = [r["uniform"] for r in (two if world == 2 else four)]
    E = 4 if world == 2 else 8
    for res in results:
        T, k, H, b = TOKENS, 2, 32, 8
        dispatch = [ev for ev in res["events"] if ev[0] == "all_to_all"][1]
        assert dispatch[2] == T * k * H * b * (world - 1) / world       # T·k·H·b·(ep−1)/ep exactly
        assert res["pairs"]["aux"][0].item() == pytest.approx(0.01, rel=1e-12)  # = its coefficient
        assert res["load"].tolist() == [world * T * k // E] * (E // world)


def _check_training(runs, cfg, ep, steps, global_batch, seq_len):
    ref_losses, ref_model = train_reference(reference_model(cfg), global_batches(steps, global_batch, seq_len),
                                            lr=1e-3)
    ref_params = dict(ref_model.named_parameters())
    for rank, run in enumerate(runs):
        assert run["losses"] == pytest.approx(ref_losses, rel=2e-6)
        for name, p in run["params"].items():
            want = ref_params[name].detach()
            if name.endswith(("mlp.w1", "mlp.w3", "mlp.w2")):  # my experts: my slice of the stack
                n = p.shape[0]
                want = want[(rank % ep) * n:(rank % ep + 1) * n]
            torch.testing.assert_close(p, want, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
        assert all(sum(load) == global_batch * seq_len * cfg.top_k - d
                   for load, d in zip(run["loads"], run["dropped"]))
        # memory: a rank holds 1/ep of the expert weights and all the rest
        experts = cfg.n_layers * 3 * cfg.n_experts * cfg.dim * cfg.ffn_dim
        assert sum(p.numel() for p in run["params"].values()) == num_params(cfg) - experts * (ep - 1) // ep


def test_training_ep2_matches_single_process(two):
    for cf in (None, 0.5):
        runs = [r["train"][cf] for r in two]
        _check_training(runs, get_config("tiny", n_experts=4, top_k=2, capacity_factor=cf), 2, 3, 4, 16)
        assert (sum(runs[0]["dropped"]) > 0) == (cf is not None)


def test_training_ep2_on_four_ranks_matches_single_process(four):
    _check_training([r["train"] for r in four], get_config("tiny", n_experts=4, top_k=2), 2, 3, 8, 16)


def test_invalid_sizes_raise_before_any_collective(two):
    for r in two:
        msgs, calls = r["errors"]
        assert calls == 0
        assert "n_experts=3 is not divisible by ep=2" in msgs[0] and "choose ep from [1, 3]" in msgs[0]
        assert "top_k=5 must be between 1 and n_experts=4" in msgs[1]
        assert "capacity_factor=0.0 must be > 0" in msgs[2]


def test_torchrun_demo_runs_and_checks():
    out = run_script("expert_parallel.py", "--tokens", "32", "--batch", "4", "--seq", "16", "--steps", "2",
                     "--compare", nproc=4)
    assert out.count(" ok;") == 8 and "MISMATCH" not in out
    assert "matches the single-device model: ok" in out
    assert "PyTorch all_to_all_single_autograd" in out


def test_plain_python_demo_runs():
    out = run_script("expert_parallel.py", "--tokens", "16", "--batch", "2", "--seq", "16", "--steps", "2")
    assert "ep=1 (ours)" in out and "matches the single-device model: ok" in out
