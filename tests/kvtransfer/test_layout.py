"""BlockLayout: derived from the engine config, hashed stably, compared field by field."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import EngineConfig, ModelConfig, RopeConfig, SpecConfig
from kvtransfer import BlockLayout, LayoutMismatch, check_compatible
from tests.kvtransfer.conftest import tiny_layout


def engine_config(dtype=torch.bfloat16, spec: SpecConfig | None = None) -> EngineConfig:
    model = ModelConfig(model_type="llama", vocab_size=128, hidden_size=64,
                        intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                        head_dim=16, rms_norm_eps=1e-6, rope=RopeConfig(), max_position=256,
                        name="tiny-llama")
    return EngineConfig(model=model, dtype=dtype, block_size=16, num_blocks=32,
                        spec=spec or SpecConfig())


def test_layout_matches_the_engine_kv_tensor():
    from engine.runner import allocate_kv_cache

    cfg = engine_config()
    layout = BlockLayout.from_engine_config(cfg)
    assert (layout.model, layout.dtype, layout.num_layers, layout.num_draft_layers) == (
        "tiny-llama", "bfloat16", 5, 1)
    kv = allocate_kv_cache(cfg, 32)
    assert tuple(kv.shape) == layout.kv_shape(32)
    layout.check_tensor(kv)
    assert layout.block_bytes == cfg.kv_bytes_per_block


def test_no_draft_layer_without_eagle():
    layout = BlockLayout.from_engine_config(engine_config(spec=SpecConfig(method="ngram")))
    assert (layout.num_layers, layout.num_draft_layers) == (4, 0)


def test_compat_hash_is_pinned():
    """A canonical encoding: the same in every process and every Python version."""
    h = tiny_layout().compat_hash()
    assert h == BlockLayout.from_dict(tiny_layout().to_dict()).compat_hash()
    assert h == "b01aaec3b7adabf34e55e7299cf829de56741c93f2c4c71709961c0587fa0e68"


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(BlockLayout)])
def test_every_field_changes_the_hash_and_is_named(field):
    base = tiny_layout()
    strings = {"model": "x", "dtype": "float16"}
    value = strings[field] if field in strings else getattr(base, field) + 1
    other = dataclasses.replace(base, **{field: value})
    assert other.compat_hash() != base.compat_hash()
    with pytest.raises(LayoutMismatch, match=field) as err:
        check_compatible(base, other)
    assert err.value.fields == (field,)


def test_mismatch_message_names_both_values():
    with pytest.raises(LayoutMismatch) as err:
        check_compatible(tiny_layout(), tiny_layout("bfloat16", block_size=32))
    assert err.value.fields == ("dtype", "block_size")
    assert "'float32' (local) != 'bfloat16' (peer)" in str(err.value)


def test_check_tensor_refuses_other_layouts():
    layout = tiny_layout()
    layout.check_tensor(torch.zeros(layout.kv_shape(7)))
    with pytest.raises(LayoutMismatch):
        layout.check_tensor(torch.zeros(layout.kv_shape(7), dtype=torch.bfloat16))
    with pytest.raises(LayoutMismatch):
        layout.check_tensor(torch.zeros(3, 2, 7, 16, 2, 4))
    with pytest.raises(ValueError, match="contiguous"):
        layout.check_tensor(torch.zeros(layout.kv_shape(7)).transpose(0, 0)[:, :, ::2])


def test_invalid_layouts_are_refused():
    with pytest.raises(ValueError, match="dtype"):
        tiny_layout("float33")
    with pytest.raises(ValueError):
        tiny_layout(head_dim=0)
    with pytest.raises(LayoutMismatch, match="unknown fields"):
        BlockLayout.from_dict({**tiny_layout().to_dict(), "rope": 1})
