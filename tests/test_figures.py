"""The README's pictures: drawn by the course's own code with one command, `python -m lab.figures`, committed
under notebooks/figures/ and shown in the lessons they belong to."""
import os
import struct

from harness import ROOT, run_command
from lab.figures import FIGURES

SHOWN_IN = {"mesh_groups.png": "## Lesson 0", "zero_memory.png": "## Lesson 2", "pipeline_1f1b_zb.png": "## Lesson 5",
            "ring_attention.png": "## Lesson 6", "published_runs.png": "## Running for real: speed"}


def _png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def test_one_command_draws_every_picture(tmp_path):
    out = run_command(["-m", "lab.figures", "--out", str(tmp_path)], timeout=400)
    for name in FIGURES:
        width, height = _png_size(tmp_path / name)
        assert width >= 600 and height >= 300 and os.path.getsize(tmp_path / name) > 20_000, (name, width, height)
        assert str(tmp_path / name) in out


def test_every_picture_is_committed_and_shown_in_its_lesson():
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert set(SHOWN_IN) == set(FIGURES)
    for name, lesson in SHOWN_IN.items():
        _png_size(os.path.join(ROOT, "notebooks", "figures", name))
        section = readme[readme.index(lesson):]
        section = section[:section.index("\n## ", 1)]
        assert f"](notebooks/figures/{name})" in section, f"{name} is not shown in {lesson}"
