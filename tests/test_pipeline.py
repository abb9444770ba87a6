"""Pipeline parallel (pipeline.py): schedules checked and played as data against their formulas, then real
runs (every schedule, p = 2 and 4, several m, float64) checked against one process."""
import re
from fractions import Fraction

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lab.baseline import single_process
from harness import Exercise, global_batches, reference_model, run_ranks, run_script
from lab.instruments import CommCounter
from mesh import Mesh
from lab.model import get_config
from lab.pipeline_demo import held_formula, idle_formula, train
from pipeline import (COMPUTE, SCHEDULES, Action, DeferWeightGrads, PipeGroup, Stage, _by_ticks, check_schedule,
                      interleaved, one_f_one_b_plain, pipeline_step, simulate, split_layers, split_linears, validate,
                      weight_grads)

B, S, LR = 8, 16, 1e-3
# (schedule, m, v) per pipeline size: m < p, m = p and m > p where the schedule allows it
CONFIGS = {2: [("gpipe", 4, 1), ("1f1b", 1, 1), ("1f1b", 4, 1), ("interleaved", 2, 2), ("interleaved", 4, 2),
               ("zb", 1, 1), ("zb", 4, 1), ("plain", 1, 1), ("plain", 4, 1)],
           4: [("gpipe", 2, 1), ("1f1b", 2, 1), ("1f1b", 8, 1), ("interleaved", 4, 2), ("zb", 2, 1), ("zb", 8, 1),
               ("plain", 2, 1), ("plain", 8, 1)]}
LAYERS = {2: 5, 4: 9}  # uneven on purpose: [3, 2] and [3, 2, 2, 2]; interleaved [2, 1, 1, 1] and [2, 1, ..]


# ---- the schedules, without running anything -----------------------------------------------------

@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_is_valid_and_plays_to_its_formula(name):
    for p in (1, 2, 3, 4, 8):
        for v in ((2, 3) if name == "interleaved" else (1,)):
            for m in (1, 2, 3, 4, 5, 8, 16):
                try:
                    validate(p, m, 64, 16 * m, name, v)
                except ValueError:
                    assert name == "interleaved" and (m % p or p == 1)
                    continue
                sched = SCHEDULES[name](p, m, v)
                check_schedule(sched)
                for t_f, t_b, t_w in [(1, 1, 1), (1, 2, 1)]:   # unit time, and B:W:F = 2:1:1
                    t_f, t_b, t_w = (Fraction(t) for t in (t_f, t_b, t_w))
                    sim = simulate(sched, t_f, t_b, t_w)
                    idle = idle_formula(name, p, m, v, t_f, t_b, t_w)
                    assert sim["idle"] == [idle] * p, (name, p, v, m, t_b)          # exactly, every rank
                    assert sim["total"] == m * (t_f + t_b + t_w) + idle
                    assert sim["peak_in_flight"] == [held_formula(name, p, m, r, v) for r in range(p)]


def test_the_bubbles_compare_as_the_papers_say():
    p, m = 4, 8
    one = idle_formula("1f1b", p, m)
    assert idle_formula("gpipe", p, m) == one and one / (3 * m) == Fraction(p - 1, m)      # (p-1)/m of ideal
    assert idle_formula("interleaved", p, m, 2) == one / 2                                # (p-1)/(v m)
    assert idle_formula("zb", p, m) == one / 3                                            # a third at 1:1:1
    for r in range(p):   # ZB-H1 never holds more than 1F1B's stage 0
        assert held_formula("zb", p, m, r) == held_formula("1f1b", p, m, 0)


def test_zb_h1_order_is_pytorchs_zero_bubble_with_one_stage_per_rank():
    """The demo compares zb with ScheduleInterleavedZeroBubble: with one stage per rank its computes
    come in exactly our ZB-H1 order (read from its private planner, which torch 2.11 and 2.13 both have)."""
    from torch.distributed.pipelining import schedules
    assert hasattr(schedules.ScheduleInterleavedZeroBubble, "_calculate_single_rank_operations"), \
        "this torch's zero-bubble schedule has no planner to read: compare its order some other way"
    kind = {"FORWARD": "F", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}
    for p, m in [(2, 4), (4, 2), (4, 8), (8, 16)]:
        ref = object.__new__(schedules.ScheduleInterleavedZeroBubble)
        ref.n_local_stages, ref.pp_group_size, ref._n_microbatches = 1, p, m
        ref.number_of_rounds = max(1, m // p)
        ref.microbatches_per_round = m // ref.number_of_rounds
        theirs = [[(kind[a.computation_type.name], a.microbatch_index)
                   for a in ref._calculate_single_rank_operations(r) if a is not None] for r in range(p)]
        assert theirs == [[(a.op, a.mb) for a in acts if a.op in COMPUTE] for acts in SCHEDULES["zb"](p, m)]


def test_schedules_demo_prints_the_formulas_beside_the_simulation(capsys):
    """`python pipeline.py --simulate` (in this process): every schedule's bubble and peak held, simulated = formula."""
    from lab.pipeline_demo import demo
    assert demo(["--simulate", "--p", "4", "--m", "8", "--times", "1", "2", "1", "--transfers"]) == 0
    out = capsys.readouterr().out
    bubbles = re.findall(r"simulated (\S+), formula (\S+)\n", out)
    held = re.findall(r"held at the peak per rank: simulated ([\d ]*\d), formula ([\d ]*\d)", out)
    assert len(bubbles) == len(held) == len(SCHEDULES) and all(s == f for s, f in bubbles + held), out
    assert "F3 [SEND_F3 RECV_B0] B0" in out   # 1F1B rank 0: one batch of transfers, as the runner posts it
    idle = idle_formula("1f1b", 4, 8, 1, 1, 2, 1)   # B:W:F = 2:1:1
    assert bubbles[1] == (f"{idle / (8 * 4 + idle):.3f}",) * 2


def test_interleaved_needs_its_transfers_batched_per_tick():
    """The same interleaved computes with each transfer right next to its compute: the last rank
    sends forward to the first while the first sends gradients back to it, and rendezvous waits
    form a cycle — simulate finds it."""
    p, m, v = 4, 8, 2
    one_by_one = [_by_ticks([[(a.op, a.mb, a.chunk)] for a in acts if a.op in COMPUTE], r, p, v)
                  for r, acts in enumerate(interleaved(p, m, v))]
    check_schedule(one_by_one)
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(one_by_one)


def test_bad_schedules_are_caught():
    ok = SCHEDULES["gpipe"](2, 2)
    swapped = [ok[0], [Action("RECV_F", 1), Action("F", 1), Action("RECV_F", 0), Action("F", 0)] + ok[1][4:]]
    with pytest.raises(ValueError, match="order"):
        check_schedule(swapped)
    with pytest.raises(ValueError, match="missing"):
        check_schedule([ok[0], ok[1][:-1]])
    A = Action   # each rank's order is valid, but rank 0 waits for a gradient before sending the input
    dead = [[A("F", 0), A("SEND_F", 0), A("F", 1), A("RECV_B", 0), A("B", 0), A("SEND_F", 1), A("RECV_B", 1),
             A("B", 1)],
            [A("RECV_F", 0), A("F", 0), A("RECV_F", 1), A("F", 1), A("B", 0), A("SEND_B", 0), A("B", 1),
             A("SEND_B", 1)]]
    check_schedule(dead)
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(dead)


def test_split_and_validation():
    assert [len(s) for s in split_layers(5, 4)] == [2, 1, 1, 1]
    assert [list(s) for s in split_layers(4, 2)] == [[0, 1], [2, 3]]
    assert Stage(get_config("tiny", n_layers=8), 1, 2, v=2, device="meta").chunks == [[2, 3], [6, 7]]
    for args, match in [((2, 3, 4, 8), "not divisible"), ((4, 4, 3, 8), "cannot fill"), ((2, 2, 4, 8, "x"), "unknown"),
                        ((4, 6, 16, 12, "interleaved", 2), "multiple of p"),
                        ((2, 2, 8, 8, "interleaved", 1), "virtual stages per rank"),
                        ((2, 2, 8, 8, "zb", 2), "needs --schedule interleaved"),
                        ((4, 4, 7, 8, "interleaved", 2), "cannot fill")]:
        with pytest.raises(ValueError, match=match):
            validate(*args)
    validate(4, 1, 4, 8, "1f1b")   # m < p: 1F1B allows it


def test_stage_takes_positions_like_the_model():
    """A one-stage pipeline is the whole model, also for a sequence shard's absolute positions."""
    cfg = get_config("tiny")
    model, stage = reference_model(cfg, 0, torch.float64), Stage(cfg, 0, 1, seed=0, dtype=torch.float64)
    x = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([2, 3, 12, 13, 20, 21, 30, 31])
    want = model(x, positions=pos)
    assert not torch.allclose(want, model(x))          # the positions matter
    assert torch.equal(stage(x), model(x)) and torch.equal(stage(x, positions=pos), want)
    stage.positions = pos
    assert torch.equal(stage(x), want)


def _split_backward(model, loss_of):
    """Backward in two passes under DeferWeightGrads: B (input gradients), then W. Returns what each
    pass left, its FLOPs, and how often each parameter's post-accumulate-grad hook fired."""
    fired = {n: 0 for n, _ in model.named_parameters()}
    for n, q in model.named_parameters():
        q.register_post_accumulate_grad_hook(lambda q, n=n: fired.__setitem__(n, fired[n] + 1))
    deferred = []
    split_linears(model)
    with DeferWeightGrads(model, deferred):
        loss = loss_of(model)
    with FlopCounterMode(display=False) as fb:
        loss.backward()
    after_b = {n for n, q in model.named_parameters() if q.grad is not None}
    with FlopCounterMode(display=False) as fw:
        weight_grads(deferred)
    return dict(after_b=after_b, flops_b=fb.get_total_flops(), flops_w=fw.get_total_flops(), fired=fired,
                grads={n: q.grad for n, q in model.named_parameters()})


def test_zero_bubble_split_is_honest_in_autograd():
    """B computes no weight gradient of any linear; W computes exactly those matmuls, accumulates them
    through autograd (hooks fire once), and the gradients equal an ordinary backward."""
    cfg = get_config("tiny", n_layers=2)
    x, y = global_batches(1, 2, S)[0]
    plain = reference_model(cfg, dtype=torch.float64)
    loss = plain(x, y)
    with FlopCounterMode(display=False) as fl:   # an ordinary backward
        loss.backward()
    split = _split_backward(reference_model(cfg, dtype=torch.float64), lambda mod: mod(x, y))
    linears = {n + ".weight": mod for n, mod in plain.named_modules() if isinstance(mod, torch.nn.Linear)}
    assert split["after_b"] == {n for n, _ in plain.named_parameters()} - set(linears)
    tokens = x.numel()
    assert split["flops_w"] == sum(2 * tokens * mod.in_features * mod.out_features for mod in linears.values())
    assert split["flops_b"] + split["flops_w"] == fl.get_total_flops()
    assert set(split["fired"].values()) == {1}
    for n, q in plain.named_parameters():
        torch.testing.assert_close(split["grads"][n], q.grad, rtol=1e-12, atol=1e-15)


def test_w_holds_one_linears_weight_gradient_at_a_time():
    """W hands autograd each linear's dL/dW as soon as it is computed: never two at once (all of a stage's at
    once is a model's worth of fresh memory every W, page faults measured in thousands per step)."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    class LiveMatmuls(TorchDispatchMode):   # bytes of matmul outputs alive, and their peak
        live = peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.mm.default:
                LiveMatmuls.live += out.nbytes
                LiveMatmuls.peak = max(LiveMatmuls.peak, LiveMatmuls.live)
                weakref.finalize(out, lambda n=out.nbytes: setattr(LiveMatmuls, "live", LiveMatmuls.live - n))
            return out

    cfg = get_config("tiny", n_layers=2)
    x, y = global_batches(1, 2, S)[0]
    model, deferred = split_linears(reference_model(cfg, dtype=torch.float64)), []
    with DeferWeightGrads(model, deferred):
        model(x, y).backward()
    for q in model.parameters():   # (an existing .grad: autograd adds each new one into it, then frees it)
        q.grad = torch.zeros_like(q)
    with LiveMatmuls():
        weight_grads(deferred)
    weights = [mod.weight.nbytes for mod in model.modules() if isinstance(mod, torch.nn.Linear)]
    assert LiveMatmuls.peak == max(weights), (LiveMatmuls.peak, weights)


def test_a_b_followed_by_its_w_is_one_ordinary_backward():
    """Where W comes right after its B (every B of the first stage: no one waits for its input gradient), the
    split would buy nothing: the runner does one ordinary backward, and that W computes nothing."""
    from contextlib import contextmanager
    cfg = get_config("tiny", n_layers=2)
    x, y = global_batches(1, 4, S)[0]
    flops = []

    @contextmanager
    def count(group):   # the runner's trace hook: FLOPs of each action
        with FlopCounterMode(display=False) as fc:
            yield
        flops.append((group[0].op, fc.get_total_flops()))

    stage = Stage(cfg, 0, 1, dtype=torch.float64)   # one stage: first and last
    actions = SCHEDULES["zb"](1, 2)[0]
    assert [a.op for a in actions] == ["F", "B", "W", "F", "B", "W"]
    pipeline_step(stage, actions, PipeGroup(0, 1, [0]), x, y, 2, trace=count)
    plain = reference_model(cfg, dtype=torch.float64)
    with FlopCounterMode(display=False) as fl:
        plain(x, y).backward()
    assert [f for op, f in flops if op == "W"] == [0, 0]
    assert sum(f for op, f in flops if op == "B") == fl.get_total_flops() - sum(f for op, f in flops if op == "F")
    for n, q in plain.named_parameters():
        torch.testing.assert_close(stage.get_parameter(n).grad, q.grad, rtol=1e-12, atol=1e-15)


# ---- real runs on gloo ranks ----------------------------------------------------------------------

def _moe_cfg():
    return get_config("tiny", n_layers=4, n_experts=4, top_k=2)


def _rank_runs(p, layers, configs, batches, extras=False):
    """Every configuration in one spawned group (spawning costs seconds)."""
    cfg, out = get_config("tiny", n_layers=layers), {}
    pipe = PipeGroup.from_ranks(list(range(p)))
    for name, m, v in configs:
        with CommCounter() as c:
            if name == "plain":   # the control-flow 1F1B, one step
                stage = Stage(cfg, pipe.r, p, dtype=torch.float64)
                loss = one_f_one_b_plain(stage, pipe, *batches[0], m)
                res = dict(losses=[None if loss is None else loss.item()], peak_held=None,
                           grads={n: q.grad.clone() for n, q in stage.named_parameters()})
            else:
                res = train(cfg, name, m, batches, list(range(p)), v, lr=LR, dtype=torch.float64)
        out[(name, m, v)] = dict(losses=res["losses"], grads=res["grads"], peak=res["peak_held"],
                                 sent=(c.calls("send"), c.bytes("send")))
    if p == 2:   # MoE stages: the aux loss of each micro-batch in its backward
        x, y = batches[0]
        for name, m in [("1f1b", 2), ("zb", 4)]:
            stage = Stage(_moe_cfg(), pipe.r, p, dtype=torch.float64)
            res = pipeline_step(stage, SCHEDULES[name](p, m)[pipe.r], pipe, x, y, m)
            out[("moe", name, m)] = dict(loss=res["loss"], aux=res["aux"],
                                         grads={n: q.grad for n, q in stage.named_parameters()})
        # the split on tensor-parallel linears (Column/RowParallelLinear call F.linear)
        import tensor_parallel as tp
        models = [tp.apply_tensor_parallel(reference_model(get_config("tiny"), dtype=torch.float64), None)
                  for _ in range(2)]
        models[0](x[:2], y[:2]).backward()
        split = _split_backward(models[1], lambda mod: mod(x[:2], y[:2]))
        diff = max((q.grad - split["grads"][n]).abs().max().item() for n, q in models[0].named_parameters())
        out["tp"] = dict(diff=diff,
                         fired=set(split["fired"].values()), after_b=split["after_b"])
    if extras:
        mesh = Mesh(pp=2, dp_replicate=2)   # pp=2 x dp=2: each stage's replicas all-reduce once
        res = train(cfg, "zb", 2, batches, mesh.ranks("pp"), 1, mesh.group("dp"), mesh.rank("dp"), 2, lr=LR,
                    dtype=torch.float64)
        out["dp"] = dict(losses=res["losses"], grads=res["grads"], stage=mesh.coords["pp"])
        out["zero3"] = {name: _zero3(cfg, batches, name) for name in ("1f1b", "zb")}
        errors = {}
        for key, args in [("m%p", (cfg, "interleaved", 2, batches, list(range(p)), 2)),
                          ("layers", (get_config("tiny", n_layers=3), "gpipe", 4, batches, list(range(p)))),
                          ("indivisible", (cfg, "1f1b", 3, batches, list(range(p))))]:
            with CommCounter() as c:
                try:
                    train(*args)
                    errors[key] = None
                except ValueError as e:
                    errors[key] = (str(e), c.calls())
        out["errors"] = errors
    return out


def _zero3(cfg, batches, name):
    """pp=2 x ZeRO-3 over dp_shard=2: forward pre-hooks gather each unit's parameters, the runner only
    calls the stage; inside opt.accumulating() a unit reduces once per step, after its last W; AdamW."""
    from fsdp import shard_model
    mesh = Mesh(pp=2, dp_shard=2)
    pipe = PipeGroup.from_ranks(mesh.ranks("pp"))
    stage = Stage(cfg, pipe.r, 2, dtype=torch.float64)
    units = list(stage.layers.values()) + [u for u in (stage.tok_embeddings, getattr(stage, "norm", None),
                                                        getattr(stage, "output", None)) if u is not None]
    opt = shard_model(stage, 3, torch.optim.AdamW, group=mesh.group("dp_shard"), units=units, lr=LR)
    out = []
    for x, y in batches:
        b = x.shape[0] // 2
        sl = slice(mesh.rank("dp_shard") * b, (mesh.rank("dp_shard") + 1) * b)
        with opt.accumulating():   # one reduction per unit and step, after its last (deferred) W
            res = pipeline_step(stage, SCHEDULES[name](2, 2)[pipe.r], pipe, x[sl], y[sl], 2)
        opt.step()
        opt.zero_grad()
        out.append(None if res["loss"] is None else res["loss"].item())
    return dict(losses=out, params=opt.full_state_dict(), stage=mesh.coords["pp"], dp=mesh.rank("dp_shard"))


def _reference(layers, batches, m=1, cfg=None):
    cfg = cfg or get_config("tiny", n_layers=layers)

    def micro_batches(model, batch):   # one process, accumulating over the same micro-batches
        return sum(model(xm, ym) for xm, ym in zip(batch[0].chunk(m), batch[1].chunk(m))) / m
    return single_process(reference_model(cfg, dtype=torch.float64), batches, lr=LR, keep_grads=True,
                          loss_fn=micro_batches)


def _check(results, p, batches):
    ref = _reference(LAYERS[p], batches)
    H = get_config("tiny").dim
    for name, m, v in CONFIGS[p]:
        key, seen = (name, m, v), set()
        for r, res in enumerate(results):
            got = res[key]
            for n, g in got["grads"].items():   # every gradient of the rank's part equals the whole model's
                torch.testing.assert_close(g, ref["grads"][0][n], rtol=1e-10, atol=1e-13, msg=f"{key} rank {r} {n}")
                seen.add(n)
            # point to point: per step m activations [B/m, S, H] forward and m gradients back per boundary
            boundaries = sum((c * p + r < p * v - 1) + (c * p + r > 0) for c in range(v))
            steps = len(got["losses"])
            assert got["sent"] == (steps * m * boundaries, steps * m * boundaries * (B // m) * S * H * 8), (key, r)
            if got["peak"] is not None:   # measured from autograd's saved tensors
                assert got["peak"] == held_formula(name, p, m, r, v), (key, r, got["peak"])
        assert seen == set(ref["grads"][0]), key   # the ranks together hold every parameter
        assert results[-1][key]["losses"] == pytest.approx(ref["losses"][:len(results[-1][key]["losses"])],
                                                           rel=1e-10, abs=1e-12), key


def test_p2_every_schedule_moe_and_tensor_parallel_split():
    batches = global_batches(2, B, S)
    results = run_ranks(_rank_runs, 2, 2, LAYERS[2], CONFIGS[2], batches, timeout=240)
    _check(results, 2, batches)
    for name, m in [("1f1b", 2), ("zb", 4)]:   # MoE: each micro-batch's aux loss, scaled 1/m, in its backward
        ref = _reference(None, batches[:1], m, _moe_cfg())
        got = [res[("moe", name, m)] for res in results]
        for res in got:
            for n, g in res["grads"].items():
                torch.testing.assert_close(g, ref["grads"][0][n], rtol=1e-10, atol=1e-13, msg=f"moe {name} {n}")
        total = got[-1]["loss"].item() + sum(res["aux"].item() for res in got)   # reported loss + every aux
        assert total == pytest.approx(ref["losses"][0], rel=1e-12)
    for res in results:   # tensor-parallel linears: the same split, the same gradients
        assert res["tp"]["diff"] < 1e-14 and res["tp"]["fired"] == {1}
        assert not any(k.endswith(("wq.weight", "w1.weight", "w2.weight")) for k in res["tp"]["after_b"])


def test_p4_every_schedule_dp_zero3_and_errors():
    batches = global_batches(2, B, S)
    results = run_ranks(_rank_runs, 4, 4, LAYERS[4], CONFIGS[4], batches, extras=True, timeout=300)
    _check(results, 4, batches)
    ref = _reference(LAYERS[4], batches)
    for res in results:   # pp=2 x dp=2: gradients of the full batch; the loss averaged over the replicas
        for n, g in res["dp"]["grads"].items():
            torch.testing.assert_close(g, ref["grads"][0][n], rtol=1e-10, atol=1e-13)
    last = [res["dp"]["losses"] for res in results if res["dp"]["stage"] == 1]
    assert [sum(v) / 2 for v in zip(*last)] == pytest.approx(ref["losses"], rel=1e-10)
    for name in ("1f1b", "zb"):   # pp=2 x ZeRO-3: parameters after two steps equal one process's
        for res in results:
            for n, t in res["zero3"][name]["params"].items():
                torch.testing.assert_close(t, dict(ref["model"].named_parameters())[n].detach(), rtol=1e-9, atol=1e-12)
        last = [res["zero3"][name]["losses"] for res in results if res["zero3"][name]["stage"] == 1]
        assert [sum(v) / 2 for v in zip(*last)] == pytest.approx(ref["losses"], rel=1e-10), name
    for key, match in [("m%p", "multiple of p"), ("layers", "cannot fill"), ("indivisible", "not divisible")]:
        for res in results:   # the same ValueError on every rank, before any communication
            msg, calls = res["errors"][key]
            assert match in msg and calls == 0, (key, msg, calls)


# ---- the demo and the README exercises ------------------------------------------------------------

def test_demo_against_torch_pipelining_and_plain_python():
    out = run_script("pipeline.py", "--schedule", "zb", "--microbatches", "4", "--model", "tiny",
                     "--steps", "1", "--compare", nproc=2)
    diff = float(re.search(r"ScheduleInterleavedZeroBubble: gradients max \|diff\| (\S+);", out).group(1))
    assert diff < 1e-6 and "single-process model: ok" in out, out
    out = run_script("pipeline.py", "--model", "tiny", "--steps", "1", "--microbatches", "2")
    assert "p=1 ranks" in out and "single-process model: ok" in out, out


def _held(out):
    return re.search(r"measured from autograd's saved tensors: (.*?)   activation", out).group(1).split()


def _bubbles(out):
    m = re.search(r"formula (\S+), simulated (\S+), measured per rank (.*)", out)
    return float(m.group(1)), float(m.group(2)), [float(b) for b in m.group(3).split()]


def _check_held(expect):
    def check(out):
        assert _held(out) == expect, _held(out)
        assert "single-process model: ok" in out
    return check


def _check_bubble(formula):
    def check(out):
        f, s, measured = _bubbles(out)
        assert f == s == formula and len(measured) == 4 and all(b >= 0 for b in measured), out
    return check


def _check_error(out):
    assert out.count("interleaved needs the micro-batches to be a multiple of p=4") == 4, out
    assert "use --microbatches 4" in out, out


EXERCISES = [
    Exercise("torchrun --nproc_per_node 4 pipeline.py --schedule gpipe --microbatches 8 --model tiny",
             _check_held(["8/8"] * 4)),
    Exercise("torchrun --nproc_per_node 4 pipeline.py --schedule 1f1b --microbatches 8 --model tiny",
             _check_held(["4/4", "3/3", "2/2", "1/1"])),
    Exercise("torchrun --nproc_per_node 4 pipeline.py --schedule 1f1b --microbatches 2 --model tiny",
             _check_held(["2/2", "2/2", "2/2", "1/1"])),
    Exercise("torchrun --nproc_per_node 4 pipeline.py --schedule zb --microbatches 8", _check_bubble(0.111)),
    Exercise("torchrun --nproc_per_node 4 pipeline.py --schedule 1f1b --microbatches 8", _check_bubble(0.273)),
    Exercise("torchrun --nproc_per_node 4 pipeline.py --schedule interleaved --microbatches 2 --model tiny",
             _check_error, fails=True),
]
