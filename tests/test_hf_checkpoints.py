"""Real models in and out of train.py: a Hugging Face directory (config.json + safetensors, one file or shards)
starts any layout with exactly its weights, each rank reading about its own share of the bytes; --export-format
hf writes a directory transformers' from_pretrained loads, with the course's logits; a directory train.py
cannot use is refused on every rank before any collective; a tokenizer.json beside the weights tokenizes --data.

Every checkpoint here is written by transformers' save_pretrained from a tiny config with random float64
weights: nothing is downloaded. Expected values come from transformers' own state dict through lab/hf.py's
to_course (not through the reader under test). Spawning ranks is the cost: one spawn of 4 ranks runs every
4-rank layout, export and refusal (the fixture `four`), and one of 8 ranks tp x pp x dp."""
import io
from contextlib import redirect_stdout
import json
import os
import re
import shutil
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from harness import refusals as refusal_errors, run_ranks
from lab import checkpoint
from lab.data import get_batch, load_corpus
from lab.hf import config_from_hf, to_course, to_hf
from lab.model import build_model, get_config, num_params
from lab.train_demo import reference_losses
import test_hf
from test_hf import float64_islands  # noqa: F401  (the fixture: transformers' float32 islands in float64)
from train import parse_args

EXACT = 1e-10
TOL64 = 1e-9
COMMON = ["--dtype", "float64", "--global-batch-size", "4", "--seq-len", "16", "--steps", "2", "--warmup", "1",
          "--quiet"]


def llama_config(vocab=256, tied=False):
    return test_hf.llama_config(tied, vocab)   # (test_hf's tiny shapes, this file's byte vocabulary)


def mixtral_config():
    return test_hf.mixtral_config(vocab=256)


CAUSAL_LM = dict(test_hf.CAUSAL_LM, gpt2=transformers.GPT2LMHeadModel)


def gpt2_config(vocab=256):
    return test_hf.gpt2_config(vocab=vocab)   # (256: a multiple of 128, no padded rows; 257: padded to 384)


def saved(path, config, seed=0, **save_kw):
    """A float64 Hugging Face model with random weights (norms not 1), written by save_pretrained to `path`;
    returns the course's state dict of the same weights (lab.hf.to_course of the model's own state dict)."""
    if config.model_type == "gpt2":
        model = test_hf.gpt2_model(config, seed)
    else:
        torch.manual_seed(seed)
        model = CAUSAL_LM[config.model_type](config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) / p.shape[-1] ** 0.5)
        model = model.to(torch.float64)
    model.save_pretrained(path, **save_kw)
    return {k: v.clone() for k, v in to_course(model.state_dict(), config_from_hf(config)).items()}


def as_on_the_hub(path):
    """Rewrite a saved GPT-2 as the hub's own checkpoint holds it: names without "transformer.", and each layer's
    causal-mask buffers (attn.bias, attn.masked_bias) beside the weights."""
    from safetensors.torch import load_file
    files = load_file(os.path.join(path, "model.safetensors"))
    hub = {k.removeprefix("transformer."): v for k, v in files.items()}
    for i in range(2):
        hub[f"h.{i}.attn.bias"] = torch.ones(64, 64, dtype=torch.float64).tril()[None, None]
        hub[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4, dtype=torch.float64)
    save_file(hub, os.path.join(path, "model.safetensors"))


def from_pretrained(path, kind):
    return CAUSAL_LM[kind].from_pretrained(path, dtype=torch.float64, **(
        {"experts_implementation": "eager"} if kind == "mixtral" else {}))


# ---- in: every layout starts from exactly the directory's weights --------------------------------------

class _Look:
    """train.train's observer: right after --init-from, each parameter this rank holds (gathered over its
    ZeRO group: the tp slice or experts it keeps whole) and the places of its pieces."""

    def begin(self, trainer, start):
        import fsdp
        self.held = fsdp.full_state_dict(trainer.opt)
        self.where = {n: trainer.where(n) for n in self.held}
        self.share = [p[4] - p[3] for _, _, p in checkpoint.places(trainer.opt, trainer.where)]

    def around(self, trainer, step):
        return nullcontext()

    def after(self, trainer, step, loss):
        pass


def _start_from(cases):
    """On each rank, for each (flags, expected course state dict): train.train, then this rank's largest
    difference from the expected values of every parameter it held right after --init-from, the bytes it read
    from the files and the elements of its share, and the losses. A case with --check runs through the runner
    (lab.train_demo.measured_train: its step lines and its comparison with one process) instead."""
    import train
    from lab.instruments import watch_calls
    from lab.train_demo import measured_train
    out = []
    for flags, expected in cases:
        if "--check" in flags:
            printed = io.StringIO()
            with redirect_stdout(printed):
                res = measured_train(parse_args(flags))
            out.append(dict(flags=flags, check_ok=res["check_ok"], printed=printed.getvalue(), losses=res["losses"]))
            continue
        look = _Look()
        with watch_calls(train.Trainer, "init_from", memory=False) as inits:
            res = train.train(parse_args(flags), observer=look)
        diff = 0.0
        for name, held in look.held.items():
            shape, narrow = look.where[name]
            want = expected[name] if narrow is None else expected[name].narrow(narrow[0], narrow[1],
                                                                               narrow[2] - narrow[1])
            assert tuple(expected[name].shape) == tuple(shape) and held.shape == want.shape, name
            diff = max(diff, (held - want).abs().max().item())
        out.append(dict(flags=flags, diff=diff, names=sorted(look.held), read=inits[0]["result"] if inits else None,
                        share=sum(look.share), losses=res["losses"]))
    return out


def _rank_work(layouts, exports, refusals, shard_bytes):
    """Rank function: everything one spawn of ranks checks."""
    checkpoint.SHARD_BYTES = shard_bytes  # (small: the export is sharded)
    return dict(layouts=_start_from(layouts), exports=_start_from(exports), refusals=refusal_errors(refusals))


# (flags, family) on 4 ranks: tp (4 > 2 kv heads: replicated), pp x ZeRO-3, ZeRO-3, cp x tp, tp x pp, tp x ZeRO-3
# read by rank 0, ep x ZeRO-3 and ep x tp; a tied checkpoint, a sharded one (13 files) and a stacked Mixtral; GPT-2
# (Conv1D weights read transposed, c_attn split, learned positions, the tied matrix on the first and last stage)
# on tp, pp x ZeRO-3 (as the hub holds it) and cp x tp with SP
LAYOUTS = [(["--tp", "4"], "gpt2"), (["--pp", "2", "--dp-shard", "2"], "gpt2-hub"),
           (["--cp", "2", "--tp", "2", "--sequence-parallel"], "gpt2"),
           (["--tp", "4"], "llama"),
           (["--pp", "2", "--dp-shard", "2"], "llama-sharded"),
           (["--dp-shard", "4"], "llama-tied"),
           (["--cp", "2", "--tp", "2"], "llama"),
           (["--pp", "2", "--tp", "2", "--sequence-parallel"], "llama-sharded"),
           (["--tp", "2", "--dp-shard", "2", "--init-read", "rank-0"], "llama"),
           (["--dp-shard", "4", "--ep", "4"], "mixtral"),
           (["--dp-shard", "2", "--tp", "2", "--ep", "2"], "mixtral-stacked")]
# tp x pp x dp needs 8 ranks (with experts: ep borrows the 2 data-parallel ranks)
LAYOUTS_8 = [(["--pp", "2", "--tp", "2", "--dp-shard", "2", "--ep", "2"], "mixtral")]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{family: (directory, expected course state dict)}."""
    root, out = tmp_path_factory.mktemp("hf"), {}
    for family, config, kw in (("llama", llama_config(), {}), ("llama-tied", llama_config(tied=True), {}),
                               ("llama-sharded", llama_config(), dict(max_shard_size="20KB")),
                               ("mixtral", mixtral_config(), {})):
        out[family] = (str(root / family), saved(root / family, config, **kw))
    # Mixtral stacked as the model holds it (gate_up_proj [E, 2F, H]), as another tool may save it
    stacked, config = root / "mixtral-stacked", mixtral_config()
    torch.manual_seed(1)
    model = transformers.MixtralForCausalLM(config).to(torch.float64)
    os.makedirs(stacked)
    config.save_pretrained(stacked)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(stacked / "model.safetensors"))
    out["mixtral-stacked"] = (str(stacked), to_course(model.state_dict(), config_from_hf(config)))
    for family in ("gpt2", "gpt2-hub"):
        out[family] = (str(root / family), saved(root / family, gpt2_config(), seed=2))
    as_on_the_hub(out["gpt2-hub"][0])
    return out


def test_the_reader_gives_transformers_weights_in_one_process(models):
    """checkpoint.whole_model (every course tensor read whole through the lazy reader) is to_course of the
    model's own state dict, on every kind of directory: tied, sharded, Mixtral per expert and stacked, GPT-2 as
    save_pretrained writes it and as the hub holds it (which transformers loads too)."""
    for family, (path, expected) in models.items():
        got = checkpoint.whole_model(path)
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got), family
        assert checkpoint.hf_problems(path) == [], family
    assert len([f for f in os.listdir(models["llama-sharded"][0]) if f.endswith(".safetensors")]) > 3
    x = torch.randint(256, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hub, saved_ = (from_pretrained(models[f][0], "gpt2")(x).logits for f in ("gpt2-hub", "gpt2"))
    assert torch.equal(hub, saved_)


def _case(models, flags, family):
    path, expected = models[family]
    return COMMON + flags + ["--init-from", path], expected


def _check_layouts(results, models, layouts, world):
    """Every rank holds exactly the directory's values; the losses are one process's from the same directory;
    each rank read about its share (every-rank), or rank 0 all the shares (rank-0)."""
    bytes_lines = []
    for i, (flags, family) in enumerate(layouts):
        per_rank = [r[i] for r in results]
        assert all(r["diff"] == 0.0 for r in per_rank), (flags, [r["diff"] for r in per_rank])
        held = set().union(*(r["names"] for r in per_rank))
        assert held == set(models[family][1]), (flags, sorted(set(models[family][1]) - held))
        want = reference_losses(parse_args(_case(models, flags, family)[0]))
        err = max(abs(a - b) for a, b in zip(per_rank[0]["losses"], want))
        assert err < TOL64, (flags, err)
        assert all(r["losses"] == per_rank[0]["losses"] for r in per_rank)
        read, share = [r["read"] for r in per_rank], [8 * r["share"] for r in per_rank]  # float64 files
        if "rank-0" in flags:
            assert sum(share) <= read[0] <= 1.2 * sum(share) and not any(read[1:]), (flags, read, share)
        else:  # each rank its own share, plus the rest of a first and last row of each piece
            assert all(s <= r <= 1.2 * s for r, s in zip(read, share)), (flags, read, share)
        bytes_lines.append(f"{' '.join(flags)} ({family}): bytes read per rank {read}, its share {share}")
    print("\n".join(bytes_lines))


def test_a_hf_directory_starts_every_layout_with_its_weights(models, four):
    _check_layouts([r["layouts"] for r in four["results"]], models, LAYOUTS, 4)


def test_a_hf_directory_starts_tp_x_pp_x_dp_on_8_ranks(models):
    layouts = [_case(models, f, fam) for f, fam in LAYOUTS_8]
    results = run_ranks(_rank_work, 8, layouts, [], [], checkpoint.SHARD_BYTES, timeout=600)
    _check_layouts([r["layouts"] for r in results], models, LAYOUTS_8, 8)



# ---- out: a directory transformers loads, with the course's logits; and a real tokenizer --------------------

def word_tokenizer(path, words):
    """A tiny word-level tokenizer (the tokenizers library) trained on `words`, saved as path/tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(words)], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(os.path.join(path, "tokenizer.json"))
    return tok


WORDS = ("shard gather reduce scatter rank tensor pipeline stage expert router token layer norm head "
         "embedding optimizer step loss gradient bucket ring chunk slice column row").split()
SHARDED = ["--dp-shard", "2", "--tp", "2"]


def text(n=3000, seed=0):
    g = torch.Generator().manual_seed(seed)
    return " ".join(WORDS[i] for i in torch.randint(len(WORDS), (n,), generator=g))


def _read_safetensors(path):
    out = {}
    for f in (f for f in os.listdir(path) if f.endswith(".safetensors")):
        with safe_open(os.path.join(path, f), framework="pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def _exports(models, root):
    """(cases, paths): trained 2 steps on ZeRO-3 x tp from the llama directory, exported plain and as a
    Hugging Face directory; a Mixtral on ZeRO-3 x ep; a model with a tokenizer.json (32 tokens) on --data,
    through the runner with --check."""
    tokdir = root / "with-tokenizer"
    expected_tok = saved(tokdir, llama_config(vocab=32))
    tok = word_tokenizer(tokdir, WORDS)
    (root / "words.txt").write_text(text())
    out = {k: str(root / k) for k in ("plain.pt", "llama", "mixtral", "tokenized", "gpt2.pt", "gpt2")}
    llama = ["--init-from", models["llama"][0]]
    odd = root / "gpt2-odd"   # GPT-2's odd vocabulary: 257 rows, padded to 384 in the course, 257 again on export
    expected_odd = saved(odd, gpt2_config(vocab=257), seed=4)
    gpt2 = COMMON + SHARDED + ["--init-from", str(odd)]
    cases = [(COMMON + SHARDED + llama + ["--export", out["plain.pt"]], models["llama"][1]),
             (COMMON + SHARDED + llama + ["--export", out["llama"], "--export-format", "hf"], models["llama"][1]),
             (COMMON + ["--dp-shard", "4", "--ep", "2", "--init-from", models["mixtral"][0], "--export",
                        out["mixtral"], "--export-format", "hf"], models["mixtral"][1]),
             ([f for f in COMMON if f != "--quiet"] + ["--dp-shard", "4", "--init-from", str(tokdir), "--data",
                                                       str(root / "words.txt"), "--export", out["tokenized"],
                                                       "--export-format", "hf", "--check"], expected_tok),
             (gpt2 + ["--export", out["gpt2.pt"]], expected_odd),
             (gpt2 + ["--export", out["gpt2"], "--export-format", "hf"], expected_odd)]
    return cases, dict(out, tokenizer=tok, words=str(root / "words.txt"), expected_tok=expected_tok)


def _refusal_cases(models, root):
    """{name: (flags, the message's words)}: directories train.py cannot use, each wrong in one way."""
    llama, expected = models["llama"]
    hf_state = to_hf(expected, config_from_hf(llama_config()))
    cases = {}

    def case(name, message, *flags, config=None, tensors=None, copy=None):
        d = root / name
        if copy:
            shutil.copytree(copy, d)
        else:
            os.makedirs(d)
        if config is not None:
            config.save_pretrained(d)
        if tensors is not None:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"))
        cases[name] = (["--dp-shard", "4", "--init-from", str(d), *flags], message)
        return d

    case("no-config", "holds no config.json", tensors=hf_state)
    case("bloom", "not 'bloom'", config=transformers.BloomConfig(hidden_size=32, n_layer=2, n_head=4))
    case("gpt2-scaled", "scale_attn_by_inverse_layer_idx", config=transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, scale_attn_by_inverse_layer_idx=True))
    case("qwen2", "biases", config=transformers.Qwen2Config(hidden_size=32, num_attention_heads=4,
                                                             num_key_value_heads=2))
    llama32 = llama_config()
    llama32.rope_parameters = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    case("llama3-rope", "rope_parameters", config=llama32)
    case("no-weights", "holds neither model.safetensors", config=llama_config())
    case("missing-tensor", "lacks 1 of the tensors", config=llama_config(),
         tensors={k: v for k, v in hf_state.items() if k != "model.layers.1.mlp.up_proj.weight"})
    narrow = llama_config()
    narrow.intermediate_size = 48
    case("other-shape", "do not have the shape config.json gives", config=narrow, tensors=hf_state)
    case("extra-tensor", "has no place for", config=llama_config(), tensors=dict(hf_state, bias=torch.zeros(3)))
    gone = case("missing-shard", "files that are not there", copy=models["llama-sharded"][0])
    os.remove(gone / sorted(f for f in os.listdir(gone) if f.endswith(".safetensors"))[2])
    word_tokenizer(case("tokenizer-too-big", "would not fit the embedding", copy=llama),
                   WORDS + [f"w{i}" for i in range(300)])
    word_tokenizer(case("few-tokens", "holds 6 tokens of tokenizer.json", "--data", str(root / "six.txt"),
                        copy=llama), WORDS)
    (root / "six.txt").write_text("shard gather reduce scatter rank tensor")  # 39 bytes, 6 words
    cases["layers"] = (["--dp-shard", "4", "--init-from", llama, "--layers", "1"], "--layers: --init-from")
    cases["export-over"] = (["--dp-shard", "4", "--init-from", llama, "--export", llama, "--export-format", "hf"],
                            "an export never writes over a directory")
    return cases


@pytest.fixture(scope="module")
def four(models, tmp_path_factory):
    """One spawn of 4 ranks: every 4-rank layout, the exports, the refusals."""
    root = tmp_path_factory.mktemp("four")
    exports, paths = _exports(models, root)
    refusals = _refusal_cases(models, root)
    layouts = [_case(models, f, fam) for f, fam in LAYOUTS]
    results = run_ranks(_rank_work, 4, layouts, exports, [COMMON + f for f, _ in refusals.values()], 20_000,
                        timeout=600)
    return dict(results=results, exports=exports, paths=paths, refusals=refusals, root=root)


def test_export_after_training_on_a_sharded_layout_loads_in_transformers(four, models, float64_islands):
    """Trained 2 steps on ZeRO-3 x tp (and a Mixtral on ZeRO-3 x ep), --export-format hf writes shards (a small
    SHARD_BYTES) that from_pretrained loads, holding exactly the trained weights (the same run's plain export)
    and giving the course model's logits to 1e-10."""
    float64_islands()
    res, out = [r["exports"] for r in four["results"]], four["paths"]
    for i, (flags, _) in enumerate(four["exports"][:3]):
        assert all(r[i]["diff"] == 0.0 for r in res), flags
        want = reference_losses(parse_args(flags))
        for rank, r in enumerate(res):   # every rank reports the global losses
            assert max(abs(a - b) for a, b in zip(r[i]["losses"], want)) < TOL64, (rank, flags)
    assert all(r[0]["losses"] == r[1]["losses"] for r in res)

    x = torch.randint(256, (2, 16), generator=torch.Generator().manual_seed(3))
    trained = torch.load(out["plain.pt"], weights_only=True)
    files = os.listdir(out["llama"])
    shards = [f for f in files if f.endswith(".safetensors")]
    assert "config.json" in files and "model.safetensors.index.json" in files and len(shards) > 3, files
    index = json.load(open(os.path.join(out["llama"], "model.safetensors.index.json")))
    assert set(index["weight_map"].values()) == set(shards)
    cfg = config_from_hf(transformers.AutoConfig.from_pretrained(out["llama"]))
    on_disk = _read_safetensors(out["llama"])
    assert on_disk.keys() == to_hf(trained, cfg).keys()
    assert all(torch.equal(on_disk[k], v) for k, v in to_hf(trained, cfg).items())  # the trained weights, exactly
    course = build_model(cfg, dtype=torch.float64)
    course.load_state_dict(trained, strict=True)
    with torch.no_grad():
        diff = (from_pretrained(out["llama"], "llama")(x).logits - course(x)).abs().max().item()
    assert diff < EXACT, diff
    assert not any(p.endswith(".partial") for p in os.listdir(four["root"]))

    moe = build_model(config_from_hf(transformers.AutoConfig.from_pretrained(out["mixtral"])), dtype=torch.float64)
    moe.load_state_dict(checkpoint.whole_model(out["mixtral"]), strict=True)
    assert not torch.equal(moe.layers[0].mlp.w1, models["mixtral"][1]["layers.0.mlp.w1"])  # trained
    with torch.no_grad():
        diff = (from_pretrained(out["mixtral"], "mixtral")(x).logits - moe(x)).abs().max().item()
    assert diff < EXACT, diff


def test_gpt2_fine_tuned_on_a_sharded_layout_exports_to_transformers(four):
    """GPT-2 with GPT-2's odd vocabulary (257 rows, padded to 384 so tp splits them): trained 2 steps on ZeRO-3 x tp
    from its directory (every rank starting from exactly its values; the one-process losses), exported plain and as
    a Hugging Face directory: that holds exactly the trained weights, tied (no lm_head.weight on disk), the padded
    rows left out, and from_pretrained gives the course model's logits to 1e-10."""
    res, out = [r["exports"] for r in four["results"]], four["paths"]
    for i in (4, 5):
        flags = four["exports"][i][0]
        assert all(r[i]["diff"] == 0.0 for r in res), flags
        want = reference_losses(parse_args(flags))
        assert all(max(abs(a - b) for a, b in zip(r[i]["losses"], want)) < TOL64 for r in res), flags
    trained = torch.load(out["gpt2.pt"], weights_only=True)
    cfg = config_from_hf(transformers.AutoConfig.from_pretrained(out["gpt2"]))
    assert cfg.tie_embeddings and trained["tok_embeddings.weight"].shape == (cfg.padded_vocab, 32) == (384, 32)
    on_disk, want = _read_safetensors(out["gpt2"]), to_hf(trained, cfg)
    del want["lm_head.weight"]   # (tied: save_pretrained writes the matrix once)
    assert on_disk.keys() == want.keys() and on_disk["transformer.wte.weight"].shape == (257, 32)
    assert all(torch.equal(on_disk[k], v) for k, v in want.items())   # the trained weights, exactly
    course = build_model(cfg, dtype=torch.float64)
    course.load_state_dict(trained, strict=True)
    x = torch.randint(257, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (from_pretrained(out["gpt2"], "gpt2")(x).logits - course(x)).abs().max().item()
    assert diff < EXACT, diff


def test_a_model_directory_tokenizer_tokenizes_the_data(four):
    """tokenizer.json beside the weights: --data becomes word ids (a byte would not fit the 32-token embedding);
    the step lines and --check work as before; the first loss, recomputed here from the tokenizer's ids; the
    tokenizer goes along with the export."""
    res, out = [r["exports"][3] for r in four["results"]], four["paths"]
    assert all(r["check_ok"] for r in res)
    printed = res[0]["printed"]
    assert re.search(r"step +2 +loss", printed) and "losses vs the single-process run" in printed, printed
    tok = out["tokenizer"]
    ids = load_corpus(out["words"], tokenizer=tok)
    assert len(ids) == 3000 and int(ids.max()) < 32 and torch.equal(ids, torch.tensor(tok.encode(text()).ids))
    model = build_model(config_from_hf(llama_config(vocab=32)), dtype=torch.float64)
    model.load_state_dict(out["expected_tok"])
    x, y = get_batch(ids, 0, 4, 16)
    with torch.no_grad():
        first = F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    assert all(abs(r["losses"][0] - first) < TOL64 for r in res), [r["losses"][0] for r in res]
    assert os.path.isfile(os.path.join(out["tokenized"], "tokenizer.json"))


# ---- refusals: one clear error on every rank, before any collective -----------------------------------------

def test_a_directory_train_py_cannot_use_is_refused_on_every_rank(four):
    for rank in four["results"]:
        for (name, (_, message)), (err, calls) in zip(four["refusals"].items(), rank["refusals"]):
            assert err is not None and message in err and calls == 0, (name, message, err, calls)
            assert err.count("\n  - ") == 1, (name, err)  # one problem, one line


# ---- named real models ------------------------------------------------------------------------------------

def test_named_real_models_have_their_published_sizes():
    """SmolLM2-135M and Llama-3.2-1B: with the embedding counted once (they tie it to the head; the course holds
    two), their published parameter counts."""
    for name, published in (("smollm2-135m", 134_515_008), ("llama3.2-1b", 1_235_814_400)):
        cfg = get_config(name)
        assert num_params(cfg) - cfg.vocab_size * cfg.dim == published, name
    from train import check_args
    check_args(parse_args(["--model", "smollm2-135m", "--dp-shard", "8", "--plan"]), 8)
