"""train.py's runner: the capstone measured from outside and printed, checked against one process
(--check) and compared with PyTorch's FSDP2 + DTensor TP (--compare). `python train.py` and
`torchrun ... train.py` run `main` here; the tests and the notebook call `run_layouts` and
`reference_losses`.

StepMeter attaches to train.train's loop through its observer hooks: around each step it times the
step, counts every collective the step issues (CommCounter: API bytes and ring bytes) and reads the
peak memory; after it, the model state the rank holds (fsdp_demo.held_bytes) and the global loss,
for one line per step (and --log-file's JSON).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import time
import warnings
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

import fsdp
import train
from lab import checkpoint, collective_watch, mismatch, plan, references
from lab.changed_lesson import lessons_in_place
from lab.plan import activation_formula
from lab.baseline import LOSS_TOL, OneProcess
from lab.data import IGNORE, get_batch, load_corpus
from lab.fsdp_demo import held_bytes, offload_formula
from lab.instruments import (CommCounter, ProfileSpans, memory_tracker, overlap_fraction, peak_memory_bytes, sync,
                             time_side_by_side, watch_calls)
from lab.launch import finish, main as run_main, start_watch
from lab.model import build_model, flops_per_token, num_params
from lab.report import all_agree
from mesh import init_distributed
from train import check_args, config_of, lr_at, parse_args, store_dtype

PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16, from the vendors' data sheets


def _peak_memory(device) -> int:
    """CUDA allocator peak on a GPU; the process's peak resident set size on CPU."""
    return peak_memory_bytes(device) or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _peak_flops(device) -> float | None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


class StepMeter:
    """train.train's observer: what each step took, measured from outside the step."""

    def __init__(self, args, device, verbose: bool = True):
        self.args, self.device, self.verbose = args, device, verbose
        self.rank0, self.world = dist.get_rank() == 0, dist.get_world_size()
        self.comm = CommCounter()
        self.out = dict(tokens_per_s=[], comm_bytes=[], peak_memory_bytes=[], grad_norms=[], state_bytes=None,
                        offload_bytes=[], ddp_overlap=None, ddp_launches=[])
        self.launched, self.grad_passes = [], []  # this step's bucket launches, and the backwards that added to them
        self.transfers = ([], [])  # OffloadedUnit.download / upload calls (measured_train watches them)

    def begin(self, trainer, start: int) -> None:
        a, self.trainer = self.args, trainer
        # ZeRO-0's buckets (ddp.BucketedDDP): one step (the second, past the first's warm-up) runs under
        # torch.profiler, for the share of all-reduce time that lay inside backward
        self.profile_step = min(start + 1, (a.stop_at or a.steps) - 1) if trainer.ddp is not None else None
        if trainer.ddp is not None:
            self._watch_buckets(trainer.ddp)
        self.fpt = flops_per_token(trainer.cfg, a.seq_len)
        self.peak = _peak_flops(self.device) if a.dtype == "bfloat16" else None
        if self.verbose and self.rank0:
            dtype = a.dtype + (" with float8 matmuls" if a.float8 else "")
            print(f"train.py: {trainer.mesh}, zero stage {a.zero_stage}, model {train.model_name(a)} ({num_params(trainer.cfg):,} "
                  f"parameters), {dtype}, global batch {a.global_batch_size}x{a.seq_len}, {self.device}"
                  + (f", resuming after step {start}" if start else ""), flush=True)

    def _watch_buckets(self, dp) -> None:
        """ZeRO-0: where each of ddp.BucketedDDP's bucket all-reduces is launched — by which backward pass (autograd
        numbers each: its graph task), or by none (synchronize(), after the step's backwards) — and which backward
        passes added to a bucketed gradient: counted, not timed, so the same on a busy machine."""
        launch, finish, ending = dp._launch_in_order, dp._finish_backward, [False]
        # (the hooks call self._launch_in_order, autograd and synchronize() self._finish_backward: instance
        #  attributes win over the class's methods)

        def launch_watched():
            first = dp._next
            launch()
            task = torch._C._current_graph_task_id()   # -1: outside any backward
            done = self.grad_passes.count(task)        # gradients this backward produced before the hook's own
            self.launched += [(b.nbytes, task, ending[0], done) for b in dp.buckets[first:dp._next]
                              if dist.get_world_size(b.group) > 1]

        def finish_watched():   # the backward's end (or synchronize()): what no hook launched during it
            ending[0] = True
            try:
                finish()
            finally:
                ending[0] = False
        dp._launch_in_order, dp._finish_backward = launch_watched, finish_watched
        for p in dp.params:
            p.register_post_accumulate_grad_hook(lambda _: self.grad_passes.append(torch._C._current_graph_task_id()))

    def _bucket_launches(self) -> dict:
        """This step's bucket all-reduces: bytes launched; of them, inside the last backward that added to a
        gradient — of those, by its hooks while it computed, and before its last gradient (with gradients
        still to compute behind them: order, counted, the same on any load) — and outside any backward (by
        synchronize(), after it); and the number of backwards that added to a bucketed gradient."""
        last = max(self.grad_passes, default=None)
        total = self.grad_passes.count(last)   # the gradients the last backward produced
        return dict(bytes=sum(n for n, _, _, _ in self.launched), backwards=len(set(self.grad_passes)),
                    in_last_backward=sum(n for n, t, _, _ in self.launched if t == last and t != -1),
                    by_hooks=sum(n for n, t, end, _ in self.launched if t == last and t != -1 and not end),
                    before_last_gradient=sum(n for n, t, end, done in self.launched
                                             if t == last and t != -1 and not end and done + 1 < total),
                    after_backward=sum(n for n, t, _, _ in self.launched if t == -1))

    @contextmanager
    def around(self, trainer, step: int):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        sync(self.device)
        t0 = time.perf_counter()
        self.comm.reset()
        self.launched, self.grad_passes = [], []
        moved = [len(calls) for calls in self.transfers]
        tracker = memory_tracker(trainer.model, trainer.opt.inner) if self.args.track_memory else nullcontext()
        # (one process has nothing to count; and under --compile a dispatch mode around the step would make
        #  dynamo run every frame eagerly, so the collectives are not counted there)
        counting = self.world > 1 and not self.args.compile
        self.spans = ProfileSpans() if step == self.profile_step else nullcontext()
        with self.comm if counting else nullcontext(), warnings.catch_warnings(), tracker as tracked, self.spans, \
                collective_watch.context(f"step {step + 1}"):
            warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper")  # (MemTracker)
            yield
        self.tracked_peak = next(iter(tracked.get_tracker_snapshot("peak").values()))["Total"] \
            if self.args.track_memory else None
        self.out["offload_bytes"].append(tuple(sum(c["result"].numel() * c["result"].element_size() for c in calls[k:])
                                               for calls, k in zip(self.transfers, moved)))
        sync(self.device)
        self.seconds = time.perf_counter() - t0
        self.out["state_bytes"] = held_bytes(trainer.opt)  # model state held after the step, gradients included

    def after(self, trainer, step: int, loss: float) -> None:
        a, comm = self.args, self.comm
        tps = a.global_batch_size * a.seq_len / self.seconds
        lr, nbytes, wire = lr_at(step + 1, a), comm.bytes(), comm.wire_bytes()
        mem = self.tracked_peak if self.tracked_peak is not None else _peak_memory(self.device)
        mfu = self.fpt * tps / (self.peak * self.world) if self.peak else None
        norm = None if trainer.grad_norm is None else float(trainer.grad_norm)
        hidden = overlap_fraction(self.spans.spans) if step == self.profile_step else None
        self.out["ddp_overlap"] = hidden if hidden is not None else self.out["ddp_overlap"]
        launches = self._bucket_launches() if trainer.ddp is not None else None
        if launches is not None:
            self.out["ddp_launches"].append(launches)
        for k, v in [("tokens_per_s", tps), ("comm_bytes", nbytes), ("peak_memory_bytes", mem), ("grad_norms", norm)]:
            self.out[k].append(v)
        if self.rank0 and self.verbose and not a.quiet:
            down, up = self.out["offload_bytes"][-1]
            print(f"step {step + 1:4d}  loss {loss:.6f}  lr {lr:.2e}  {tps:10.0f} tokens/s"
                  + (f"  MFU {mfu:5.1%}" if mfu is not None else "")
                  + f"  peak {'tracked' if a.track_memory else 'mem'} {mem / 2**20:7.1f} MiB  comm {nbytes / 2**20:.3f} MiB"
                  + f" (ring {wire / 2**20:.3f}, rank 0)"
                  + (f"  offload: down {down / 2**20:.3f} up {up / 2**20:.3f} MiB" if a.offload else "")
                  + (f"  all-reduce launched before backward's last gradient {launches['before_last_gradient'] / 2**20:.1f}"
                     f" of {launches['bytes'] / 2**20:.1f} MiB, hidden in backward {hidden:.0%} (profiled)"
                     if hidden is not None else ""),
                  flush=True)
        if self.rank0 and a.log_file:
            with open(a.log_file, "a") as f:
                f.write(json.dumps(dict(step=step + 1, loss=loss, lr=lr, tokens_per_s=tps, peak_memory_bytes=mem,
                                        comm_bytes=nbytes, mfu=mfu)) + "\n")
        if a.fail_at == step + 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and self.world > 1:
            dist.barrier()   # every rank has logged the step: torchrun stops the others as soon as one dies
        if a.fail_at == step + 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" \
                and dist.get_rank() == self.world - 1:  # --fail-at: a crash, on the first attempt only
            print(f"[rank {dist.get_rank()}] --fail-at {a.fail_at}: dying after step {step + 1}", flush=True)
            os._exit(1)

    def results(self) -> dict:
        """The per-step readings, and what the last step left: bytes by collective, model state, layout."""
        opt, mesh = self.trainer.opt, self.trainer.mesh
        return dict(self.out, comm_summary=self.comm.summary(), coords=dict(mesh.coords),
                    offload_formula=offload_formula(opt),
                    comm_events=[(e.op, e.group_ranks, e.api_bytes) for e in self.comm.events],
                    zero_units=[(u.flat_numel, u.names[0], 1 if u.averaged else dist.get_world_size(u.group),
                                 len(u.params)) for u in opt.units],
                    ddp_buckets=[(b.flat.numel(), b.flat.element_size(), tuple(dist.get_process_group_ranks(b.group)), len(b.params))
                                 for b in self.trainer.ddp.buckets] if self.trainer.ddp is not None else [])


def measured_train(args, device=None, verbose: bool = True, meter=None) -> dict:
    """train.train with a StepMeter (every rank), and every checkpoint save and load, export and --init-from
    watched from outside (seconds, host memory): the losses and first step, what was measured, and with
    --check the verdict of the comparison with one process (check_ok)."""
    device = device or torch.device("cpu")
    meter = meter or StepMeter(args, device, verbose)
    with watch_calls(train.Trainer, "save") as saves, watch_calls(train.Trainer, "load") as loads, \
            watch_calls(train.Trainer, "init_from") as inits, watch_calls(train.Trainer, "export") as exports, \
            watch_calls(fsdp.OffloadedUnit, "download", memory=False) as down, \
            watch_calls(fsdp.OffloadedUnit, "upload", memory=False) as up:
        meter.transfers = (down, up)
        out = train.train(args, device, observer=meter)
    out.update(meter.results())
    out["checkpoint_io"] = io = checkpoint_io(meter.trainer, saves, loads, inits, exports)
    if dist.get_rank() == 0 and verbose:
        state, n = out["state_bytes"], num_params(meter.trainer.cfg)
        print("model state on rank 0 after a step: " + ", ".join(f"{k} {v / 2**10:.1f} KiB" for k, v in state.items())
              + f" ({state['total'] / n:.2f} bytes per parameter of the model)", flush=True)
        print_checkpoint_io(io, args, out)
    if args.check:
        out["check_ok"], out["check_report"] = check(args, device, out)
    return out


def check(args, device, out) -> tuple[bool, list[str]]:
    """--check: the run's losses (and, with clipping, its gradient norms: AdamW all but hides a gradient's scale from
    the losses, not from the norm) against the single-process run, on rank 0; where they differ, lab.mismatch replays
    the run to say where it first differs, and whether a float32 or bf16 difference is rounding (then the run is
    right: ok) or a bug. Returns (ok, on every rank alike; the report's lines)."""
    ok, last, lines = True, 0, []
    if dist.get_rank() == 0:
        stop = args.stop_at or args.steps
        one = reference_losses(args, range(out["start"], stop), device, norms=True)
        want, norms = one["losses"], one["norms"]
        tol = args.check_tolerance if args.check_tolerance is not None else LOSS_TOL[args.dtype]
        bad = [i for i, (a, b) in enumerate(zip(out["losses"], want)) if not abs(a - b) <= tol]
        err = max(abs(a - b) for a, b in zip(out["losses"], want))
        line = f"losses vs the single-process run: max |diff| {err:.2e} (tolerance {tol}: {args.dtype} losses)"
        if norms and all(n is not None for n in out["grad_norms"]):
            rel = [abs(a - b) / max(b, 1e-30) for a, b in zip(out["grad_norms"], norms)]
            bad = sorted(set(bad) | {i for i, r in enumerate(rel) if not r <= tol})
            line += f"; gradient norms: max relative diff {max(rel):.2e}"
        ok = not bad
        print(f"{line} -> {'ok' if ok else 'MISMATCH'}", flush=True)
        last = out["start"] + bad[0] + 1 if bad else 0
    ok = all_agree(ok)
    if not ok:
        step = [last]
        dist.broadcast_object_list(step, src=0)
        lines, bug = mismatch.first_difference(args, device, step[0], reference_run)
        if dist.get_rank() == 0:
            print("\n".join(lines), flush=True)
        ok = not bug   # rounding, not a bug: the run is right, held to a tolerance tighter than its dtype's
    return ok, lines


def checkpoint_io(trainer, saves, loads, inits, exports) -> dict:
    """Per call, on every rank: seconds, this rank's bytes written (its file) and its peak host memory over
    the call (above what it held before: sampled, and the kernel's high-water mark, `growth`); gathered so
    every rank holds every rank's numbers."""
    def mine(calls, written):
        return [dict(seconds=c["seconds"], peak=c["rss_peak"] - c["rss_before"], growth=c["rss_growth"],
                     written=c["result"][1] if written else 0, path=c["result"][0] if written else None)
                for c in calls]
    masters = sum(u.master.numel() * u.master.element_size() for u in trainer.opt.units)
    local = dict(saves=mine(saves, True), loads=mine(loads, False), inits=mine(inits, False),
                 exports=mine(exports, False), state=masters + held_bytes(trainer.opt)["optimizer"])
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, local)
    return dict(per_rank=every)


def print_checkpoint_io(io, args, out) -> None:
    """Rank 0's lines: every save, load, --init-from and --export, with its seconds and per-rank numbers."""
    ranks, mib = io["per_rank"], 1 / 2**20
    first = ranks[0]
    per = lambda key, i, k: " ".join(f"{r[key][i][k] * mib:.2f}" for r in ranks)  # noqa: E731
    for i, call in enumerate(first["saves"]):
        total = sum(r["saves"][i]["written"] for r in ranks)
        print(f"checkpoint {os.path.basename(call['path'])}: {max(r['saves'][i]['seconds'] for r in ranks):.3f} s; "
              f"MiB written per rank {per('saves', i, 'written')} (all {total * mib:.2f}); peak host memory "
              f"per rank +{per('saves', i, 'peak')} MiB", flush=True)
    for key, what in (("loads", f"resumed after step {out['start']} from {out.get('resumed_from')}"),
                      ("inits", f"started from {args.init_from} (--init-read {args.init_read})"),
                      ("exports", f"exported to {args.export}")):
        if first[key]:
            print(f"{what}: {max(r[key][0]['seconds'] for r in ranks):.3f} s; peak host memory per rank "
                  f"+{per(key, 0, 'peak')} MiB (its master weights and optimizer state per rank "
                  + " ".join(f"{r['state'] * mib:.2f}" for r in ranks) + " MiB)", flush=True)


# ---- the single-process reference ------------------------------------------------------------------------

def reference_run(args, device=None, on_rows=None):
    """The single-process reference of a run: (lab.baseline.OneProcess, the global batches of its steps) — model.py's
    model in ONE process on the whole global batch: AdamW, torch's own clip_grad_norm_, the same learning rate (bf16
    runs are compared with fp32). With experts and m > 1 micro-batches it accumulates over the same micro-batches a
    parallel run makes — micro-batch i gathers the i-th rows of every data-parallel rank — since the aux loss is per
    forward. on_rows(rows): told, before each forward, which rows of the global batch it runs on."""
    cfg = config_of(args)
    model = build_model(cfg, seed=args.seed, device=device, dtype=store_dtype(args))
    if args.init_from:  # the same start as the parallel run: a plain state dict or a Hugging Face directory
        model.load_state_dict(checkpoint.whole_model(args.init_from))
    tokens = load_corpus(args.data, tokenizer=checkpoint.tokenizer_of(args.init_from))
    batches = [get_batch(tokens, s, args.global_batch_size, args.seq_len, args.seed, pad_share=args.pad_share,
                         device=device or "cpu") for s in range(args.stop_at or args.steps)]
    dp, m = args.dp_replicate * args.dp_shard, args.microbatches
    said = on_rows or (lambda rows: None)

    def loss_fn(model, batch):
        x, y = batch
        if not cfg.n_experts or m == 1:
            said(torch.arange(len(x)))
            return model(x, y)
        model.loss_fn.divide_by = max(int((y != IGNORE).sum()), 1) / m   # Σ CE over micro-batch / (counted/m)
        rows = torch.arange(len(x)).view(dp, m, -1).transpose(0, 1).reshape(m, -1)  # [m, rows of mb i]
        loss = 0
        for r in rows:
            said(r)
            loss = loss + model(x[r], y[r])
        model.loss_fn.divide_by = None
        return loss / m
    return OneProcess(model, lr=args.lr, lr_at=lambda s: lr_at(s, args), clip=args.grad_clip or None,
                      loss_fn=loss_fn, copy_model=False), batches


def reference_losses(args, steps: range = None, device=None, norms: bool = False):
    """The losses of steps `steps` (default all) in ONE process (reference_run); norms: dict(losses, norms), the
    gradient norms too (None without clipping)."""
    steps = steps or range(args.steps)
    one, batches = reference_run(args, device)
    for batch in batches[:steps.stop]:
        one.step(batch)
    losses = one.losses[steps.start:]
    return dict(losses=losses, norms=one.norms[steps.start:] or None) if norms else losses


def run_layouts(layouts: list[list[str]], common: list[str] = ()) -> list[dict]:
    """A rank function (launch.run_ranks): train each layout in turn on the same ranks; every layout's
    flags are `common + layout`. Returns each layout's result on this rank."""
    out = []
    for flags in layouts:
        args = parse_args([*common, *flags, "--quiet"])
        with lessons_in_place(args.lesson):   # --lesson NAME=FILE: that layout's changed lesson, then the course's
            out.append(dict(measured_train(args, verbose=False), flags=" ".join(flags)))
    return out


# ---- the entry point ---------------------------------------------------------------------------------------

def compare_checkpoints(args, trainer, device, rounds: int = 3) -> None:
    """Save and load time and bytes per rank: ours (train.Trainer.save / load, the last step's state) beside
    torch.distributed.checkpoint saving the same model and AdamW state under FSDP2 on the same layout,
    timed in alternating rounds (instruments.time_side_by_side); the ratios printed on rank 0."""
    root = os.path.join(args.save, "benchmark")
    ours_dir = os.path.join(root, "ours")
    step = (args.stop_at or args.steps)
    save, load, written = references.dcp_checkpoint(args, device, os.path.join(root, "torch_dcp"))
    t = time_side_by_side(dict(ours_save=lambda: trainer.save(ours_dir, step), dcp_save=save), rounds, 1)
    t |= time_side_by_side(dict(ours_load=lambda: trainer.load(os.path.join(ours_dir, checkpoint.STEP_DIR.format(step))),
                                dcp_load=load), rounds, 1)
    mine = torch.tensor([trainer.save(ours_dir, step)[1], written()], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    times = torch.tensor([t[k] for k in ("ours_save", "dcp_save", "ours_load", "dcp_load")], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank's: the job waits for it
    if dist.get_rank() == 0:
        mib = 1 / 2**20
        print(f"checkpoints, ours vs torch.distributed.checkpoint (FSDP2), median of {rounds} alternating rounds: save "
              f"{times[0] * 1e3:.1f} ms vs {times[1] * 1e3:.1f} ms (ours/theirs {times[0] / times[1]:.2f}), load "
              f"{times[2] * 1e3:.1f} ms vs {times[3] * 1e3:.1f} ms (ours/theirs {times[2] / times[3]:.2f}); "
              f"MiB written "
              f"per rank, ours " + " ".join(f"{e[0] * mib:.3f}" for e in every) + ", theirs "
              + " ".join(f"{e[1] * mib:.3f}" for e in every), flush=True)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)


TWINS = {"compile": ("compiled", "eager"), "float8": ("float8", "without float8")}


def compare_with_twin(args, trainer, device, switch: str, rounds: int = 3) -> float:
    """--compile, --float8: the trainer's step beside a twin's built with that switch off (the same layout, the
    same groups), timed in alternating rounds (instruments.time_side_by_side); rank 0 prints the ratio, which
    every rank returns (the slowest rank's times)."""
    on, off = TWINS[switch]
    twin, tokens = train.Trainer(argparse.Namespace(**dict(vars(args), **{switch: False})), trainer.mesh,
                                 device), load_corpus(args.data)
    t = time_side_by_side({on: lambda: trainer.step(0, tokens), off: lambda: twin.step(0, tokens)},
                          rounds, 2, device=device)
    times = torch.tensor([t[on], t[off]], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        label = f"compiled ({args.compile_backend}) vs eager" if switch == "compile" else f"{on} vs {off}"
        print(f"{label}, median of {rounds} alternating rounds: {times[0] * 1e3:.1f} ms vs {times[1] * 1e3:.1f} ms "
              f"per step: {on}/{off} {times[0] / times[1]:.2f}", flush=True)
    return float(times[0] / times[1])


def run(argv=None, compare=references.train_fsdp2_tp) -> int:
    """torchrun entry point. compare(args, device) -> (losses, seconds per step): the same layout under
    PyTorch's own FSDP2 + DTensor TP, for --compare (with --save: their checkpointing beside ours too).
    --lesson NAME=FILE: the run uses that file in place of the lesson (lab/changed_lesson.py)."""
    args = parse_args(argv)
    with lessons_in_place(args.lesson):
        return _run(args, compare)


def _run(args, compare) -> int:
    if args.plan:  # one process plans for the whole layout: the world is the product of the sizes
        from lab import plan_time
        assume = plan_time.assumptions(args.assume)   # --assume KEY=VALUE: a bad key raises, naming the known
        if args.search:   # every layout for --gpus ranks, ranked by predicted step time
            check_args(args, math.prod(getattr(args, d) for d in train.DIMS))
            dev = plan_time.device_named(args.device, assume)
            G = args.gpus_per_node or dev.gpus_per_node
            memory = plan.parse_memory(args.device_memory) if args.device_memory else dev.memory
            plan_time.print_search(args, args.gpus, G, dev, plan_time.search(args, args.gpus, dev, G, memory, assume))
            return 0
        check_args(args, math.prod(getattr(args, d) for d in train.DIMS))
        plans = plan.plan(args)
        plan.print_plan(args, plans)
        if args.device:
            dev = plan_time.device_named(args.device, assume)
            plan_time.print_time(args, dev, args.gpus_per_node or dev.gpus_per_node, plans, assume)
        return 0
    check_args(args, int(os.environ.get("WORLD_SIZE", "1")))  # before joining: every rank alike, no hang
    start_watch(args)   # --watch: every collective checked before it runs, from the first
    device = init_distributed()
    meter = StepMeter(args, device)
    out = measured_train(args, device, meter=meter)
    collective_watch.report(sum(args.global_batch_size * args.seq_len / t for t in out["tokens_per_s"]), "the steps")
    if args.compare and args.save:
        compare_checkpoints(args, meter.trainer, device)
    for switch in (s for s in TWINS if getattr(args, s) and not args.watch):   # (a timing: never under --watch)
        compare_with_twin(args, meter.trainer, device, switch)
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


def main(argv=None) -> None:
    run_main(run, argv)


# ---- activation memory: what a block keeps for its backward, measured and by formula --------------------------

def activation_profile(model_name: str = "tiny", hows=("none", "selective", "full"), dtype=torch.float32,
                       batch: int = 4, seq: int = 32, sp: bool = False, repeats: int = 3) -> dict:
    """Rank function (a tp group of the whole world): for each checkpointing policy, the bytes one block keeps
    after its forward per token (instruments.SavedBytes around block 0's forward: what autograd and checkpointing
    keep for its backward, its input and output and the parameters left out) beside activation_formula, and
    the median time of a whole model's forward + backward over `repeats` calls (0: not timed, seconds None). tp = the
    world size (1: no tensor parallel)."""
    import tensor_parallel
    from lab.instruments import SavedBytes, time_steps
    from lab.model import alibi_bias, get_config, rope_cos_sin
    cfg, t = get_config(model_name), dist.get_world_size()
    tokens = load_corpus()
    x, y = get_batch(tokens, 0, batch, seq)
    out = {}
    for how in hows:
        model = build_model(cfg, dtype=dtype)
        if t > 1:
            tensor_parallel.apply_tensor_parallel(model, dist.group.WORLD, sequence_parallel=sp)
        if how != "none":
            for block in model.layers:
                train._checkpointed(block, how)
        block, s_local = model.layers[0], seq // t if sp else seq
        cos, sin = (rope_cos_sin(torch.arange(seq), cfg.head_dim, cfg.rope_theta, dtype)
                    if cfg.positions == "rope" else (None, None))
        h = torch.randn(batch, s_local, cfg.dim, dtype=dtype, requires_grad=True) * 1.0  # a block's input
        with SavedBytes() as saved:
            o = block(h, cos, sin)
        # what autograd keeps for the backward, but for the block's input (the previous block's output, which
        # the formula leaves out), its output (the next block's input), the rotary tables or ALiBi's bias (every
        # layer's) and the parameters
        shared = [cos, sin] if cos is not None else [alibi_bias(cfg.n_heads, block.attn.sdpa.first, cfg.n_heads // t,
                                                                seq, seq, h.device, dtype)] if cfg.positions == "alibi" else []
        kept = saved.held(exclude=[o, h, *shared, *model.parameters()]) / (batch * seq)
        o.float().sum().backward()
        step = lambda: model(x, y).backward()  # noqa: E731
        out[how] = dict(bytes_per_token=kept, seconds=time_steps(step, repeats) if repeats else None,
                        formula=activation_formula(cfg, how, torch.finfo(dtype).bits // 8, t, sp))
    return out
