"""Start the cluster: Ray (embedded or `address`), prefill and decode actors, the router's
disaggregated backend. Actors get GPUs when the config asks for them.

This process imports neither torch nor transformers: the actor classes import the engine
where they start, and the router encodes prompts with the tokenizer a prefill actor exports
(`Tokenizer.spec`, `SpecTokenizer`)."""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass

from decode_node.node import DecodeNode
from engine.jit_watch import CACHE_ENV
from engine.prompt import PromptEncoder
from engine.tokenizer_spec import SpecTokenizer
from node_common.node import NOSET_ENV
from prefill_node.node import PrefillNode
from router.disagg import DisaggBackend

# How long `join` waits for the GCS to answer its token check; it answers in milliseconds.
PROBE_S = 5.0


@dataclass
class Cluster:
    backend: DisaggBackend
    prefills: list
    decodes: list
    metrics_ports: list  # per actor, prefills then decodes (None: metrics off)

    def shutdown(self) -> None:
        import ray

        for a in self.prefills + self.decodes:
            ray.kill(a)


def start(model: str | None, engine_kwargs: dict, decode_kwargs: dict | None = None, *,
          prefill_replicas: int = 1, decode_replicas: int = 1, transport: str = "ucx",
          address: str | None = None, prefill_gpus: float = 0.0, decode_gpus: float = 0.0,
          metrics: bool = True, transport_kwargs: dict | None = None,
          ipc_across_gpus: bool = False, prefill_restarts: int = -1,
          decode_restarts: int = -1, resume_attempts: int = 3,
          chat_special_tokens: bool = False, kv_wait_s: float = 120.0,
          metrics_host: str = "127.0.0.1", metrics_ports: list[int] | None = None,
          net_devices: str | None = None, prefill_resources: dict | None = None,
          decode_resources: dict | None = None, triton_cache_dir: str | None = None,
          cpu_threads: int = 0) -> Cluster:
    """Connect to (or start) Ray, place the actors, and return the router's backend.
    `engine_kwargs` configure prefill engines, `decode_kwargs` (default: the same) decode;
    `transport_kwargs` every actor's `kvtransfer` transport (`TransferSection`);
    `ipc_across_gpus`: GPU actors see every GPU of their node (`actor_options`); `*_restarts`: Ray
    restarts of a dead actor (-1: always); `resume_attempts`: moves of one stream after a worker
    died; `chat_special_tokens`: special-token strings in chat content read as tokens;
    `kv_wait_s`: wait for KV room on a decode actor; `metrics_host`, `metrics_ports` (per actor,
    prefills then decodes; 0 or None: free port): /metrics; `net_devices`: `UCX_NET_DEVICES`;
    `*_resources`: Ray custom resources each replica books; `triton_cache_dir`: where every
    actor keeps Triton's compiled kernels (`TRITON_CACHE_DIR`); `cpu_threads`: torch threads of
    an actor whose engine runs on the CPU (0: OMP_NUM_THREADS as the actor was started with,
    else its CPUs: `engine.affinity.cpu_threads`). Engine arguments may name the dtype
    ("bfloat16") and give the speculation config as a dict, so they pickle without torch."""
    import ray

    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS")
        if address:  # an existing cluster, e.g. inside `ray job submit`
            join(address)
        else:  # a fresh local instance: never attach to a stray `ray start` left running
            ray.init(address="local", num_cpus=max(2, os.cpu_count() or 2),
                     include_dashboard=False,
                     log_to_driver=os.environ.get("TANDEM_RAY_LOGS") == "1")
    P = ray.remote(PrefillNode).options(**actor_options(
        prefill_gpus, ipc_across_gpus, prefill_restarts, net_devices, prefill_resources,
        triton_cache_dir))
    D = ray.remote(DecodeNode).options(**actor_options(
        decode_gpus, ipc_across_gpus, decode_restarts, net_devices, decode_resources,
        triton_cache_dir))
    n = prefill_replicas + decode_replicas
    ports = [None] * n if not metrics else list(metrics_ports or [0] * n)  # see info()
    tkw = transport_kwargs or {}
    prefills = [P.remote(model, engine_kwargs, transport, ports[k], tkw, metrics_host,
                         cpu_threads) for k in range(prefill_replicas)]
    decodes = [D.remote(model, decode_kwargs or engine_kwargs, transport,
                        ports[prefill_replicas + k], tkw, metrics_host, cpu_threads)
               for k in range(decode_replicas)]
    infos = ray.get([a.info.remote() for a in prefills + decodes])  # waits for the models
    info = infos[-1]
    spec = ray.get(prefills[0].tokenizer_spec.remote())
    tok = SpecTokenizer(spec) if spec is not None else None
    encoder = PromptEncoder(tok, info["vocab_size"], info["max_model_len"], info["block_size"],
                            min(i["num_blocks"] for i in infos), chat_special_tokens)
    return Cluster(DisaggBackend(prefills, decodes, encoder, info, resume_attempts, kv_wait_s),
                   prefills, decodes, [i["metrics_port"] for i in infos])


def join(address: str) -> None:
    """Connect this process to the Ray cluster at `address`. A cluster with token auth on
    refuses a caller without its token: that is answered at once with what to set, rather
    than after `ray.init`'s retries (it tries again once a second, 20 times by default)."""
    import ray

    if refuses_token(address):
        raise token_error(address)
    try:
        ray.init(address=address, log_to_driver=False)
    except ConnectionError as e:  # its cause carries the last attempt's traceback as text
        if "AuthenticationError" not in str(e.__cause__):
            raise
        raise token_error(address) from None


def token_error(address: str) -> ConnectionError:
    return ConnectionError(
        f"the Ray cluster at {address} checks a token this process did not send: set"
        " RAY_AUTH_MODE=token and the cluster's token in RAY_AUTH_TOKEN or in a file named"
        " by RAY_AUTH_TOKEN_PATH (`ray get-auth-token` on the head prints it)")


def refuses_token(address: str, wait_s: float = PROBE_S) -> bool:
    """Whether the GCS at `address` ("host:port") answers this process's first call with an
    authentication error, waited on for at most `wait_s`. Anything else is False: nothing
    listening yet (a head still starting), another error, no answer in time; `ray.init` then
    connects with its retries as it would have."""
    host, _, port = address.rpartition(":")
    if "://" in address or not port.isdigit():  # "auto", a Ray Client address
        return False
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=wait_s).close()
    except OSError:
        return False
    from ray._raylet import GcsClient
    from ray.exceptions import AuthenticationError

    refused: list[bool] = []

    def probe() -> None:
        try:
            GcsClient(address=address)  # asks the GCS for the cluster id: checked like any call
        except AuthenticationError:
            refused.append(True)
        except Exception:  # not for this check to judge: ray.init says what it is
            pass

    # A daemon thread: a port that holds no GCS keeps the client waiting far beyond `wait_s`.
    t = threading.Thread(target=probe, name="ray-auth-probe", daemon=True)
    t.start()
    t.join(wait_s)
    return bool(refused)


def actor_options(num_gpus: float, ipc_across_gpus: bool = False,
                  max_restarts: int = -1, net_devices: str | None = None,
                  resources: dict | None = None, triton_cache_dir: str | None = None) -> dict:
    """Ray options of a node actor. `ipc_across_gpus`: a GPU actor sees every GPU of its node and
    picks its own by index, so KV can move between GPUs by CUDA IPC; otherwise Ray pins it.
    `max_restarts`: Ray restarts of a dead one (-1: always); `net_devices`: `UCX_NET_DEVICES`;
    `resources`: Ray custom resources it books, limiting the nodes it runs on;
    `triton_cache_dir`: Triton's cache (`TRITON_CACHE_DIR`), in the actor's environment from its
    start, so it holds before anything compiles."""
    # No CPUs booked, so Ray starts the actor with OMP_NUM_THREADS=1: a node on the CPU sets
    # its torch threads itself (`cpu_threads` of `start`).
    opts: dict = {"num_gpus": num_gpus, "num_cpus": 0, "max_concurrency": 1000,
                  "max_restarts": max_restarts}
    if resources:
        opts["resources"] = dict(resources)
    env = {}
    if ipc_across_gpus and num_gpus > 0:
        env[NOSET_ENV] = "1"
    if net_devices:
        env["UCX_NET_DEVICES"] = net_devices
    if triton_cache_dir:
        env[CACHE_ENV] = triton_cache_dir
    if env:
        opts["runtime_env"] = {"env_vars": env}
    return opts


def start_from_config(cfg) -> Cluster:
    """The cluster a `ClusterConfig` (cluster/config.py) describes, in disaggregated mode."""
    from cluster.engine_args import node_kwargs

    return start(cfg.model.path, node_kwargs(cfg, "prefill"), node_kwargs(cfg, "decode"),
                 prefill_replicas=cfg.prefill.replicas, decode_replicas=cfg.decode.replicas,
                 transport=cfg.transfer.transport, address=cfg.ray_address,
                 prefill_gpus=cfg.prefill.num_gpus, decode_gpus=cfg.decode.num_gpus,
                 metrics=cfg.metrics.enabled,
                 transport_kwargs=cfg.transfer.transport_kwargs(),
                 ipc_across_gpus=cfg.transfer.ipc_across_gpus,
                 prefill_restarts=cfg.prefill.max_restarts,
                 decode_restarts=cfg.decode.max_restarts,
                 resume_attempts=cfg.router.resume_attempts,
                 chat_special_tokens=cfg.router.chat_special_tokens,
                 kv_wait_s=cfg.router.max_queue_wait_s, metrics_host=cfg.metrics.host,
                 metrics_ports=list(cfg.metrics_ports().values())[1:],
                 net_devices=cfg.transfer.net_devices,
                 prefill_resources=cfg.prefill.resources, decode_resources=cfg.decode.resources,
                 triton_cache_dir=cfg.engine.triton_cache_dir)
