"""EAGLE-3 head folders: read the public layouts as their trainers meant them, write one every
runtime loads.

Read (`config.json` + `*.safetensors` or `pytorch_model*.bin`):
- EAGLE: a flat Llama config with `draft_vocab_size`; tensors `fc`, `midlayer.*`, `norm`,
  `lm_head`, `d2t`, `t2d`, with or without a `model.` prefix.
- speculators: `speculators_model_type: "eagle3"`, the layer's shape in
  `transformer_layer_config` (a diff against LlamaConfig's defaults), tensors under `layers.0.*`.

Tap i is the hidden state entering target layer i (0: the embeddings).
"""

from __future__ import annotations

import glob
import json
import logging
import os
from dataclasses import replace
from types import SimpleNamespace

import torch
from torch import nn

from engine.config import ModelConfig, RopeConfig, _rope_from_hf
from engine.spec.eagle3 import Eagle3Config, Eagle3Head, default_taps

log = logging.getLogger(__name__)

TAPS = "eagle_aux_hidden_state_layer_ids"
NESTED_TAPS = f"eagle_config.{TAPS}"
# What LlamaConfig assumes for a key a config leaves out (speculators drops these on save).
LLAMA_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                  "num_attention_heads": 32, "max_position_embeddings": 2048,
                  "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu"}
# Copies of the target's own tensors some trainers store beside the head: the target's are used.
TARGET_COPIES = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
EXPECTED = ("fc.weight, midlayer.* (speculators: layers.0.*), norm.weight, lm_head.weight "
            "(left out: the target's LM head, full-vocabulary drafting), d2t (may be left out "
            "when the draft vocabulary is the target's)")
README_MARK = "<!-- written by save_head; rewritten on every save -->"


def resolve_taps(d: dict, num_layers: int) -> tuple[tuple[int, ...], str]:
    """The target layers whose input hidden states the head reads, ascending, and a line saying
    where they came from. Top-level ids (vLLM, speculators) are layer i's input; ids nested in
    `eagle_config` (SpecForge, sglang) are layer i's output, i.e. layer i + 1's input. Neither
    (or empty): the common default (2, L//2, L-3)."""
    given = {}  # key -> (ids as written, the layers they mean, the rule)
    nested = (d.get("eagle_config") or {}).get(TAPS)
    for key, raw, shift, rule in ((TAPS, d.get(TAPS), 0, "input of layer i"),
                                  (NESTED_TAPS, nested, 1, "output of layer i, sglang's +1")):
        if raw:
            ids = _ids(key, raw)
            given[key] = (ids, sorted(i + shift for i in ids), rule)
    said = {k: f"{k} = {raw} ({rule}: layers {ids})" for k, (raw, ids, rule) in given.items()}
    if not given:
        return default_taps(num_layers), "no tap key: the default"
    if len({tuple(ids) for _, ids, _ in given.values()}) > 1:
        raise ValueError("EAGLE-3 head config gives its taps twice and they disagree: "
                         + "; ".join(said.values()) + ". Keep the key the head was trained "
                         "with")
    key, (_, ids, _) = next(iter(given.items()))
    if len(ids) != 3 or not all(0 <= i < num_layers for i in ids):
        raise ValueError(f"EAGLE-3 head taps do not fit the target: {said[key]}, but the head "
                         f"reads three hidden states entering layers 0..{num_layers - 1} "
                         f"(the target has {num_layers} layers)")
    if len(set(ids)) < 3:
        log.warning("EAGLE-3 head taps repeat a layer (%s): sglang and vLLM capture each "
                    "layer once and cannot run this head", said[key])
    return tuple(ids), said[key]


def _ids(key: str, raw) -> list[int]:
    if not isinstance(raw, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                            for i in raw):
        raise ValueError(f"EAGLE-3 head config: {key} must be a list of layer numbers, "
                         f"got {raw!r}")
    return raw


def _layer_config(d: dict) -> tuple[str, dict]:
    """(layout name, the decoder layer's config with LlamaConfig's defaults filled in)."""
    if "speculators_model_type" in d or "transformer_layer_config" in d:
        kind = d.get("speculators_model_type")
        if kind != "eagle3":
            raise ValueError(f"speculators head of type {kind!r}: only 'eagle3' loads here")
        return "speculators", {**LLAMA_DEFAULTS, **d.get("transformer_layer_config", {})}
    return "EAGLE", {**LLAMA_DEFAULTS, **d}


def _rope(layer: dict) -> RopeConfig:
    params = layer.get("rope_parameters")
    if params and "rope_theta" not in params:
        params = {**params, "rope_theta": layer["rope_theta"]}
    return _rope_from_hf(SimpleNamespace(rope_parameters=params, rope_theta=layer["rope_theta"],
                                         rope_scaling=layer.get("rope_scaling")))


def config_from_hf(d: dict, target: ModelConfig) -> tuple[Eagle3Config, str, str]:
    """The head's shape from its config.json in any accepted layout, the taps resolved
    against `target`; with the layout's name and where the taps came from."""
    layout, layer = _layer_config(d)
    if layer["hidden_act"] != "silu":
        raise ValueError(f"EAGLE-3 head with activation {layer['hidden_act']!r}: only silu runs")
    if (d.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
        raise ValueError("EAGLE-3 head config sets eagle_config.use_aux_hidden_state = false "
                         "(no fc over the target's taps): that head does not run here")
    if layout == "speculators" and "norm_before_residual" not in d:
        log.warning("speculators head without norm_before_residual: false, speculators' "
                    "default (vLLM assumes true)")
    taps, source = resolve_taps(d, target.num_layers)
    hidden, heads = layer["hidden_size"], layer["num_attention_heads"]
    vocab = layer["vocab_size"]
    cfg = Eagle3Config(
        hidden, layer["intermediate_size"], heads, layer.get("num_key_value_heads") or heads,
        layer.get("head_dim") or hidden // heads, layer["rms_norm_eps"], _rope(layer),
        layer["max_position_embeddings"], vocab, d.get("draft_vocab_size") or vocab,
        d.get("target_hidden_size") or hidden, taps,
        bool(d.get("norm_before_residual", False)))
    return cfg, layout, source


def _reference_rope(r: RopeConfig) -> dict | None:
    """rope_scaling as the EAGLE reference runtime's config class accepts it: None or
    {"type": linear|dynamic, "factor": > 1}. llama3 scaling has no such form; it goes in
    `rope_parameters` (transformers 5, tandem)."""
    if r.type == "linear" and r.factor > 1:
        return {"type": "linear", "factor": float(r.factor)}
    return None


def config_to_hf(cfg: Eagle3Config) -> dict:
    """config.json that the EAGLE reference runtime, SpecForge, sglang, vLLM and tandem read
    alike (the taps in both conventions)."""
    r, ids = cfg.rope, list(cfg.aux_layer_ids)
    d = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "num_hidden_layers": 1, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": r.theta,
        "rope_scaling": _reference_rope(r), "max_position_embeddings": cfg.max_position,
        "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.draft_vocab_size, TAPS: ids,
        "norm_before_residual": cfg.norm_before_residual, "tie_word_embeddings": False,
    }
    if r.type == "llama3":
        d["rope_parameters"] = {
            "rope_type": "llama3", "rope_theta": r.theta, "factor": r.factor,
            "low_freq_factor": r.low_freq_factor, "high_freq_factor": r.high_freq_factor,
            "original_max_position_embeddings": r.original_max_position}
    # The reference runtime loads the target's embedding only when this key is absent.
    if cfg.target_hidden_size != cfg.hidden_size:
        d["target_hidden_size"] = cfg.target_hidden_size
    if min(ids) >= 1:  # sglang's ids count one lower: tap 0 (the embeddings) has no such id
        d["eagle_config"] = {TAPS: [i - 1 for i in ids], "use_aux_hidden_state": True}
    return d


def _read_tensors(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    paths = sorted(glob.glob(os.path.join(folder, "*.safetensors"))) or sorted(
        glob.glob(os.path.join(folder, "pytorch_model*.bin")))
    if not paths:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin weights in {folder}")
    sd: dict[str, torch.Tensor] = {}
    for path in paths:
        sd.update(load_file(path) if path.endswith(".safetensors")
                  else torch.load(path, map_location="cpu", weights_only=True))
    return sd


def _our_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors under tandem's names: `model.` dropped, speculators' `layers.0.` as
    `midlayer.`, the target's copies left out."""
    out = {}
    for k, v in sd.items():
        k = k.removeprefix("model.")
        if k.startswith("layers.0."):
            k = "midlayer." + k.removeprefix("layers.0.")
        if k not in TARGET_COPIES:
            out[k] = v
    return out


def _vocab(sd: dict, cfg: Eagle3Config, layout: str) -> torch.Tensor:
    """Each draft id's target id, from d2t (identity when the draft vocabulary is the
    target's and d2t is left out); t2d is always rebuilt from it, as no runtime reads it."""
    n, vocab = cfg.draft_vocab_size, cfg.vocab_size
    d2t = sd.pop("d2t", None)
    if d2t is None:
        if n != vocab:
            raise ValueError(f"EAGLE-3 head ({layout} layout): missing tensor d2t: a head "
                             f"drafting {n} of {vocab} target tokens needs it to map its ids "
                             "(d2t [draft] int: target id - draft id)")
        d2t = torch.zeros(n, dtype=torch.int64)
    if d2t.shape != (n,):
        raise ValueError(f"d2t has shape {tuple(d2t.shape)}, the config's draft_vocab_size "
                         f"is {n}")
    ids = torch.arange(n) + d2t.to(torch.int64)
    if n and not (0 <= int(ids.min()) and int(ids.max()) < vocab):
        raise ValueError(f"d2t maps draft ids outside the target vocabulary of {vocab}")
    t2d = sd.pop("t2d", None)
    if t2d is not None and not torch.equal(t2d.to(torch.bool).nonzero()[:, 0], ids.sort()[0]):
        log.warning("EAGLE-3 head: t2d disagrees with d2t; rebuilt from d2t, which every "
                    "runtime drafts with")
    return ids


def _their_name(name: str, layout: str) -> str:
    """A tensor's name as the layout's files spell it (speculators: `layers.0.*`)."""
    if layout == "speculators" and name.startswith("midlayer."):
        return "layers.0." + name.removeprefix("midlayer.")
    return name


def _check(sd: dict, head: Eagle3Head, layout: str, optional: set[str]) -> None:
    """Refuse tensors that are missing (but `optional`), left over or of another shape,
    naming them as the layout's files do."""
    want = head.state_dict()
    missing = sorted(_their_name(k, layout) for k in want if k not in sd and k not in optional)
    extra = sorted(_their_name(k, layout) for k in sd if k not in want)
    shapes = [f"{_their_name(k, layout)} {tuple(v.shape)} (expected {tuple(want[k].shape)})"
              for k, v in sd.items() if k in want and v.shape != want[k].shape]
    if missing or extra or shapes:
        raise ValueError(f"EAGLE-3 head ({layout} layout) cannot run here: missing tensors "
                         f"{missing}, tensors of no use here {extra} (one decoder layer runs), "
                         f"wrong shapes {shapes}. Expected: {EXPECTED}")


def load_head(folder: str, target: ModelConfig, make_backend,
              dtype: torch.dtype = torch.float32, device: str = "cpu",
              target_model: nn.Module | None = None) -> Eagle3Head:
    """Load an EAGLE-3 head in any accepted layout; refuses a head built for another target
    and what cannot run, naming it. `make_backend(cfg)` builds the attention backend for the
    head's shape. target_model (with `lm_head`): its LM head stands in for a head that has
    none (full-vocabulary drafting)."""
    with open(os.path.join(folder, "config.json")) as f:
        raw = json.load(f)
    cfg, layout, taps = config_from_hf(raw, target)
    cfg.check_target(target)
    sd = _our_names(_read_tensors(folder))
    shared = "lm_head.weight" not in sd
    if shared:
        cfg = _full_vocab(raw, cfg, target_model, layout)
    cfg = replace(cfg, max_position=max(cfg.max_position, target.max_position))
    ids = _vocab(sd, cfg, layout)
    with torch.device(device):
        head = Eagle3Head(cfg, make_backend(cfg))
    _check(sd, head, layout, {"d2t", "t2d"} | ({"lm_head.weight"} if shared else set()))
    head.load_state_dict(sd, strict=False)
    head.set_vocab(ids.to(head.d2t.device))
    head = head.to(dtype).eval()
    if shared:
        w = target_model.lm_head.weight
        if not torch.equal(ids, torch.arange(len(ids))):  # draft ids in another order
            w = nn.Parameter(w[ids.to(w.device)].detach(), requires_grad=False)
        head.lm_head.weight = w
    log.info("EAGLE-3 head %s (%s layout): taps %s from %s; draft vocabulary %d of %d%s",
             folder, layout, list(cfg.aux_layer_ids), taps, cfg.draft_vocab_size,
             cfg.vocab_size, ", the target's LM head" if shared else "")
    return head


def _full_vocab(raw: dict, cfg: Eagle3Config, target_model: nn.Module | None,
                layout: str) -> Eagle3Config:
    """A head without lm_head drafts over the whole target vocabulary with the target's LM
    head, as sglang runs it; refused where that is not what its config says."""
    said = f"EAGLE-3 head ({layout} layout): missing tensor lm_head.weight: the target's LM head"
    if raw.get("draft_vocab_size") not in (None, cfg.vocab_size):
        raise ValueError(f"{said} stands in only for a full-vocabulary head, and "
                         f"draft_vocab_size is {cfg.draft_vocab_size} of {cfg.vocab_size}")
    if target_model is None:
        raise ValueError(f"{said} stands in (full-vocabulary drafting) only where the target "
                         "model is given")
    return replace(cfg, draft_vocab_size=cfg.vocab_size)


def save_head(head: Eagle3Head, folder: str, dtype: torch.dtype = torch.bfloat16,
              extra: dict | None = None, target: ModelConfig | None = None) -> None:
    """Write config.json (`config_to_hf`), model.safetensors and a README.md saying which
    target and taps the head is for. A README.md not written here is left as it is."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    sd = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous().cpu()
          for k, v in head.state_dict().items()}
    save_file(sd, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    cfg = config_to_hf(head.cfg)
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    cfg.update(extra or {})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    readme = os.path.join(folder, "README.md")
    if os.path.exists(readme):
        with open(readme) as f:
            if README_MARK not in f.read():
                return
    with open(readme, "w") as f:
        f.write(readme_text(head.cfg, cfg, target))


def readme_text(cfg: Eagle3Config, written: dict, target: ModelConfig | None) -> str:
    """What a saved folder's README.md says: the target, the taps, the vocabulary, and where
    a runtime would run the head other than it was trained. written: its config.json."""
    name = target.name if target is not None else "its target"
    ids = list(cfg.aux_layer_ids)
    lines = [f"# EAGLE-3 draft head for {name}", "", README_MARK, ""]
    if target is not None:
        lines.append(f"- Target: `{name}`, {target.num_layers} layers, hidden size "
                     f"{target.hidden_size}, vocabulary {target.vocab_size}.")
    nested = (written.get("eagle_config") or {}).get(TAPS)
    lines += [
        f"- Taps: the hidden states entering target layers {ids} (0: the embeddings). In "
        f"config.json: `{TAPS}` = {ids} (vLLM, speculators: the input of layer i)"
        + (f"; `{NESTED_TAPS}` = {nested} (SpecForge, sglang: the output of layer i)."
           if nested else "."),
        f"- Draft vocabulary: {cfg.draft_vocab_size} of {cfg.vocab_size} target tokens "
        "(`d2t`: target id - draft id; `t2d`: the target ids drafted).",
        f"- Layer: hidden {cfg.hidden_size}, {cfg.num_heads} heads / {cfg.num_kv_heads} KV "
        f"heads of {cfg.head_dim}, RoPE {_rope_text(cfg.rope)}, norm_before_residual "
        f"{str(cfg.norm_before_residual).lower()}.",
        f"- Weights: `model.safetensors` ({written['torch_dtype']}): `fc`, `midlayer.*`, "
        "`norm`, `lm_head`, `d2t`, `t2d`. The target's token embedding is not stored: "
        "runtimes use the target's.",
    ]
    caveats = _caveats(cfg, target)
    if caveats:
        lines.append("- Caveats: " + "; ".join(caveats) + ".")
    return "\n".join(lines) + "\n"


def _rope_text(r: RopeConfig) -> str:
    if r.type == "llama3":
        return (f"theta {r.theta:g} with llama3 scaling (factor {r.factor:g}, in "
                "`rope_parameters`)")
    return f"theta {r.theta:g}" + (f", {r.type} scaling {r.factor:g}" if r.type != "default"
                                   else "")


def _caveats(cfg: Eagle3Config, target: ModelConfig | None) -> list[str]:
    """Where a runtime would run the head other than it was trained."""
    ids, out = cfg.aux_layer_ids, []
    if target is not None and default_taps(target.num_layers) != ids:
        out.append("the EAGLE reference runtime taps layers (2, L//2, L-3) whatever the "
                   "config says")
    if cfg.norm_before_residual:
        out.append("the EAGLE reference runtime keeps the residual before the hidden norm "
                   "(no norm_before_residual)")
    if cfg.rope.type == "llama3":
        out.append("runtimes that read `rope_scaling` only (the EAGLE reference runtime, "
                   "transformers 4) apply plain RoPE")
    if len(set(ids)) < len(ids):
        out.append("sglang and vLLM capture a layer once and cannot run a head tapping one "
                   "twice")
    if min(ids) == 0:
        out.append("sglang's nested ids cannot name tap 0, so it reads its default taps")
    if (target is not None and default_taps(target.num_layers) != ids) or \
            cfg.norm_before_residual:
        out.append("speculators' converter reads neither the taps nor norm_before_residual "
                   f"from config.json: pass it eagle_aux_hidden_state_layer_ids {list(ids)} "
                   f"and norm_before_residual {str(cfg.norm_before_residual).lower()}")
    if cfg.head_dim * cfg.num_heads != cfg.hidden_size:
        out.append(f"speculators' converter sizes the attention as hidden size / heads "
                   f"({cfg.hidden_size // cfg.num_heads}), not head_dim {cfg.head_dim}")
    return out
