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
    env = dict(os.environ, OMP_NUM_THREADS="1", COURSE_TIMEOUT="120", PYTHONUNBUFFERED="1",
               PET_MASTER_PORT=str(free_port()))
    p = subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    out = p.stdout + p.stderr
    if expect_fail:
        assert p.returncode != 0, f"{argv} should have failed:\n{out[-3000:]}"
    else:
        assert p.returncode == 0, f"{argv} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        assert "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "Warning" not in p.stderr, p.stderr[-3000:]  # runs warning-free (no deprecated calls)
    return out


def run_script(script: str, *args: str, nproc: int | None = None, timeout: float = 240, cwd: str = ROOT,
               expect_fail: bool = False) -> str:
    """`torchrun --nproc_per_node nproc script args` (or plain `python script args` when nproc is
    None), through run_command."""
    launcher = [] if nproc is None else ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    return run_command([*launcher, script, *args], cwd=cwd, timeout=timeout, expect_fail=expect_fail)


@dataclass
class Exercise:
    """One README exercise, checked the way a learner would check it.

    command   the command exactly as the README prints it (`torchrun --nproc_per_node N file.py ...`
              or `python file.py ...`)
    check     check(output) asserts that what the exercise says to look for is in what it printed
    edits     the code changes the exercise asks for: (file, old text, new text), applied to a copy
              of the repository (the lesson itself is never touched)
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
        path = os.path.join(dst, file)
        text = open(path).read()
        assert text.count(old) == 1, f"the exercise's edit of {file} must match exactly once: {old!r}"
        open(path, "w").write(text.replace(old, new))


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
                    run_command(exercise_argv(command), cwd=d, timeout=timeout)
                self.dirs[key] = d
            return self.dirs[key]

    def remove(self) -> None:
        for d in self.dirs.values():
            shutil.rmtree(d, ignore_errors=True)


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
                run_command(exercise_argv(command), cwd=tmp, timeout=ex.timeout)
        return run_command(argv, cwd=tmp, timeout=ex.timeout, expect_fail=ex.fails)
