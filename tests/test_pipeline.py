"""Pipeline parallel: schedules checked as data, then real runs checked against one process."""
import re

import pytest
import torch

from harness import global_batches, reference_model, run_ranks, run_script, train_reference
from instruments import CommCounter
from mesh import Mesh
from model import get_config
from pipeline import (Action, Stage, bubble_formula, check_schedule, gpipe, one_f_one_b, simulate,
                      split_layers, train, validate)

B, S, STEPS, LR = 8, 16, 2, 1e-3
# (schedule, m) per pipeline size: m = 1, 4, 8 where valid (1F1B needs m >= p), plus m = p.
CONFIGS = {2: [("gpipe", 1), ("gpipe", 4), ("gpipe", 8), ("1f1b", 2), ("1f1b", 4), ("1f1b", 8)],
           4: [("gpipe", 1), ("gpipe", 4), ("gpipe", 8), ("1f1b", 4), ("1f1b", 8)]}
LAYERS = {2: 3, 4: 5}  # uneven on purpose: split [2, 1] and [2, 1, 1, 1]


# ---- the schedules, without running anything -----------------------------------------------

@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_schedules_as_data(name):
    for p in (1, 2, 3, 4, 8):
        for m in (1, 2, 4, 8, 16):
            if name == "1f1b" and m < p:
                with pytest.raises(ValueError, match="m >= p"):
                    one_f_one_b(p, m)
                continue
            sched = (gpipe if name == "gpipe" else one_f_one_b)(p, m)
            check_schedule(sched)
            for r, acts in enumerate(sched):
                for op in ("F", "B"):  # every micro-batch forwarded and backwarded once
                    assert sorted(a.mb for a in acts if a.op == op) == list(range(m))
                if name == "1f1b":  # warm-up: min(p-r-1, m) forwards before the first backward
                    first_b = [a.op for a in acts if a.op in "FB"].index("B")
                    assert first_b == min(p - r - 1, m) + 1
            for r in range(p - 1):  # what r sends, r+1 receives, in the same order
                assert [a.mb for a in sched[r] if a.op == "SEND_F"] == [a.mb for a in sched[r + 1] if a.op == "RECV_F"]
                assert [a.mb for a in sched[r + 1] if a.op == "SEND_B"] == [a.mb for a in sched[r] if a.op == "RECV_B"]
            for t_b in (1.0, 2.0):  # unit-time play: bubble and in-flight micro-batches from theory
                sim = simulate(sched, t_f=1.0, t_b=t_b)
                assert sim["total"] == pytest.approx((m + p - 1) * (1 + t_b))
                for r in range(p):
                    assert sim["bubble"][r] == pytest.approx(bubble_formula(p, m), abs=1e-12)
                    assert sim["peak_in_flight"][r] == (m if name == "gpipe" else min(p - r, m))


def test_bad_schedules_are_caught():
    ok = gpipe(2, 2)
    swapped = [ok[0], [Action("RECV_F", 1), Action("F", 1), Action("RECV_F", 0), Action("F", 0)] + ok[1][4:]]
    with pytest.raises(ValueError, match="order"):
        check_schedule(swapped)
    # Valid orders on each stage, but stage 0 waits for a gradient before sending the input that
    # stage 1 needs to produce it: a cycle of waits, which the simulator must report.
    A = Action
    dead = [[A("F", 0), A("SEND_F", 0), A("F", 1), A("RECV_B", 0), A("B", 0), A("SEND_F", 1), A("RECV_B", 1), A("B", 1)],
            [A("RECV_F", 0), A("F", 0), A("RECV_F", 1), A("F", 1), A("B", 0), A("SEND_B", 0), A("B", 1), A("SEND_B", 1)]]
    check_schedule(dead)
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(dead)


def test_split_and_validation():
    assert [len(s) for s in split_layers(5, 4)] == [2, 1, 1, 1]
    assert [list(s) for s in split_layers(4, 2)] == [[0, 1], [2, 3]]
    for args, match in [((4, 2, 8, 8, "1f1b"), "micro-batches as stages"), ((4, 4, 3, 8), "cannot fill"),
                        ((2, 3, 4, 8), "not divisible"), ((2, 2, 4, 8, "zb"), "unknown schedule")]:
        with pytest.raises(ValueError, match=match):
            validate(*args)


def test_stage_takes_positions_like_the_model():
    """A one-stage pipeline is the whole model, also for a sequence shard's absolute positions
    (given as an argument, or as the attribute pipeline_step relies on)."""
    cfg = get_config("tiny")
    model, stage = reference_model(cfg, 0, torch.float64), Stage(cfg, 0, 1, seed=0, dtype=torch.float64)
    x = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([2, 3, 12, 13, 20, 21, 30, 31])
    want = model(x, positions=pos)
    assert not torch.allclose(want, model(x))          # the positions matter
    assert torch.equal(stage(x), model(x)) and torch.equal(stage(x, positions=pos), want)
    stage.positions = pos
    assert torch.equal(stage(x), want)

# ---- real runs on gloo ranks -----------------------------------------------------------------

def _run_configs(p, layers, configs, batches, extra_dp=False):
    """Every configuration in one spawned group (spawning costs seconds)."""
    cfg = get_config("tiny", n_layers=layers)
    out = {}
    for name, m in configs:
        with CommCounter() as c:
            res = train(cfg, name, m, batches, list(range(p)), lr=LR, dtype=torch.float64)
        out[(name, m)] = dict(losses=res["losses"], grads=res["grads"], sent=(c.calls("send"), c.bytes("send")),
                              peak_in_flight=[s["peak_in_flight"] for s in res["steps"]],
                              peak_held=[s["peak_held"] for s in res["steps"]])
    if extra_dp:  # pp=2 x dp=2: replicas of each stage reduce their gradients once
        mesh = Mesh(pp=2, dp_replicate=2)
        res = train(cfg, "1f1b", 2, batches, mesh.ranks("pp"), mesh.group("dp"), mesh.rank("dp"), 2,
                    lr=LR, dtype=torch.float64)
        out["dp"] = dict(losses=res["losses"], grads=res["grads"], stage=mesh.coords["pp"])
        errors = {}
        for key, args in [("m<p", (cfg, "1f1b", 2)), ("layers<stages", (get_config("tiny", n_layers=3), "gpipe", 4)),
                          ("indivisible", (cfg, "gpipe", 3))]:
            with CommCounter() as c:
                try:
                    train(*args, batches, list(range(p)))
                    errors[key] = None
                except ValueError as e:
                    errors[key] = (str(e), c.calls())
        out["errors"] = errors
    return out


def _check_parity(results, p, layers, batches):
    ref = reference_model(get_config("tiny", n_layers=layers), dtype=torch.float64)
    x, y = batches[0]
    ref(x, y).backward()
    ref_grads = {n: q.grad for n, q in ref.named_parameters()}
    ref_losses, _ = train_reference(reference_model(get_config("tiny", n_layers=layers), dtype=torch.float64),
                                    batches, lr=LR)
    for key in CONFIGS[p]:
        name, m = key
        seen = set()
        for r, res in enumerate(results):
            got = res[key]
            for n, g in got["grads"].items():  # every gradient of the stage equals the full model's
                torch.testing.assert_close(g, ref_grads[n], rtol=1e-10, atol=1e-12, msg=f"{key} stage {r} {n}")
                seen.add(n)
            # point to point: per step, m activations [B/m, S, H] forward and m gradients back
            neighbours = (r < p - 1) + (r > 0)
            assert got["sent"] == (STEPS * m * neighbours, STEPS * B * S * get_config("tiny").dim * 8 * neighbours)
            expect = m if name == "gpipe" else min(p - r, m)
            assert got["peak_in_flight"] == [expect] * STEPS, (key, r)
            assert got["peak_held"] == [expect] * STEPS, (key, r)  # measured from autograd's saved tensors
        assert seen == set(ref_grads), key  # the stages together hold every parameter
        assert results[-1][key]["losses"] == pytest.approx(ref_losses, rel=1e-10, abs=1e-12), key


def test_pipeline_p2_matches_single_process():
    batches = global_batches(STEPS, B, S)
    results = run_ranks(_run_configs, 2, 2, LAYERS[2], CONFIGS[2], batches, timeout=240)
    _check_parity(results, 2, LAYERS[2], batches)


def test_pipeline_p4_dp_and_errors():
    batches = global_batches(STEPS, B, S)
    results = run_ranks(_run_configs, 4, 4, LAYERS[4], CONFIGS[4], batches, extra_dp=True, timeout=240)
    _check_parity(results, 4, LAYERS[4], batches)
    # pp=2 x dp=2: loss averaged over the two replicas, gradients equal the full batch's
    ref = reference_model(get_config("tiny", n_layers=LAYERS[4]), dtype=torch.float64)
    ref(*batches[0]).backward()
    ref_losses, _ = train_reference(reference_model(get_config("tiny", n_layers=LAYERS[4]), dtype=torch.float64),
                                    batches, lr=LR)
    for res in results:
        for n, g in res["dp"]["grads"].items():
            torch.testing.assert_close(g, dict(ref.named_parameters())[n].grad, rtol=1e-10, atol=1e-12)
    last = [res["dp"]["losses"] for res in results if res["dp"]["stage"] == 1]
    assert [sum(v) / 2 for v in zip(*last)] == pytest.approx(ref_losses, rel=1e-10)
    # bad settings: the same ValueError on every rank, before any communication
    for key, match in [("m<p", "micro-batches as stages"), ("layers<stages", "cannot fill"),
                       ("indivisible", "not divisible")]:
        for res in results:
            msg, calls = res["errors"][key]
            assert match in msg and calls == 0, (key, msg, calls)


# ---- the demo ---------------------------------------------------------------------------------

def test_demo_torchrun_and_plain_python():
    out = run_script("pipeline.py", "--schedule", "gpipe", "--microbatches", "4", "--model", "tiny",
                     "--batch", "8", "--seq", "16", "--steps", "2", "--compare", nproc=2)
    assert "(p-1)/(m+p-1) = 0.200" in out and "4/4  4/4" in out, out  # GPipe holds all m on both stages
    # PyTorch's own ScheduleGPipe on the same split gives the same gradients
    diff = float(re.search(r"gradients max \|diff\| (\S+);", out).group(1))
    assert diff < 1e-6, out
    out = run_script("pipeline.py", "--model", "tiny", "--batch", "4", "--seq", "16", "--steps", "1",
                     "--microbatches", "2")
    assert "p=1 stages" in out
