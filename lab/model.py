"""The one model every lesson shares: a small Llama-style decoder, or a GPT-family one by its config's options.

    tokens [B, S] -> Embedding -> L x Block -> RMSNorm -> Linear head -> logits [B, S, V]
    Block:  h = h + Attention(RMSNorm(h));  h = h + MLP(RMSNorm(h))
    Attention: grouped-query (n_kv_heads <= n_heads), rotary positions, SDPA, causal.
    MLP: SwiGLU  w2(silu(w1 x) * w3 x),  or a mixture of experts of such MLPs.

The options a GPT-family block needs (ModelConfig; the defaults are Llama, CONFIGS names GPT-2, GPT-3, MPT and
BLOOM): LayerNorm for RMSNorm (with or without its bias); a GELU MLP w2(gelu(w1 x)) (tanh-approximated, GPT-2's
gelu_new, or exact); learned positions (an embedding of max_seq_len rows added to the tokens' — GPT-2, GPT-3)
or ALiBi (no position embedding: each head adds m_h·(j − i) to the score of query i against key j — MPT,
BLOOM; Press et al. 2022, arXiv:2108.12409) for rotary; biases on attention's and the MLP's linears; the head
tied to the embedding (one matrix); a LayerNorm right after the embedding (BLOOM); and the vocabulary padded
to a multiple (Megatron's make-vocab-size-divisible-by; nanoGPT's 50,304 for GPT-2's 50,257), rows no token
uses and no loss sees, so tensor parallel can split it.

Written so a strategy can swap the part it parallelises by assignment, without
forking this file:
  - every Linear / Embedding is a plain attribute (block.attn.wq = ColumnParallel(...));
  - attention infers its local head counts from the projections' output sizes, so a
    tensor-parallel slice of wq/wk/wv just works;
  - the core attention op is a module attribute (`block.attn.sdpa`), for ring attention;
  - `forward(tokens, targets, positions)` takes explicit positions, for a sequence shard;
  - the loss is a module attribute (`model.loss_fn`), for a vocab-parallel loss.

Parameters are initialised from (seed, parameter name) alone — see `init_weights` —
so a sharded lesson can materialise exactly its slice of the same model.
"""
from __future__ import annotations

import functools
import math
import zlib
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256        # byte-level tokens
    dim: int = 32                # hidden size H
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2          # grouped-query attention: n_heads % n_kv_heads == 0
    ffn_dim: int = 64            # the MLP's inner width (SwiGLU's; GPT's GELU MLP: 4·dim)
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    n_experts: int = 0           # 0: dense SwiGLU MLP; > 0: mixture of experts
    top_k: int = 2
    capacity_factor: float | None = None  # None: dropless
    aux_loss_coef: float = 0.01
    # the block's options (the module doc): Llama's by default
    norm: str = "rms"                # "rms" (RMSNorm) or "layer" (LayerNorm)
    norm_bias: bool = False          # LayerNorm's bias (GPT-2, GPT-3, BLOOM: yes; MPT: no)
    mlp: str = "swiglu"              # "swiglu" or "gelu" (GPT: w2(gelu(w1 x))); a mixture's experts alike
    gelu_approximate: str = "tanh"   # "tanh" (GPT-2's gelu_new, BLOOM) or "none" (erf: MPT)
    positions: str = "rope"          # "rope", "learned" (GPT-2, GPT-3) or "alibi" (MPT, BLOOM)
    bias: bool = False               # biases on wq, wk, wv, wo and the MLP's linears (never the head, nor experts)
    tie_embeddings: bool = False     # the head is the embedding's matrix (GPT-2, MPT, BLOOM)
    embed_norm: bool = False         # a norm right after the embedding (BLOOM)
    vocab_multiple: int = 1          # the embedding and head hold vocab_size rounded up to a multiple of this

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def padded_vocab(self) -> int:
        """The embedding's and the head's rows: vocab_size rounded up to a multiple of vocab_multiple."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    def __post_init__(self):
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads}) "
                             f"and n_heads by n_kv_heads ({self.n_kv_heads})")
        if self.positions == "rope" and self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        choices = dict(norm=("rms", "layer"), mlp=("swiglu", "gelu"), gelu_approximate=("tanh", "none"),
                       positions=("rope", "learned", "alibi"))
        wrong = [f"{k}={getattr(self, k)!r} (choose from {v})" for k, v in choices.items() if getattr(self, k) not in v]
        if self.norm_bias and self.norm != "layer":
            wrong.append("norm_bias=True needs norm='layer' (RMSNorm has no bias)")
        if self.vocab_multiple < 1:
            wrong.append(f"vocab_multiple={self.vocab_multiple} must be >= 1")
        if wrong:
            raise ValueError("invalid model options: " + "; ".join(wrong))
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k ({self.top_k}) must be between 1 and n_experts ({self.n_experts})")


# GPT-2's block (Radford et al. 2019; transformers' GPT2LMHeadModel): LayerNorm with its bias, a 4h MLP of
# tanh-approximated GELU, learned positions, biases on every linear but the head, the head tied to the
# embedding — and its 50,257-token vocabulary padded to a multiple of 128 (50,304) so tp can split it.
# GPT-3 (Brown et al. 2020, Table 2.1) is the same block, wider (its alternating sparse attention is left out).
GPT2 = dict(norm="layer", norm_bias=True, mlp="gelu", gelu_approximate="tanh", positions="learned", bias=True,
            tie_embeddings=True, vocab_multiple=128)
# MPT-7B (MosaicML's config.json: no_bias, alibi, expansion_ratio 4): LayerNorm without a bias, exact GELU, ALiBi,
# no biases anywhere, tied. BLOOM (BigScience 2022, arXiv:2211.05100 §3.5): ALiBi, a LayerNorm after the
# embedding, biases, tanh GELU, tied.
MPT = dict(norm="layer", mlp="gelu", gelu_approximate="none", positions="alibi", tie_embeddings=True)
BLOOM = dict(norm="layer", norm_bias=True, mlp="gelu", gelu_approximate="tanh", positions="alibi", bias=True,
             tie_embeddings=True, embed_norm=True)

CONFIGS = {
    # for tests: heads 4 / kv 2 exercises GQA, and tp=4 the replicated-kv case
    "tiny": ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64),
    # for tests, GPT-family blocks at tiny's size: GPT-2's, its vocabulary odd like GPT-2's (257 rows, padded
    # to 320 for tp); BLOOM's (ALiBi, the embedding's norm) with grouped kv heads, so tp=4 replicates them
    # with their biases
    "tiny-gpt2": ModelConfig(vocab_size=257, dim=32, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=128, max_seq_len=64,
                             **dict(GPT2, vocab_multiple=64)),
    "tiny-bloom": ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64, **BLOOM),
    # ~10M parameters: CPU demos
    "small": ModelConfig(dim=384, n_layers=6, n_heads=6, n_kv_heads=2, ffn_dim=1024, max_seq_len=256),
    # ~125M and ~1B: GPUs
    "medium": ModelConfig(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048, max_seq_len=1024),
    "large": ModelConfig(dim=2048, n_layers=16, n_heads=16, n_kv_heads=8, ffn_dim=5632, max_seq_len=2048),
    # real sizes, for train.py --plan (and GPUs), each by its published config (parameters with the padding left
    # out and the tied matrix once, checked against transformers' models in tests/test_model.py): GPT-2
    # (124,439,808) and GPT-2 XL (1,557,611,200), GPT-3 175B (174,604,259,328 at GPT-2's vocabulary), MPT-7B
    # (6,649,286,656), BLOOM (176,247,271,424); Llama 2 7B and Llama 3 8B (the 8B shape of Qwen3-8B: 32 heads
    # over 8 kv heads, a 14,336-wide SwiGLU)
    "gpt2": ModelConfig(vocab_size=50257, dim=768, n_layers=12, n_heads=12, n_kv_heads=12, ffn_dim=3072,
                        max_seq_len=1024, **GPT2),
    "gpt2-xl": ModelConfig(vocab_size=50257, dim=1600, n_layers=48, n_heads=25, n_kv_heads=25, ffn_dim=6400,
                           max_seq_len=1024, **GPT2),
    "gpt3-175b": ModelConfig(vocab_size=50257, dim=12288, n_layers=96, n_heads=96, n_kv_heads=96, ffn_dim=49152,
                             max_seq_len=2048, **GPT2),
    "mpt-7b": ModelConfig(vocab_size=50432, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=16384,
                          max_seq_len=2048, **MPT),
    "bloom-176b": ModelConfig(vocab_size=250880, dim=14336, n_layers=70, n_heads=112, n_kv_heads=112,
                              ffn_dim=57344, max_seq_len=2048, **BLOOM),
    "llama2-7b": ModelConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008,
                             max_seq_len=4096),
    "llama3-8b": ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                             max_seq_len=8192, rope_theta=500000.0),
    # real small models, by their published config.json (as known here: nothing is downloaded; each count of
    # parameters with the embedding once is the published one, 134,515,008 and 1,235,814,400 — checked in
    # tests/test_hf_checkpoints.py). Both tie the head to the embedding, which the course holds twice (lab/hf.py):
    # +V·H parameters here. SmolLM2-135M loads as it is (--init-from its directory). Llama-3.2-1B scales its
    # rotary frequencies ('llama3' rope scaling), which the course does not compute: its shape is here for
    # planning, at its unscaled 8,192-token context, and config_from_hf refuses its checkpoint, saying so.
    # (Qwen2.5-0.5B is not here: its q/k/v projections have biases and its o projection none; the course's bias
    # option puts them on all four, and on the MLP.)
    "smollm2-135m": ModelConfig(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536,
                                max_seq_len=8192, rope_theta=100000.0),
    "llama3.2-1b": ModelConfig(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                               max_seq_len=8192, rope_theta=500000.0),
}


def get_config(name: str, **overrides) -> ModelConfig:
    if name not in CONFIGS:
        raise ValueError(f"unknown model {name!r}: choose one of {sorted(CONFIGS)}")
    return replace(CONFIGS[name], **overrides)


# ---- building blocks ------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Normalise in at least fp32 (bf16 sums of squares lose too much); float64 stays float64.
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


class LayerNorm(nn.Module):
    """(x − mean) / sqrt(var + eps) · weight (+ bias), normalised in at least fp32 as RMSNorm (GPT, MPT, BLOOM)."""

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x):
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        out = F.layer_norm(xf, xf.shape[-1:], eps=self.eps).to(x.dtype) * self.weight
        return out if self.bias is None else out + self.bias


def make_norm(cfg: ModelConfig) -> nn.Module:
    return RMSNorm(cfg.dim, cfg.norm_eps) if cfg.norm == "rms" else LayerNorm(cfg.dim, cfg.norm_eps, cfg.norm_bias)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin of shape [S, head_dim/2] for the given absolute positions [S]."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=work) / head_dim)
    angles = positions.to(work)[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x, cos, sin):
    """Rotate pairs (x[..., i], x[..., i + D/2]) by the position's angle. x: [B, S, heads, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class SDPA(nn.Module):
    """Causal scaled-dot-product attention on [B, heads, S, D]; the part ring attention replaces."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              enable_gqa=k.shape[1] != q.shape[1])


def alibi_slopes(n_heads: int) -> list[float]:
    """ALiBi's slope of each head (Press et al. 2022, §3): m_h = 2^(−8h/n), h = 1..n, for n a power of 2; else the
    slopes of the largest power of 2 below n, then every other slope of twice that (the paper's code, BLOOM's)."""
    def powers(n):
        return [2 ** (-8 * h / n) for h in range(1, n + 1)]
    p = 2 ** int(math.log2(n_heads))
    return powers(p) + powers(2 * p)[0::2][:n_heads - p]


class ALiBi(nn.Module):
    """Causal attention whose score of query i against key j ≤ i gets m_h·(j − i) added (ALiBi), on [B, heads, S, D];
    SDPA's place when cfg.positions == "alibi". Its heads are heads first.. of the model's n_heads (tensor parallel
    holds a slice of them). The bias depends on j − i within the sequence it sees: context parallel, which cuts
    the sequence, cannot run it (train.py refuses the pair)."""

    def __init__(self, n_heads: int, first: int = 0):
        super().__init__()
        self.n_heads, self.first = n_heads, first

    def forward(self, q, k, v):
        bias = alibi_bias(self.n_heads, self.first, q.shape[1], q.shape[2], k.shape[2], q.device, q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=k.shape[1] != q.shape[1])


@functools.lru_cache(maxsize=8)  # one tensor for every layer (autograd saves it once) and every step
def alibi_bias(n_heads: int, first: int, heads: int, sq: int, sk: int, device, dtype) -> torch.Tensor:
    """[1, heads, sq, sk]: m_h·(j − i) for the queries i = sk − sq .. sk − 1 and keys j ≤ i, −inf above (causal).
    (4-D: SDPA then takes its fused kernel, which keeps no sq × sk scores for the backward.)"""
    with torch.inference_mode(False):  # (kept: a tensor made in inference mode could never be saved for backward)
        slopes = torch.tensor(alibi_slopes(n_heads)[first:first + heads], device=device, dtype=torch.float64)
        distance = torch.arange(sk, device=device)[None, :] - torch.arange(sk - sq, sk, device=device)[:, None]
        return (slopes[:, None, None] * distance).masked_fill(distance > 0, float("-inf")).to(dtype)[None]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hd = cfg.head_dim
        self.head_dim = hd
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=cfg.bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=cfg.bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=cfg.bias)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=cfg.bias)
        self.sdpa = ALiBi(cfg.n_heads) if cfg.positions == "alibi" else SDPA()

    def forward(self, x, cos, sin):
        """x [B, S, H]; cos, sin the rotary angles of its positions, or None (learned or ALiBi positions)."""
        B, S, _ = x.shape
        # -1 heads: the local head count follows the projection's size (tensor parallel slices it).
        q = self.wq(x).view(B, S, -1, self.head_dim)   # [B, S, Hq, D]
        k = self.wk(x).view(B, S, -1, self.head_dim)   # [B, S, Hkv, D]
        v = self.wv(x).view(B, S, -1, self.head_dim)
        if cos is not None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = self.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # [B, Hq, S, D]
        return self.wo(o.transpose(1, 2).reshape(B, S, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, ffn_dim: int, bias: bool = False):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=bias)  # gate
        self.w3 = nn.Linear(dim, ffn_dim, bias=bias)  # up
        self.w2 = nn.Linear(ffn_dim, dim, bias=bias)  # down

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GeluMLP(nn.Module):
    """GPT's MLP: w2(gelu(w1 x)), w1 up [F, H], w2 down [H, F] (GPT-2's c_fc and c_proj)."""

    def __init__(self, dim: int, ffn_dim: int, bias: bool = False, approximate: str = "tanh"):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=bias)  # up
        self.w2 = nn.Linear(ffn_dim, dim, bias=bias)  # down
        self.approximate = approximate

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x), approximate=self.approximate))


def make_mlp(cfg: ModelConfig) -> nn.Module:
    if cfg.n_experts:
        return MoE(cfg)
    if cfg.mlp == "swiglu":
        return SwiGLU(cfg.dim, cfg.ffn_dim, cfg.bias)
    return GeluMLP(cfg.dim, cfg.ffn_dim, cfg.bias, cfg.gelu_approximate)


class MoE(nn.Module):
    """Mixture of E SwiGLU experts, top-k routing — the single-device reference.

    Router: p = softmax(x Wr) over E experts; each token goes to its top-k experts,
    weighted by their probabilities renormalised to sum to 1.
    Capacity (if capacity_factor is set): each expert takes at most
        C = ceil(T * k / E * capacity_factor)
    of the T*k assignments it sees in this call; it keeps them in token order
    (earlier tokens first) and drops the rest (their contribution is zero).
    Aux loss (Switch): coef * E * sum_i f_i * P_i, f_i = share of assignments routed to
    expert i, P_i = mean router probability of expert i; equals coef under uniform routing.
    Expert weights are stacked [E, ...] so expert parallel slices them along dim 0. With cfg.mlp "gelu" each
    expert is GPT's MLP, w2(gelu(w1 x)): no w3.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, H, F_ = cfg.n_experts, cfg.dim, cfg.ffn_dim
        self.n_experts, self.top_k = E, cfg.top_k
        self.capacity_factor, self.aux_loss_coef = cfg.capacity_factor, cfg.aux_loss_coef
        self.router = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.empty(E, F_, H))
        self.w3 = nn.Parameter(torch.empty(E, F_, H)) if cfg.mlp == "swiglu" else None
        self.w2 = nn.Parameter(torch.empty(E, H, F_))
        self.approximate = cfg.gelu_approximate  # (a GELU expert's)
        self.aux_loss = None          # set by forward
        self.tokens_per_expert = None  # [E] assignments kept, set by forward
        self.dropped = 0

    def route(self, x):
        """x [T, H] -> probs [T, E], topk weights [T, k], topk experts [T, k], aux loss."""
        probs = F.softmax(self.router(x).to(torch.promote_types(x.dtype, torch.float32)), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        f = torch.bincount(experts.flatten(), minlength=self.n_experts).to(probs.dtype) / experts.numel()
        aux = self.aux_loss_coef * self.n_experts * (f * probs.mean(0)).sum()
        return probs, weights, experts, aux

    def capacity(self, n_tokens: int) -> int | None:
        if self.capacity_factor is None:
            return None
        return math.ceil(n_tokens * self.top_k / self.n_experts * self.capacity_factor)

    def expert(self, e: int, x):
        if self.w3 is None:
            return F.gelu(x @ self.w1[e].T, approximate=self.approximate) @ self.w2[e].T
        return F.silu(x @ self.w1[e].T) * (x @ self.w3[e].T) @ self.w2[e].T

    def experts(self, xs: list) -> list:
        """[expert e's output for xs[e]]: the experts' rows, one matmul chain each. The stacked weights are
        unbound once, so backward stacks each weight's gradient once — indexing w[e] per expert would make
        a zero-filled [E, ...] gradient per expert, E times the weights' bytes written and added."""
        if self.w3 is None:
            return [F.gelu(x @ a.T, approximate=self.approximate) @ b.T
                    for x, a, b in zip(xs, self.w1.unbind(0), self.w2.unbind(0))]
        return [F.silu(x @ a.T) * (x @ c.T) @ b.T
                for x, a, c, b in zip(xs, self.w1.unbind(0), self.w3.unbind(0), self.w2.unbind(0))]

    def forward(self, x):
        B, S, H = x.shape
        x = x.reshape(-1, H)                               # [T, H]
        _, weights, experts, self.aux_loss = self.route(x)
        cap = self.capacity(x.shape[0])
        out = torch.zeros_like(x)
        kept = []
        picks = [(experts == e).nonzero(as_tuple=True) for e in range(self.n_experts)]  # to e, in token order
        if cap is not None:
            picks = [(token[:cap], slot[:cap]) for token, slot in picks]
        for (token, slot), y in zip(picks, self.experts([x[token] for token, _ in picks])):
            kept.append(token.numel())
            out = out.index_add(0, token, y * weights[token, slot, None])
        self.tokens_per_expert = torch.tensor(kept)
        self.dropped = experts.numel() - sum(kept)
        return out.view(B, S, H)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg)
        self.mlp = make_mlp(cfg)

    def forward(self, h, cos, sin):
        h = h + self.attn(self.attn_norm(h), cos, sin)
        return h + self.mlp(self.mlp_norm(h))


IGNORE = -100  # a target that counts nowhere (padding); F.cross_entropy's default ignore_index


class CrossEntropy(nn.Module):
    """Token cross-entropy over the targets that are not IGNORE; the part a vocab-parallel loss replaces.

    divide_by None: the mean over this call's counted targets. A number: their SUM divided by it —
    a parallel run sets it so that the ranks' losses add up to the mean over every counted token
    of the global batch, whatever share of them each rank holds (train.py, "token-weighted loss").
    """

    def __init__(self):
        super().__init__()
        self.divide_by = None

    def forward(self, logits, targets):
        # bf16 logits are upcast: the log-sum-exp over the vocabulary needs fp32.
        logits = logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32))
        if self.divide_by is None:
            return F.cross_entropy(logits, targets.flatten(), ignore_index=IGNORE)
        return F.cross_entropy(logits, targets.flatten(), ignore_index=IGNORE, reduction="sum") / self.divide_by


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, seed: int | None = 0):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.padded_vocab, cfg.dim)
        if cfg.positions == "learned":
            self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.dim)
        if cfg.embed_norm:
            self.embed_norm = make_norm(cfg)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = make_norm(cfg)
        self.output = nn.Linear(cfg.dim, cfg.padded_vocab, bias=False)
        self.tie_weights()
        self.loss_fn = CrossEntropy()
        if seed is not None and not any(p.is_meta for p in self.parameters()):
            self.init_weights(seed)

    def tie_weights(self):
        """cfg.tie_embeddings: the head holds the embedding's parameter itself (one matrix, used twice; its
        gradient is the sum of both uses). Again after anything that makes new parameters (to_empty)."""
        if self.cfg.tie_embeddings and getattr(self, "output", None) is not None \
                and getattr(self, "tok_embeddings", None) is not None:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens, targets=None, positions=None):
        """tokens [B, S] -> logits [B, S, V], or the loss if targets [B, S] are given.

        positions [S]: absolute positions of these tokens (default 0..S-1); a context-
        parallel shard passes the positions it holds.
        """
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.blocks(self.embed(tokens, positions), self.layers, positions)  # [B, S, H]
        out = self.head(h, targets)
        return out if targets is None else out + self.aux_loss()

    def embed(self, tokens, positions):
        """tokens [B, S] -> h [B, S, H]: their embedding rows, plus (learned positions) the rows of `positions`
        [S], then (BLOOM) the embedding's norm. (A pipeline's first stage runs this too.)"""
        h = self.tok_embeddings(tokens)
        if self.cfg.positions == "learned":
            h = h + self.pos_embeddings(positions)
        return self.embed_norm(h) if self.cfg.embed_norm else h

    def blocks(self, h, layers, positions):
        """h [B, S, H] through `layers`, with the rotary angles of `positions` [S] computed once (None for
        learned or ALiBi positions). (A pipeline stage runs its own layers through this, model.forward's middle.)"""
        cos, sin = (rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, h.dtype)
                    if self.cfg.positions == "rope" else (None, None))
        for layer in layers:
            h = layer(h, cos, sin)
        return h

    def head(self, h, targets=None):
        """h [B, S, H] -> logits [B, S, V] (final norm, output head), or their loss against targets. A padded
        vocabulary's extra logits are cut off here (tensor parallel's loss masks those of its slice)."""
        logits = self.output(self.norm(h))
        if self.cfg.padded_vocab != self.cfg.vocab_size:
            logits = logits[..., :self.cfg.vocab_size]
        return logits if targets is None else self.loss_fn(logits, targets)

    def aux_loss(self):
        aux = [l.mlp.aux_loss for l in self.layers if isinstance(l.mlp, MoE) and l.mlp.aux_loss is not None]
        return sum(aux) if aux else 0.0

    @torch.no_grad()
    def init_weights(self, seed: int = 0):
        for name, p in self.named_parameters():
            p.copy_(init_tensor(self.cfg, name, tuple(p.shape), seed))


def init_tensor(cfg: ModelConfig, name: str, shape: tuple, seed: int = 0) -> torch.Tensor:
    """The initial value of parameter `name`, from (seed, name) alone, in float32 on CPU.

    Independent of every other parameter, of the device and of the dtype, so a
    sharded or meta-initialised model can rebuild exactly the same numbers.
    """
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):  # linears' and LayerNorm's biases start at zero (GPT-2)
        return torch.zeros(shape)
    if cfg.tie_embeddings and name == "output.weight":  # a tied head is the embedding's matrix
        name = "tok_embeddings.weight"
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    std = 0.02
    if name.endswith(("wo.weight", "w2.weight", ".w2")):  # residual outputs: GPT-2's 1/sqrt(2L)
        std /= math.sqrt(2 * cfg.n_layers)
    return torch.randn(shape, generator=gen).mul_(std)  # (in place: one whole tensor at a time while building)


def build_model(cfg: ModelConfig | str = "tiny", seed: int = 0, dtype=torch.float32, device=None):
    """The shared model, initialised from `seed` (on the meta device: shapes only, no data)."""
    cfg = get_config(cfg) if isinstance(cfg, str) else cfg
    if device is not None and torch.device(device).type == "meta":
        with torch.device("meta"):  # shapes only: a 7B model costs no memory at all
            return Transformer(cfg, seed=None).to(dtype=dtype)
    return Transformer(cfg, seed).to(device=device, dtype=dtype)


# ---- sizes ---------------------------------------------------------------------------

def num_params(cfg: ModelConfig, active: bool = False) -> int:
    """Total parameters, computed from the config (tests check it against the model): a tied matrix once, a
    padded vocabulary's rows included. active=True counts only top_k of the experts (the parameters one token
    uses)."""
    H, q, kv, F_, b = cfg.dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim, int(cfg.bias)
    attn = H * (q + 2 * kv) + q * H + b * (q + 2 * kv + H)
    matrices = 3 if cfg.mlp == "swiglu" else 2
    if cfg.n_experts:
        experts = cfg.top_k if active else cfg.n_experts
        mlp = H * cfg.n_experts + experts * matrices * H * F_
    else:
        mlp = matrices * H * F_ + b * ((matrices - 1) * F_ + H)
    norm = H * (2 if cfg.norm_bias else 1)
    per_layer = attn + mlp + 2 * norm
    embedding = cfg.padded_vocab * H * (1 if cfg.tie_embeddings else 2)
    positions = cfg.max_seq_len * H if cfg.positions == "learned" else 0
    return embedding + positions + cfg.n_layers * per_layer + norm * (1 + cfg.embed_norm)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token, 6N + 6·L·H·Q·T (PaLM, appendix B, causal).

    N: parameters a token touches in matrix multiplies — all but the embedding tables
    (lookups: the tokens', and learned positions'), counting only top_k experts, and the head
    even when it is the embedding's matrix (tied: a lookup and a matmul). The second term is attention's
    score and value products (L layers, H heads, Q head dim, T sequence length):
    PaLM's 12·L·H·Q·T counts every query against every key; the model's attention is
    causal, and its fused kernels compute only the half on and below the diagonal.
    """
    lookups = cfg.padded_vocab * cfg.dim * (0 if cfg.tie_embeddings else 1)
    lookups += cfg.max_seq_len * cfg.dim if cfg.positions == "learned" else 0
    n = num_params(cfg, active=True) - lookups
    return 6 * n + 6 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len


# ---- float8 matmuls, by hand (train.py --float8) ---------------------------------------------------
#
# A float8 matmul (Micikevicius et al. 2022, arXiv:2209.05433) multiplies 8-bit numbers: e4m3 (3 mantissa bits,
# largest 448) for weights and activations in the forward, e5m2 (2 bits, largest 57,344: more range, less
# precision) for gradients in the backward. Dynamic tensorwise scaling: each tensor is multiplied by
# scale = largest / amax(|x|) before the cast, so its largest element lands on the format's largest number,
# and the product is divided by both scales. Parameters stay in their own dtype (ZeRO and tp never see
# float8); only the matmul's inputs are cast, each time.

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def to_float8(x: torch.Tensor, dtype=E4M3):
    """(x·scale cast to dtype, scale), scale = dtype's largest / amax(|x|): tensorwise dynamic scaling."""
    largest = torch.finfo(dtype).max
    scale = largest / x.detach().abs().max().float().clamp(min=1e-12)
    return (x.float() * scale).clamp(-largest, largest).to(dtype), scale


def _scaled_matmul(a, scale_a, b, scale_b, out_dtype):
    """a [M, K] @ b [K, N] of float8 tensors, divided by both scales. torch._scaled_mm where the device has
    float8 matmuls (a CUDA GPU of compute capability 8.9 or more: it wants b column-major), else emulated:
    the float8 values, exactly, multiplied in fp32."""
    if a.is_cuda and torch.cuda.get_device_capability(a.device) >= (8, 9):
        return torch._scaled_mm(a, b.t().contiguous().t(), scale_a=(1 / scale_a).reshape(()),
                                scale_b=(1 / scale_b).reshape(()), out_dtype=out_dtype)
    return ((a.float() @ b.float()) / (scale_a * scale_b)).to(out_dtype)


class Float8Matmul(torch.autograd.Function):
    """y = x @ w.T with x, w cast to e4m3 in the forward and dL/dy to e5m2 in the backward:
    dL/dx = dL/dy @ w, dL/dw = dL/dy^T @ x, each a float8 matmul of the float8 tensors saved from the forward."""

    @staticmethod
    def forward(ctx, x, w):                                   # x [..., K], w [N, K]
        x2 = x.reshape(-1, x.shape[-1])
        (xq, sx), (wq, sw) = to_float8(x2), to_float8(w)
        ctx.save_for_backward(xq, sx, wq, sw)
        ctx.shape, ctx.dtypes = x.shape, (x.dtype, w.dtype)
        return _scaled_matmul(xq, sx, wq.t(), sw, x.dtype).view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, gy):
        xq, sx, wq, sw = ctx.saved_tensors
        gq, sg = to_float8(gy.reshape(-1, gy.shape[-1]), E5M2)
        gx = _scaled_matmul(gq, sg, wq, sw, ctx.dtypes[0]).view(ctx.shape)
        gw = _scaled_matmul(gq.t(), sg, xq, sx, ctx.dtypes[1])
        return gx, gw


def float8_linear(x, weight, bias=None):
    """F.linear with the matmul in float8 (bias, if any, added in the input's dtype)."""
    y = Float8Matmul.apply(x, weight)
    return y if bias is None else y + bias


def use_float8(model, keep=("tok_embeddings", "output", "router")) -> list[str]:
    """Make every linear layer's matmul a float8 one, in place, but those whose name has a part in `keep`: the
    embedding (a lookup, no matmul), the output head, whose logits feed the loss and are the most sensitive to
    rounding, and a mixture of experts' router, whose top-k choice a rounding can flip. A layer is an nn.Linear,
    or anything with a `linear` attribute it calls (tensor_parallel's linears); the experts' stacked weights
    [E, F, H] are neither and stay as they are. Returns the names of the layers changed."""
    changed = []
    for name, module in model.named_modules():
        if set(name.split(".")) & set(keep):
            continue
        if isinstance(module, nn.Linear):
            module.forward = lambda x, m=module: float8_linear(x, m.weight, m.bias)
        elif hasattr(module, "linear") and hasattr(module, "weight"):
            module.linear = float8_linear
        else:
            continue
        changed.append(name)
    return changed
