"""EAGLE-3 heads in every public layout (SpecForge, the EAGLE reference, speculators) load as
their trainer meant them: taps, vocabulary map, weights, and greedy output equal to no
speculation. A saved head maps every tensor under sglang's, vLLM's, the EAGLE reference
runtime's and speculators' published loading rules, re-implemented here from those rules."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine import Engine, SamplingParams
from engine.attention import TorchAttention
from engine.config import RopeConfig, SpecConfig
from engine.spec.eagle3 import Eagle3Config, Eagle3Head, default_taps
from engine.spec.head_io import TAPS, config_from_hf, load_head, resolve_taps, save_head
from engine.testing import random_head, tiny_engine

LAYERS = 8  # default taps (2, 4, 5): distinct
TRAINED_TAPS = (1, 4, 6)  # a head trained on other taps than the default
PROMPTS = [[(5 * i + j) % 40 for j in range(4 + 3 * i)] * 2 for i in range(4)]
GREEDY = SamplingParams(temperature=0, max_tokens=16)


def backend(cfg: Eagle3Config) -> TorchAttention:
    return TorchAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 4)


@pytest.fixture(scope="module")
def base() -> Engine:
    return tiny_engine(0, num_layers=LAYERS, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def plain(base) -> list[list[int]]:
    return [c.token_ids for c in base.generate(PROMPTS, GREEDY)]


def source_head(base: Engine, full_vocab: bool, taps=TRAINED_TAPS) -> Eagle3Head:
    """A random head on `taps`; full_vocab: it drafts every target token with the target's
    own LM head (the head sglang runs when the checkpoint has none)."""
    m = base.config.model
    head = random_head(base, draft_vocab=m.vocab_size if full_vocab else 128)
    head.cfg = replace(head.cfg, aux_layer_ids=tuple(taps))
    if full_vocab:
        head.set_vocab(torch.arange(m.vocab_size))
        head.lm_head.weight = base.model.lm_head.weight
    return head


def flat_config(head: Eagle3Head, taps: str) -> dict:
    """A flat Llama config as EAGLE's and SpecForge's trainers write it; taps as the given
    convention writes them: "nested" (SpecForge, sglang: output of layer i), "top" (vLLM:
    input of layer i), "both", or "none" (the default)."""
    c, ids = head.cfg, list(head.cfg.aux_layer_ids)
    d = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
         "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
         "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
         "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps,
         "max_position_embeddings": 2048, "vocab_size": c.vocab_size,
         "draft_vocab_size": c.draft_vocab_size, "tie_word_embeddings": False,
         "target_hidden_size": c.hidden_size}
    if taps in ("nested", "both"):
        d["eagle_config"] = {TAPS: [i - 1 for i in ids], "use_aux_hidden_state": True}
    if taps in ("top", "both"):
        d[TAPS] = ids
    return d


def speculators_config(head: Eagle3Head, taps: str) -> dict:
    """speculators' Eagle3SpeculatorConfig: the layer's config stored as a diff against
    LlamaConfig's defaults (so rope_theta 10000 and rms_norm_eps 1e-6 are left out), taps at
    the top level in vLLM's convention."""
    layer = {k: v for k, v in flat_config(head, "none").items()
             if k in ("model_type", "hidden_size", "intermediate_size", "num_attention_heads",
                      "num_key_value_heads", "num_hidden_layers", "vocab_size")}
    d = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
         "transformer_layer_config": layer, "draft_vocab_size": head.cfg.draft_vocab_size,
         "norm_before_residual": head.cfg.norm_before_residual, "target_hidden_size": None,
         "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "t"}}}
    if taps == "top":
        d[TAPS] = list(head.cfg.aux_layer_ids)
    return d


def write(folder, base: Engine, head: Eagle3Head, layout: str, taps: str, t2d: bool,
          lm_head: bool) -> None:
    """The head as `layout`'s trainer stores it: SpecForge (safetensors, `midlayer.*`, a copy
    of the target's embedding), the EAGLE reference (pytorch_model.bin) or speculators
    (`layers.0.*`, the target's embedding and LM head copied in)."""
    sd = {k: v.detach().clone().contiguous() for k, v in head.state_dict().items()}
    for name, keep in (("t2d", t2d), ("lm_head.weight", lm_head), ("d2t", lm_head)):
        if not keep:  # a full-vocabulary head without lm_head also leaves the identity d2t out
            sd.pop(name)
    embed = base.model.embed_tokens.weight.detach().clone()
    if layout == "speculators":
        sd = {k.replace("midlayer.", "layers.0."): v for k, v in sd.items()}
        sd |= {"embed_tokens.weight": embed,
               "verifier_lm_head.weight": base.model.lm_head.weight.detach().clone()}
        cfg = speculators_config(head, taps)
    else:
        cfg = flat_config(head, taps)
    if layout == "specforge":
        save_file(sd | {"embed_tokens.weight": embed}, os.path.join(folder, "model.safetensors"))
    if layout == "eagle":
        torch.save(sd, os.path.join(folder, "pytorch_model.bin"))
    if layout == "speculators":
        save_file(sd, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)


CASES = [  # layout, taps written, t2d kept, lm_head kept
    ("specforge", "nested", True, True), ("specforge", "nested", False, True),
    ("specforge", "both", True, False), ("eagle", "none", True, True),
    ("eagle", "top", False, False), ("speculators", "top", True, True),
    ("speculators", "top", False, False), ("speculators", "none", True, True)]


@pytest.mark.parametrize("layout,taps,t2d,lm_head", CASES)
def test_each_layout_loads_as_its_trainer_meant(tmp_path, base, plain, caplog, layout, taps,
                                                t2d, lm_head):
    m = base.config.model
    src = source_head(base, full_vocab=not lm_head,
                      taps=default_taps(LAYERS) if taps == "none" else TRAINED_TAPS)
    write(str(tmp_path), base, src, layout, taps, t2d, lm_head)
    with caplog.at_level(logging.INFO, logger="engine.spec.head_io"):
        head = load_head(str(tmp_path), m, backend, target_model=base.model)
    assert head.cfg.aux_layer_ids == src.cfg.aux_layer_ids
    assert f"taps {list(src.cfg.aux_layer_ids)}" in caplog.text
    assert torch.equal(head.draft_to_target, src.draft_to_target)
    assert torch.equal(head.t2d, src.t2d)
    want = src.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in head.state_dict().items())
    if not lm_head:
        assert head.lm_head.weight is base.model.lm_head.weight
    eng = Engine(replace(base.config, spec=SpecConfig(method="eagle3", num_tokens=3,
                                                      dynamic=False)),
                 weights_of=base, draft_head=head)
    assert [c.token_ids for c in eng.generate(PROMPTS, GREEDY)] == plain
    assert eng.spec.stats.verify_steps > 0


@pytest.mark.parametrize("config,meant", [
    ({"eagle_config": {TAPS: [0, 3, 6]}}, (1, 4, 7)),  # sglang/SpecForge: output of layer i
    ({TAPS: [1, 4, 7]}, (1, 4, 7)),  # vLLM/speculators: input of layer i
    ({TAPS: [1, 4, 7], "eagle_config": {TAPS: [0, 3, 6]}}, (1, 4, 7)),  # both, agreeing
    ({TAPS: [6, 1, 4]}, (1, 4, 6)),  # runtimes concatenate in layer order
    ({}, (2, 4, 5)), ({TAPS: [], "eagle_config": {}}, (2, 4, 5)),  # the default
])
def test_taps_follow_each_convention(config, meant):
    assert resolve_taps(config, LAYERS)[0] == meant


@pytest.mark.parametrize("config,match", [
    ({TAPS: [1, 4, 7], "eagle_config": {TAPS: [1, 4, 7]}}, r"disagree.*eagle_config\."),
    ({TAPS: [1, 4, 8]}, r"eagle_aux_hidden_state_layer_ids = \[1, 4, 8\].*8 layers"),
    ({"eagle_config": {TAPS: [4, 12, 7]}}, r"eagle_config\.eagle_aux.*\[5, 8, 13\].*8 layers"),
    ({TAPS: [1, 4]}, r"\[1, 4\].*three hidden states"),
    ({TAPS: ["1", 4, 7]}, r"eagle_aux_hidden_state_layer_ids must be a list of layer numbers"),
])
def test_taps_out_of_range_or_contradicting_are_refused(config, match):
    with pytest.raises(ValueError, match=match):
        resolve_taps(config, LAYERS)


def test_what_cannot_run_is_refused_naming_it(tmp_path, base):
    m, src = base.config.model, source_head(base, full_vocab=False)

    def refused(layout, match, t2d=True, lm_head=True, drop=(), extra=None, target_model=None,
                taps="top"):
        write(str(tmp_path), base, src, layout, taps, t2d, lm_head)
        path = tmp_path / "model.safetensors"
        if drop or extra:
            sd = {k: v for k, v in load_file(str(path)).items() if k not in drop}
            save_file(sd | (extra or {}), str(path))
        with pytest.raises(ValueError, match=match):
            load_head(str(tmp_path), m, backend, target_model=target_model)

    refused("specforge", r"\(EAGLE layout\): missing tensor d2t", drop=("d2t",))
    refused("speculators", r"\(speculators layout\): missing tensor d2t", drop=("d2t",))
    refused("specforge", r"\(EAGLE layout\): missing tensor lm_head\.weight.*128 of 256",
            drop=("lm_head.weight",), target_model=base.model)
    refused("speculators", r"\(speculators layout\).*missing tensors "
            r"\['layers\.0\.mlp\.down_proj\.weight'\].*Expected: fc\.weight",
            drop=("layers.0.mlp.down_proj.weight",))
    refused("speculators", r"wrong shapes \['layers\.0\.hidden_norm\.weight \(3,\)",
            extra={"layers.0.hidden_norm.weight": torch.ones(3)})
    refused("specforge", r"missing tensors \['fc\.weight'\].*Expected: fc\.weight",
            drop=("fc.weight",))
    refused("speculators", r"layers\.1\.mlp\.down_proj\.weight.*one decoder layer runs",
            extra={"layers.1.mlp.down_proj.weight": torch.zeros(64, 128)})
    full = source_head(base, full_vocab=True)
    write(str(tmp_path), base, full, "specforge", "top", True, False)
    with pytest.raises(ValueError, match=r"missing tensor lm_head\.weight.*target model"):
        load_head(str(tmp_path), m, backend)


def test_saved_folder_names_target_and_taps(tmp_path, base):
    m = replace(base.config.model, name="tiny-llama")
    head = source_head(base, full_vocab=False)
    save_head(head, str(tmp_path), dtype=torch.float32, target=m)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    readme = (tmp_path / "README.md").read_text()
    assert "tiny-llama" in readme and "[1, 4, 6]" in readme and "[0, 3, 5]" in readme
    assert "(2, L//2, L-3)" in readme  # the reference runtime taps other layers than these
    assert "converter reads neither the taps" in readme  # speculators takes them as arguments
    assert "eagle_aux_hidden_state_layer_ids [1, 4, 6]" in readme
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert "target_hidden_size" not in cfg  # else the reference runtime skips the embedding
    (tmp_path / "README.md").write_text("kept\n")
    save_head(head, str(tmp_path), dtype=torch.float32, target=m)
    assert (tmp_path / "README.md").read_text() == "kept\n"


def reference_accepts(cfg: dict) -> None:
    """The EAGLE reference runtime's config class: rope_scaling is None or exactly
    {"type": "linear" | "dynamic", "factor": a float above 1}; draft_vocab_size is read."""
    rs = cfg.get("rope_scaling")
    assert rs is None or (len(rs) == 2 and rs.get("type") in ("linear", "dynamic")
                          and isinstance(rs.get("factor"), float) and rs["factor"] > 1)
    assert isinstance(cfg["draft_vocab_size"], int)


@pytest.mark.parametrize("rope", [
    RopeConfig(theta=500000.0, type="llama3", factor=8.0, original_max_position=8192),
    RopeConfig(theta=10000.0, type="linear", factor=2.0), RopeConfig(theta=100000.0)])
def test_rope_is_written_in_a_form_every_reader_takes(tmp_path, base, rope):
    m = replace(base.config.model, rope=rope)
    head = source_head(base, full_vocab=False)
    head.cfg = replace(head.cfg, rope=rope)
    save_head(head, str(tmp_path), dtype=torch.float32, target=m)
    cfg = json.loads((tmp_path / "config.json").read_text())
    reference_accepts(cfg)
    assert config_from_hf(cfg, m)[0] == head.cfg
    if rope.type == "llama3":
        assert cfg["rope_parameters"]["rope_type"] == "llama3" and cfg["rope_scaling"] is None


def runtime_params(cfg: dict, sd: dict, d2t_name: str) -> dict[str, torch.Tensor]:
    """What sglang's and vLLM's EAGLE-3 Llama loaders (alike here) fill from a head file: t2d
    skipped, d2t kept under `d2t_name`, `midlayer.` read as `layers.0.`, every name but the
    LM head's under `model.`, q/k/v and gate/up stacked into one projection each."""
    stacks = {".qkv_proj": (".q_proj", ".k_proj", ".v_proj"),
              ".gate_up_proj": (".gate_proj", ".up_proj")}
    parts, out = {}, {}
    for name, w in sd.items():
        if name == "t2d":
            continue
        if name == "d2t":
            out[d2t_name] = w
            continue
        name = name.replace("midlayer.", "layers.0.")
        name = name if name.startswith("lm_head") else "model." + name
        for fused, shards in stacks.items():
            hit = [s for s in shards if s in name]
            if hit:
                parts.setdefault(name.replace(hit[0], fused), {})[shards.index(hit[0])] = w
                break
        else:
            out[name] = w
    out |= {k: torch.cat([p[i] for i in sorted(p)]) for k, p in parts.items()}
    h, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, inter = cfg.get("head_dim") or h // nh, cfg["intermediate_size"]
    lm = "model.layers.0."
    want = {"model.fc.weight": (h, 3 * cfg.get("target_hidden_size", h)),
            lm + "self_attn.qkv_proj.weight": ((nh + 2 * nkv) * hd, 2 * h),
            lm + "self_attn.o_proj.weight": (h, nh * hd),
            lm + "mlp.gate_up_proj.weight": (2 * inter, h), lm + "mlp.down_proj.weight": (h, inter),
            lm + "input_layernorm.weight": (h,), lm + "hidden_norm.weight": (h,),
            lm + "post_attention_layernorm.weight": (h,), "model.norm.weight": (h,),
            "lm_head.weight": (cfg["draft_vocab_size"], h), d2t_name: (cfg["draft_vocab_size"],)}
    assert {k: tuple(v.shape) for k, v in out.items()} == want  # every tensor, every parameter
    assert not cfg["tie_word_embeddings"]  # else the LM head is the (target's) embedding
    return out


def reference_params(folder: str, cfg: dict) -> dict[str, torch.Tensor]:
    """The EAGLE reference runtime: pytorch_model.bin, else model.safetensors, loaded without
    strictness into its Model's tensors; the embedding comes from the target only where the
    config has no target_hidden_size; d2t/t2d are dropped when the vocabularies match."""
    bin_path = os.path.join(folder, "pytorch_model.bin")
    sd = torch.load(bin_path) if os.path.exists(bin_path) else \
        load_file(os.path.join(folder, "model.safetensors"))
    h, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, inter = cfg.get("head_dim") or h // nh, cfg["intermediate_size"]
    vocab, draft = cfg["vocab_size"], cfg["draft_vocab_size"]
    want = {"embed_tokens.weight": (vocab, h), "lm_head.weight": (draft, h),
            "fc.weight": (h, 3 * cfg.get("target_hidden_size", h)), "norm.weight": (h,),
            "midlayer.self_attn.q_proj.weight": (nh * hd, 2 * h),
            "midlayer.self_attn.k_proj.weight": (nkv * hd, 2 * h),
            "midlayer.self_attn.v_proj.weight": (nkv * hd, 2 * h),
            "midlayer.self_attn.o_proj.weight": (h, nh * hd),
            "midlayer.mlp.gate_proj.weight": (inter, h), "midlayer.mlp.up_proj.weight": (inter, h),
            "midlayer.mlp.down_proj.weight": (h, inter), "midlayer.hidden_norm.weight": (h,),
            "midlayer.input_layernorm.weight": (h,),
            "midlayer.post_attention_layernorm.weight": (h,), "d2t": (draft,), "t2d": (vocab,)}
    if vocab == draft:
        del want["d2t"], want["t2d"]
    from_target = {"embed_tokens.weight"} if "target_hidden_size" not in cfg else set()
    assert {k: tuple(v.shape) for k, v in sd.items() if k in want} == \
        {k: v for k, v in want.items() if k not in from_target}
    assert set(sd) - set(want) <= {"d2t", "t2d"}  # left over only where deleted above
    return sd


def test_saved_head_maps_every_tensor_in_each_runtime(tmp_path, base):
    src = source_head(base, full_vocab=False)
    save_head(src, str(tmp_path), dtype=torch.float32, target=base.config.model)
    cfg = json.loads((tmp_path / "config.json").read_text())
    sd = load_file(str(tmp_path / "model.safetensors"))
    ours = src.state_dict()
    qkv = torch.cat([ours[f"midlayer.self_attn.{p}_proj.weight"] for p in "qkv"])

    sglang = runtime_params(cfg, sd, "hot_token_id")
    assert [i + 1 for i in cfg["eagle_config"][TAPS]] == list(src.cfg.aux_layer_ids)
    assert torch.equal(sglang["hot_token_id"] + torch.arange(128), src.draft_to_target)
    assert torch.equal(sglang["model.layers.0.self_attn.qkv_proj.weight"], qkv)

    vllm = runtime_params(cfg, sd, "draft_id_to_target_id")
    assert cfg[TAPS] == list(src.cfg.aux_layer_ids)
    assert torch.equal(vllm["draft_id_to_target_id"] + torch.arange(128), src.draft_to_target)
    assert torch.equal(vllm["lm_head.weight"], ours["lm_head.weight"])

    reference_accepts(cfg)
    ref = reference_params(str(tmp_path), cfg)
    assert all(torch.equal(ref[k], v) for k, v in ours.items())


def test_the_engine_loads_a_head_folder_without_lm_head(tmp_path, base, plain):
    """Named by `SpecConfig.head` (as a served deployment names it), a full-vocabulary head
    without `lm_head` drafts with the target's LM head."""
    src = source_head(base, full_vocab=True, taps=TRAINED_TAPS)
    write(str(tmp_path), base, src, "specforge", "nested", True, False)
    eng = Engine(replace(base.config, spec=SpecConfig(method="eagle3", num_tokens=3,
                                                      dynamic=False, head=str(tmp_path))),
                 weights_of=base)
    assert eng.spec.head.lm_head.weight is eng.model.lm_head.weight
    assert [c.token_ids for c in eng.generate(PROMPTS, GREEDY)] == plain


def test_model_prefixed_names_load(tmp_path, base):
    """Tensors saved under `model.` (a whole-model state dict's names) load as the bare ones."""
    src = source_head(base, full_vocab=False)
    write(str(tmp_path), base, src, "specforge", "top", True, True)
    path = str(tmp_path / "model.safetensors")
    save_file({"model." + k: v for k, v in load_file(path).items()}, path)
    head = load_head(str(tmp_path), base.config.model, backend)
    assert torch.equal(head.draft_to_target, src.draft_to_target)
    want = src.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in head.state_dict().items())


SPECULATORS_KEPT = ("d2t", "t2d", "embed_tokens.", "fc.", "lm_head.", "norm.", "layers.0.")


def speculators_convert(folder: str, embed: torch.Tensor, taps: list[int],
                        norm_before_residual: bool) -> tuple[dict, dict[str, torch.Tensor]]:
    """speculators' converter for an EAGLE-3 research checkpoint, from its published rules:
    names lose `model.`, `midlayer.` becomes `layers.0.`, and only d2t, t2d, embed_tokens, fc,
    lm_head and norm are otherwise kept (any other name fails its format check); the target
    vocabulary is t2d's length (128000 without it); the layer takes hidden_size,
    intermediate_size, the head counts (8 KV heads if unsaid), rms_norm_eps and rope_theta,
    its head_dim being hidden_size / heads; draft_vocab_size and target_hidden_size are read;
    the taps and norm_before_residual are the converter's arguments; a missing embedding is
    the verifier's. Checks every tensor against Eagle3DraftModel's, whose embedding, verifier
    copies, d2t and t2d may be missing at load (d2t and t2d exist only for a reduced
    vocabulary, t2d marking exactly draft_vocab_size ids)."""
    cfg = json.loads(open(os.path.join(folder, "config.json")).read())
    sd = {}
    for name, w in load_file(os.path.join(folder, "model.safetensors")).items():
        name = name.removeprefix("model.")
        name = "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") \
            else name
        assert name.startswith(SPECULATORS_KEPT), f"speculators cannot convert {name}"
        sd[name] = w
    sd.setdefault("embed_tokens.weight", embed)
    h, nh = cfg.get("hidden_size", 4096), cfg.get("num_attention_heads", 32)
    layer = {"model_type": "llama", "vocab_size": sd["t2d"].shape[0] if "t2d" in sd else 128000,
             "hidden_size": h, "intermediate_size": cfg.get("intermediate_size", 11008),
             "num_hidden_layers": 1, "num_attention_heads": nh,
             "num_key_value_heads": cfg.get("num_key_value_heads", 8),
             "max_position_embeddings": cfg.get("max_position_embeddings", 4096),
             "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
             "rope_theta": cfg.get("rope_theta", 10000.0)}
    out = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
           "transformer_layer_config": layer,
           "draft_vocab_size": cfg.get("draft_vocab_size", 32000),
           "target_hidden_size": cfg.get("target_hidden_size"),
           "norm_before_residual": norm_before_residual, TAPS: taps}
    vocab, draft, inter = layer["vocab_size"], out["draft_vocab_size"], layer["intermediate_size"]
    hd, nkv, lp = h // nh, layer["num_key_value_heads"], "layers.0."
    want = {"embed_tokens.weight": (vocab, h), "fc.weight": (h, 3 * h), "norm.weight": (h,),
            "lm_head.weight": (draft, h), lp + "self_attn.q_proj.weight": (nh * hd, 2 * h),
            lp + "self_attn.k_proj.weight": (nkv * hd, 2 * h),
            lp + "self_attn.v_proj.weight": (nkv * hd, 2 * h),
            lp + "self_attn.o_proj.weight": (h, nh * hd), lp + "mlp.gate_proj.weight": (inter, h),
            lp + "mlp.up_proj.weight": (inter, h), lp + "mlp.down_proj.weight": (h, inter),
            lp + "input_layernorm.weight": (h,), lp + "hidden_norm.weight": (h,),
            lp + "post_attention_layernorm.weight": (h,)}
    if draft != vocab:
        want |= {"d2t": (draft,), "t2d": (vocab,)}
        assert int(sd["t2d"].sum()) == draft
    assert {k: tuple(v.shape) for k, v in sd.items()} == want  # every tensor, every parameter
    return out, sd


def test_saved_head_maps_every_tensor_under_speculators(tmp_path, base):
    """A saved head converted by speculators' rules (taps and norm_before_residual passed as
    the README says) maps every tensor, and the converted folder loads back as the same head."""
    src = source_head(base, full_vocab=False)
    src.cfg = replace(src.cfg, norm_before_residual=True)
    save_head(src, str(tmp_path / "saved"), dtype=torch.float32, target=base.config.model)
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    embed = base.model.embed_tokens.weight.detach().clone()
    cfg, sd = speculators_convert(str(tmp_path / "saved"), embed, saved[TAPS],
                                  saved["norm_before_residual"])
    ours = src.state_dict()
    assert all(torch.equal(sd[k.replace("midlayer.", "layers.0.")], v) for k, v in ours.items())
    (tmp_path / "conv").mkdir()
    save_file(sd, str(tmp_path / "conv" / "model.safetensors"))
    (tmp_path / "conv" / "config.json").write_text(json.dumps(cfg))
    head = load_head(str(tmp_path / "conv"), base.config.model, backend)
    assert head.cfg == src.cfg
    assert all(torch.equal(v, ours[k]) for k, v in head.state_dict().items())
