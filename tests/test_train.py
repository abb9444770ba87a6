"""train.py: every layout trains to the single-process loss curve; checkpoints; invalid layouts.

The reference is an independent single-process loop (model.py + torch.optim.AdamW +
torch.nn.utils.clip_grad_norm_ + the same warm-up/cosine learning rate) on the same global
batches. Each run_ranks call trains MANY layouts of one world size in turn (train.run_layouts).
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from harness import run_ranks
from train import check_args, lr_at, parse_args, run_layouts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, B, S = 10, 8, 16
# float64, short sequences, a small clip so clipping is active (the reference norms exceed it)
COMMON = ["--dtype", "float64", "--steps", str(STEPS), "--global-batch-size", str(B), "--seq-len", str(S),
          "--lr", "3e-3", "--grad-clip", "1.5"]
TOL64, TOL32 = 1e-9, 2e-5


def reference(flags=(), dtype=torch.float64):
    """The single-process run: (losses, gradient norms before clipping)."""
    from data import get_batch, load_corpus
    from model import build_model, get_config
    args = parse_args(list(COMMON) + list(flags))
    cfg = get_config(args.model, n_experts=args.experts, top_k=args.top_k)
    model = build_model(cfg, seed=args.seed, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    tokens, losses, norms = load_corpus(), [], []
    for s in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(s + 1, args)
        x, y = get_batch(tokens, s, args.global_batch_size, args.seq_len, args.seed)
        loss = model(x, y)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, norms


@pytest.fixture(scope="module")
def ref_dense():
    return reference()


@pytest.fixture(scope="module")
def ref_f32():
    return reference(["--dtype", "float32"], dtype=torch.float32)


@pytest.fixture(scope="module")
def ref_moe():
    return reference(["--experts", "4"])


def _check(results, want, tol, what=""):
    """results: run_layouts' output on each rank; every rank reports the same global losses."""
    for i, res in enumerate(results[0]):
        got = res["losses"]
        assert len(got) == len(want), res["flags"]
        err = max(abs(a - b) for a, b in zip(got, want))
        assert err < tol, f"{what} layout [{res['flags']}]: max |loss diff| {err:.2e} vs single process"
        for r in results[1:]:
            assert r[i]["losses"] == got, f"ranks disagree on the global loss of [{res['flags']}]"


def test_lr_schedule_and_defaults():
    a = parse_args(["--lr", "1", "--warmup", "2", "--steps", "10"])
    assert [round(lr_at(s, a), 6) for s in (1, 2)] == [0.5, 1.0]
    assert lr_at(10, a) == pytest.approx(0.1) and lr_at(6, a) == pytest.approx(0.1 + 0.9 * 0.5)
    assert parse_args(["--dp-shard", "2"]).zero_stage == 3 and parse_args([]).zero_stage == 0
    assert parse_args(["--pp", "2"]).microbatches == 2


def test_clipping_is_active_in_the_reference(ref_dense):
    _, norms = ref_dense
    assert max(norms) > 1.5 > min(norms)  # so the parity runs test the global norm


def test_world_1_and_every_dimension_alone_on_2_ranks(ref_dense):
    """dp_replicate 2, dp_shard 2 at each ZeRO stage, tp 2, cp 2, pp 2 with each schedule;
    plus ZeRO-3 with activation checkpointing and gradient accumulation."""
    want, norms = ref_dense
    one = run_ranks(run_layouts, 1, [[]], COMMON, timeout=120)
    _check(one, want, TOL64, "world 1")
    assert max(abs(a - b) for a, b in zip(one[0][0]["grad_norms"], norms)) < 1e-9
    layouts = [["--dp-replicate", "2"]] + [["--dp-shard", "2", "--zero-stage", str(z)] for z in range(4)] + [
        ["--tp", "2"], ["--tp", "2", "--sequence-parallel"], ["--cp", "2"],
        ["--pp", "2", "--schedule", "gpipe", "--microbatches", "2"],
        ["--pp", "2", "--schedule", "1f1b", "--microbatches", "4"],
        ["--dp-shard", "2", "--activation-checkpointing", "full", "--microbatches", "2"]]
    res = run_ranks(run_layouts, 2, layouts, COMMON, timeout=240)
    _check(res, want, TOL64, "2 ranks")
    for r in res:  # the global norm (each parameter once) equals the single-process norm
        for lay in r:
            assert max(abs(a - b) for a, b in zip(lay["grad_norms"], norms)) < 1e-9, lay["flags"]
    assert all(b > 0 for lay in res[0] for b in lay["comm_bytes"])
    _check_bytes_and_memory({lay["flags"]: lay for lay in res[0]})


def _check_bytes_and_memory(by):
    """Rank 0's last step against the formulas (API bytes; float64 = 8 bytes per element).
    Every layout also all-reduces one float64 for the global gradient norm (+8 bytes)."""
    from fsdp import zero_comm_formula, zero_state_formula
    from model import get_config
    cfg, b = get_config("tiny"), 8
    L, H, P = cfg.n_layers, cfg.dim, 2
    norm = {"all_reduce": 8}
    for z in range(4):
        lay = by[f"--dp-shard 2 --zero-stage {z}"]
        numel = sum(n for n, _ in lay["zero_units"])
        root = lay["zero_units"][-1][0]  # the model's root unit (embedding, norm, head) is last
        want = zero_comm_formula(z, numel, P, b, root)  # its gradients are fp32: here float64
        want = {k: v * b // 4 if k != "all_gather" else v for k, v in want.items()}
        want = {k: want.get(k, 0) + norm.get(k, 0) for k in set(want) | set(norm)}
        got = {k: v["bytes"] for k, v in lay["comm_summary"].items()}
        assert got == want, (z, got, want)
        mem, form = lay["state_bytes"], zero_state_formula(z, numel, P, b, 0, b, 2 * b)
        assert mem["parameters"] == form["parameters"], (z, mem, form)
        # AdamW's moments, plus one `step` scalar per flat unit
        assert 0 <= mem["optimizer"] - form["optimizer"] <= 8 * len(lay["zero_units"]), (z, mem, form)
    # tp 2: forward 1 (embedding) + 2 per layer + 3 (vocab-parallel loss, [B·S] each), backward
    # 2 per layer + 1 (head input): all-reduces of [B, S, H]
    tp = by["--tp 2"]["comm_summary"]
    assert tp["all_reduce"]["bytes"] == (4 * L + 2) * B * S * H * b + 3 * B * S * b + 8
    assert tp["all_reduce"]["calls"] == 4 * L + 2 + 3 + 1
    # pp 2: stage 0 sends m activations [B/m, S, H] and receives m gradients of them
    for flags in ("--pp 2 --schedule gpipe --microbatches 2", "--pp 2 --schedule 1f1b --microbatches 4"):
        pp = by[flags]["comm_summary"]
        assert pp["send"]["bytes"] == pp["recv"]["bytes"] == B * S * H * b, (flags, pp)
    # cp 2 (ring, zigzag): per layer k, v pass once forward, once backward plus dk, dv home
    from ring_attention import ring_bytes
    fwd, bwd = ring_bytes(B, S // 2, cfg.n_kv_heads, cfg.head_dim, 2, b)
    cp = by["--cp 2"]["comm_summary"]
    assert cp["send"]["bytes"] == L * (fwd + bwd), cp


def test_experts_ep_2(ref_moe):
    want, _ = ref_moe
    moe = ["--experts", "4"]
    res = run_ranks(run_layouts, 2, [["--dp-shard", "2", "--ep", "2"], ["--dp-replicate", "2", "--ep", "2"],
                                     ["--dp-shard", "2"]], COMMON + moe, timeout=180)
    _check(res, want, TOL64, "MoE")
    assert "all_to_all" in res[0][0]["comm_summary"]


def test_combinations_on_4_ranks(ref_dense, ref_f32, ref_moe):
    want, _ = ref_dense
    layouts = [["--dp-replicate", "2", "--dp-shard", "2"],
               ["--dp-shard", "2", "--tp", "2"],
               ["--cp", "2", "--tp", "2"],
               ["--pp", "2", "--tp", "2", "--microbatches", "2"],
               ["--pp", "2", "--dp-shard", "2", "--microbatches", "2", "--schedule", "gpipe"],
               # beyond the list: cp inside the ZeRO shard group, pp x cp, and tp 4 > n_kv_heads
               # (each kv head replicated on 2 ranks: finish_grads, and the norm counts it once)
               ["--dp-shard", "2", "--cp", "2"], ["--pp", "2", "--cp", "2", "--microbatches", "2"],
               ["--tp", "4"], ["--pp", "2", "--dp-shard", "2", "--zero-stage", "1", "--microbatches", "2"],
               ["--dp-shard", "2", "--tp", "2", "--zero-stage", "1", "--sequence-parallel"],
               ["--cp", "2", "--tp", "2", "--sequence-parallel"]]
    # float32 ZeRO-3 is built on the meta device: each rank materialises only its shard of its tp slice
    meta = ["--dp-shard", "2", "--tp", "2", "--dtype", "float32"]
    # experts: ep 2 borrowed from a 2 x 2 data-parallel mesh (each expert on 2 edp ranks)
    moe = ["--dp-replicate", "2", "--dp-shard", "2", "--ep", "2", "--experts", "4"]
    res = run_ranks(run_layouts, 4, layouts + [meta, moe], COMMON, timeout=300)
    _check([r[:-2] for r in res], want, TOL64, "4 ranks")
    _check([r[-2:-1] for r in res], ref_f32[0], TOL32, "float32 meta-initialised")
    _check([r[-1:] for r in res], ref_moe[0], TOL64, "MoE ep 2 x edp 2")
    assert all(r[-2]["meta_init"] for r in res) and not any(lay["meta_init"] for lay in res[0][:-2])
    _check_composed_bytes({lay["flags"]: lay for lay in res[0]})


def _check_composed_bytes(by):
    """A composition's bytes are the sum of its lessons' (rank 0, last step, float64 API bytes)."""
    from fsdp import zero_comm_formula
    from model import get_config
    cfg, b = get_config("tiny"), 8
    L, H = cfg.n_layers, cfg.dim
    # dp_shard 2 x tp 2: ZeRO-3 on this rank's tp slice + tp's all-reduces on the local batch B/2
    lay = by["--dp-shard 2 --tp 2"]
    numel, root = sum(n for n, _ in lay["zero_units"]), lay["zero_units"][-1][0]
    z = zero_comm_formula(3, numel, 2, b, root)
    got = {k: v["bytes"] for k, v in lay["comm_summary"].items()}
    Bl = B // 2
    assert got["all_gather"] == z["all_gather"] and got["reduce_scatter"] == 2 * z["reduce_scatter"]
    assert got["all_reduce"] == (4 * L + 2) * Bl * S * H * b + 3 * Bl * S * b + 8
    # pp 2 x dp_shard 2 (gpipe, m = 2): every module is a ZeRO-3 unit, gathered before each
    # micro-batch's forward AND backward, reduce-scattered after each backward: the gathers
    # grow with m (why ZeRO-3 and pipelining combine badly); stage 0 also sends its activations.
    lay, m = by["--pp 2 --dp-shard 2 --microbatches 2 --schedule gpipe"], 2
    numel = sum(n for n, _ in lay["zero_units"])
    got = {k: v["bytes"] for k, v in lay["comm_summary"].items()}
    assert got["all_gather"] == 2 * m * numel * b and got["reduce_scatter"] == m * numel * b, got
    assert got["send"] == got["recv"] == Bl * S * H * b and got["all_reduce"] == 8, got
    # ... while ZeRO-1 reduces once per step, whatever m
    lay = by["--pp 2 --dp-shard 2 --zero-stage 1 --microbatches 2"]
    numel = sum(n for n, _ in lay["zero_units"])
    got = {k: v["bytes"] for k, v in lay["comm_summary"].items()}
    assert got["all_gather"] == got["reduce_scatter"] == numel * b, got


def test_pp_dp_shard_tp_on_8_ranks(ref_dense):
    want, _ = ref_dense
    res = run_ranks(run_layouts, 8, [["--pp", "2", "--dp-shard", "2", "--tp", "2", "--microbatches", "2"],
                                     # and two more 3-D layouts: HSDP x TP, and pp x cp x tp
                                     ["--dp-replicate", "2", "--dp-shard", "2", "--tp", "2"],
                                     ["--pp", "2", "--cp", "2", "--tp", "2", "--microbatches", "2"]],
                    COMMON, timeout=400)
    _check(res, want, TOL64, "8 ranks")


def test_float32_and_bfloat16_tolerance(ref_f32):
    """float32 within 2e-5 of the float32 single-process run; bf16 compute (fp32 master weights,
    optimizer and reductions) within 2e-2 of it."""
    want, _ = ref_f32
    common = COMMON + ["--dtype", "float32"]
    bf16 = ["--dtype", "bfloat16"]
    res = run_ranks(run_layouts, 2, [["--dp-shard", "2"], ["--tp", "2"], ["--dp-shard", "2"] + bf16,
                                     ["--tp", "2"] + bf16], common, timeout=240)
    _check([r[:2] for r in res], want, TOL32, "float32")
    _check([r[2:] for r in res], want, 2e-2, "bfloat16")


def test_save_at_5_resume_to_10_equals_uninterrupted(ref_dense, tmp_path):
    """ZeRO-3 and ZeRO-1 shards (flat masters) and a tensor-parallel model (a state dict per rank)."""
    want, _ = ref_dense
    layouts = []
    for i, lay in enumerate((["--dp-shard", "2", "--zero-stage", "3"], ["--dp-shard", "2", "--zero-stage", "1"],
                             ["--tp", "2"])):
        d = str(tmp_path / f"ckpt{i}")
        layouts += [lay + ["--stop-at", "5", "--save", d], lay + ["--resume", d]]
    res = run_ranks(run_layouts, 2, layouts, COMMON, timeout=240)
    for i in range(0, len(layouts), 2):
        first, second = res[0][i], res[0][i + 1]
        assert len(first["losses"]) == 5 and second["start"] == 5 and len(second["losses"]) == 5
        err = max(abs(a - b) for a, b in zip(first["losses"] + second["losses"], want))
        assert err < TOL64, (first["flags"], err)
        assert sorted(os.listdir(tmp_path / f"ckpt{i // 2}")) == ["meta.json", "rank0.pt", "rank1.pt"]


def test_resume_with_another_layout_is_refused(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "meta.json").write_text(json.dumps(dict(step=5, world_size=2, layout=dict(tp=2))))
    with pytest.raises(ValueError, match="was written with") as e:
        check_args(parse_args(["--dp-shard", "2", "--resume", str(d)]), 2)
    assert "lacks the shards of ranks [0, 1]" in str(e.value)


INVALID = [
    (["--dp-shard", "3"], 2, "world size is 2"),
    (["--tp", "3"], 3, "does not divide the model's n_heads"),
    (["--pp", "2", "--microbatches", "1"], 2, "1F1B needs at least as many micro-batches"),
    (["--dp-shard", "2", "--global-batch-size", "6", "--microbatches", "2"], 2, "not divisible by the data-parallel"),
    (["--dp-shard", "2", "--experts", "3", "--ep", "2"], 2, "--experts 3 is not divisible by --ep 2"),
    (["--data", "/no/such/file.txt"], 1, "does not exist"),
    (["--pp", "3"], 3, "more stages than the model's 2 layers"),
    (["--cp", "2", "--seq-len", "6"], 2, "not divisible by 2*cp"),
    (["--ep", "2", "--dp-shard", "2"], 2, "needs a mixture-of-experts"),
    (["--tp", "2", "--experts", "4"], 2, "not supported yet"),
    (["--tp", "2", "--sequence-parallel", "--seq-len", "9"], 2, "--sequence-parallel splits"),
    (["--dp-shard", "2", "--tp", "2", "--sequence-parallel"], 4, "not supported yet: --sequence-parallel with --zero-stage 3"),
]


@pytest.mark.parametrize("flags, world, msg", INVALID)
def test_invalid_layouts_are_named(flags, world, msg):
    with pytest.raises(ValueError, match=msg.replace("*", r"\*")):
        check_args(parse_args(flags), world)


def _main_exit_codes(cases):
    """Rank function: train.main on each invalid command line; (exit code, stderr) of each."""
    import contextlib
    import io

    import train
    out = []
    for flags in cases:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = train.main(flags)
        out.append((code, err.getvalue()))
    return out


def test_every_invalid_layout_exits_nonzero_on_every_rank():
    """train.main on 2 ranks (world size 2 makes the product check fire too where sizes differ):
    each invalid command returns non-zero with its message on every rank, touching no collective
    (a collective that only some ranks reached would hang and fail the call by timeout)."""
    res = run_ranks(_main_exit_codes, 2, [f for f, _, _ in INVALID], timeout=60)
    for rank, codes in enumerate(res):
        for (flags, _, msg), (code, err) in zip(INVALID, codes):
            assert code != 0 and msg in err and f"[rank {rank}]" in err, (flags, err)


def _torchrun(n, flags, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    from mesh import free_port  # not torchrun's default port: other jobs may hold it
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n),
                           "--master_port", str(free_port()), os.path.join(ROOT, "train.py")] + flags,
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def test_invalid_layout_under_torchrun_fails_on_every_rank_without_hanging():
    p = _torchrun(2, ["--dp-shard", "2", "--global-batch-size", "5"], timeout=90)
    assert p.returncode != 0
    for r in range(2):
        assert f"[rank {r}] invalid training layout" in p.stderr, p.stderr[-2000:]
    assert "use a multiple of 2" in p.stderr


def test_torchrun_demo_log_file_check_and_compare(tmp_path):
    """4 ranks, dp_shard 2 x tp 2: per-step lines, JSON log, --check (one process on rank 0) and
    --compare (PyTorch's FSDP2 + DTensor TP on the same layout, same losses)."""
    log = tmp_path / "log.jsonl"
    p = _torchrun(4, ["--dp-shard", "2", "--tp", "2", "--steps", "3", "--seq-len", "16", "--log-file", str(log),
                      "--check", "--compare"], timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Warning" not in p.stderr, p.stderr[-2000:]
    assert p.stdout.count("tokens/s") == 3 and "comm" in p.stdout
    assert "losses vs the single-process run" in p.stdout and "-> ok" in p.stdout, p.stdout
    line = next(x for x in p.stdout.splitlines() if x.startswith("PyTorch FSDP2"))
    assert float(line.split("max |loss diff| ")[1].split(";")[0]) < 1e-5, line
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["loss"] > 0 and r["tokens_per_s"] > 0 and r["peak_memory_bytes"] > 0 and r["comm_bytes"] > 0


def test_plain_python_runs():
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--steps", "2", "--seq-len", "16"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0 and p.stdout.count("tokens/s") == 2, p.stderr[-2000:]
    assert "Warning" not in p.stderr
