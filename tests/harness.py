"""Test helpers: ranks from lab/launch.py, the single-process reference (lab/baseline.py), and running a lesson
— or a README exercise — the way a learner does."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from lab.baseline import single_process  # noqa: F401  (the one single-process reference loop)
from lab.launch import RankError, free_port, run_ranks  # noqa: F401  (re-exported for the tests)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def reference_model(cfg="tiny", seed: int = 0, dtype=torch.float32):
    """The same model every parallel run starts from, in one process."""
    from lab.model import build_model
    return build_model(cfg, seed=seed, dtype=dtype)


def train_reference(model, batches, lr: float = 1e-3, optimizer_cls=torch.optim.AdamW, **opt_kwargs):
    """(losses, trained copy) of lab.baseline.single_process — kept for the older tests' call form."""
    out = single_process(model, batches, lr=lr, optimizer=optimizer_cls, **opt_kwargs)
    return out["losses"], out["model"]


def global_batches(n_steps: int, global_batch: int, seq_len: int, seed: int = 0, **kw):
    """The first n_steps global batches of the built-in corpus."""
    from lab.data import get_batch, load_corpus
    tokens = load_corpus()
    return [get_batch(tokens, s, global_batch, seq_len, seed, **kw) for s in range(n_steps)]


def refusals(cases: list[list[str]]) -> list[tuple]:
    """Rank function: lab.train_demo.run on each (invalid) command line; for each, (the ValueError's message or
    None, how many collectives ran before it) on this rank — bad input must fail on every rank before any
    collective (lab.launch.main turns the error into one line and exit code 2)."""
    from lab import train_demo
    from lab.instruments import CommCounter
    out = []
    for flags in cases:
        with CommCounter() as c:
            try:
                train_demo.run(flags)
                out.append((None, c.calls()))
            except ValueError as e:
                out.append((str(e), c.calls()))
    return out


# ---- running a lesson the way a learner does ---------------------------------------------

def run_command(argv: list[str], *, cwd: str = ROOT, timeout: float = 240, expect_fail: bool = False) -> str:
    """Run argv (after the interpreter) as a learner would; check its exit code and that it printed
    no warning and (unless it is meant to fail) no traceback; return stdout + stderr. torchrun's rendezvous
    port comes from the environment (PET_MASTER_PORT, which torchrun reads when the command names no
    --master-port): a free one, not the default 29500 another job — or another exercise — may hold."""
    env = dict(_learner_env(), PET_MASTER_PORT=str(free_port()))
    p = subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return _checked(argv, p.returncode, p.stdout, p.stderr, expect_fail)


def _learner_env() -> dict:
    """The environment a command of the course runs in here: one thread a rank, collectives that give up after
    120 s, output unbuffered — and none of pytest's variables (a learner's shell has no PYTEST_XDIST_WORKER)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return dict(env, OMP_NUM_THREADS="1", COURSE_TIMEOUT="120", PYTHONUNBUFFERED="1")


def _checked(argv, code: int, stdout: str, stderr: str, expect_fail: bool) -> str:
    """A command's exit code and stderr as a learner's run must leave them; stdout + stderr."""
    out = stdout + stderr
    if expect_fail:
        assert code != 0, f"{argv} should have failed:\n{out[-3000:]}"
    else:
        assert code == 0, f"{argv} exited {code}:\n{stdout[-3000:]}\n{stderr[-3000:]}"
        assert "Traceback" not in stderr, stderr[-3000:]
    assert "Warning" not in stderr, stderr[-3000:]  # runs warning-free (no deprecated calls)
    return out


def run_script(script: str, *args: str, nproc: int | None = None, timeout: float = 240, cwd: str = ROOT,
               expect_fail: bool = False) -> str:
    """`torchrun --nproc_per_node nproc script args` (or plain `python script args` when nproc is
    None): a lesson's run that succeeds under torchrun through the real torchrun (run_command) -- each lesson's
    proof that torchrun starts it; one process, or bad input, forked (run_forked: the same script, no torch import)."""
    launcher = [] if nproc is None else ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    run = run_forked if nproc is None or expect_fail else run_command
    return run([*launcher, script, *args], cwd=cwd, timeout=timeout, expect_fail=expect_fail)


@dataclass
class Exercise:
    """One README exercise, checked the way a learner would check it.

    command   the command exactly as the README prints it (`torchrun --nproc_per_node N file.py ...`
              or `python file.py ...`)
    check     check(output) asserts that what the exercise says to look for is in what it printed
    edits     the code changes the exercise asks for: (file, old text, new text), applied to a copy
              of the repository (the lesson itself is never touched); file "a.py -> b.py": the learner's
              copy b.py of a.py, with the change
    fails     the exercise is about an error: the command must exit non-zero
    setup     README commands the exercise runs first, in the same directory (e.g. the run that saves
              the checkpoint a resume reads); they must succeed, their output is not checked
    alone     its check reads timings (what overlapped what): run it with no other exercise beside it
    """
    command: str
    check: Callable[[str], None]
    edits: tuple = ()
    fails: bool = False
    timeout: float = 240
    setup: tuple = ()
    alone: bool = False


def exercise_argv(command: str) -> list[str]:
    """The interpreter arguments of a README command: torchrun ... | python file.py ... | python -m ..."""
    words = command.split()
    if words[0] == "torchrun":
        return ["-m", "torch.distributed.run", *words[1:]]
    assert words[0] in ("python", "python3"), f"a README exercise runs torchrun or python: {command!r}"
    return words[1:]


def _copy_repository(dst: str, edits=()) -> None:
    """The code (root .py and .ini files, tests/, lab/) copied to dst, with an exercise's edits applied."""
    for name in os.listdir(ROOT):
        src = os.path.join(ROOT, name)
        if name.endswith((".py", ".ini")) or name in ("tests", "lab"):
            (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, os.path.join(dst, name))
    for file, old, new in edits:
        source, _, target = file.partition(" -> ")   # "a.py -> b.py": the edit goes into b.py, a copy of a.py
        text = open(os.path.join(dst, source)).read()
        assert text.count(old) == 1, f"the exercise's edit of {source} must match exactly once: {old!r}"
        open(os.path.join(dst, target or source), "w").write(text.replace(old, new))


class SetupCache:
    """The directories the exercises' setup commands leave behind, each made once: exercises with the same
    edits and the same setup (two resumes of one saved checkpoint) start from copies of one directory, as
    if each had run the setup there itself. Thread-safe; remove() deletes the directories."""

    def __init__(self):
        self.dirs, self.lock, self.locks = {}, threading.Lock(), {}

    def prepared(self, ex: Exercise, timeout: float) -> str:
        key = (ex.edits, ex.setup)
        with self.lock:
            lock = self.locks.setdefault(key, threading.Lock())
        with lock:
            if key not in self.dirs:
                d = tempfile.mkdtemp()
                _copy_repository(d, ex.edits)
                for command in ex.setup:
                    run_forked(exercise_argv(command), cwd=d, timeout=timeout)
                self.dirs[key] = d
            return self.dirs[key]

    def remove(self) -> None:
        for d in self.dirs.values():
            shutil.rmtree(d, ignore_errors=True)


# ---- the same command, started from a server that has imported torch ------------------------------------------
#
# A README exercise is `torchrun --nproc_per_node N lesson.py ...` (or `python lesson.py ...`). torchrun starts a
# fresh interpreter per rank, and each imports torch: 1.5 s of CPU a rank, 5 s of wall for 4 ranks on 2 cores --
# half of what the 57 exercises cost the suite. So the exercises start their ranks the way torchrun would --
# the environment it sets (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), the script
# run as __main__ with the command's arguments, every rank's output, the others killed when one fails, a non-zero
# exit when any rank's is -- but forked from lab.launch's server, which has imported torch once. What this skips
# is torchrun's own launcher (its agent, rendezvous and restarts), which each lesson's own test still runs for
# real (run_script), as does every exercise that names more than --nproc_per_node (e.g. --max-restarts) and
# every one when COURSE_REAL_TORCHRUN=1.

def _inside(path: str, directory: str) -> bool:
    path = os.path.abspath(path)
    return path == directory or path.startswith(directory + os.sep)


def _exercise_rank(script, args, cwd, env, out_path):
    """One rank of a forked exercise: the process a torchrun worker would be, from a server with torch in it."""
    import runpy
    code = 1
    with open(out_path + ".out", "wb") as out, open(out_path + ".err", "wb") as err:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)      # C++ warnings too, as a worker's would
    try:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        # the copy's code, not the repository's the server imported (lab.launch): forget every module from a
        # directory of the repository, and put the copy first on the path, as `python script` would
        for name, mod in list(sys.modules.items()):
            if _inside(getattr(mod, "__file__", None) or "/", ROOT):
                del sys.modules[name]
        sys.path[:] = [cwd] + [p for p in sys.path if not _inside(p or ".", ROOT)]
        sys.argv = [script, *args]
        torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))   # run_command's environment sets 1
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - what a worker prints when it dies of an exception
        import traceback
        traceback.print_exc()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)   # as lab.launch's ranks leave: no interpreter finalisation with gloo threads alive


def _forked_command(argv: list[str]):
    """(nproc or None for `python script`, script, args) when argv can start forked; else None."""
    if argv[:2] == ["-m", "torch.distributed.run"]:
        if len(argv) < 5 or argv[2] != "--nproc_per_node" or not argv[4].endswith(".py"):
            return None                     # anything more than --nproc_per_node: the real torchrun
        return int(argv[3]), argv[4], argv[5:]
    return (None, argv[0], argv[1:]) if argv[0].endswith(".py") else None


def run_forked(argv: list[str], *, cwd: str, timeout: float, expect_fail: bool = False) -> str:
    """run_command's checks and result for a torchrun (or python) command whose ranks fork from the server that
    imported torch (see above); the real command where that cannot stand in for it."""
    import multiprocessing as mp
    import time

    from lab import launch
    parsed = _forked_command(argv)
    if parsed is None or os.environ.get("COURSE_REAL_TORCHRUN") == "1":
        return run_command(argv, cwd=cwd, timeout=timeout, expect_fail=expect_fail)
    nproc, script, args = parsed
    base = _learner_env()
    base.pop("PYTEST_CURRENT_TEST", None)
    world, port = nproc or 1, free_port()
    launch._context()                                # lab.launch's server, started as its own calls start it
    ctx = mp.get_context("forkserver")
    procs, outs, logs = [], [], tempfile.mkdtemp()
    for r in range(world):
        env = dict(base) if nproc is None else dict(base, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                                                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                                                   MASTER_PORT=str(port))
        outs.append(os.path.join(logs, f"rank{r}"))
        procs.append(ctx.Process(target=_exercise_rank, args=(script, args, cwd, env, outs[-1]),
                                 daemon=True))
    for p in procs:
        p.start()
    deadline, failed = time.monotonic() + timeout, False
    while any(p.is_alive() for p in procs):
        if time.monotonic() > deadline:
            break
        if any(p.exitcode not in (None, 0) for p in procs):
            failed = True                    # torchrun's agent: one worker failed, stop the others
            time.sleep(0.5)                  # (their last words first)
            break
        time.sleep(0.05)
    timed_out = not failed and any(p.is_alive() for p in procs)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    read = lambda path: open(path, errors="replace").read() if os.path.exists(path) else ""  # noqa: E731
    stdout = "".join(read(o + ".out") for o in outs)
    stderr = "".join(read(o + ".err") for o in outs)
    shutil.rmtree(logs, ignore_errors=True)
    if timed_out:
        raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr)
    return _checked(argv, int(failed or any(p.exitcode != 0 for p in procs)), stdout, stderr, expect_fail)


def run_exercise(ex: Exercise, setups: SetupCache | None = None) -> str:
    """Run ex.command in a copy of the repository (the code, with the exercise's edits), so that nothing an
    exercise writes — a checkpoint, an exported model — lands in the repository; return what it printed.
    With setups, an exercise's setup commands run once per SetupCache (see there)."""
    argv = exercise_argv(ex.command)
    with tempfile.TemporaryDirectory() as tmp:
        if ex.setup and setups is not None:
            shutil.copytree(setups.prepared(ex, ex.timeout), tmp, dirs_exist_ok=True)
        else:
            _copy_repository(tmp, ex.edits)
            for command in ex.setup:
                run_forked(exercise_argv(command), cwd=tmp, timeout=ex.timeout)
        return run_forked(argv, cwd=tmp, timeout=ex.timeout, expect_fail=ex.fails)
