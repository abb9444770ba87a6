"""The lab: everything the course's lessons are run, measured and checked with — so that each lesson
file at the root holds its algorithm and nothing else.

Imports run one way: the first four modules import no lesson; mesh.py may import them; the lessons import
mesh.py (and a lesson another only where its idea builds on it); train.py imports every lesson; the
rest of the package imports whatever it measures; the tests and notebooks import everything.

    model.py          the one small Llama-style model every lesson shares, and its named sizes
    data.py           byte-level text every machine has, and the global batch of step s from (seed, s)
    instruments.py    CommCounter (collectives and their bytes), memory, time, profiler spans
    launch.py         N gloo ranks from Python (tests, notebooks), and a torchrun entry point's clean end
    baseline.py       single_process: the one-process run every strategy must equal; snapshot, max_diff
    mismatch.py       train.py --check: where a run first differs from one process (place, rank, pattern, collective)
    changed_lesson.py train.py --lesson NAME=FILE: an edited copy of a lesson run in place of the course's
    report.py         print0, print_by_rank, all_agree, bytes_table: what demos print and agree on
    hf.py             the course's model <-> Hugging Face Llama / Mixtral: configs and state dicts, both ways
    references.py     PyTorch's own implementation of each lesson that has one (DDP, FSDP2, DTensor TP,
                      pipelining, the autograd all-to-all): what every --compare and the tests put beside ours
    <lesson>_demo.py  each lesson's demo (what `torchrun ... <lesson>.py` runs) and the measurements its
                      tests and notebook use: mesh, ddp, fsdp (the ZeRO formulas, held_bytes,
                      train_and_measure), hsdp, tensor_parallel, pipeline, ring_attention, expert_parallel,
                      train (the capstone's measured loop, --check and --compare)
"""
