"""train.py's checkpoints: written atomically and periodically, resumed after a crash (torchrun restarts)
to the bit, loaded on ANY other layout and world size to the single-process losses, refused — on every
rank, before any collective — when they are damaged or do not fit, and exported to / started from one
plain state dict in both reading modes, with the host memory each rank holds measured.

Each parity check compares the losses from the resumed step on with lab.train_demo.reference_losses: the
model trained in ONE process from step 0 (float64; asserted within 1e-9)."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from harness import ROOT, RankError, refusals, run_forked, run_ranks
from lab.train_demo import reference_losses, run_layouts
from lab.checkpoint import complete_checkpoints
from train import check_args, parse_args

COMMON = ["--dtype", "float64", "--steps", "8", "--global-batch-size", "8", "--seq-len", "16", "--lr", "3e-3",
          "--grad-clip", "1.7"]
MOE = ["--experts", "4"]
TOL64 = 1e-9


def _resumed_equal_one_process(per_rank, common=COMMON):
    """per_rank: run_layouts' result for one layout on every rank of a run that resumed: each rank resumed at
    the same step and its losses (every rank reports the global ones) from there on equal the single-process
    run's. The worst rank's error."""
    first = per_rank[0]
    args = parse_args(list(common) + first["flags"].split())
    want = reference_losses(args, range(first["start"], args.steps))  # once: it trains a model
    worst = 0.0
    for rank, res in enumerate(per_rank):
        assert res["flags"] == first["flags"] and res["start"] == first["start"], (rank, res["flags"], res["start"])
        assert res["start"] > 0 and len(res["losses"]) == len(want), (rank, res["flags"])
        err = max(abs(a - b) for a, b in zip(res["losses"], want))
        assert err < TOL64, \
            f"rank {rank} [{res['flags']}]: max |loss diff| {err:.2e} after resuming at step {res['start']}"
        worst = max(worst, err)
    return worst


# (saved on, with how many ranks) -> (resumed on, with how many ranks): six pairs and a world of one
PAIRS = [(2, ["--tp", "2"], 2, ["--pp", "2"]),                                                   # tp -> pp
         (2, ["--dp-shard", "2", "--zero-stage", "3"], 2, ["--dp-shard", "2", "--zero-stage", "0"]),  # ZeRO-3 -> 0
         (4, MOE + ["--dp-shard", "4", "--ep", "2"], 2, MOE + ["--tp", "2"]),                      # ep -> no ep
         (4, ["--dp-shard", "2", "--tp", "2", "--sequence-parallel"], 2, ["--dp-shard", "2"]),      # world 4 -> 2
         (2, ["--dp-shard", "2", "--zero-stage", "1"], 8, ["--pp", "2", "--dp-shard", "2", "--tp", "2"]),  # 2 -> 8
         (4, ["--dp-replicate", "2", "--dp-shard", "2"], 4,
          ["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--layers", "4", "--microbatches", "2",
           "--cp", "2"]),                                                                        # HSDP -> pp x cp
         (2, ["--pp", "2", "--schedule", "zb", "--microbatches", "2"], 1, [])]                    # pp -> one process


def test_a_checkpoint_resumes_on_any_layout(tmp_path):
    """Each pair saved at step 2 of 4 on one layout, resumed on the other: the losses of steps 3-4 are the
    single-process run's. The interleaved pair needs 4 layers, so both of its runs use --layers 4."""
    common = COMMON + ["--steps", "4"]   # (the last --steps counts)
    saves = {}
    for i, (n, save, _, load) in enumerate(PAIRS):
        layers = ["--layers", "4"] if "--layers" in load else []
        saves.setdefault(n, []).append(save + layers + ["--stop-at", "2", "--save", str(tmp_path / f"c{i}")])
    for n, layouts in saves.items():
        run_ranks(run_layouts, n, layouts, common, timeout=300)
    loads = {}
    for i, (_, _, n, load) in enumerate(PAIRS):
        loads.setdefault(n, []).append(load + ["--resume", str(tmp_path / f"c{i}")])
    errors = {}
    for n, layouts in loads.items():
        results = run_ranks(run_layouts, n, layouts, common, timeout=400)
        for i, res in enumerate(results[0]):
            errors[res["flags"]] = _resumed_equal_one_process([rank[i] for rank in results], common)
    assert len(errors) == len(PAIRS)


def _live_bytes_layouts(layouts, common):
    """run_layouts with glibc's malloc giving every freed block of 64 KiB or more back to the system (mallopt's
    M_MMAP_THRESHOLD, what MALLOC_MMAP_THRESHOLD_=65536 sets at a process's start): memory means live bytes."""
    import ctypes
    assert ctypes.CDLL("libc.so.6").mallopt(-3, 65536) == 1   # M_MMAP_THRESHOLD = -3 (malloc.h)
    return run_layouts(layouts, common)


def test_save_and_load_hold_no_whole_model(tmp_path):
    """Host memory each rank holds above what it held before, over a save and over a load (sampled while
    the call runs): a save adds next to nothing (it writes tensors the rank holds), a load adds this rank's
    optimizer state (the fresh trainer had none) and no more than one parameter's worth besides — never the
    whole model, whose checkpoint is 3x its fp32 parameters (value, and AdamW's two moments)."""
    from lab.model import get_config, num_params
    cfg = get_config("small")
    whole = 3 * 4 * num_params(cfg)                                     # the checkpoint's tensors, fp32
    largest = 3 * 4 * cfg.vocab_size * cfg.dim                          # one parameter's value and moments
    common = ["--model", "small", "--steps", "3", "--global-batch-size", "4", "--seq-len", "16", "--quiet"]
    saved = run_ranks(_live_bytes_layouts, 4, [["--dp-shard", "4", "--stop-at", "2", "--save", str(tmp_path)]],
                      common, timeout=300)
    loaded = run_ranks(_live_bytes_layouts, 2, [["--dp-shard", "2", "--resume", str(tmp_path)]], common, timeout=300)
    save_io = saved[0][0]["checkpoint_io"]["per_rank"]
    assert sum(r["saves"][0]["written"] for r in save_io) >= whole
    for r in save_io:
        assert r["saves"][0]["peak"] < largest + 2**21, r["saves"]
    load_io = loaded[0][0]["checkpoint_io"]["per_rank"]
    for r in load_io:
        optimizer_state = 2 * r["state"] / 3  # of its master weights and two moments, the moments are new
        assert r["loads"][0]["peak"] < optimizer_state + largest + 2**22, (r["loads"], r["state"])
        assert r["loads"][0]["peak"] < whole / 2


# ---- a crash: torchrun restarts the job, which continues from its newest checkpoint -----------------------

def _torchrun(n, flags, restarts=0, timeout=240):
    from lab.launch import free_port
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--max-restarts",
                           str(restarts), "--master_port", str(free_port()), os.path.join(ROOT, "train.py"), *flags],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def _logged(path):
    """{step: loss}, the last line of each step (a restarted run logs its resumed steps again)."""
    return {r["step"]: r["loss"] for r in map(json.loads, open(path))}


def test_a_rank_killed_mid_run_restarts_and_continues_exactly(tmp_path):
    """torchrun --max-restarts 1 with --fail-at 5: the last rank dies after step 5 on the first attempt, torchrun
    restarts every rank, --resume auto picks the checkpoint of step 4, and steps 5-8 equal an uninterrupted
    run's to the bit (data order, learning rate and random state come back with it) -- in float32, where any
    difference in what was restored would show in the last bits."""
    flags = ["--dp-shard", "2", "--tp", "2", "--steps", "8", "--dtype", "float32", "--seq-len", "16"]
    p = _torchrun(4, flags + ["--save", str(tmp_path / "ck"), "--save-every", "2", "--resume", "auto", "--fail-at", "5",
                              "--log-file", str(tmp_path / "crash.jsonl")], restarts=1)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "--fail-at 5: dying after step 5" in p.stdout and "resuming after step 4" in p.stdout, p.stdout[-2000:]
    # the uninterrupted run: torchrun's ranks, forked (harness.run_forked) -- what is tested here is the restart
    run_forked(["-m", "torch.distributed.run", "--nproc_per_node", "4", "train.py", *flags, "--log-file",
                str(tmp_path / "plain.jsonl"), "--quiet"], cwd=ROOT, timeout=240)
    crashed, plain = _logged(tmp_path / "crash.jsonl"), _logged(tmp_path / "plain.jsonl")
    assert sorted(crashed) == list(range(1, 9)) and crashed == plain
    assert [s for s, _ in complete_checkpoints(str(tmp_path / "ck"))] == [2, 4, 6, 8]


def _die_in_second_save(flags):
    """Rank function: train with a checkpoint every 2 steps; rank 1 dies while it writes the second one, half
    a file on the disk."""
    import torch.distributed as dist

    import train
    from lab.train_demo import measured_train
    inner, calls = train.Trainer.save, []

    def save(self, root, step):
        calls.append(step)
        if len(calls) == 2 and dist.get_rank() == 1:
            real = torch.save

            def half(obj, f):
                real(obj, f)
                f.truncate(f.tell() // 2)
                f.flush()
                os._exit(1)
            train.torch.save = half
        return inner(self, root, step)
    train.Trainer.save = save
    return measured_train(parse_args(flags), verbose=False)["losses"]


def test_a_save_killed_half_way_leaves_the_last_checkpoint_loadable(tmp_path):
    ck = str(tmp_path / "ck")
    flags = COMMON + ["--dp-shard", "2", "--save", ck, "--save-every", "2", "--quiet"]
    with pytest.raises((RankError, TimeoutError)):  # rank 1 died; rank 0 lost its peer in the save
        run_ranks(_die_in_second_save, 2, flags, timeout=60)
    assert os.path.isdir(os.path.join(ck, "step_00000004.partial"))  # half written, never renamed
    assert [s for s, _ in complete_checkpoints(ck)] == [2]
    res = run_ranks(run_layouts, 2, [["--dp-shard", "2", "--save", ck, "--resume", "auto"]], COMMON, timeout=120)
    for rank in res:  # every rank resumed after step 2 and reports the global losses
        assert rank[0]["start"] == 2
    _resumed_equal_one_process([rank[0] for rank in res])
    assert [s for s, _ in complete_checkpoints(ck)] == [2, 8] and not os.path.exists(ck + "/step_00000004.partial")


def test_keep_the_newest_k(tmp_path):
    ck = str(tmp_path / "ck")
    run_ranks(run_layouts, 2, [["--dp-shard", "2", "--save", ck, "--save-every", "1", "--keep", "2"]], COMMON,
              timeout=120)
    assert [s for s, _ in complete_checkpoints(ck)] == [7, 8]


# ---- refusals: one message naming the file and what is wrong, on every rank, before any collective -------

class _Payload:
    """Unpickling this runs a shell command: what a tampered checkpoint could carry."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _damaged(src, dst, what, marker):
    shutil.copytree(src, dst)
    rank1, meta_path = os.path.join(dst, "rank1.pt"), os.path.join(dst, "meta.json")
    meta = json.load(open(meta_path))
    if what == "tampered":       # code in the file, and meta.json updated to match it: weights_only refuses
        torch.save({"pieces": [], "rng": _Payload(marker)}, rank1)
        from lab.checkpoint import sha256 as _sha256
        meta["files"]["rank1.pt"].update(bytes=os.path.getsize(rank1), sha256=_sha256(rank1))
    elif what == "altered":      # a few bytes changed, meta.json not: the checksum refuses
        data = bytearray(open(rank1, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(rank1, "wb").write(bytes(data))
    elif what == "truncated":
        data = open(rank1, "rb").read()
        open(rank1, "wb").write(data[:len(data) // 2])
    elif what == "missing":
        os.remove(rank1)
    elif what == "meta":
        open(meta_path, "w").write("{not json")
    json.dump(meta, open(meta_path, "w")) if what in ("tampered",) else None
    return dst


REFUSALS = [("tampered", [], "cannot be read safely"), ("altered", [], "does not match the sha256"),
            ("truncated", [], "truncated or altered"), ("missing", [], "rank1.pt is missing"),
            ("meta", [], "cannot be read as a checkpoint"),
            ("other model", ["--layers", "3"], "was written for another model"),
            ("done", ["--steps", "4"], "nothing is left to train")]


def test_damaged_or_unfitting_checkpoints_are_refused_on_every_rank(tmp_path):
    run_ranks(run_layouts, 2, [["--dp-shard", "2", "--stop-at", "4", "--save", str(tmp_path / "ck")]], COMMON,
              timeout=120)
    good = complete_checkpoints(str(tmp_path / "ck"))[-1][1]
    marker = str(tmp_path / "code-ran")
    cases = []
    for what, extra, _ in REFUSALS:
        path = _damaged(good, str(tmp_path / what.replace(" ", "_")), what, marker) \
            if what not in ("other model", "done") else good
        cases.append(COMMON + ["--dp-shard", "2", "--resume", path] + extra)
    for what, msg in (("missing file", "does not exist"), ("tampered file", "cannot be read safely"),
                      ("other model", "not a state dict of this model")):
        f = str(tmp_path / f"{what.replace(' ', '_')}.pt")
        if what == "tampered file":
            torch.save({"tok_embeddings.weight": _Payload(marker)}, f)
        elif what == "other model":
            torch.save({"tok_embeddings.weight": torch.zeros(3, 3)}, f)
        cases.append(COMMON + ["--dp-shard", "2", "--init-from", f])
    cases.append(COMMON + ["--dp-shard", "2", "--resume", "auto"])   # auto needs --save
    msgs = [m for _, _, m in REFUSALS] + ["does not exist", "cannot be read safely", "not a state dict of this model",
                                          "give --save DIR too"]
    for rank_results in run_ranks(refusals, 2, cases, timeout=120):
        for flags, msg, (err, calls) in zip(cases, msgs, rank_results):
            assert err is not None and msg in err and calls == 0, (flags, msg, err)
            path = flags[flags.index("--resume" if "--resume" in flags else "--init-from") + 1]
            assert os.path.basename(path) in err or path == "auto", (path, err)  # the message names the file
    assert not os.path.exists(marker), "a checkpoint ran code while it was read"
    with pytest.raises(ValueError, match="nothing is left to train"):  # and on its own, arithmetic only
        check_args(parse_args(COMMON + ["--steps", "4", "--resume", good]), 2)


# ---- a plain state dict out of a sharded run, and into any layout ------------------------------------------

def test_export_then_start_any_layout_from_it_in_both_reading_modes(tmp_path):
    """--export writes one {name: tensor} that the plain model loads with strict=True and that holds the trained
    weights; --init-from starts another layout from it, its losses the single-process run's from the same
    file — reading it on every rank (each holds the whole model for a moment) or on rank 0 alone (the others
    hold only their pieces): the host memory each rank held while it read is measured and compared."""
    from lab.baseline import single_process
    from lab.data import get_batch, load_corpus
    from lab.model import build_model, get_config, num_params
    f = str(tmp_path / "model.pt")
    common = ["--model", "small", "--global-batch-size", "4", "--seq-len", "16", "--quiet", "--dtype", "float64"]
    run_ranks(run_layouts, 4, [["--dp-shard", "2", "--tp", "2", "--steps", "2", "--export", f]], common, timeout=300)
    sd = torch.load(f, weights_only=True)
    plain = build_model("small", dtype=torch.float64)
    plain.load_state_dict(sd, strict=True)
    batches = [get_batch(load_corpus(), s, 4, 16) for s in range(2)]
    ref = single_process(build_model("small", dtype=torch.float64), batches, lr=1e-3,
                         lr_at=lambda s: [5e-4, 1e-3][s - 1], clip=1.0)["model"]
    assert max((sd[n] - p).abs().max().item() for n, p in ref.named_parameters()) < 1e-9
    whole = 8 * num_params(get_config("small"))
    layouts = [["--dp-shard", "4", "--steps", "3", "--init-from", f, "--init-read", mode]
               for mode in ("every-rank", "rank-0")]
    res = run_ranks(_live_bytes_layouts, 4, layouts, common, timeout=300)
    for i, flags in enumerate(lay["flags"] for lay in res[0]):
        want = reference_losses(parse_args(common + flags.split()))
        for rank, lays in enumerate(res):  # every rank reports the global losses
            assert max(abs(a - b) for a, b in zip(lays[i]["losses"], want)) < TOL64, (rank, flags)
    every, rank0 = (res[0][i]["checkpoint_io"]["per_rank"] for i in range(2))
    # the larger of the sampled peak and the kernel's high-water mark: a sampler thread starved on a busy
    # machine can miss the moment the whole model is held; the high-water mark cannot (neither file is mapped:
    # every-rank loads the file into memory, ranks 1-3 of rank-0 never open it)
    held = lambda r: max(r["inits"][0]["peak"], r["inits"][0]["growth"] or 0)  # noqa: E731
    assert all(held(r) > 0.7 * whole for r in every), [r["inits"] for r in every]
    assert all(held(r) < 0.5 * whole for r in rank0[1:]), [r["inits"] for r in rank0]
