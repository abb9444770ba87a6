"""Every exercise in the README, run as a learner would run it, and checked for what it says to look for.

Each lesson's test module lists its exercises as `EXERCISES = [harness.Exercise(command, check, ...)]`,
with the command exactly as the README prints it. This module collects them, checks that the README
and the lists name the same commands (so neither can drift), and runs every one.
"""
import glob
import importlib
import os
import re

import pytest

from harness import ROOT, run_exercise


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


@pytest.mark.parametrize("command", sorted(EXERCISES))
def test_exercise(command):
    ex = EXERCISES[command]
    ex.check(run_exercise(ex))
