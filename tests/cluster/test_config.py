"""cluster.config: defaults, YAML round trip, error messages, overrides, engine kwargs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from cluster.config import (
    ClusterConfig,
    ConfigError,
    RoleSection,
    apply_overrides,
    config_from_dict,
    load_config,
)
from cluster.engine_args import engine_kwargs
from engine.config import SpecConfig

EXAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "examples"


def test_defaults_are_one_prefill_one_decode_on_cpu_with_eagle3():
    cfg = load_config(None)
    assert cfg == ClusterConfig()
    assert cfg.mode == "disaggregated" and cfg.ray_address is None
    for role in ("prefill", "decode"):
        sec = cfg.role_section(role)
        assert (sec.replicas, sec.resolved_device, sec.num_gpus) == (1, "cpu", 0.0)
    assert cfg.speculation.method == "eagle3"
    assert cfg.model.path is None and cfg.model.block_size == 16


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        ClusterConfig().mode = "colocated"


def test_yaml_file_round_trip(tmp_path):
    d = {"mode": "colocated", "decode": {"replicas": 1, "kv_cache_bytes": "64MiB"},
         "speculation": {"method": "ngram", "num_tokens": 3}, "metrics": {"port_base": 9500}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(d))
    cfg = load_config(path)
    assert cfg.decode.kv_cache_bytes == 64 << 20
    assert cfg.speculation.num_tokens == 3 and cfg.mode == "colocated"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    assert load_config(path) == cfg
    assert config_from_dict(cfg.to_dict()) == cfg


def test_empty_yaml_file_gives_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing\n")
    assert load_config(path) == ClusterConfig()


@pytest.mark.parametrize("name", ["local.yaml", "two-gpu.yaml"])
def test_example_configs_load(name):
    cfg = load_config(EXAMPLES / name)
    assert cfg.mode == "disaggregated"
    assert cfg.prefill.replicas == cfg.decode.replicas == 1


def test_two_gpu_example_books_one_gpu_per_role_in_bf16():
    cfg = load_config(EXAMPLES / "two-gpu.yaml")
    assert cfg.prefill.num_gpus == cfg.decode.num_gpus == 1.0
    assert engine_kwargs(cfg, "decode")["dtype"] == torch.bfloat16
    assert cfg.metrics_ports() == {"router": 9400, "prefill-0": 9401, "decode-0": 9402}


def test_unknown_key_names_section_and_suggests():
    with pytest.raises(ConfigError, match=r"'replica' in section 'decode'.*'replicas'"):
        config_from_dict({"decode": {"replica": 2}})
    with pytest.raises(ConfigError, match=r"'specualtion' in the top level.*'speculation'"):
        config_from_dict({"specualtion": {}})


def test_unknown_key_in_file_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("router:\n  prot: 1\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml.*'prot'.*did you mean 'port'"):
        load_config(path)


def test_only_true_and_false_are_booleans(tmp_path):
    """YAML 1.1 reads yes/no/on/off as booleans: `--set speculation.method=off` became False
    ("must be str, got False"). Here they are words, and a bool field says what it got."""
    cfg = load_config(None)
    with pytest.raises(ConfigError, match="speculation.method must be one of .*got 'off'"):
        apply_overrides(cfg, ["speculation.method=off"])
    with pytest.raises(ConfigError, match="router.http must be bool, got 'yes'"):
        apply_overrides(cfg, ["router.http=yes"])
    assert apply_overrides(cfg, ["router.http=false"]).router.http is False
    path = tmp_path / "words.yaml"
    path.write_text("router:\n  http: on\n")
    with pytest.raises(ConfigError, match="router.http must be bool, got 'on'"):
        load_config(path)
    path.write_text("router:\n  http: False\n")
    assert load_config(path).router.http is False
    assert yaml.safe_load("on") is True  # PyYAML's own loader is left as it was


def test_a_key_given_twice_in_a_file_is_refused(tmp_path):
    """YAML's loaders keep the last of two equal keys without a word: a setting pasted below
    an older one would win or vanish silently."""
    path = tmp_path / "twice.yaml"
    for text, key, line in [("router:\n  port: 1\n  port: 2\n", "port", 3),
                            ("router: {port: 1}\ndecode: {}\nrouter: {host: x}\n", "router", 3)]:
        path.write_text(text)
        with pytest.raises(ConfigError, match=rf"twice\.yaml: .*'{key}' is given twice \(line "
                                              rf"{line}\)"):
            load_config(path)
    path.write_text("router:\n  port: 1\ndecode:\n  port_like: {a: 1, b: 2}\n")
    with pytest.raises(ConfigError, match="port_like"):  # distinct keys reach the key check
        load_config(path)


@pytest.mark.parametrize("d, field", [
    ({"decode": {"replicas": 0}}, "decode.replicas"),
    ({"decode": {"replicas": "two"}}, "decode.replicas"),
    ({"prefill": {"replicas": True}}, "prefill.replicas"),
    ({"prefill": {"device": "cpu", "num_gpus": 1}}, "prefill.num_gpus"),
    ({"prefill": {"num_gpus": 1.5}}, "prefill.num_gpus"),
    ({"decode": {"device": "cuda"}}, "decode.device"),
    ({"decode": {"device": "tpu"}}, "decode.device"),
    ({"decode": {"gpu_memory_utilization": 1.5}}, "decode.gpu_memory_utilization"),
    ({"decode": {"admission_delay_steps": -1}}, "decode.admission_delay_steps"),
    ({"decode": {"kv_cache_bytes": "lots"}}, "decode.kv_cache_bytes"),
    ({"model": {"dtype": "fp8"}}, "model.dtype"),
    ({"model": {"block_size": 12}}, "model.block_size"),
    ({"speculation": {"method": "medusa"}}, "speculation.method"),
    ({"speculation": {"num_tokens": 17}}, "speculation.num_tokens"),
    ({"router": {"port": 70000}}, "router.port"),
    ({"mode": "mixed"}, "mode"),
    ({"transfer": {"transport": "tcp"}}, "transfer.transport"),
    ({"transfer": {"progress_mode": "polling"}}, "transfer.progress_mode"),
    ({"transfer": {"timeout_s": 0}}, "transfer.timeout_s"),
    ({"decode": 3}, "'decode'"),
])
def test_bad_values_name_the_field(d, field):
    with pytest.raises(ConfigError, match=field):
        config_from_dict(d)


def test_bad_choice_suggests_the_closest():
    with pytest.raises(ConfigError, match="did you mean 'eagle3'"):
        config_from_dict({"speculation": {"method": "eagel3"}})


def test_ints_pass_as_floats_and_sizes_parse():
    sec = RoleSection(num_gpus=1, kv_cache_bytes="1.5GiB")
    assert isinstance(sec.num_gpus, float)
    assert sec.kv_cache_bytes == 3 << 29
    assert RoleSection(kv_cache_bytes="1000").kv_cache_bytes == 1000


def test_overrides_parse_values_as_yaml():
    cfg = apply_overrides(ClusterConfig(), [
        "decode.replicas=2", "speculation.method=ngram", "decode.num_gpus=0.5",
        "model.path=/m/llama", "ray_address=auto", "metrics.enabled=false",
    ])
    assert cfg.decode.replicas == 2 and cfg.speculation.method == "ngram"
    assert cfg.decode.num_gpus == 0.5 and cfg.decode.resolved_device == "cuda"
    assert cfg.model.path == "/m/llama" and cfg.ray_address == "auto"
    assert cfg.metrics.enabled is False
    assert apply_overrides(cfg, ["model.path=null"]).model.path is None


@pytest.mark.parametrize("item, message", [
    ("decode.replicas", "section.key=value"),
    ("decode.replcas=2", "did you mean 'replicas'"),
    ("decod.replicas=2", "did you mean 'decode'"),
    ("mode.x=1", "mode is a value"),
    ("decode.replicas=0", "decode.replicas"),
])
def test_bad_overrides(item, message):
    with pytest.raises(ConfigError, match=message):
        apply_overrides(ClusterConfig(), [item])


def test_transfer_section_gives_the_transport_its_kwargs():
    pytest.importorskip("ucxx")
    from cluster.config import PULL_ENGINES
    from kvtransfer import ipc
    from kvtransfer.ucx import UcxTransport
    from tests.kvtransfer.conftest import tiny_layout

    assert ClusterConfig().transfer.transport_kwargs() == {
        "ipc": None, "pull": None, "push": None, "pull_engine": "dst",
        "progress_mode": "thread", "checksum": False, "timeout": 30.0}
    assert PULL_ENGINES == ipc.ENGINES
    assert ClusterConfig().transfer.pull_engine == ipc.DEFAULT_ENGINE
    cfg = apply_overrides(ClusterConfig(), ["transfer.pull=false", "transfer.checksum=true",
                                            "transfer.transport=ucx-tcp",
                                            "transfer.pull_engine=src", "transfer.push=false"])
    kw = cfg.transfer.transport_kwargs()
    assert kw["ipc"] is False and kw["checksum"] is True and cfg.transfer.transport == "ucx-tcp"
    t = UcxTransport(tiny_layout(), **kw)  # every key is one the transport takes
    assert (t.ipc, t.checksum, t.timeout, t.pull_engine, t.push, t.pull) == (
        False, True, 30.0, "src", False, False)
    kw = apply_overrides(ClusterConfig(), ["transfer.pull=false"]).transfer.transport_kwargs()
    assert (kw["ipc"], kw["push"], kw["pull"]) == (None, None, False)  # push alone stays on
    with pytest.raises(ConfigError, match="pull_engine"):
        apply_overrides(ClusterConfig(), ["transfer.pull_engine=both"])


def test_load_config_overrides_dict_merges_into_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("decode:\n  replicas: 2\n  max_num_seqs: 8\n")
    cfg = load_config(path, {"decode.max_num_seqs": 4, "prefill": {"replicas": 3}})
    assert (cfg.decode.replicas, cfg.decode.max_num_seqs, cfg.prefill.replicas) == (2, 4, 3)


def test_metrics_ports_follow_components():
    cfg = load_config(None, {"decode.replicas": 2, "metrics.port_base": 9000})
    assert cfg.metrics_ports() == {"router": 9000, "prefill-0": 9001, "decode-0": 9002,
                                   "decode-1": 9003}
    colo = apply_overrides(cfg, ["mode=colocated", "decode.replicas=1"])
    assert colo.components() == ["router", "colocated-0"]
    with pytest.raises(ConfigError, match="decode.replicas must be 1"):  # one engine
        apply_overrides(cfg, ["mode=colocated"])
    assert set(ClusterConfig().metrics_ports().values()) == {0}
    with pytest.raises(ConfigError, match="port_base"):
        load_config(None, {"metrics.port_base": 65535})


def test_engine_kwargs_cpu_auto_dtype_and_eagle3():
    cfg = load_config(None, {"decode.kv_cache_bytes": 1 << 20, "model.max_model_len": 1024})
    kw = engine_kwargs(cfg, "decode")
    assert kw == {
        "device": "cpu", "dtype": torch.float32, "block_size": 16, "max_num_seqs": 64,
        "max_num_batched_tokens": 2048, "enable_prefix_caching": True,
        "admission_delay_steps": 2, "admit_in_flight": True, "kv_cache_bytes": 1 << 20,
        "max_model_len": 1024,
        "spec": SpecConfig(method="eagle3", num_tokens=5, head=None, dynamic=True,
                           collapse_below=1.1),
        "overlap": True, "deterministic": False,
    }


def test_engine_deterministic_reaches_every_role():
    cfg = load_config(None, {"engine.deterministic": True})
    assert all(engine_kwargs(cfg, r)["deterministic"] for r in ("prefill", "decode"))
    with pytest.raises(ConfigError, match="deterministic"):
        load_config(None, {"engine.deterministic": "sometimes"})


def test_engine_kwargs_cuda_auto_dtype_is_bf16_and_spec_none():
    cfg = load_config(None, {"prefill.num_gpus": 1, "prefill.gpu_memory_utilization": 0.5,
                             "speculation.method": "none"})
    kw = engine_kwargs(cfg, "prefill")
    assert (kw["device"], kw["dtype"], kw["spec"]) == ("cuda", torch.bfloat16, None)
    assert kw["gpu_memory_utilization"] == 0.5
    assert "kv_cache_bytes" not in kw and "max_model_len" not in kw


def test_engine_kwargs_explicit_dtype_and_colocated_reads_decode():
    cfg = load_config(None, {"model.dtype": "float16", "decode.max_num_seqs": 7,
                             "speculation": {"method": "ngram", "num_tokens": 2,
                                             "dynamic": False}})
    kw = engine_kwargs(cfg, "colocated")
    assert kw["dtype"] == torch.float16 and kw["max_num_seqs"] == 7
    assert kw["spec"] == SpecConfig(method="ngram", num_tokens=2, dynamic=False,
                                    collapse_below=1.1)
    off = load_config(None, {"speculation.overlap": False})
    assert engine_kwargs(off, "decode")["overlap"] is False  # greedy decodes, spec or not
    with pytest.raises(ConfigError, match="role"):
        engine_kwargs(cfg, "router")


def test_engine_kwargs_build_an_engine_config():
    from engine.config import EngineConfig, tiny_config

    for role in ("prefill", "decode"):
        ec = EngineConfig(model=tiny_config(), **engine_kwargs(ClusterConfig(), role))
        assert ec.num_draft_layers == 1


def test_node_kwargs_are_engine_kwargs_without_torch_types():
    from cluster.engine_args import node_kwargs
    from node_common.node import engine_types

    for over in ([], ["speculation.method=none"],
                 ["prefill.device=cuda", "prefill.num_gpus=1", "model.dtype=auto"]):
        cfg = apply_overrides(ClusterConfig(), over)
        for role in ("prefill", "decode"):
            portable = node_kwargs(cfg, role)
            assert isinstance(portable["dtype"], str)
            assert portable["spec"] is None or isinstance(portable["spec"], dict)
            assert engine_types(portable) == engine_kwargs(cfg, role)
