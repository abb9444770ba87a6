"""Every notebook in notebooks/ runs top to bottom and draws the figures it promises.

A code cell tagged "figure" (cell metadata `"tags": ["figure"]`) must produce a PNG. The
notebooks are committed executed, so their figures show on the repository page: the committed
copy must hold those PNGs too. To re-execute one in place after a change:

    python tests/test_notebooks.py notebooks/ddp.ipynb

A notebook's kernel starts on one core while the other idles, so the selected notebooks execute two at a
time, in test order (a module fixture); plan_time.ipynb, which times steps, executes with no other notebook beside it
(the test reads none of its timings: the committed copy holds the numbers its text reads).
"""
import glob
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
ALONE = ("plan_time.ipynb",)  # it measures step times: nothing else runs beside it


def execute(path):
    nb = nbformat.read(path, as_version=4)
    os.environ.setdefault("MPLBACKEND", "Agg")
    # (the kernel's own log at errors only: its start-up warning about plain TCP on localhost would reach the
    # suite's output; a cell's output and errors come through the notebook, not this log)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": ROOT}},
                   extra_arguments=["--IPKernelApp.log_level=ERROR"]).execute()
    return nb


def figure_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code" and "figure" in c.get("metadata", {}).get("tags", [])]


def has_png(cell) -> bool:
    return any("image/png" in o.get("data", {}) for o in cell.get("outputs", []))


pytestmark = pytest.mark.background   # each notebook takes the machine itself (conftest)


@pytest.fixture(scope="module")
def executed(request, machine):
    """path -> a future of the executed notebook, for every notebook selected in this session, two at a time."""
    selected = [item.callspec.params["path"] for item in request.session.items
                if item.module is request.module and item.originalname == "test_notebook_runs_and_draws_its_figures"]
    slots, taking = threading.Semaphore(2), threading.Lock()
    had_backend = "MPLBACKEND" in os.environ
    os.environ.setdefault("MPLBACKEND", "Agg")  # (for the kernels; taken back below, as lab.launch.run_ranks
    # forks ranks from a server only while the environment is the one it started with)

    def run(path):
        n = 2 if os.path.basename(path) in ALONE else 1
        with taking:
            for _ in range(n):
                slots.acquire()
        try:
            with machine():
                return execute(path)
        finally:
            for _ in range(n):
                slots.release()

    pool = ThreadPoolExecutor(2)
    yield {p: pool.submit(run, p) for p in selected}
    pool.shutdown(wait=True, cancel_futures=True)
    if not had_backend:
        del os.environ["MPLBACKEND"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[os.path.basename(p) for p in NOTEBOOKS])
def test_notebook_runs_and_draws_its_figures(path, executed):
    committed = nbformat.read(path, as_version=4)
    assert figure_cells(committed), "tag the cells that draw a figure with 'figure'"
    missing = [i for i, c in enumerate(figure_cells(committed)) if not has_png(c)]
    assert not missing, f"the committed notebook lacks the figures of tagged cells {missing}: execute it in place"
    nb = executed[path].result()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, errors[0].get("evalue")
    assert all(has_png(c) for c in figure_cells(nb)), "a figure cell drew no figure"


if __name__ == "__main__":
    for p in sys.argv[1:]:
        nbformat.write(execute(p), p)
        print("executed", p)
