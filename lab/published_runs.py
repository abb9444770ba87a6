"""Published GPU runs the time planner (lab/plan_time.py) is checked against: each model's shape as its
config.json gives it, each run's source, GPUs, layout as train.py flags, framework bundle and published tokens/s
per GPU. PUBLISHED set the constants; FURTHER were checked after them, nothing set to match them."""
from __future__ import annotations

from dataclasses import dataclass, replace


def _gpt(h: int, layers: int, heads: int) -> dict:
    """Megatron-LM's GPT as GPT-2's config.json holds it (the course's GPT-family block: LayerNorm with its bias,
    learned positions, a 4h MLP of tanh GELU, biases on every linear, the head tied to the embedding), at Megatron's
    widths, layers and heads, its 51,200-token vocabulary and 2,048 positions; no dropout."""
    return dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=51200, n_embd=h, n_layer=layers,
                n_head=heads, n_inner=4 * h, n_positions=2048, activation_function="gelu_new",
                layer_norm_epsilon=1e-5, tie_word_embeddings=True)


def _mpt(h: int, layers: int, heads: int, seq: int = 2048) -> dict:
    """MosaicML's MPT as llm-foundry's benchmarks ran it (v0.3.0: scripts/train/yamls/pretrain/mpt-*.yaml gives
    d_model, n_heads, n_layers, expansion_ratio 4 and the 50,368-token vocabulary; MPTConfig's defaults the rest --
    learned positions up to max_seq_len, the run's sequence, for alibi is off; biases on every linear and LayerNorm,
    for no_bias is False; exact GELU; the head tied to the embedding): GPT-2's block, as its config.json holds it. The
    benchmark table's NumParams column is this count (7B at 2,048 tokens: 6,658,859,008; at 65,536 the positions'
    63,488 more rows); the course's GPT-2 shape pads the vocabulary to 50,432 (64 rows more, 0.004% of the 7B)."""
    return dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=50368, n_embd=h, n_layer=layers,
                n_head=heads, n_inner=4 * h, n_positions=seq, activation_function="gelu", layer_norm_epsilon=1e-5,
                tie_word_embeddings=True)


def _llama31(h: int, layers: int, heads: int, ffn: int) -> dict:
    """Llama 3.1 as published (config.json: 128,256-token vocabulary, 8 kv heads, rope theta 500,000), without its
    'llama3' rotary scaling (the course computes default rotary: the same shapes and FLOPs) and with positions to
    the longest sequence planned."""
    return dict(vocab_size=128256, hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=8, intermediate_size=ffn, max_position_embeddings=262144, rope_theta=500000.0)


def _llama2(h: int, layers: int, heads: int, kv: int, ffn: int) -> dict:
    """Llama 2 as published (config.json: 32,000-token vocabulary, rope theta 10,000, 4,096 positions)."""
    return dict(vocab_size=32000, hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv, intermediate_size=ffn, max_position_embeddings=4096)


PUBLISHED_MODELS = {
    "llama3.1-8b": _llama31(4096, 32, 32, 14336), "llama3.1-70b": _llama31(8192, 80, 64, 28672),
    "llama3.1-405b": _llama31(16384, 126, 128, 53248),
    "llama2-13b": _llama2(5120, 40, 40, 40, 13824), "llama2-70b": _llama2(8192, 80, 64, 8, 28672),
    "gpt-1.7b": _gpt(2304, 24, 24), "gpt-3.6b": _gpt(3072, 30, 32), "gpt-7.5b": _gpt(4096, 36, 32),
    "gpt-18b": _gpt(6144, 40, 48), "gpt-39b": _gpt(8192, 48, 64), "gpt-76b": _gpt(10240, 60, 80),
    "gpt-145b": _gpt(12288, 80, 96), "gpt-310b": _gpt(16384, 96, 128), "gpt-530b": _gpt(20480, 105, 128),
    "gpt-1t": _gpt(25600, 128, 160),
    # llm-foundry's MPT sizes (heads chosen so that each is 128 wide: the 30B's 56), at the sequences the rows ran
    "lf-mpt-1b": _mpt(2048, 24, 16), "lf-mpt-3b": _mpt(2560, 32, 20), "lf-mpt-7b": _mpt(4096, 32, 32),
    "lf-mpt-7b-8k": _mpt(4096, 32, 32, 8192), "lf-mpt-13b": _mpt(5120, 40, 40), "lf-mpt-30b": _mpt(7168, 48, 56),
}



@dataclass(frozen=True)
class Published:
    """One published run: where it is published, the model, the GPUs, the layout as train.py flags, the
    framework's mechanisms (--assume pairs), and its tokens/s per GPU (as published, or derived as `how` says)."""
    source: str
    name: str
    model: str
    device: str
    gpus: int
    flags: tuple
    assume: tuple
    tokens_per_gpu: float
    how: str = "as published"
    further: bool = False


def _megatron(params, model, tflops, tp, pp, gpus, batch, mbs, v=1):
    """Narayanan et al. 2021 (arXiv:2104.04473), Table 1, as run by its own script (Megatron-LM,
    examples/sc21/run_table_1.sh: micro-batch size, interleaving, torch DDP for pp = 1 and Megatron's local DDP
    for pp > 1): A100 80GB (Selene, 8 a node), fp16, full recomputation, sequence 2,048. Tokens/s per GPU from the
    table's teraFLOP/s per GPU and the paper's FLOPs per token with recomputation, 96·l·h²(1 + s/6h + V/16lh)."""
    cfg = PUBLISHED_MODELS[model]
    h, l, s, V = cfg["n_embd"], cfg["n_layer"], 2048, 51200
    per_token = 96 * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    dp = gpus // (tp * pp)
    flags = ["--tp", str(tp), "--pp", str(pp), "--dp-shard", str(dp), "--zero-stage", "0", "--seq-len", "2048",
             "--global-batch-size", str(batch), "--microbatches", str(batch // dp // mbs),
             "--activation-checkpointing", "full"]
    if v > 1:
        flags += ["--schedule", "interleaved", "--virtual-stages", str(v)]
    return Published("Narayanan et al. 2021, arXiv:2104.04473, Table 1; Megatron-LM examples/sc21/run_table_1.sh",
                     f"GPT {params}: tp {tp} x pp {pp}{f' (v {v})' if v > 1 else ''} x dp {dp}, {gpus} A100s, "
                     f"micro-batch {mbs}", model, "a100", gpus, tuple(flags),
                     ("framework=megatron2021",) + (("overlap.ddp=0",) if pp > 1 else ()),
                     tflops * 1e12 / per_token, f"{tflops} TFLOP/s per GPU / {per_token / 1e9:.2f} GFLOP per token")


TT = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
TT_ASYNC = "torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"


def _titan(source, name, model, gpus, flags, tokens, compile=False, float8=False, async_tp=False,
           device="h100-gt"):
    """torchtitan on Grand Teton H100s (96 GB HBM2e, 500 W; 8 a node, 400 Gb/s per GPU between nodes) unless
    `device` says otherwise, bf16 compute with fp32 gradient reduction (FSDP2's mixed precision), global batch =
    local batch x data parallel."""
    extra = (["--compile"] if compile else []) + (["--float8"] if float8 else [])
    return Published(source, name, model, device, gpus, tuple(list(flags) + extra),
                     ("framework=torchtitan",) + (("overlap.tp=1",) if async_tp else ()), tokens)


def _fsdp(dp, lbs, seq, ac, cp=1, tp=1):
    return ["--dp-shard", str(dp), "--cp", str(cp), "--tp", str(tp), "--zero-stage", "3", "--seq-len", str(seq),
            "--global-batch-size", str(dp * lbs), "--activation-checkpointing", ac] + \
        (["--sequence-parallel"] if tp > 1 else [])


PUBLISHED = [
    _titan(TT + ", Table 1", "Llama 3.1 8B, FSDP 8, local batch 2, selective", "llama3.1-8b", 8,
           _fsdp(8, 2, 8192, "selective"), 5762),
    _titan(TT + ", Table 1", "Llama 3.1 8B, FSDP 8, + compile", "llama3.1-8b", 8,
           _fsdp(8, 2, 8192, "selective"), 6667, compile=True),
    _titan(TT + ", Table 1", "Llama 3.1 8B, FSDP 8, + compile + float8", "llama3.1-8b", 8,
           _fsdp(8, 2, 8192, "selective"), 8532, compile=True, float8=True),
    _titan(TT + ", Table 3", "Llama 3.1 8B, FSDP 128, local batch 2, selective", "llama3.1-8b", 128,
           _fsdp(128, 2, 8192, "selective"), 5605),
    _titan(TT + ", Table 3", "Llama 3.1 8B, FSDP 128, + compile", "llama3.1-8b", 128,
           _fsdp(128, 2, 8192, "selective"), 6514, compile=True),
    _titan(TT + ", Table 3", "Llama 3.1 8B, FSDP 128, + compile + float8", "llama3.1-8b", 128,
           _fsdp(128, 2, 8192, "selective"), 8380, compile=True, float8=True),
    _titan(TT + ", Table 2", "Llama 3.1 8B, FSDP 8, 32k tokens, full, compile + float8", "llama3.1-8b", 8,
           _fsdp(8, 1, 32768, "full"), 3890, compile=True, float8=True),
    _titan(TT + ", Table 2", "Llama 3.1 8B, FSDP 4 x CP 2, 64k tokens", "llama3.1-8b", 8,
           _fsdp(4, 1, 65536, "full", cp=2), 2540, compile=True, float8=True),
    _titan(TT + ", Table 2", "Llama 3.1 8B, FSDP 2 x CP 4, 128k tokens", "llama3.1-8b", 8,
           _fsdp(2, 1, 131072, "full", cp=4), 1071, compile=True, float8=True),
    _titan(TT + ", Table 2", "Llama 3.1 8B, FSDP 1 x CP 8, 256k tokens", "llama3.1-8b", 8,
           _fsdp(1, 1, 262144, "full", cp=8), 548, compile=True, float8=True),
    _titan(TT_ASYNC, "Llama 3.1 8B, FSDP 8 x TP 8, local batch 12, selective, compile", "llama3.1-8b", 64,
           _fsdp(8, 12, 8192, "selective", tp=8), 4378, compile=True),
    _titan(TT_ASYNC, "Llama 3.1 8B, FSDP 8 x TP 8, + async TP", "llama3.1-8b", 64,
           _fsdp(8, 12, 8192, "selective", tp=8), 4809.4, compile=True, async_tp=True),
    _titan(TT_ASYNC, "Llama 3.1 8B, FSDP 8 x TP 8, + float8", "llama3.1-8b", 64,
           _fsdp(8, 12, 8192, "selective", tp=8), 5078.1, compile=True, float8=True),
    _titan(TT_ASYNC, "Llama 3.1 8B, FSDP 8 x TP 8, + float8 + async TP", "llama3.1-8b", 64,
           _fsdp(8, 12, 8192, "selective", tp=8), 5570.1, compile=True, float8=True, async_tp=True),
    _titan(TT_ASYNC, "Llama 3.1 70B, FSDP 32 x TP 8, local batch 16, full, compile", "llama3.1-70b", 256,
           _fsdp(32, 16, 8192, "full", tp=8), 597.3, compile=True),
    _titan(TT_ASYNC, "Llama 3.1 70B, FSDP 32 x TP 8, + async TP", "llama3.1-70b", 256,
           _fsdp(32, 16, 8192, "full", tp=8), 652.4, compile=True, async_tp=True),
    _titan(TT_ASYNC, "Llama 3.1 70B, FSDP 32 x TP 8, + float8", "llama3.1-70b", 256,
           _fsdp(32, 16, 8192, "full", tp=8), 809.8, compile=True, float8=True),
    _titan(TT_ASYNC, "Llama 3.1 70B, FSDP 32 x TP 8, + float8 + async TP", "llama3.1-70b", 256,
           _fsdp(32, 16, 8192, "full", tp=8), 942.4, compile=True, float8=True, async_tp=True),
    _titan(TT + ", Table 4", "Llama 3.1 70B, FSDP 32 x TP 8, compile + float8 (2024)", "llama3.1-70b", 256,
           _fsdp(32, 16, 8192, "full", tp=8), 829, compile=True, float8=True),
    _titan(TT + ", Table 4", "Llama 3.1 70B, FSDP 32 x TP 8, compile + float8 + async TP (2024)", "llama3.1-70b",
           256, _fsdp(32, 16, 8192, "full", tp=8), 876, compile=True, float8=True, async_tp=True),
    _megatron("1.7B", "gpt-1.7b", 137, 1, 1, 32, 512, 16),
    _megatron("3.6B", "gpt-3.6b", 138, 2, 1, 64, 512, 16),
    _megatron("7.5B", "gpt-7.5b", 142, 4, 1, 128, 512, 16),
    _megatron("18.4B", "gpt-18b", 135, 8, 1, 256, 1024, 8),
    _megatron("39.1B", "gpt-39b", 138, 8, 2, 512, 1536, 4),
    _megatron("76.1B", "gpt-76b", 140, 8, 4, 1024, 1792, 2, v=3),
    _megatron("145.6B", "gpt-145b", 148, 8, 8, 1536, 2304, 2, v=2),
    _megatron("310.1B", "gpt-310b", 155, 8, 16, 1920, 2160, 1, v=2),
    _megatron("529.6B", "gpt-530b", 163, 8, 35, 2520, 2520, 1, v=3),
    _megatron("1008B", "gpt-1t", 163, 8, 64, 3072, 3072, 1),
]

# Further published runs, checked after the table above had set the constants: no constant was set to match them.
# One of them found a mechanism: Llama 2 70B at local batch 1 (11.5 s a step) moves 550 GB per GPU through
# FSDP's collectives, which one 200 Gb/s NIC per GPU cannot carry in that time -- a group with 8 ranks in each
# node crosses at the node's 8 NICs together (collective_time). torchtitan's benchmarks folder and docs.
TT_H200 = "torchtitan benchmarks/llama3_8b_h200_2025-06_torchtitan.md (Trainy; 8 H200 a node, 400 Gb/s per GPU)"
TT_A100 = ("torchtitan docs/performance.md (Apr 2024, 1ea476e9f): 64 A100 80GB, FSDP2, no compile; the A100 "
           "profile's network, 200 Gb/s per GPU, is assumed (the page does not say)")
TT_405 = ("torchtitan docs/performance.md (Aug 2024, 3faaa1a0d): 128 H100 of 95 GB HBM2e at a lower TDP, "
          "train_configs/llama3_405b.toml (compile, tp 8)")
FURTHER = [replace(row, further=True) for row in (
    _titan(TT_H200, "Llama 3.1 8B, FSDP 32 (4 nodes of H200), local batch 2, compile + float8", "llama3.1-8b", 32,
           _fsdp(32, 2, 8192, "selective"), 10938, compile=True, float8=True, device="h200"),
    _titan(TT_H200, "Llama 3.1 8B, FSDP 64 (8 nodes of H200), local batch 2, compile + float8", "llama3.1-8b", 64,
           _fsdp(64, 2, 8192, "selective"), 10753, compile=True, float8=True, device="h200"),
    _titan(TT_A100, "Llama 3 8B, FSDP 64 A100s, local batch 1, selective (op)", "llama3.1-8b", 64,
           _fsdp(64, 1, 8192, "selective"), 2973, device="a100"),
    _titan(TT_A100, "Llama 3 70B, FSDP 64 A100s, local batch 1, full", "llama3.1-70b", 64,
           _fsdp(64, 1, 8192, "full"), 331, device="a100"),
    _titan(TT_A100, "Llama 2 13B, FSDP 64 A100s, local batch 2, no checkpointing", "llama2-13b", 64,
           _fsdp(64, 2, 4096, "none"), 2162, device="a100"),
    _titan(TT_A100, "Llama 2 13B, FSDP 64 A100s, local batch 2, selective (op)", "llama2-13b", 64,
           _fsdp(64, 2, 4096, "selective"), 1904, device="a100"),
    _titan(TT_A100, "Llama 2 70B, FSDP 64 A100s, local batch 1, selective (op)", "llama2-70b", 64,
           _fsdp(64, 1, 4096, "selective"), 355, device="a100"),
    _titan(TT_A100, "Llama 2 70B, FSDP 64 A100s, local batch 2, full", "llama2-70b", 64,
           _fsdp(64, 2, 4096, "full"), 353, device="a100"),
    # Table 5: 3D on 512 GPUs; micro-batches not given: torchtitan's default, the pp degree
    # (torchtitan/parallelisms/pipeline_llama.py, Dec 2024: pipeline_parallel_microbatches or parallel_dims.pp)
    _titan(TT + ", Table 5", "Llama 3.1 405B, FSDP 8 x TP 8 x PP 8, local batch 32, full, 1F1B", "llama3.1-405b",
           512, ["--pp", "8", "--microbatches", "8", "--schedule", "1f1b"] + _fsdp(8, 32, 8192, "full", tp=8), 100,
           compile=True, float8=True, async_tp=True),
    _titan(TT + ", Table 5", "Llama 3.1 405B, FSDP 8 x TP 8 x PP 8, interleaved 1F1B (2 stages a rank)",
           "llama3.1-405b", 512, ["--pp", "8", "--microbatches", "8", "--schedule", "interleaved",
                                  "--virtual-stages", "2"] + _fsdp(8, 32, 8192, "full", tp=8), 128,
           compile=True, float8=True, async_tp=True),
    _titan(TT_405, "Llama 3.1 405B, FSDP 16 x TP 8, local batch 2, full, compile", "llama3.1-405b", 128,
           _fsdp(16, 2, 8192, "full", tp=8), 109, compile=True),
    _titan(TT_405, "Llama 3.1 405B, FSDP 16 x TP 8, + float8", "llama3.1-405b", 128,
           _fsdp(16, 2, 8192, "full", tp=8), 177, compile=True, float8=True),
    _titan(TT_405, "Llama 3.1 405B, FSDP 16 x TP 8, + float8 + async TP", "llama3.1-405b", 128,
           _fsdp(16, 2, 8192, "full", tp=8), 185, compile=True, float8=True, async_tp=True),
)]


LLM_FOUNDRY = ("llm-foundry scripts/train/benchmarking/README.md (061f2c7), MPT on 8 GPUs a node, as its "
               "submit_benchmarks.py (b2a43a1) ran them: llm-foundry v0.3.0 on torch 2.1, attn_impl triton, FSDP1 "
               "mixed precision DEFAULT, every micro-batch synchronised")
LLM_FOUNDRY_SCALE = ("llm-foundry scripts/train/benchmarking/README.md, its H100 table at 128-512 GPUs, as its "
                     "sweep.py (5e85bd6) ran them: attn_impl flash (FlashAttention-2) for the 1B, 3B and 7B")


def _foundry(name, model, device, gpus, seq, mbs, accum, checkpointing, tokens, zero=3, source=LLM_FOUNDRY,
             kernel="fa1"):
    """An llm-foundry benchmark row: Composer's FSDP1 with FULL_SHARD (ZeRO-3 over every GPU; SHARD_GRAD_OP:
    zero=2), micro-batches of `mbs` sequences, `accum` of them a step, full checkpointing or none; the attention
    kernel its attn_impl names (triton: the 2022 Triton port of FlashAttention, at FlashAttention's rates: fa1;
    flash: fa2)."""
    flags = ["--dp-shard", str(gpus), "--zero-stage", str(zero), "--seq-len", str(seq), "--global-batch-size",
             str(gpus * mbs * accum), "--microbatches", str(accum), "--activation-checkpointing",
             "full" if checkpointing else "none"]
    return Published(source, name, model, device, gpus, tuple(flags),
                     ("framework=fsdp1", f"attention_kernel={kernel}"), tokens, further=True)


FURTHER += [
    _foundry("MPT-7B, FSDP1 8 H100s, 2k tokens, micro-batch 6, no checkpointing", "lf-mpt-7b", "h100", 8, 2048, 6, 1,
             False, 10643),
    _foundry("MPT-7B, FSDP1 8 H100s, 8k tokens, micro-batch 8 x 2, full", "lf-mpt-7b-8k", "h100", 8, 8192, 8, 2,
             True, 6935),
    _foundry("MPT-13B, FSDP1 64 H100s, 2k tokens, micro-batch 2, no checkpointing", "lf-mpt-13b", "h100", 64, 2048, 2,
             1, False, 4800),
    _foundry("MPT-30B, FSDP1 32 H100s, 2k tokens, micro-batch 14 x 3, full", "lf-mpt-30b", "h100", 32, 2048, 14, 3,
             True, 2308),
    _foundry("MPT-7B, FSDP1 8 A100s, 2k tokens, micro-batch 6 x 2, no checkpointing", "lf-mpt-7b", "a100", 8, 2048, 6,
             2, False, 4641),
    _foundry("MPT-7B, FSDP1 8 A100s, 8k tokens, micro-batch 8 x 2, full", "lf-mpt-7b-8k", "a100", 8, 8192, 8, 2,
             True, 3206),
    # the same file's later H100 table, 128 to 512 GPUs, SHARD_GRAD_OP for the 1B and 3B, FlashAttention-2
    _foundry("MPT-1B, FSDP1 SHARD_GRAD_OP 128 H100s, micro-batch 12", "lf-mpt-1b", "h100", 128, 2048, 12, 1, False,
             44123, zero=2, source=LLM_FOUNDRY_SCALE, kernel="fa2"),
    _foundry("MPT-1B, FSDP1 SHARD_GRAD_OP 512 H100s, micro-batch 12", "lf-mpt-1b", "h100", 512, 2048, 12, 1, False,
             39837, zero=2, source=LLM_FOUNDRY_SCALE, kernel="fa2"),
    _foundry("MPT-3B, FSDP1 SHARD_GRAD_OP 128 H100s, micro-batch 8", "lf-mpt-3b", "h100", 128, 2048, 8, 1, False,
             23422, zero=2, source=LLM_FOUNDRY_SCALE, kernel="fa2"),
    _foundry("MPT-3B, FSDP1 SHARD_GRAD_OP 512 H100s, micro-batch 8", "lf-mpt-3b", "h100", 512, 2048, 8, 1, False,
             21664, zero=2, source=LLM_FOUNDRY_SCALE, kernel="fa2"),
    _foundry("MPT-7B, FSDP1 512 H100s, micro-batch 6, no checkpointing", "lf-mpt-7b", "h100", 512, 2048, 6, 1, False,
             9670, source=LLM_FOUNDRY_SCALE, kernel="fa2"),
]


def _bloom():
    """BLOOM-176B's training (BigScience's tr11-176B-ml.slurm: tp 4 x pp 12 x dp 8 on 384 A100 80GB, micro-batch
    2, global batch 2,048 x 2,048 tokens, bf16, ZeRO-1, activation checkpointing; Megatron-DeepSpeed) at 150 TFLOP/s
    per GPU once the batch reached 2,048 (S. Bekman, Machine Learning Engineering, the batch-size ramp of BLOOM-176B:
    "ramped up to GBS=2048 (150 TFLOPs)"), counted as Megatron-DeepSpeed counts it: 96·l·h²(1 + s/6h + V/16lh) FLOPs
    a token. Its shape: lab.model's bloom-176b (ALiBi, the embedding's LayerNorm, biases, tied)."""
    from lab.model import get_config
    cfg = get_config("bloom-176b")
    h, l, s, V = cfg.dim, cfg.n_layers, 2048, cfg.vocab_size
    per_token = 96 * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    flags = ("--tp", "4", "--pp", "12", "--dp-shard", "8", "--zero-stage", "1", "--seq-len", "2048",
             "--global-batch-size", "2048", "--microbatches", "128", "--activation-checkpointing", "full")
    return Published("BigScience tr11-176B-ml (Megatron-DeepSpeed); Bekman, Machine Learning Engineering",
                     "BLOOM 176B: tp 4 x pp 12 x dp 8, 384 A100s (Jean Zay), micro-batch 2, ZeRO-1", "bloom-176b",
                     "a100-jz", 384, flags, ("framework=deepspeed",), 150e12 / per_token,
                     f"150 TFLOP/s per GPU / {per_token / 1e9:.0f} GFLOP per token", further=True)


FURTHER.append(_bloom())


# the band: every row within 0.8-1.25x of its published tokens/s, the median within 0.9-1.1x
# (tests/test_plan_time.py holds a few rows to it and every further run to the band; the notebook prints them all)
TARGET_BAND = (0.8, 1.25)
