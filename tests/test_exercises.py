"""Every exercise in the README, run as a learner would run it, and checked for what it says to look for.

Each lesson's test module lists its exercises as `EXERCISES = [harness.Exercise(command, check, ...)]`,
with the command exactly as the README prints it. This module collects them, checks that the README
and the lists name the same commands (so neither can drift), and runs every one.

Spawning ranks is most of the suite's time: a torchrun command's ranks start forked from a server that imported
torch once, with the environment torchrun gives them (harness.run_forked; the real torchrun for a command that
names more than --nproc_per_node, and for all with COURSE_REAL_TORCHRUN=1 -- each lesson's own test runs its
demo under the real one). One exercise leaves a core idle much of the time (a rank waiting on another), so the
selected exercises run two at a time, in test order,
each in its own copy of the repository on its own port; an exercise marked `alone` (its check reads timings)
runs with nothing beside it. Each test then checks its own exercise's output. A setup
that several exercises share (the checkpoint two resumes read) runs once (harness.SetupCache).
"""
import threading
from concurrent.futures import ThreadPoolExecutor
import glob
import importlib
import os
import re

import pytest

from harness import ROOT, SetupCache, run_exercise


def readme_commands() -> list[str]:
    """The commands (inline code starting with torchrun or python) inside the README's Exercises lists."""
    text = open(os.path.join(ROOT, "README.md")).read()
    commands = []
    for block in re.findall(r"^Exercises\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M):
        for code in re.findall(r"`([^`]+)`", block):
            code = " ".join(code.split())
            if code.startswith(("torchrun ", "python ")):
                commands.append(code)
    return commands


def collected() -> dict:
    out = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "tests", "test_*.py"))):
        name = os.path.basename(path)[:-3]
        if name == "test_exercises":
            continue
        for ex in getattr(importlib.import_module(name), "EXERCISES", []):
            key = " ".join(ex.command.split()) + (" [after the exercise's edit]" if ex.edits else "")
            assert key not in out, f"exercise command listed twice: {key}"
            out[key] = ex
    return out


EXERCISES = collected()


def test_every_readme_exercise_is_run_by_a_test():
    readme = set(readme_commands())
    assert readme, "the README lists no exercise commands"
    run = {" ".join(c.split()) for ex in EXERCISES.values() for c in (ex.command, *ex.setup)}
    assert readme == run, (f"in the README but not run: {sorted(readme - run)}\n"
                           f"run but not in the README: {sorted(run - readme)}")


pytestmark = pytest.mark.background   # each exercise takes the machine itself (conftest): an `alone` one, alone


@pytest.fixture(scope="module")
def outputs(request, machine):
    """command -> a future of what it printed, for every exercise selected in this session, two at a time."""
    selected = [item.callspec.params["command"] for item in request.session.items
                if item.module is request.module and item.originalname == "test_exercise"]
    slots, taking, setups = threading.Semaphore(2), threading.Lock(), SetupCache()

    def run(ex):
        n = 2 if ex.alone else 1  # alone: both slots, so nothing else runs beside it
        with taking:
            for _ in range(n):
                slots.acquire()
        try:
            with machine(alone=ex.alone):
                return run_exercise(ex, setups)
        finally:
            for _ in range(n):
                slots.release()

    pool = ThreadPoolExecutor(2)
    futures = {c: pool.submit(run, EXERCISES[c]) for c in selected}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)
    setups.remove()


@pytest.mark.parametrize("command", sorted(EXERCISES))
def test_exercise(command, outputs):
    EXERCISES[command].check(outputs[command].result())
