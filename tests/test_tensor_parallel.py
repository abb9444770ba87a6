"""tensor_parallel.py: equal to one process (lab.baseline.single_process), the collectives Megatron predicts,
sequence parallel at the same wire bytes, the vocab-parallel loss, partial gradients found by name
(as ZeRO needs them), a sequence-parallel pipeline split, clear errors; and the README's exercises."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import tensor_parallel as tp
from lab import tensor_parallel_demo as tp_demo
from lab.baseline import single_process
from harness import Exercise, global_batches, run_ranks, run_script
from lab.instruments import CommCounter
from lab.model import IGNORE, CrossEntropy, build_model, get_config

B, S = 2, 16
F64 = torch.float64


def _batch():
    x, y = global_batches(1, B, S, seed=3)[0]
    y = y.clone()
    y[0, :5] = IGNORE  # ignored targets: the loss averages over the others only
    return x, y


def _err(model, grads_or_params, grads=True):
    """Largest |difference| of every parameter's gradient (or value) to its slice of the full one."""
    return max((((p.grad if grads else p.detach()) - tp.full_slice(grads_or_params[n], p)).abs().max().item()
                for n, p in model.named_parameters()))


def _one_config(cfg, dtype, sp):
    """One forward + backward against one process: errors and the collectives counted."""
    x, y = _batch()
    ref = build_model(cfg, seed=0, dtype=dtype)
    one = single_process(ref, [(x, y)], keep_grads=True)
    model = tp.apply_tensor_parallel(copy.deepcopy(ref), None, sequence_parallel=sp)
    with CommCounter() as fwd:
        loss = model(x, y)
    with CommCounter() as bwd:
        loss.backward()
    with CommCounter() as fin:
        tp.finish_grads(model)
    return dict(loss=abs(loss.item() - one["losses"][0]), grads=_err(model, one["grads"][0]), fwd=fwd, bwd=bwd,
                fin=fin, local_params=sum(p.numel() for p in model.parameters()),
                loss_value=loss.item())


def _train(sp):
    """3 AdamW steps in float64, against one process: losses and parameters."""
    batches = global_batches(3, B, S, seed=1)
    ref = build_model("tiny", dtype=F64)
    one = single_process(ref, batches, lr=1e-2)
    m = tp.apply_tensor_parallel(copy.deepcopy(ref), None, sequence_parallel=sp)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses = [tp.train_step(m, opt, x, y).item() for x, y in batches]
    return dict(losses=losses, ref=one["losses"], params=_err(m, dict(one["model"].named_parameters()), grads=False))


def _vocab_ce():
    """VocabParallelCrossEntropy against model.CrossEntropy in float64, IGNORE targets, both divisors."""
    t, r = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    N, V = 24, 256
    full = (torch.randn(1, N, V, generator=gen, dtype=F64) * 4).requires_grad_()
    targets = torch.randint(0, V, (1, N), generator=gen)
    targets[0, ::5] = IGNORE
    out = {}
    for divide_by in (None, 7.0):
        ce, ours = CrossEntropy(), tp.VocabParallelCrossEntropy(r * V // t, dist.group.WORLD)
        ce.divide_by = ours.divide_by = divide_by
        full.grad = None
        ref = ce(full, targets)
        ref.backward()
        local = full.detach()[..., r * V // t:(r + 1) * V // t].clone().requires_grad_()
        with CommCounter() as c:
            loss = ours(local, targets)
        loss.backward()
        out[divide_by] = (abs(loss.item() - ref.item()),
                          (local.grad - full.grad[..., r * V // t:(r + 1) * V // t]).abs().max().item(),
                          c.calls("all_reduce"), c.bytes("all_reduce"))
    return out


def _partial_by_name():
    """finish_grads per unit after every parameter was replaced by a new one (as ZeRO does), at tp=t
    with sequence parallel: the same gradients as one process; no collective for a unit with nothing
    partial; mark_partial adds a parameter of the caller's own."""
    x, y = _batch()
    ref = build_model("tiny", dtype=F64)
    one = single_process(ref, [(x, y)], keep_grads=True)["grads"][0]
    m = tp.apply_tensor_parallel(copy.deepcopy(ref), None, sequence_parallel=True)
    slices = {n: p.tp_slice for n, p in m.named_parameters() if hasattr(p, "tp_slice")}
    for mod in m.modules():
        for a, p in list(mod._parameters.items()):
            mod._parameters[a] = nn.Parameter(p.detach().clone())
    m.router = nn.Linear(4, 2, bias=False).double()  # a caller's own partial parameter (a plain sum)
    tp.mark_partial(m, "router.weight")
    m(x, y).backward()
    m.router.weight.grad = torch.full_like(m.router.weight, dist.get_rank() + 1.0)
    units = [list(b.parameters()) for b in m.layers] + [[m.tok_embeddings.weight], [m.norm.weight, m.output.weight],
                                                        [m.router.weight]]
    calls = []
    for u in units:
        with CommCounter() as c:
            tp.finish_grads(m, u)
        calls.append(c.calls())
    named = dict(m.named_parameters())
    err = max((named[n].grad - (one[n].narrow(slices[n][0], slices[n][1], slices[n][2] - slices[n][1])
                                if n in slices else one[n])).abs().max().item() for n in one)
    return dict(calls=calls, err=err, router=m.router.weight.grad.unique().tolist(), names=dict(m.tp_partial_grads))


def _stages(sp):
    """The model cut into two pipeline.Stages, run one after the other in this process; the activation
    crosses the boundary by hand ([b, S/tp, H] under SP). Against the whole (SP) model and one process."""
    from pipeline import Stage
    x, y = _batch()
    cfg = get_config("tiny")
    ref = build_model(cfg, dtype=F64)
    one = single_process(ref, [(x, y)], keep_grads=True)
    whole = tp.apply_tensor_parallel(copy.deepcopy(ref), None, sequence_parallel=sp)
    loss_whole = whole(x, y)
    loss_whole.backward()
    tp.finish_grads(whole)
    stages = [tp.apply_tensor_parallel(Stage(cfg, s, 2, dtype=F64), None, sequence_parallel=sp) for s in (0, 1)]
    pos = torch.arange(S)  # a Stage takes its default positions from its activation's S/tp tokens: give all S
    h = stages[0](x, positions=pos)                                      # [b, S/tp, H] under SP
    boundary = h.detach().requires_grad_()
    with CommCounter() as c:
        try:  # without the positions of all S, stage 1 cannot know them: a clear error, no collective
            stages[1](boundary, y)
            no_positions = None
        except ValueError as e:
            no_positions = (str(e), c.calls())
    loss = stages[1](boundary, y, positions=pos)
    loss.backward()
    h.backward(boundary.grad)
    for st in stages:
        tp.finish_grads(st)
    wg = dict(whole.named_parameters())
    assert all(st.sequence_parallel == sp for st in stages)   # what a pipeline needs to size its transfers
    return dict(shape=tuple(h.shape), loss=abs(loss.item() - loss_whole.item()),
                loss_one=abs(loss.item() - one["losses"][0]),
                vs_whole=max((p.grad - wg[n].grad).abs().max().item()
                             for st in stages for n, p in st.named_parameters()),
                vs_one=max(_err(st, one["grads"][0]) for st in stages), no_positions=no_positions,
                sliced=sorted(n for st in stages for n, p in st.named_parameters() if hasattr(p, "tp_slice")))


def _errors():
    """Every indivisible size: one ValueError naming the fix, before any collective."""
    bad = {"n_heads": get_config("tiny", dim=48, n_heads=6, n_kv_heads=2),
           "n_kv_heads": get_config("tiny", dim=96, n_heads=12, n_kv_heads=3),
           "ffn_dim": get_config("tiny", ffn_dim=66), "vocab_size": get_config("tiny", vocab_size=258)}
    errors = {}
    for key, fn in [(k, lambda c=c: tp.apply_tensor_parallel(build_model(c), None)) for k, c in bad.items()] + [
            ("sequence", lambda: tp.apply_tensor_parallel(build_model("tiny"), None, True)(
                *(torch.zeros(2, 18, dtype=torch.long),) * 2))]:   # 18 tokens over 4 ranks
        with CommCounter() as c:
            try:
                fn()
                errors[key] = None
            except ValueError as e:
                errors[key] = (str(e), c.calls())
    # a mixture of experts' MLP stays whole (expert parallel splits its tokens): its width need not divide
    from lab.model import MoE
    moe = tp.apply_tensor_parallel(build_model(get_config("tiny", n_experts=4, ffn_dim=66)), None)
    errors["moe_kept"] = all(isinstance(b.mlp, MoE) for b in moe.layers)
    return errors


def _mesh():
    """Inside a 2-D mesh (tp groups {0,1}, {2,3}): only the tp group talks, the result is one process's."""
    from mesh import Mesh
    mesh, (x, y) = Mesh(dp_shard=2, tp=2), _batch()
    ref = build_model("tiny", dtype=F64)
    one = single_process(ref, [(x, y)], keep_grads=True)
    m = tp.apply_tensor_parallel(copy.deepcopy(ref), mesh, sequence_parallel=True)
    with CommCounter() as c:
        loss = m(x, y)
        loss.backward()
        tp.finish_grads(m)
    return (abs(loss.item() - one["losses"][0]), _err(m, one["grads"][0]), {e.group_ranks for e in c.events},
            mesh.ranks("tp"))


def _rank(t):
    """Everything one group of ranks checks (one spawn per tp size: spawning costs seconds)."""
    out = {}
    for dtype in (F64, torch.float32) if t == 2 else (F64,):
        for sp in (False, True):
            out[(dtype, sp, 2)] = _one_config(get_config("tiny"), dtype, sp)
    for sp in (False, True):   # one more layer: the per-layer count is the difference
        out[(F64, sp, 3)] = _one_config(get_config("tiny", n_layers=3), F64, sp)
    extra = dict(ce=_vocab_ce(), partial=_partial_by_name(), stages={sp: _stages(sp) for sp in (False, True)})
    if t == 2:
        extra["train"] = {sp: _train(sp) for sp in (False, True)}
    else:
        extra.update(errors=_errors(), mesh=_mesh())
    return out, extra


_RESULTS = {}


def _results(t):
    if t not in _RESULTS:
        _RESULTS[t] = run_ranks(_rank, t, t, timeout=300)
    return _RESULTS[t]


@pytest.mark.parametrize("t", [2, 4])
def test_matches_single_process_and_counts_collectives(t):
    cfg = get_config("tiny")
    for res, _ in _results(t):
        for (dtype, sp, L), r in res.items():
            tol = 1e-12 if dtype == F64 else 2e-6
            assert r["loss"] < tol and r["grads"] < tol, ((dtype, sp, L), r)
            b = 8 if dtype == F64 else 4
            c = get_config("tiny", n_layers=L)
            want = tp_demo.comm_formula(c, B, S, b, t, sp)  # Megatron: 4L + 2 activation collectives, 3 for the loss
            for op, (calls, nbytes) in want.items():
                got = (r["fwd"].calls(op) + r["bwd"].calls(op), r["fwd"].bytes(op) + r["bwd"].bytes(op))
                assert got == (calls, nbytes), ((dtype, sp, L), op, got)
            assert set(r["fwd"].summary()) | set(r["bwd"].summary()) == set(want)
            # forward: embedding + 2 per layer (+ the loss's 3 all-reduces); backward: 2 per layer + the head's
            ops = ("all_gather", "reduce_scatter") if sp else ("all_reduce",)
            assert all(r["fwd"].calls(op) == 2 * L + 1 + 3 * (op == "all_reduce") for op in ops)
            assert all(r["bwd"].calls(op) == 2 * L + 1 for op in ops)
            plain = res[(dtype, False, L)]  # SP: the same wire bytes and the same loss as plain TP
            assert r["fwd"].wire_bytes() + r["bwd"].wire_bytes() == pytest.approx(
                plain["fwd"].wire_bytes() + plain["bwd"].wire_bytes(), rel=1e-12)
            assert r["loss_value"] == pytest.approx(plain["loss_value"], abs=1e-12 if b == 8 else 1e-6)
            # finish_grads: replicated kv heads (zero-padded to n_kv slots) + SP norm weights, one call
            n = tp_demo.partial_formula(c, t, sp)
            assert (r["fin"].calls("all_reduce"), r["fin"].bytes("all_reduce")) == ((1 if n else 0), n * b)
        # every matmul weight is split t ways, kv projections min(t, n_kv) ways; norms replicated
        H, kv_rows = cfg.dim, max(cfg.n_kv_heads // t, 1) * cfg.head_dim
        per_layer = 2 * H * H // t + 2 * kv_rows * H + 3 * H * cfg.ffn_dim // t + 2 * H
        assert res[(F64, False, 2)]["local_params"] == 2 * cfg.vocab_size * H // t + cfg.n_layers * per_layer + H


@pytest.mark.parametrize("t", [2, 4])
def test_vocab_parallel_loss_partial_grads_by_name_and_sp_stages(t):
    for rank, (_, res) in enumerate(_results(t)):
        for divide_by, (loss_err, grad_err, calls, nbytes) in res["ce"].items():
            assert loss_err < 1e-13 and grad_err < 1e-15, divide_by
            assert calls == 3 and nbytes == 3 * 24 * 8  # max, target logit, sum of exponentials
        p = res["partial"]
        assert p["err"] < 1e-12
        L = get_config("tiny").n_layers  # blocks: one call each; embedding: nothing partial, no call
        assert p["calls"] == [1] * L + [0, 1, 1]
        assert p["router"] == [t * (t + 1) / 2]   # slot 0 of 1: the plain sum over the tp ranks
        norms = {f"layers.{i}.{n}.weight": (0, 1) for i in range(L) for n in ("attn_norm", "mlp_norm")}
        kv = {f"layers.{i}.attn.{w}.weight": (rank // 2, 2) for i in range(L) for w in ("wk", "wv")} if t == 4 else {}
        assert p["names"] == {**norms, **kv, "norm.weight": (0, 1), "router.weight": (0, 1)}  # kv: my head's slot
        for sp, st in res["stages"].items():
            assert st["loss"] < 1e-12 and st["loss_one"] < 1e-12, (sp, st)
            assert st["vs_whole"] < 1e-12 and st["vs_one"] < 1e-12, (sp, st)
            assert st["shape"] == (B, S // t if sp else S, get_config("tiny").dim)
            assert st["sliced"] == sorted(["tok_embeddings.weight", "output.weight"] + [
                f"layers.{i}.{n}.weight" for i in range(2) for n in ("attn.wq", "attn.wk", "attn.wv", "attn.wo",
                                                                      "mlp.w1", "mlp.w2", "mlp.w3")])
            if sp:
                msg, calls = st["no_positions"]
                assert "torch.arange(S)" in msg and calls == 0
            else:
                assert st["no_positions"] is None


def test_training_equals_single_process():
    for _, res in _results(2):
        for sp, r in res["train"].items():
            assert r["ref"][0] != pytest.approx(r["ref"][-1], abs=1e-3)  # training moved
            assert r["losses"] == pytest.approx(r["ref"], abs=1e-12), sp
            assert r["params"] < 1e-12, sp


def test_errors_and_mesh():
    for _, res in _results(4):
        words = {"n_heads": "n_heads=6", "n_kv_heads": "n_kv_heads=3", "ffn_dim": "ffn_dim",
                 "vocab_size": "vocab_size=258", "sequence": "multiple of 4"}
        for key, word in words.items():
            assert res["errors"][key] is not None, key
            msg, calls = res["errors"][key]
            assert word in msg and calls == 0, (key, msg, calls)
        assert res["errors"]["moe_kept"]
        loss_err, grad_err, groups, tp_ranks = res["mesh"]
        assert loss_err < 1e-12 and grad_err < 1e-12
        assert groups == {tuple(tp_ranks)} and len(tp_ranks) == 2


def test_demo_runs_under_torchrun_and_plain_python():
    out = run_script("tensor_parallel.py", "--model", "tiny", "--seq", "32", "--steps", "2", "--rounds", "1",
                     "--timed", "1", "--sp", nproc=2)
    assert "all checks ok" in out and "DTensor  vs one process" in out and "throughput by hand / DTensor" in out
    out = run_script("tensor_parallel.py", "--model", "tiny", "--seq", "16", "--steps", "1", "--rounds", "1",
                     "--timed", "1", "--no-compare")
    assert "tp=1" in out and "all checks ok" in out


# ---- the README's exercises, checked as a learner would -------------------------------------------

def _line(out, start):
    return next(line for line in out.splitlines() if line.strip().startswith(start))


def _check_plain(out):
    assert "8 all_reduce" in _line(out, "by hand  forward") and "5 all_reduce" in _line(out, "by hand  backward")
    assert "all checks ok" in out


def _check_sp(out):
    fwd = _line(out, "by hand  forward")
    assert "5 reduce_scatter" in fwd and "5 all_gather" in fwd and "3 all_reduce" in fwd
    assert "wire 330,752 bytes, formula 330,752" in out          # the same as without --sp
    assert "1 all_reduce (1,280 B" in _line(out, "by hand  finish_grads")  # (2L + 1)·H = 160 float64 elements
    assert "all checks ok" in out


def _check_no_finish(out):
    for rank in range(4):
        wrong = _line(out, f"rank {rank}: gradients of step 1 that differ")
        names = wrong.split(": ")[-1].split(", ")
        assert {"layers.0.attn.wk.weight", "layers.1.attn.wv.weight", "layers.0.mlp_norm.weight",
                "norm.weight"} <= set(names)
        assert not any("wq" in n or "w1" in n for n in names)
    assert "all checks FAILED" in out


def _check_fused(out):
    assert "9 all_reduce" in _line(out, "by hand  backward")      # 4 per layer (3 + 1) + the head's
    assert "11 all_reduce" in _line(out, "DTensor  backward")     # 5 per layer + the head's
    row = _line(out, "all_reduce     API")                         # measured | formula: 2L·B·S·H·8 more bytes
    assert row.split()[2:5] == ["923,648", "|", "661,504"] and 923648 - 661504 == 2 * 2 * 4 * 64 * 32 * 8
    assert row.endswith("(17 calls)") and "all checks FAILED" in out  # (the count no longer fits the formula)


EXERCISES = [
    Exercise("torchrun --nproc_per_node 2 tensor_parallel.py --model tiny --seq 32", _check_plain),
    Exercise("torchrun --nproc_per_node 2 tensor_parallel.py --model tiny --seq 32 --sp", _check_sp),
    Exercise("torchrun --nproc_per_node 4 tensor_parallel.py --model tiny --seq 32 --sp", _check_no_finish,
             edits=(("tensor_parallel.py", '    group, partial = getattr(model, "tp_group", None)',
                     '    return\n    group, partial = getattr(model, "tp_group", None)'),), fails=True),
    Exercise("torchrun --nproc_per_node 2 tensor_parallel.py --model tiny --seq 64", _check_fused,
             edits=(("tensor_parallel.py", "column_parallel(w, group, rows, input_op=None)",
                     'column_parallel(w, group, rows, input_op="copy")'),
                    ("tensor_parallel.py", "super().forward(enter_tp(x, self.group, self.sp), cos, sin)",
                     "super().forward(x, cos, sin)")), fails=True),
]
