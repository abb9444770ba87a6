"""What a GPU run adds to the course's code, as the time planner (lab/plan_time.py) prices it: the frameworks'
bundles of mechanisms (--assume framework=NAME), the table of every mechanism with its switch, what it changes,
its source and its defaults (notebooks/published_runs.ipynb prints them), and the bytes measured from a framework's code."""


# What torchtitan and Megatron do beyond the course's code, as --assume framework=NAME sets it (a run's own
# features — --compile, --float8, async TP as overlap.tp=1, its micro-batches — stay the run's flags)
FRAMEWORKS = {
    "course": {},
    # torchtitan (Liang et al. 2024, arXiv:2410.06511): SDPA's flash kernel, under context parallel per ring step
    # (torch.distributed.tensor.experimental.context_parallel); FSDP2's prefetched all-gathers (zero3 overlap, the
    # default); selective checkpointing's per-op policy saves every op of its list "except every second mm"
    # (torchtitan/parallelisms/parallelize_llama.py, _apply_ac_to_transformer_block); FSDP2's copies around its
    # collectives (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py)
    "torchtitan": dict(attention="fused", selective_every=2, fsdp2_copies=1.0, torch_cp=1.0),
    # Megatron-LM as Narayanan et al. 2021 ran it: attention as separate kernels (QKᵀ, its fused
    # scale-mask-softmax, attention dropout 0.1, ·V), its fused elementwise kernels (bias-GeLU, bias-dropout-add,
    # LayerNorm: compile's fusion), tensor parallel's all-reduces exposed, torch DDP's buckets behind the backward
    # (--DDP-impl torch; a row with its local DDP, pp > 1, gives overlap.ddp=0), the scatter/gather of §4.1, and
    # its reentrant checkpoint (megatron/mpu/random.py, CheckpointFunction: the whole layer's forward again)
    "megatron2021": dict(attention="unfused", compile=1.0, pp_scatter=1.0, recompute_whole=1.0),
    # Megatron-Core today (its documentation: Transformer Engine's fused attention and kernels,
    # --tp-comm-overlap, --overlap-grad-reduce and --overlap-param-gather with the distributed optimizer)
    "megatron": dict(attention="fused", compile=1.0, pp_scatter=1.0, overlap=dict(tp=1.0, tp_b=1.0, step=1.0)),
    # PyTorch's FSDP1 as llm-foundry runs it through Composer (FORCED_SYNC: every micro-batch's gradients reduced;
    # mixed precision DEFAULT: gathered in bf16, reduced in fp32): each unit gathered in the next forward and its
    # gradients reduce-scattered in each micro-batch's backward (fsdp1), and the casts, concatenation and divisions
    # around those collectives (fsdp1_copies); the attention kernel is the run's (llm-foundry's attn_impl: triton, its
    # 2022 Triton port of FlashAttention, --assume attention_kernel=fa1; flash, FlashAttention-2 from 2024: fa2)
    "fsdp1": dict(fsdp1=1.0, fsdp1_copies=1.0),
    # Megatron-DeepSpeed as BLOOM ran it (BigScience's Megatron-DeepSpeed, DeepSpeed's pipeline engine and
    # BF16_Optimizer): Megatron's fused kernels (bias-GeLU, scale-mask-softmax: attention as separate kernels), its
    # reentrant checkpoint, DeepSpeed's pipeline sending whole boundaries, each micro-batch's bf16 gradients added
    # into fp32 buffers (fp32_accumulation)
    "deepspeed": dict(attention="unfused", compile=1.0, recompute_whole=1.0, fp32_accumulation=1.0),
}
# Each mechanism a GPU run adds to the course's code: its switch, what it changes in the step's breakdown, its
# source, and its default — on cpu-gloo (the course's code as it runs here), on a GPU as the course's code runs
# (--device h100 and the like, framework=course), and in the frameworks' bundles
MECHANISMS = [
    ("fused attention", "attention=code|fused|unfused",
     "attention: ring attention's blocks as one flash kernel per ring step (no fp32 score blocks in memory: "
     "their bytes and operations leave 'memory' and 'launch'), Ulysses' already are; unfused prices every score "
     "in memory (UNFUSED_SCORE_BYTES; ALiBi's bias, QKᵀ's input in Megatron-DeepSpeed: ALIBI_SCORE_BYTES) and every "
     "product of the scores at the matmul rate (none skipped: a causal triangle or a mask computed whole)",
     "Dao 2023 (arXiv:2307.08691); torch.distributed.tensor.experimental.context_parallel; Narayanan et al. 2021; "
     "BigScience's Megatron-DeepSpeed (megatron/model/transformer.py)",
     "code", "code", "torchtitan: fused; megatron2021, deepspeed: unfused; megatron: fused"),
    ("compile", "--compile, or compile=0|1",
     "memory, launch: each run of memory-bound operations between two matmuls (or attention, or a collective) "
     "in a block is one kernel that reads what enters it and writes what leaves it (the probe counts both)",
     "torch.compile (inductor) applied per block (train.py --compile, torchtitan's training.compile)",
     "--compile", "--compile", "megatron2021 and megatron: 1 (their fused kernels)"),
    ("float8 matmuls", "--float8, or float8=0|1",
     "matmul: the blocks' linears at the float8 peak x its measured efficiency (the head stays in bf16); memory: "
     "each linear's input, weight and output gradient cast (amax, scale, 1-byte copy) and transposed",
     "Micikevicius et al. 2022 (arXiv:2209.05433); torchao float8 (tensorwise); Azure's sustained fp8 cuBLASLt rate",
     "--float8 (no float8 rate on a CPU: off)", "--float8", "the run's flag"),
    ("data-parallel overlap", "overlap.zero3, overlap.ddp, overlap.zero2, overlap.step",
     "dp: ZeRO-3's prefetched gathers and reduce-scatters behind the step's compute, DDP's buckets behind the "
     "last backward; step: ZeRO-1/2's reductions and gathers at the step (Megatron's distributed optimizer with "
     "--overlap-grad-reduce/--overlap-param-gather: 1)",
     "Zhao et al. 2023 (FSDP, arXiv:2304.11277); FSDP2's implicit prefetch; Li et al. 2020 (DDP); Megatron-Core docs",
     "0 (one core per rank: nothing hides)", "zero3 1, ddp 1, zero2 1, step 0",
     "megatron: step 1; megatron2021 rows with local DDP: ddp 0"),
    ("tensor-parallel overlap", "overlap.tp (forward), overlap.tp_b (backward)",
     "tp: the layer's collectives behind its matmuls, the first of tp pieces exposed; async TP (torchtitan) is "
     "reported to speed the forward (~29%) far more than the step (~8%): the forward's",
     "Wang et al., ASPLOS 2023 (overlap by decomposition); PyTorch dev-discuss 'Introducing Async Tensor "
     "Parallelism' (2024); Megatron-Core --tp-comm-overlap",
     "0", "0", "torchtitan async TP rows: tp 1; megatron: tp 1, tp_b 1"),
    ("context-parallel overlap", "overlap.cp",
     "cp: the ring's next block travels while the current one is computed (ring_attention.RingPass): hidden up to "
     "the attention's time",
     "Liu et al. 2023 (Ring Attention, arXiv:2310.01889)", "0", "1", "1"),
    ("torchtitan's selective recomputation", "selective_every=K",
     "compute: under selective checkpointing every K-th matmul of a block is recomputed (torchtitan's per-op "
     "policy: K = 2, wk, wo and w3 here), where the course's policy keeps every matmul's output",
     "torchtitan torchtitan/parallelisms/parallelize_llama.py (_apply_ac_to_transformer_block)",
     "0", "0", "torchtitan: 2"),
    ("FSDP2's copies", "fsdp2_copies=0|1",
     "fsdp2 copies: around every ZeRO-3 gather, the shard cast into the gather's input and the gathered buffer "
     "copied out into each parameter (read and write of the unsharded parameters); before each reduce-scatter "
     "the gradients copied and cast to the reduce dtype into its input -- memory-bound, on the step's path",
     "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py (all_gather_copy_in, split_with_sizes_copy, "
     "chunk_cat)", "0 (the course's flat parameter: views)", "0", "torchtitan: 1"),
    ("torch's context parallel", "torch_cp=0|1",
     "memory: under fused attention, what torch's context_parallel does around each ring step's flash kernel -- "
     "the output merged in fp32, K and V (repeated to the query heads, as torchtitan's model does) concatenated "
     "for each send, the gradients accumulated and concatenated in fp32: 46 bytes a query element a step "
     "forward, 54 backward (TORCH_CP_STEP_BYTES), where a fused ring's merges take 12 and 24",
     "torch/distributed/tensor/experimental/_context_parallel/_attention.py (_SDPAMerger, "
     "_templated_ring_attention_backward); torchtitan's repeat_kv", "0", "0", "torchtitan: 1"),
    ("reentrant full recomputation", "recompute_whole=0|1",
     "compute: full checkpointing reruns the block's last linear too (PyTorch's non-reentrant checkpoint stops "
     "before it)", "Megatron-LM (2021) megatron/mpu/random.py CheckpointFunction; torch.utils.checkpoint",
     "0", "0", "megatron2021: 1"),
    ("pipeline scatter/gather", "pp_scatter=0|1",
     "pp: a stage boundary crosses nodes as 1/tp of it per tp rank, then an all-gather inside the node",
     "Narayanan et al. 2021 §4.1", "0", "0", "megatron2021, megatron: 1"),
    ("measured kernel rates", "efficiency=X (one share for both; none: the device's)",
     "matmul: the sustained rate (power-saturated: cuBLASLt after 10,000 warm-ups; MSMF); attention: the "
     "forward kernel (and checkpointing's rerun of it) at FlashAttention-2's measured forward rate, the backward "
     "kernel at its backward rate, both at the settled clock of a power-saturated board (x MSMF/MAMF)",
     "Azure AI-benchmarking-guide (cuBLASLt, 10,000 warm-up iterations); Bekman, ML Engineering (MSMF); Shah et "
     "al. 2024 (FlashAttention-3), Fig. 5-6",
     "1 (the measured matmul rate is the peak)", "the device's", "the device's"),
    ("NCCL's algorithm", "the device (Device.nccl, Device.nvls)",
     "every all-reduce: priced as the algorithm NCCL's cost model picks for its size and group -- a ring (2(n-1) "
     "steps at α), a tree (log2 of the nodes' hops: the clip's and other small all-reduces across nodes), or NVLS "
     "inside an H100/H200 node (the NVSwitch reduces: 2 x 0.85 of NVLink's bus bandwidth)",
     "NVIDIA/nccl src/graph/tuning.cc (ncclTopoTuneModel, ncclTopoGetAlgoTime: latencies, bandwidths, tree "
     "correction)", "a ring (gloo)", "NCCL's pick", "NCCL's pick"),
    ("a node's NICs together", "--gpus-per-node (where the ranks sit)",
     "every collective across nodes: a group with k ranks in each node crosses at k NICs' rate -- NCCL's ring "
     "runs on channels that leave the node at different GPUs -- and NVLink carries its other hops",
     "Bekman, Machine Learning Engineering, network/README.md ('Inter-node speed depends on intra-node speed')",
     "one node", "k NICs", "k NICs"),
    ("achievable memory bandwidth", "hbm_efficiency=X (none: the device's)",
     "memory, and the optimizer on a GPU: bytes at the datasheet bandwidth x the share STREAM-like kernels reach",
     "BabelStream on Azure's ND A100 v4, ND H100 v5, ND H200 v5 (Azure AI-benchmarking-guide)",
     "1 (its rate is measured here)", "0.81 (A100) - 0.88 (H100)", "the device's"),
    ("compute beside a collective", "overlap_slowdown=S (none: the device's)",
     "overlap: each second of a collective hidden behind compute costs S/(1 + S) s more, the compute running "
     "S slower beside it (NCCL's kernels hold SMs)",
     "Lee et al. 2025 (arXiv:2507.03114): 18.9% on average on A100, H100, MI250, MI210",
     "0 (one core per rank: nothing hides)", "0.189", "0.189"),
    ("the attention kernel", "attention_kernel=fa1|fa2|fa3|triton|sdpa_math",
     "attention: fused attention's forward and backward kernels at that kernel's rates, as measured beside "
     "FlashAttention-2 on one H100 (ATTENTION_KERNELS): FlashAttention-3 1.8x and 1.7x, the Triton tutorial's 1.13x "
     "forward, standard attention (SDPA's math) 0.10x and 0.56x, FlashAttention (and the 2022 Triton port of it that "
     "llm-foundry runs) 0.42x",
     "Shah et al. 2024 (FlashAttention-3, arXiv:2407.08608), Fig. 5-6; Dao 2023 (FlashAttention-2, arXiv:2307.08691), "
     "Fig. 7; flash-attn's flash_attn_triton.py; llm-foundry v0.3.0 TUTORIAL.md", "fa2", "fa2", "the run's kernel"),
    ("FSDP1's schedule", "fsdp1=0|1",
     "dp: ZeRO-2 gathers each unit in every micro-batch's forward (prefetched, behind it) and ZeRO-2/3 "
     "reduce-scatter in every micro-batch's backward, behind it, where the course's ZeRO-2 moves both at the step "
     "and its ZeRO-3 defers the reduce-scatters",
     "torch/distributed/fsdp/_runtime_utils.py (_pre_forward_unshard, _post_backward_reshard); Composer's "
     "FORCED_SYNC for FSDP", "0", "0", "fsdp1: 1"),
    ("FSDP1's copies", "fsdp1_copies=0|1",
     "fsdp1 copies: under mixed precision, the shard cast before each gather; each micro-batch's flat gradient "
     "concatenated from the parameters' (views split off the flat parameter), cast to the reduce dtype and divided "
     "before the reduce-scatter, the shard divided after it and added into the saved one -- memory-bound",
     "torch/distributed/fsdp/_flat_param.py (_use_low_precision_shard), _runtime_utils.py (_post_backward_hook, "
     "_reduce_grad); Composer's mixed precision DEFAULT", "0", "0", "fsdp1: 1"),
    ("DeepSpeed's fp32 gradient accumulation", "fp32_accumulation=0|1",
     "fp32 accumulation: after every micro-batch's backward its bf16 gradients added into fp32 buffers, tensor by "
     "tensor (FP32_ACCUMULATE_BYTES a parameter at the memory bandwidth), in the backward and so in the bubble",
     "deepspeed/runtime/bf16_optimizer.py (update_hp_grads)", "0", "0", "deepspeed: 1"),
    ("micro-batch size", "--microbatches (and --global-batch-size)",
     "every term: tokens per micro-batch set each matmul's and collective's size, the calls per step (gathers, "
     "α), the bubble's share; a published run's comes from its own configuration (Megatron's "
     "examples/sc21/run_table_1.sh: 16 sequences a micro-batch on the 1.7B row, 1 on the 1T row)",
     "the run's configuration", "the flag", "the flag", "the run's flag"),
]

# torch's context_parallel (torch/distributed/tensor/experimental/_context_parallel/_attention.py, the same merge
# as in Dec 2024), bytes per query element this rank holds, per ring step, on the rank that merges every step in
# full (the last: every block it receives comes from an earlier rank), with K and V repeated to the query heads
# as torchtitan's model does before SDPA (repeat_kv). Forward (_SDPAMerger.step, convert_to_f32): the block's
# output cast to fp32 (2 read + 4 written), out - block_out (12), its product with sigmoid(lse') (8), out minus
# that (12), and the concatenation of K and V for the next send (2 x (2 + 2)): 46. Backward: grad_query +=
# the step's (4 + 2 read, 4 written), the same for grad_key and grad_value (20), their fp32 concatenation for
# the send (2 x (4 + 4)), K and V's concatenation again (8): 54. Full checkpointing's rerun adds the forward's.
TORCH_CP_STEP_BYTES = {"f": 46, "b": 54}

# Megatron-LM 2021's attention as separate kernels, bytes per element of the scores [b, heads, S, S] (16-bit):
# forward QKᵀ writes them (2), the fused scale-mask-softmax reads and writes (4), dropout reads, writes the kept
# values and a one-byte mask (5), ·V reads (2); backward dO·Vᵀ writes (2), dropout's backward reads it and the mask
# and writes (5), softmax's reads the probabilities and the gradient and writes (6), dS·K and dSᵀ·Q read it (4),
# Pᵀ·dO reads the kept probabilities (2)
UNFUSED_SCORE_BYTES = dict(f=13, b=19)
# ALiBi in Megatron-DeepSpeed's unfused attention (bigscience-workshop/Megatron-DeepSpeed, megatron/model/
# transformer.py, ParallelAttention.forward: torch.baddbmm(alibi, q, kᵀ, beta=1.0)): the bias, [b·heads, 1, S], is
# QKᵀ's input, broadcast-copied into the scores' buffer (2 written) and read by the matmul's accumulation (2), in the
# forward (and checkpointing's rerun of it); it has no gradient
ALIBI_SCORE_BYTES = dict(f=4, b=0)

# DeepSpeed's BF16_Optimizer (deepspeed/runtime/bf16_optimizer.py, update_hp_grads, under the pipeline engine after
# every micro-batch's backward): per parameter, the bf16 gradient read and cast to a temporary fp32 tensor (2 read,
# 4 written), added into the fp32 gradient (4 + 4 read, 4 written), then the bf16 gradient zeroed (2 written): 20
FP32_ACCUMULATE_BYTES = 20
