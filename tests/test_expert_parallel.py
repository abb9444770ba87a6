"""expert_parallel.py against the single-device MoE on the same tokens: outputs, aux loss, every
gradient, bytes per collective, training — ep = 2 and 4 on gloo ranks, alone and composed with
uneven token splits, tensor parallel (with and without sequence parallel), context parallel,
micro-batches and pipeline stages; and the README's exercises."""
import copy
import re
from types import SimpleNamespace

import pytest
import torch

from harness import Exercise, global_batches, reference_model, run_ranks, run_script, single_process
from lab.instruments import CommCounter
from mesh import Mesh
from lab.model import get_config, num_params

from lab.expert_parallel_demo import train_ep
from expert_parallel import expert_parameters, parallelize_experts, sync_gradients, tp_partial_parameters

TOKENS = 24  # tokens per token-holding slot in the layer checks
EXPERT = ("mlp.w1", "mlp.w3", "mlp.w2")


# ---- what runs on every rank ----------------------------------------------------------------

def _layer_case(mesh, cfg, dtype, sizes=None, sp=False, x_all=None, router=None):
    """parallelize_experts(mesh) on one MoE; this rank's tokens through it, forward and backward, then
    sync_gradients; the single-device MoE on every distinct token. The token-holding slots are the
    dp × cp ranks (× tp under sequence parallel; without it every tp rank of a slot holds its tokens),
    slot s holding sizes[s] tokens (default TOKENS each), concatenated in slot order."""
    tp, D = mesh.size("tp"), mesh.size("dp_cp")
    slot = mesh.rank("dp_cp") * (tp if sp else 1) + (mesh.rank("tp") if sp else 0)
    sizes = sizes or [TOKENS] * (D * (tp if sp else 1))
    ref = reference_model(cfg, seed=0, dtype=dtype).layers[0].mlp
    if router is not None:
        with torch.no_grad():
            ref.router.weight.copy_(router)
    holder = SimpleNamespace(layers=[SimpleNamespace(mlp=copy.deepcopy(ref))])
    parallelize_experts(holder, mesh, sequence_parallel=sp)
    layer = holder.layers[0].mlp
    g = torch.Generator().manual_seed(1)
    N = sum(sizes)
    if x_all is None:
        x_all = torch.randn(N, 1, cfg.dim, generator=g, dtype=dtype)
    dy = torch.randn(x_all.shape, generator=g, dtype=dtype)
    x_ref = x_all.clone().requires_grad_()
    out_ref = ref(x_ref)
    ((out_ref * dy).sum() / N + ref.aux_loss).backward()
    sl = slice(sum(sizes[:slot]), sum(sizes[:slot + 1]))
    x = x_all[sl].clone().requires_grad_()
    with CommCounter() as c:
        out = layer(x)
        # my loss: (Σ over the slots) / D is the reference's; every tp rank of a slot computes it
        ((out * dy[sl]).sum() * D / N + layer.aux_loss).backward()
        sync_gradients(layer, mesh.group("dp_cp"), mesh.group("edp_cp"), D, mesh.group("tp") if tp > 1 else None)
    lo, n = layer.first, layer.n_local
    pairs = dict(out=(out, out_ref[sl]), aux=(layer.aux_loss, ref.aux_loss), x_grad=(x.grad / D, x_ref.grad[sl]),
                 router_grad=(layer.router.weight.grad, ref.router.weight.grad))
    for name, p, q in zip(("w1", "w3", "w2"), layer.expert_parameters(), (ref.w1, ref.w3, ref.w2)):
        pairs[name + "_grad"] = (p.grad, q.grad[lo:lo + n])
    return dict(pairs={k: (a.detach(), b.detach()) for k, (a, b) in pairs.items()},
                events=[(e.op, e.api_bytes, e.wire_bytes) for e in c.events],
                experts=ref.route(x_all.view(-1, cfg.dim))[2], cap=ref.capacity(N), dropped=layer.dropped,
                ref_dropped=ref.dropped, ep_rank=mesh.rank("ep"), n_local=n, load=layer.tokens_per_expert.clone(),
                partial=len(tp_partial_parameters(layer)), D=layer.grad_divisor)


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


def _micro_batches(mesh, cfg, m=2, steps=2, batch=8, seq=8, lr=0.2):
    """The whole model, float64, SGD: each rank accumulates m micro-batches (loss/m each) as train.py
    does, then sync_gradients. Returns losses, step-1 gradients, final parameters and the bytes of
    the gradient all-reduces (dense over dp, experts over edp)."""
    model = parallelize_experts(reference_model(cfg, dtype=torch.float64), mesh)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    D, out = mesh.size("dp"), dict(losses=[])
    for x, y in global_batches(steps, batch, seq):
        x, y = x.chunk(D)[mesh.rank("dp")], y.chunk(D)[mesh.rank("dp")]
        loss = 0.0
        for xm, ym in zip(x.chunk(m), y.chunk(m)):
            lm = model(xm, ym)
            (lm / m).backward()
            loss += lm.item() / m
        with CommCounter() as c:
            sync_gradients(model, mesh.group("dp"), mesh.group("edp"), D)
        out.setdefault("grads", {n: p.grad.clone() for n, p in model.named_parameters()})
        out.setdefault("events", [(e.op, e.api_bytes, len(e.group_ranks)) for e in c.events])
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = torch.tensor([loss], dtype=torch.float64)
        torch.distributed.all_reduce(t)
        out["losses"].append(t.item() / D)
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["expert_ids"] = sorted(n for n, p in model.named_parameters() if any(p is q for q in expert_parameters(model)))
    return out


def _pipeline_stages(mesh, cfg, m=2, batch=4, seq=8, aux_weight=True):
    """Both stages of a 2-stage pipeline.Stage split on every rank (layers in a ModuleDict), run as a
    pipeline runs them: stage 1's backward starts from the loss, stage 0's from the gradient of its
    output only — so stage 0's aux loss reaches the router only through aux_weight. m micro-batches,
    all forwards first, float64. Returns step-1 gradients by name."""
    from pipeline import Stage
    w = 1 / m if aux_weight else None
    stages = [parallelize_experts(Stage(cfg, r, 2, dtype=torch.float64), mesh, aux_weight=w) for r in range(2)]
    (x, y), = global_batches(1, batch, seq)
    D = mesh.size("dp")
    x, y = x.chunk(D)[mesh.rank("dp")], y.chunk(D)[mesh.rank("dp")]
    flight = []
    for xm, ym in zip(x.chunk(m), y.chunk(m)):
        h = stages[0](xm)
        h_in = h.detach().requires_grad_()
        flight.append((h, h_in, stages[1](h_in, ym) / m))
    for h, h_in, loss in flight:
        loss.backward()
        torch.autograd.backward(h, h_in.grad)
    for s in stages:
        sync_gradients(s, mesh.group("dp"), mesh.group("edp"), D)
    return {n: p.grad.clone() for s in stages for n, p in s.named_parameters()}


def _two_ranks():
    mesh = Mesh(dp_shard=2, ep=2)
    cfg = dict(n_experts=4, top_k=2)
    tiny = get_config("tiny", **cfg)
    out = dict(errors=_errors(mesh))
    out["layer"] = {(dt, cf): _layer_case(mesh, get_config("tiny", **cfg, capacity_factor=cf), dt)
                    for dt in (torch.float64, torch.float32) for cf in (None, 0.5)}
    # C = 2 per expert: rank 0's tokens fill every expert, rank 1 sends no rows at all
    out["layer"][torch.float64, 0.05] = _layer_case(mesh, get_config("tiny", **cfg, capacity_factor=0.05),
                                                    torch.float64)
    out["uneven"] = _layer_case(mesh, tiny, torch.float64, sizes=[7, 41])  # any split of the tokens
    out["uniform"] = _uniform_case(mesh, 4)
    out["train"] = {cf: train_ep(get_config("tiny", **cfg, capacity_factor=cf), ep=2, steps=3,
                                 global_batch=4, seq_len=16, dtype=torch.float64) for cf in (None, 0.5)}
    out["pipeline"] = {w: _pipeline_stages(mesh, tiny, aux_weight=w) for w in (True, False)}
    return out


def _four_ranks():
    m4, m2 = Mesh(dp_shard=4, ep=4), Mesh(dp_shard=4, ep=2)
    tiny, out = get_config("tiny", n_experts=4, top_k=2), dict(layer={})
    for cf in (None, 0.5):
        out["layer"][4, cf] = _layer_case(m4, get_config("tiny", n_experts=8, top_k=2, capacity_factor=cf),
                                          torch.float64)
    # ep = 2 inside dp = 4: two copies of every expert (edp = 2); dropless, so the reference is
    # the single-device MoE on all four ranks' tokens
    out["layer"][2, None] = _layer_case(m2, tiny, torch.float64)
    out["uniform"] = _uniform_case(m4, 8)
    out["train"] = train_ep(tiny, ep=2, steps=3, global_batch=8, seq_len=16, dtype=torch.float64)
    out["micro"] = _micro_batches(m2, tiny)
    tp = Mesh(dp_shard=2, tp=2, ep=2)
    out["tp"] = _layer_case(tp, tiny, torch.float64, sizes=[13, 27])       # T % tp != 0 on one slot
    out["sp"] = _layer_case(tp, tiny, torch.float64, sp=True, sizes=[5, 11, 20, 9])
    out["cp"] = _layer_case(Mesh(dp_shard=2, cp=2, ep=2), tiny, torch.float64, sizes=[10, 30, 17, 23])
    return out


@pytest.fixture(scope="module")
def two():
    return run_ranks(_two_ranks, 2, timeout=240)


@pytest.fixture(scope="module")
def four():
    return run_ranks(_four_ranks, 4, timeout=240)


# ---- the checks -----------------------------------------------------------------------------

def _expected_rows(experts, cap, T, n_local, ep):
    """rows[d][j]: assignments of dp rank d's tokens kept by the experts of ep rank j of d's ep
    group — walking each ep group's concatenated tokens in order, every expert accepting its
    first `cap` (the ep groups are consecutive dp ranks: d // ep is the group)."""
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


def _assert_pairs(results, dtype=torch.float64):
    tol = dict(rtol=1e-12, atol=1e-15) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-7)
    for res in results:
        for name, (got, want) in res["pairs"].items():
            torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{name}: {m}")


def _check_layer(results, dtype, ep, capacity):
    _assert_pairs(results, dtype)
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
        aux_bytes = (2 * E + 1) * 8  # one all-reduce of routing statistics (float64) over dp
        assert [ev for ev in res["events"] if ev[0] != "all_to_all"][0] == (
            "all_reduce", aux_bytes, 2 * (D - 1) / D * aux_bytes)
        assert res["load"].sum().item() == got


def test_layer_matches_single_device_moe_two_ranks(two):
    for (dtype, cf) in two[0]["layer"]:
        _check_layer([r["layer"][dtype, cf] for r in two], dtype, 2, cf)
    # the edge case: a rank whose assignments are all dropped sends nothing, and nothing hangs
    assert two[1]["layer"][torch.float64, 0.05]["dropped"] == TOKENS * 2


def test_layer_matches_single_device_moe_four_ranks(four):
    for (ep, cf) in four[0]["layer"]:
        _check_layer([r["layer"][ep, cf] for r in four], torch.float64, ep, cf)


def test_aux_loss_and_router_gradient_with_any_split_of_the_tokens(two):
    """7 and 41 tokens: the aux loss is the global one, every gradient equals one process's."""
    _assert_pairs([r["uneven"] for r in two])


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


def test_tensor_parallel_tokens_dispatched_once(four):
    """tp 2 × dp 2, ep 2, no sequence parallel: each tp rank dispatches half of its slot's tokens (13
    and 27: uneven halves), outputs all-gathered; after summing router and experts over tp every
    gradient equals one process's. Bytes: each tp rank's all-to-alls carry only its own rows."""
    res = [r["tp"] for r in four]
    _assert_pairs(res)
    for rank, r in enumerate(res):
        T = [13, 27][rank // 2]
        n = -(-T // 2)  # rows per tp rank, padded to the larger half for the all-gather
        gathers = [ev for ev in r["events"] if ev[0] == "all_gather"]
        assert gathers == [("all_gather", 2 * n * 32 * 8, n * 32 * 8)] * 2  # output fwd, input grad bwd
        mine = n if rank % 2 == 0 else T - n
        assert [ev for ev in r["events"] if ev[0] == "all_to_all"][1][1] == mine * 2 * 32 * 8  # my rows, k = 2
        assert r["partial"] == 4 and r["D"] == 2  # router + w1, w3, w2 summed over tp; divisor dp·cp


def test_sequence_parallel_and_context_parallel(four):
    """Sequence parallel (each tp rank its own rows) and cp 2 × dp 2 with ep 2: aux over every rank's
    tokens, expert gradients over edp_cp divided by dp·cp, all equal one process's (uneven splits)."""
    _assert_pairs([r["sp"] for r in four])
    _assert_pairs([r["cp"] for r in four])
    assert [r["cp"]["D"] for r in four] == [4] * 4 and [r["sp"]["D"] for r in four] == [2] * 4


def _check_training(runs, cfg, ep, steps, global_batch, seq_len):
    """float64 AdamW (lab/baseline.py: in fp32 AdamW turns rounding on a ~0 gradient into whole steps, and a
    near-tie in the top-k routing can flip): losses, step-1 gradients and parameters to rounding."""
    ref = single_process(reference_model(cfg, dtype=torch.float64), global_batches(steps, global_batch, seq_len),
                         keep_grads=True)
    ref_params = dict(ref["model"].named_parameters())
    for rank, run in enumerate(runs):
        assert run["losses"] == pytest.approx(ref["losses"], rel=1e-12)
        lo = (rank % ep) * cfg.n_experts // ep
        for name, p in run["params"].items():
            want, g_want = ref_params[name].detach(), ref["grads"][0][name]
            if name.endswith(EXPERT):  # my experts: my slice of the stack
                want, g_want = want[lo:lo + p.shape[0]], g_want[lo:lo + p.shape[0]]
            torch.testing.assert_close(p, want, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")
            torch.testing.assert_close(run["grads"][name], g_want, rtol=1e-10, atol=1e-13)
        assert all(sum(load) == global_batch * seq_len * cfg.top_k - d
                   for load, d in zip(run["loads"], run["dropped"]))
        # memory: a rank holds 1/ep of the expert weights and all the rest
        experts = cfg.n_layers * 3 * cfg.n_experts * cfg.dim * cfg.ffn_dim
        assert sum(p.numel() for p in run["params"].values()) == num_params(cfg) - experts * (ep - 1) // ep


def test_training_ep2_matches_single_process(two):
    for cf in (None, 0.5):
        runs = [r["train"][cf] for r in two]
        _check_training(runs, get_config("tiny", n_experts=4, top_k=2, capacity_factor=cf), 2, 3, 4, 16)
        for rank, run in enumerate(runs):  # all-reduced: every rank reports the global count
            assert (sum(run["dropped"]) > 0) == (cf is not None), (rank, cf)


def test_training_ep2_on_four_ranks_matches_single_process(four):
    _check_training([r["train"] for r in four], get_config("tiny", n_experts=4, top_k=2), 2, 3, 8, 16)


def _global_mb(t, m, ranks):
    """[global micro-batch j for j < m]: rank r's j-th chunk for every r, in rank order."""
    return [torch.cat([r.chunk(m)[j] for r in t.chunk(ranks)]) for j in range(m)]


def test_micro_batches_match_one_process_accumulating(four):
    """dp 4, ep 2, 2 micro-batches per rank, float64 SGD: losses, step-1 gradients and parameters after
    2 steps equal one process accumulating over the same global micro-batches."""
    cfg = get_config("tiny", n_experts=4, top_k=2)

    def loss_fn(model, batch):
        x, y = (_global_mb(t, 2, 4) for t in batch)
        return sum(model(xj, yj) / 2 for xj, yj in zip(x, y))
    ref = single_process(reference_model(cfg, dtype=torch.float64), global_batches(2, 8, 8), loss_fn=loss_fn,
                         lr=0.2, optimizer=torch.optim.SGD, keep_grads=True)
    for rank, r in enumerate(four):
        run = r["micro"]
        assert max(abs(a - b) for a, b in zip(run["losses"], ref["losses"])) < 1e-12
        lo = (rank % 2) * 2
        for name, g in run["grads"].items():
            want = ref["grads"][0][name]
            want = want[lo:lo + 2] if name.endswith(EXPERT) else want
            torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-13, msg=lambda m: f"{name}: {m}")
        # bytes of the gradient all-reduces: experts Ψ_E/ep elements over edp (2 ranks), the rest over dp
        psi_e = cfg.n_layers * 3 * cfg.n_experts * cfg.dim * cfg.ffn_dim
        assert run["events"] == [("all_reduce", (num_params(cfg) - psi_e) * 8, 4), ("all_reduce", psi_e // 2 * 8, 2)]
        assert run["expert_ids"] == sorted(f"layers.{i}.{w}" for i in range(cfg.n_layers) for w in EXPERT)


def test_pipeline_stages_carry_the_aux_loss(two):
    """Two pipeline.Stage halves (layers in a ModuleDict) with 2 micro-batches, stage 0's backward
    started from its output gradient: with aux_weight = 1/m every gradient equals one process
    accumulating; without it, stage 0's router misses its aux loss (the test can fail)."""
    cfg = get_config("tiny", n_experts=4, top_k=2)

    def loss_fn(model, batch):
        x, y = (_global_mb(t, 2, 2) for t in batch)
        return sum(model(xj, yj) / 2 for xj, yj in zip(x, y))
    ref = single_process(reference_model(cfg, dtype=torch.float64), global_batches(1, 4, 8), loss_fn=loss_fn,
                         keep_grads=True)["grads"][0]
    for rank, r in enumerate(two):
        for name, g in r["pipeline"][True].items():
            want = ref[name][rank * 2:rank * 2 + 2] if name.endswith(EXPERT) else ref[name]
            torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-13, msg=lambda m: f"{name}: {m}")
        missing = r["pipeline"][False]["layers.0.mlp.router.weight"] - ref["layers.0.mlp.router.weight"]
        assert missing.abs().max() > 1e-6


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
    assert out.count("expert gradient norm ours / one process = 1.000") == 4
    assert "matches the single-device model: ok" in out and "PyTorch's all_to_all_single_autograd" in out


def test_plain_python_demo_runs():
    out = run_script("expert_parallel.py", "--tokens", "16", "--batch", "2", "--seq", "16", "--steps", "2")
    assert "ep=1 (ours)" in out and "matches the single-device model: ok" in out


# ---- the README's exercises, checked as a learner would ------------------------------------------

def _capacity(out):
    total, of = map(int, re.search(r"\[capacity factor 0.5\] dropped (\d+) of (\d+)", out).groups())
    per_rank = [int(d) for d in re.findall(r"\[capacity factor 0.5\]: .*dropped (\d+)/", out)]
    assert total >= of * 0.5 and sum(per_rank) == total  # at least 1 − cf of the assignments
    assert per_rank[-1] == max(per_rank) > per_rank[0]   # token order: the last rank loses most


def _doubled(out):
    ratios = re.findall(r"expert gradient norm ours / one process = ([\d.]+)", out)
    assert ratios == ["2.000"] * 4  # the gradients are twice too large ...
    diff = float(re.search(r"ep=2 \(ours\) losses .* max \|diff\| ([\d.e+-]+)", out).group(1))
    assert diff < 1e-4 and "FAILED" in out  # ... while AdamW's losses barely notice


def _top1(out):
    sent = [int(b) for b in re.findall(r"\[dropless\]: .*\n\s*bytes sent per all-to-all \(dispatch, combine, "
                                       r"combine-bwd, dispatch-bwd\) \[(\d+),", out)]
    uniform = 256 * 1 * 32 * 8 * 3 / 4  # T·k·H·b·(ep−1)/ep at top-1: half of top-2's
    assert len(sent) == 4 and all(abs(s - uniform) < 0.1 * uniform for s in sent)
    assert "uniform routing T·k·H·b·(ep-1)/ep = 49152" in out


EXERCISES = [
    Exercise("torchrun --nproc_per_node 4 expert_parallel.py --capacity-factor 0.5", _capacity),
    Exercise("torchrun --nproc_per_node 4 expert_parallel.py --ep 2", _doubled, fails=True, edits=[(
        "expert_parallel.py", "if id(p) in expert], edp_group, divide_by)",
        "if id(p) in expert], edp_group, dist.get_world_size(edp_group))")]),
    Exercise("torchrun --nproc_per_node 4 expert_parallel.py --top-k 1 --tokens 256", _top1),
    Exercise("torchrun --nproc_per_node 4 expert_parallel.py --experts 6", fails=True, check=lambda out: (
        out.count("n_experts=6 is not divisible by ep=4") == 4)),
]
