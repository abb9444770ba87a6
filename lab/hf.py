"""The course's model and Hugging Face's Llama and Mixtral: configs and weights, both ways.

The course's Transformer (lab/model.py) is Llama: the same pre-norm block, RMSNorm, grouped-query attention,
SwiGLU and rotary positions; Mixtral is the same with a mixture of experts. A conversion is a renaming, and one
table holds it (HF_NAMES, Hugging Face's name -> the course's; i a layer):

    model.embed_tokens.weight                   tok_embeddings.weight
    model.layers.i.input_layernorm.weight       layers.i.attn_norm.weight
    model.layers.i.self_attn.q/k/v/o_proj       layers.i.attn.wq/wk/wv/wo
    model.layers.i.post_attention_layernorm     layers.i.mlp_norm
    model.layers.i.mlp.gate/up/down_proj        layers.i.mlp.w1/w3/w2                   (dense)
    model.layers.i.mlp.gate                     layers.i.mlp.router                     (Mixtral)
    model.layers.i.mlp.experts.gate_up_proj     layers.i.mlp.w1, w3 concatenated on dim 1: [E, 2F, H]
    model.layers.i.mlp.experts.down_proj        layers.i.mlp.w2                         [E, H, F]
    model.norm.weight                           norm.weight
    lm_head.weight                              output.weight

Conventions (tests/test_hf.py checks each):
  - rotary pairs: both rotate (x_j, x_{j+D/2}) (Hugging Face's rotate_half), so q and k need no permutation.
    Meta's original checkpoints pair (x_{2j}, x_{2j+1}); Hugging Face's conversion script permuted q/k's rows
    once, so Hugging Face's Llama checkpoints are already in this model's half-split order.
  - tied embeddings: the course's model has none (its lessons shard the embedding and the head apart). A tied
    checkpoint becomes an untied course model holding the same matrix twice: the same logits, and the tied
    weight's gradient is the sum of the two. to_hf(..., tied=True) refuses once the two have drifted apart.
  - Mixtral: softmax over all experts -> top-k -> renormalise, dropless: the course's MoE with capacity_factor
    None. Transformers holds the experts stacked (gate_up_proj, down_proj) but saves them per expert
    (block_sparse_moe.experts.j.w1/w2/w3, the course's own names); to_course reads both.
  - config_from_hf refuses what the course does not compute (biases, another activation, rope scaling, a
    sliding window, ...), with one ValueError naming each.

On disk (a model directory: config.json, model.safetensors or shards named by model.safetensors.index.json),
read_config gives the course's config and disk_map says where each course tensor lies in the files, so a rank
can read just its part (lab/checkpoint.py reads and writes the directories).
"""
from __future__ import annotations

import functools
import math
import os

import torch

from lab.model import ModelConfig, build_model

HF_NAMES = {  # Hugging Face name -> course name; a tuple: the course's tensors concatenated on dim 1 (rows)
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.attn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "layers.{i}.attn.wq.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "layers.{i}.attn.wk.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "layers.{i}.attn.wv.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "layers.{i}.attn.wo.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.mlp_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "layers.{i}.mlp.w1.weight",
    "model.layers.{i}.mlp.up_proj.weight": "layers.{i}.mlp.w3.weight",
    "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.mlp.w2.weight",
    "model.layers.{i}.mlp.gate.weight": "layers.{i}.mlp.router.weight",
    "model.layers.{i}.mlp.experts.gate_up_proj": ("layers.{i}.mlp.w1", "layers.{i}.mlp.w3"),
    "model.layers.{i}.mlp.experts.down_proj": "layers.{i}.mlp.w2",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
UNLIKE = {  # families the course's model cannot express, and why (config_from_hf says so)
    "qwen2": "its q, k and v projections have biases; the course's linears have none",
    "gpt2": "learned positions, LayerNorm and a GELU MLP; the course's model has rotary positions, RMSNorm, SwiGLU",
    "gemma": "its RMSNorm scales by 1 + weight, its embedding by sqrt(hidden_size), its MLP is GELU-gated",
}
DENSE = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
MOE = ("mlp.gate.", "mlp.experts.")


def config_from_hf(hf) -> ModelConfig:
    """A Hugging Face LlamaConfig or MixtralConfig -> the course's ModelConfig; a ValueError naming everything
    the course's model does not compute."""
    kind = getattr(hf, "model_type", None)
    if kind not in ("llama", "mixtral"):
        why = f" ({UNLIKE[kind]})" if kind in UNLIKE else ""
        raise ValueError(f"the course's model converts Hugging Face's 'llama' and 'mixtral', not {kind!r}{why}")
    rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    theta = rope.get("rope_theta", getattr(hf, "rope_theta", None))
    refuse = [f"{name}={getattr(hf, name)!r} (the course's {what})" for name, ok, what in [
        ("attention_bias", False, "linears have no bias"),
        ("mlp_bias", False, "linears have no bias"),
        ("hidden_act", "silu", "MLP is SwiGLU: silu"),
        ("head_dim", hf.hidden_size // hf.num_attention_heads, "head_dim is hidden_size / num_attention_heads"),
        ("sliding_window", None, "attention is fully causal, no sliding window"),
        ("attention_dropout", 0.0, "model has no dropout"),
        ("router_jitter_noise", 0.0, "router has no jitter noise"),
    ] if getattr(hf, name, None) is not None and getattr(hf, name) != ok]
    if rope.get("rope_type", rope.get("type", "default")) != "default" or rope.get("partial_rotary_factor", 1.0) != 1.0:
        refuse.append(f"rope_parameters={rope} (the course's rotary embedding is the default one, over all of "
                      f"head_dim, with no scaling)")
    if refuse:
        raise ValueError("the course's model cannot express this Hugging Face config: " + "; ".join(refuse))
    # Mixtral's balancing loss counts each of the k slots apart: k x the course's f_i, so k x its coefficient
    moe = dict(n_experts=hf.num_local_experts, top_k=hf.num_experts_per_tok, capacity_factor=None,
               aux_loss_coef=hf.router_aux_loss_coef * hf.num_experts_per_tok) if kind == "mixtral" else {}
    return ModelConfig(vocab_size=hf.vocab_size, dim=hf.hidden_size, n_layers=hf.num_hidden_layers,
                       n_heads=hf.num_attention_heads, n_kv_heads=hf.num_key_value_heads or hf.num_attention_heads,
                       ffn_dim=hf.intermediate_size, max_seq_len=hf.max_position_embeddings,
                       rope_theta=float(theta), norm_eps=hf.rms_norm_eps, **moe)


def hf_config(cfg: ModelConfig, tied: bool = False):
    """The course's ModelConfig -> a Hugging Face LlamaConfig (MixtralConfig if it has experts)."""
    import transformers  # only here: the rest of this module needs no transformers

    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.dim, num_hidden_layers=cfg.n_layers,
                  num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                  intermediate_size=cfg.ffn_dim, max_position_embeddings=cfg.max_seq_len,
                  rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
                  rms_norm_eps=cfg.norm_eps, tie_word_embeddings=tied)
    if cfg.n_experts:
        if cfg.capacity_factor is not None:
            raise ValueError("Mixtral is dropless: convert a course model with capacity_factor=None")
        return transformers.MixtralConfig(num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k,
                                          router_aux_loss_coef=cfg.aux_loss_coef / cfg.top_k,
                                          output_router_logits=True, **common)  # its loss adds the aux, as ours
    return transformers.LlamaConfig(**common)


def _names(cfg: ModelConfig):
    """(Hugging Face name, course name or names) of every tensor of this config, from the one table."""
    for hf, course in HF_NAMES.items():
        if (any(m in hf for m in MOE) and not cfg.n_experts) or (any(d in hf for d in DENSE) and cfg.n_experts):
            continue
        for i in range(cfg.n_layers) if "{i}" in hf else [None]:
            yield hf.format(i=i), (tuple(c.format(i=i) for c in course) if isinstance(course, tuple)
                                   else course.format(i=i))


def _stack_saved_experts(sd: dict, cfg: ModelConfig) -> dict:
    """Mixtral as saved on disk (block_sparse_moe.gate, block_sparse_moe.experts.{j}.w1/w3 [F, H], w2 [H, F])
    -> as held in memory (mlp.gate, mlp.experts.gate_up_proj [E, 2F, H], down_proj [E, H, F])."""
    if not any(".block_sparse_moe." in k for k in sd):
        return sd
    out = {k: v for k, v in sd.items() if ".block_sparse_moe." not in k}
    for i in range(cfg.n_layers):
        old, new = f"model.layers.{i}.block_sparse_moe.", f"model.layers.{i}.mlp."
        w = {n: torch.stack([sd[f"{old}experts.{j}.{n}.weight"] for j in range(cfg.n_experts)])
             for n in ("w1", "w2", "w3")}
        out[new + "gate.weight"] = sd[old + "gate.weight"]
        out[new + "experts.gate_up_proj"] = torch.cat([w["w1"], w["w3"]], dim=1)
        out[new + "experts.down_proj"] = w["w2"]
    return out


def to_course(sd: dict, cfg: ModelConfig) -> dict:
    """A Hugging Face state dict (as its model holds it, or Mixtral as saved) -> the course's state dict for cfg
    (the same tensors, not copies, but for a tied matrix's second use). A tied checkpoint (no lm_head.weight,
    or lm_head.weight in the embedding's memory) gives the embedding's matrix to the output head too."""
    sd = _stack_saved_experts(dict(sd), cfg)
    if "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    missing = [hf for hf, _ in _names(cfg) if hf not in sd]
    extra = sorted(set(sd) - {hf for hf, _ in _names(cfg)})
    if missing or extra:
        raise ValueError(f"this state dict does not fit {cfg}: missing {missing[:4]}, unexpected {extra[:4]}")
    out = {}
    for hf, course in _names(cfg):
        if isinstance(course, tuple):  # gate_up_proj [E, 2F, H]: the gate's F rows first, then the up's
            out.update(zip(course, (part.contiguous() for part in sd[hf].chunk(len(course), dim=1))))
        else:
            out[course] = sd[hf]
    if out["output.weight"].data_ptr() == out["tok_embeddings.weight"].data_ptr():
        out["output.weight"] = out["output.weight"].clone()  # a tied checkpoint's one matrix: two tensors here
    return out


def to_hf(sd: dict, cfg: ModelConfig, tied: bool = False) -> dict:
    """The course's state dict -> a Hugging Face one (as its model's state_dict() holds it; save_pretrained
    writes Mixtral's per-expert layout from it). tied=True: embedding and head are one tensor, under both
    names — only if the course model's two are still equal."""
    if tied and not torch.equal(sd["tok_embeddings.weight"], sd["output.weight"]):
        raise ValueError("tied=True, but tok_embeddings and output differ: a tied model holds one matrix "
                         "(convert with tied=False)")
    out = {hf: torch.cat([sd[c] for c in course], dim=1) if isinstance(course, tuple) else sd[course]
           for hf, course in _names(cfg)}
    if tied:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


# ---- a model directory on disk: its config, and where each of the course's tensors lies in its files --------

def read_config(directory: str) -> ModelConfig:
    """config.json of a Hugging Face model directory -> the course's ModelConfig (transformers reads the file, so
    its defaults fill what the file leaves out); one ValueError saying why not."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"--init-from {directory!r} holds no config.json: give a Hugging Face model directory "
                         f"(config.json and safetensors weights, as save_pretrained writes it) or a state dict file")
    return _read_config(os.path.abspath(directory), os.stat(path).st_mtime_ns)


@functools.lru_cache(maxsize=8)  # (the file's time in the key: a rewritten config.json is read again)
def _read_config(directory: str, _mtime: int) -> ModelConfig:
    import transformers  # only here: the rest of this module needs no transformers

    path = os.path.join(directory, "config.json")
    try:
        hf = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} cannot be read as a Hugging Face config ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200]})") from None
    try:
        return config_from_hf(hf)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def disk_map(cfg: ModelConfig, present) -> tuple[dict, dict]:
    """Where the course's tensors lie among a checkpoint's tensors named `present` (tied: no lm_head.weight;
    Mixtral's experts per expert as save_pretrained writes them, or stacked as the model holds them):

        parts   {course name: [(file tensor, index, first row, rows), ...]}: the course tensor seen as rows
                (every dimension but the last merged; a vector: one element a row) is these blocks one after
                another, each `rows` rows of the file tensor (at `index` of its leading dimensions) from `first row`
        shapes  {file tensor: the shape it must have}

    e.g. Mixtral's w1 [E, F, H] is experts.0.w1.weight [F, H], then experts.1.w1.weight, ...; or, stacked, rows
    0..F of gate_up_proj[0] [2F, H], then of gate_up_proj[1], ... (w3: rows F..2F of each)."""
    course = {n: tuple(p.shape) for n, p in build_model(cfg, device="meta").named_parameters()}
    tied = "lm_head.weight" not in present
    stacked = any(".mlp.experts." in n for n in present)
    parts, shapes = {}, {}

    def whole(file_name, name):  # the same tensor under another name
        shapes[file_name], parts[name] = course[name], [(file_name, (), 0, _rows(course[name]))]

    for hf, names in _names(cfg):
        if hf == "lm_head.weight" and tied:  # one matrix on disk, two in the course's model
            continue
        saved = hf.replace(".mlp.", ".block_sparse_moe.")  # Mixtral as save_pretrained writes it
        if not any(m in hf for m in MOE):
            whole(hf, names)
        elif hf.endswith(".mlp.gate.weight"):  # the router
            whole(hf if stacked else saved, names)
        elif stacked:  # gate_up_proj [E, 2F, H]: w1's F rows then w3's, per expert; down_proj [E, H, F]: w2
            group = (names,) if isinstance(names, str) else names
            e, rows, width = course[group[0]]
            shapes[hf] = (e, rows * len(group), width)
            for k, name in enumerate(group):
                parts[name] = [(hf, (j,), k * rows, rows) for j in range(e)]
        else:  # per expert: experts.j.w1.weight [F, H], w3 [F, H], w2 [H, F]
            for name in (names,) if isinstance(names, str) else names:
                e, rows, width = course[name]
                per = [saved.split(".experts.")[0] + f".experts.{j}.{name.split('.')[-1]}.weight" for j in range(e)]
                shapes.update((n, (rows, width)) for n in per)
                parts[name] = [(n, (), 0, rows) for n in per]
    if tied:
        parts["output.weight"] = parts["tok_embeddings.weight"]
    return parts, shapes


def _rows(shape) -> int:
    """A tensor seen as rows: every dimension but the last merged (a vector: one element a row)."""
    return math.prod(shape[:-1]) if len(shape) > 1 else shape[0]
