"""The devices the time planner prices a step on (lab/plan_time.py): one profile per GPU type, its datasheet's
peaks and each share of them a measurement reached, with the source of every number beside it; and this
machine's, measured by plan_time.calibration_steps."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Device:
    """A device's rates. flops: peak dense FLOP/s by compute dtype; hbm: memory bandwidth (B/s); alpha/beta:
    latency (s) and bandwidth per rank per direction (B/s) of a collective's step inside a node (intra) and
    between nodes (inter); memory: bytes; gpus_per_node: the default G; op_overhead: seconds each operation
    costs beyond its FLOPs (eager PyTorch's dispatch and a kernel launch: a few µs on a GPU).
    collective_factor  per op, a collective's wire time over the ring formula's (gloo's reduce-scatter and
                 all-gather on loopback are not ring-optimal: measured 1.5-3x; NCCL's are: 1)
    optimizer_elem, optimizer_tensor  the optimizer step (AdamW) and the clip's norm, per element of the local
                 shard and per parameter tensor (piece) it loops over; None: Assumptions.optimizer_bytes at hbm
    matmul_efficiency  by dtype, the share of `flops` a large matmul reaches (measured: a sustained cuBLAS rate,
                 else the maximum achievable matmul FLOP/s of short runs, over the peak); a dtype left out: 1
    attention_efficiency  the share of the compute dtype's peak a fused attention kernel reaches (its forward;
                 and its backward where attention_backward is None)
    attention_backward  the share its backward kernel reaches (None: attention_efficiency)
    hbm_efficiency  the share of `hbm` (the datasheet's) a streaming kernel reaches: memory-bound work runs at
                 hbm x hbm_efficiency (measured: STREAM-like kernels; cpu-gloo measures its own rate: 1)
    overlap_slowdown  while a collective runs beside compute (hidden behind it), the compute runs this much
                 slower: the collective's kernels hold SMs and memory bandwidth (0: none)
    agree        seconds lesson 0's collective check (mesh.agree: this rank's line set in the job's TCPStore,
                 every peer's read back, an old one deleted) costs before each of fsdp.py's collectives (its
                 gathers, reduce-scatters, used flags, the clip's all-reduce) and hsdp.py's;
                 COURSE_CHECK_COLLECTIVES=0 turns the check off. cpu-gloo: measured (calibration_steps). A GPU: 0 --
                 the check blocks the host, which runs ahead of the device by the kernels it has queued, so its round
                 trips (0.16-0.31 ms each on loopback here, about a hundred a step for ZeRO-3) delay no kernel while
                 the host stays ahead; not priced: the one store serving every rank's requests at hundreds of ranks
    async_launch  the host launches kernels ahead of the device (a GPU): a phase takes the longer of the device's
                 work and the host's launches; else (a CPU) their sum
    nccl         its collectives are NCCL's, which picks an algorithm per call by its cost model (NCCL_*: a ring,
                 or for an all-reduce a tree); gloo's are rings
    nvls         NVSwitches with NVLink SHARP (third generation, H100/H200 HGX boards): NCCL's NVLS algorithm, the
                 switch reducing an all-reduce inside a node
    hopper       a Hopper GPU (H100, H200): the kernels written for it run (FlashAttention-3)"""
    name: str
    flops: dict
    hbm: float
    intra_alpha: float
    intra_beta: float
    inter_alpha: float
    inter_beta: float
    memory: float
    gpus_per_node: int
    source: str
    op_overhead: float = 5e-6
    collective_factor: dict = field(default_factory=dict)
    optimizer_elem: float | None = None
    optimizer_tensor: float = 0.0
    matmul_efficiency: dict = field(default_factory=dict)
    attention_efficiency: float = 1.0
    async_launch: bool = False
    attention_backward: float | None = None
    hbm_efficiency: float = 1.0
    overlap_slowdown: float = 0.0
    agree: float = 0.0
    nccl: bool = False
    nvls: bool = False
    hopper: bool = False


# What a GPU reaches of its datasheet, each measured elsewhere and cited here (one profile per GPU type, the same
# for every run on it):
#   matmul_efficiency  the best SUSTAINED cuBLAS rate where one is published: Azure's AI-benchmarking-guide
#       (github.com/Azure/AI-benchmarking-guide, Azure_Results/ND_A100_v4_results.md, ND_H100_v5_results.md,
#       ND_H200_v5_results.md: cuBLASLt, random inputs, 10,000 warm-up iterations, so the GPU is at its power and
#       thermal steady state): A100 SXM4 80GB fp16 256.5 TFLOP/s at 16384^3 (82.2% of 312), H100 SXM fp8 1382.2 at
#       32768^3 (69.8% of 1,979), H200 fp8 1366.3 at 16384^3 (69.0%). bf16 on the H100 and H200 (Azure publishes
#       fp8 only): the maximum SUSTAINABLE matmul FLOP/s (S. Bekman, Machine Learning Engineering,
#       github.com/stas00/ml-engineering, branch fast-mamf at 082816f, 2026-08-10, compute/accelerator/README.md,
#       "MSMF": mamf-finder.py's best shape once the board is power-saturated and its clock has settled, "the number
#       that matches sustained training throughput"): H200 SXM 708.5 of 989 (71.6%; ~693 W at 1,465 MHz, where the
#       same table's short burst, MAMF, reaches 841.9 at 1,980 MHz). The H100 SXM takes the H200's share: the same
#       GH100 compute die, SM count, clocks and 700 W limit (its own MSMF is not measured yet; its short-run MAMF,
#       794.5, stood here before and predicted every bf16 row of the published table faster than it ran)
#   attention_efficiency, attention_backward  FlashAttention-2 (the kernels of PyTorch's SDPA flash backend, the
#       backend PyTorch's default order picks first on an H100 in Dec 2024: pytorch/pytorch#138522 made cuDNN's
#       opt-in) at head dim 128 on an H100 SXM5, 16k tokens: forward with the causal mask 335 TFLOP/s (33.9% of
#       989), backward 322 (32.6%) (Shah et al. 2024, FlashAttention-3, arXiv:2407.08608, Fig. 5 and Fig. 6, the
#       FlashAttention-2 bars), each times 708.5/841.9 = 0.842: those are short benchmark runs at the boost clock, and
#       a board whose power is saturated runs every compute-bound kernel at its settled clock -- the same table's MSMF
#       over MAMF on the H200 (Bekman, fast-mamf 082816f: ~1,465 against 1,980 MHz) measures what that costs the
#       tensor cores, and flash attention's inner loop is the same tensor-core matmuls (no soaked flash rate is
#       published). On an A100 (Dao 2023, arXiv:2307.08691: FlashAttention-2 reaches 50-73% of the
#       peak forward, less backward): 0.55 over both, a judgement (the further torchtitan A100 runs use it)
#   hbm_efficiency  BabelStream (CUDA) on the same Azure machines, the mean of its Copy, Mul, Add and Triad
#       kernels (one or two read streams and one write stream, as the step's elementwise kernels): A100 1.61,
#       1.61, 1.70, 1.70 TB/s (81.2% of 2.039), H100 SXM 2.90, 2.90, 2.97, 2.97 (87.6% of 3.35), H200 4.01, 4.00,
#       4.15, 4.15 (84.9% of 4.8)
#   overlap_slowdown  compute beside a collective that runs at the same time (NCCL's kernels take SMs: one
#       thread block a channel -- 24 of an H100's 132 for an all-gather beside a GEMM in the profile posted to
#       forums.developer.nvidia.com, "Compute-Communication Overlap Causes Severe GEMM Performance Degradation
#       because of Tail Effect") runs 18.9% slower on average (max 40%) than alone: Lee et al. 2025,
#       "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning",
#       arXiv:2507.03114 (GPT and LLaMA layers on A100, H100, MI250, MI210)
_GPU = dict(async_launch=True, op_overhead=5e-6, overlap_slowdown=0.189, nccl=True)
_SETTLED = 708.5 / 841.9      # the H200's sustained (MSMF) over short-run (MAMF) bf16 matmul rate
_FA2_H100 = dict(attention_efficiency=335 / 989 * _SETTLED, attention_backward=322 / 989 * _SETTLED, hopper=True)
DEVICES = {
    # NVIDIA H100 SXM5 datasheet: 989 TFLOPS dense bf16 (1,979 with sparsity), 1,979 dense fp8, 67 TFLOPS fp32,
    # 3.35 TB/s HBM3, 80 GB; NVLink 4 at 900 GB/s both directions (450 each way); one 400 Gb/s ConnectX-7 NIC per
    # GPU (50 GB/s)
    "h100": Device("h100", {"bfloat16": 989e12, "float8": 1979e12, "float32": 67e12, "float64": 34e12}, 3.35e12,
                   5e-6, 450e9, 10e-6, 50e9, 80e9, 8,
                   "NVIDIA H100 Tensor Core GPU datasheet (SXM5); NVIDIA DGX H100 user guide (NICs)",
                   matmul_efficiency={"bfloat16": 708.5 / 989, "float8": 1382.2 / 1979}, hbm_efficiency=2.935 / 3.35,
                   nvls=True, **_FA2_H100, **_GPU),
    # The H100 of Meta's Grand Teton servers, on which torchtitan's benchmarks ran: 96 GB HBM2e at 2.4 TB/s, the
    # default 500 W power limit, 400 Gb/s RDMA per GPU between hosts (torchtitan benchmarks/
    # llama3_h100_202412_torchtitan.md, "Hardware"); "the actual peak TFLOPs number is between SXM and NVL" (its
    # footnote 2): the H100 NVL's datasheet peaks, 835 TFLOPS dense bf16 and 1,671 fp8 (NVIDIA H100 NVL datasheet),
    # and the H100 SXM's measured shares of them (the same GPU; its HBM2e's share not measured: the H100 SXM's,
    # 87.6% -- te42kyfo/gpu-benches, gpu-stream, measures 85-92% on the H100 PCIe's HBM2e)
    "h100-gt": Device("h100-gt", {"bfloat16": 835e12, "float8": 1671e12, "float32": 60e12, "float64": 30e12},
                      2.4e12, 5e-6, 450e9, 10e-6, 50e9, 96e9, 8,
                      "torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Grand Teton H100); H100 NVL datasheet",
                      matmul_efficiency={"bfloat16": 708.5 / 989, "float8": 1382.2 / 1979},
                      hbm_efficiency=2.935 / 3.35, nvls=True, **_FA2_H100, **_GPU),
    # NVIDIA H200 SXM: the H100's compute with 4.8 TB/s HBM3e and 141 GB
    "h200": Device("h200", {"bfloat16": 989e12, "float8": 1979e12, "float32": 67e12, "float64": 34e12}, 4.8e12,
                   5e-6, 450e9, 10e-6, 50e9, 141e9, 8, "NVIDIA H200 Tensor Core GPU datasheet (SXM)",
                   matmul_efficiency={"bfloat16": 708.5 / 989, "float8": 1366.3 / 1979}, hbm_efficiency=4.0775 / 4.8,
                   nvls=True, **_FA2_H100, **_GPU),
    # NVIDIA A100 SXM4 80GB: 312 TFLOPS dense bf16, 19.5 fp32, 2.04 TB/s; NVLink 3 at 600 GB/s both directions, of
    # which NCCL's all-reduce reaches 230-250 GB/s bus bandwidth on 8 GPUs (nccl-tests reference numbers, e.g.
    # docs.alayanew.com "NCCL-tests in practice": 240); one 200 Gb/s HDR NIC per GPU in a DGX A100 (25 GB/s)
    "a100": Device("a100", {"bfloat16": 312e12, "float32": 19.5e12, "float64": 9.7e12}, 2.04e12, 5e-6, 240e9, 10e-6,
                   25e9, 80e9, 8, "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB); DGX A100 user guide",
                   matmul_efficiency={"bfloat16": 256.5 / 312}, attention_efficiency=0.55,
                   hbm_efficiency=1.655 / 2.039, **_GPU),
    # the A100 80GB nodes of Jean Zay (IDRIS), on which BLOOM trained: 8 A100 SXM4 on NVLink, 4 Omni-Path links of
    # 100 Gb/s a node (bigscience train/tr11-176B-ml/README.md, "Hardware"; huggingface/blog bloom-megatron-deepspeed-
    # technology.md): 6.25 GB/s per GPU between nodes; the rest the A100's
    "a100-jz": Device("a100-jz", {"bfloat16": 312e12, "float32": 19.5e12, "float64": 9.7e12}, 2.04e12, 5e-6, 240e9,
                      10e-6, 50e9 / 8, 80e9, 8, "the A100 profile; BigScience tr11-176B-ml README (Jean Zay's nodes)",
                      matmul_efficiency={"bfloat16": 256.5 / 312}, attention_efficiency=0.55,
                      hbm_efficiency=1.655 / 2.039, **_GPU),
    # this machine: gloo on loopback and one core per rank, measured by calibration_steps (predicted_vs_measured
    # measures it again; these are the numbers of the notebook's run here, 2 cores shared with other jobs)
    "cpu-gloo": Device("cpu-gloo", {"float32": 8.2e10, "float64": 4.1e10, "bfloat16": 8.2e9}, 2.9e10, 9.3e-4, 1.7e9,
                       9.3e-4, 1.7e9, 8e9, 2, "measured here: lab.plan_time.calibration_steps", 14e-6,
                       dict(reduce_scatter=3.4, all_gather=2.6, all_to_all=1.5), 2.4e-9, 2.9e-4, agree=2.7e-4),
}


# NCCL's cost model, by which it picks an algorithm and a protocol for each call: the time it predicts for each,
# latency + bytes / algorithm bandwidth, the least of them (NVIDIA/nccl src/graph/tuning.cc, ncclTopoTuneModel and
# ncclTopoGetAlgoTime, 2.19-2.23; the same constants in src/tuning/ since). Latencies in µs, by protocol (LL, LL128,
# Simple): a base per call, and per hop over NVLink or the network; a ring pays a hop per step (2(n-1) for an
# all-reduce, those between nodes at the network's), a tree 2·((ranks a node - 1)·NVLink + log2(nodes)·network),
# NVLS (the switch reducing: Simple alone, one node here) its NVLink hop once. Bandwidths: a ring's its link's bus
# bandwidth (LL 1/2, LL128 0.92 of it), a tree's 0.92 of it (LL a further 1/3.8, LL128 7/9 in a node and 120/128
# across), halved (every byte up the tree and down again), times NCCL_TREE_CORRECTION at the call's size; NVLS's
# 0.85 of NVLink's on Hopper, twice over for an all-reduce (NCCL's nvlsEfficiency). A ring's latency across nodes
# for an all-reduce of at least ranks/16 x 64 KiB is 1.9x (NCCL's "plateau effect of ring"); LL's NVLink hop 1.8x
# across nodes.
NCCL_PROTOCOLS = ("LL", "LL128", "Simple")
NCCL_BASE_LATENCY = {"ring": (6.6, 14.0, 8.4), "tree": (6.8, 14.0, 8.4), "nvls": (0.0, 0.0, 0.0)}
NCCL_NVLINK_LATENCY = {"ring": (0.6, 1.9, 3.4), "tree": (0.6, 1.25, 4.0), "nvls": (None, None, 25.0)}
NCCL_NET_LATENCY = {"ring": (2.7, 4.0, 14.0), "tree": (5.0, 8.5, 14.0)}
NCCL_RING_BANDWIDTH = (0.5, 0.92, 1.0)
NCCL_TREE_BANDWIDTH = 0.92
NCCL_NVLS_EFFICIENCY = 0.85
NCCL_RING_PLATEAU = 1.9
NCCL_LL_CROSSING = 1.8
# "Trees are not perfectly sticking to the model for medium sizes": a tree's bandwidth x this at log2(bytes/64),
# 64 B to 512 MB, per protocol
NCCL_TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9))

# Fused attention kernels measured side by side on one H100 SXM5 (Shah et al. 2024, FlashAttention-3,
# arXiv:2407.08608, Fig. 5 causal forward and Fig. 6 backward: bf16, head dim 128, 16k tokens), TFLOP/s (forward,
# backward): FlashAttention-2 (the kernels of PyTorch's SDPA flash backend), FlashAttention-3 (Hopper only),
# Triton (the Triton tutorial's fused attention; Fig. 6 has no Triton backward: FlashAttention-2's stands in) and
# standard attention (PyTorch's unfused QKᵀ, softmax and ·V: SDPA's math backend; at 8k, where it last fits). A
# device's fused attention runs at its own FlashAttention-2 rates (Device.attention_efficiency,
# attention_backward) times each kernel's ratio to FlashAttention-2's here (--assume attention_kernel=NAME).
# FlashAttention (Dao et al. 2022: flash-attn 1.x) is not in those figures: FlashAttention-2's release measured the
# two side by side, forward and backward together (Dao-AILab/flash-attention, assets/flash2_h100_fwd_bwd_benchmark.png,
# the FlashAttention-2 paper's Fig. 7: H100 SXM5, causal, head dim 128, 16k tokens: 137 against 328 TFLOP/s; its A100
# figure, 83 against 189, is the same share) -- its ratio scales both of FlashAttention-2's rates here. The 2022 Triton
# port of it (flash-attn's flash_attn_triton.py, which llm-foundry copied and runs as attn_impl: triton under
# triton-pre-mlir) runs at its speed: "overall Triton forward + backward is slightly slower than CUDA forward +
# backward" (its own docstring), "triton is slightly faster than flash" (llm-foundry v0.3.0 TUTORIAL.md, flash being
# flash-attn 1.0.9 there).
_FA1 = 137 / 328
ATTENTION_KERNELS = {"fa1": (335 * _FA1, 322 * _FA1), "fa2": (335, 322), "fa3": (616, 561), "triton": (378, 322),
                     "sdpa_math": (35, 181)}
