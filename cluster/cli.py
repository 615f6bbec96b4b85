"""The `tandem` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from cluster import subcommands
from cluster.subcommands import one_line

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="HF folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="weights/KV dtype (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--spec", default="none", choices=("none", "eagle3", "ngram"),
                   help="speculative decoding (eagle3: the shipped head, or --spec-head)")
    p.add_argument("--spec-head", default=None, help="EAGLE-3 head folder (public layout)")
    p.add_argument("--spec-tokens", type=int, default=5, help="most drafts per step (K)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


class _SetAlias(argparse.Action):
    """A flag short for `--set KEY=VALUE`: joins `args.set` in command-line order."""

    def __init__(self, option_strings, dest, key: str, **kw):
        super().__init__(option_strings, argparse.SUPPRESS, default=argparse.SUPPRESS, **kw)
        self.key = key

    def __call__(self, parser, namespace, value, option_string=None):
        # JSON quoting keeps the value a string through the YAML typing of --set
        namespace.set = [*getattr(namespace, "set", []), f"{self.key}={json.dumps(value)}"]


def _add_server_security_args(p: argparse.ArgumentParser) -> None:
    for flag, key, what in (
            ("--tls-cert", "tls_cert", "PEM certificate the server presents (TLS; with --tls-key)"),
            ("--tls-key", "tls_key", "PEM private key of --tls-cert"),
            ("--tls-client-ca", "tls_client_ca", "PEM CA clients' certificates must come from "
                                                 "(mTLS)"),
            ("--tokens-file", "tokens_file", "bearer tokens, one a line (also "
                                             "$TANDEM_API_TOKENS, comma-separated)")):
        p.add_argument(flag, action=_SetAlias, key=f"security.{key}", metavar="FILE",
                       help=f"{what}; short for --set security.{key}=FILE")


def _add_client_security_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token", default=None,
                   help="bearer token for a server that asks for one (default: "
                        "$TANDEM_API_TOKEN)")
    p.add_argument("--tls", action="store_true",
                   help="connect over TLS (implied by the other --tls-* flags)")
    p.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="root certificate(s) to trust (default: the system's)")
    p.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="client certificate for a server that asks for one (mTLS; with "
                        "--tls-key)")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")


def client_security(args) -> dict | None:
    """The SDK's `token` and `tls` arguments from the client flags (absent ones: off), or None
    after one `error:` line when a PEM file is missing or a cert comes without its key."""
    from tandem_client import TLS

    token = getattr(args, "token", None) or os.environ.get("TANDEM_API_TOKEN") or None
    ca, cert, key = (getattr(args, k, None) for k in ("tls_ca", "tls_cert", "tls_key"))
    try:
        tls = TLS(ca, cert, key) if getattr(args, "tls", False) or ca or cert or key else None
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    return {"token": token, "tls": tls}


def engine_settings(args) -> tuple[str, str, object]:
    """(device, dtype name, SpecConfig or None) from the model arguments, checked before any
    weights load: a bad value raises ValueError with one line that names the flag."""
    import torch

    from cluster.engine_args import missing_head, unusable_device
    from engine.config import SpecConfig

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if why := unusable_device(device):
        raise ValueError(why)
    dtype = DTYPES[args.dtype] if args.dtype else ("float32" if device == "cpu" else "bfloat16")
    if args.spec_head and args.spec != "eagle3":
        raise ValueError("--spec-head needs --spec eagle3")
    if args.spec_head and (why := missing_head(args.spec_head)):
        raise ValueError(f"--spec-head: {why}")
    try:
        spec = None if args.spec == "none" else SpecConfig(
            method=args.spec, head=args.spec_head, num_tokens=args.spec_tokens)
    except ValueError as e:  # SpecConfig's own range checks, e.g. num_tokens in 0..16
        raise ValueError(f"--spec-tokens: {e}") from None
    return device, dtype, spec


def build_engine(args, settings: tuple | None = None):
    """The engine the model arguments ask for (`settings`: `engine_settings(args)` already
    checked)."""
    import torch

    from engine import Engine
    from engine.loader import resolve

    device, dtype, spec = settings or engine_settings(args)
    if args.model is not None:
        resolve(args.model)  # FileNotFoundError with the path, before anything loads
    return Engine.from_pretrained(args.model, device=device, dtype=getattr(torch, dtype),
                                  spec=spec)


def cmd_generate(args) -> int:
    from engine import InvalidRequestError, SamplingParams

    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                seed=args.seed, max_tokens=args.max_tokens, stop=tuple(args.stop))
    except InvalidRequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompt = [{"role": "user", "content": args.chat}] if args.chat else args.prompt
    if not prompt:
        print("error: give a prompt or --chat", file=sys.stderr)
        return 2
    try:
        settings = engine_settings(args)
        print("loading model…", file=sys.stderr, flush=True)
        engine = build_engine(args, settings)
    except (ValueError, FileNotFoundError) as e:  # bad settings; no model or head there
        print(f"error: {one_line(e) if len(str(e).splitlines()) > 1 else e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a file the loader cannot parse (struct.error, ...)
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    first = None
    n = 0
    reason = None
    try:
        for out in engine.stream(prompt, params):
            if first is None:
                first = time.perf_counter()
            n += len(out.token_ids)
            sys.stdout.write(out.text)
            sys.stdout.flush()
            reason = out.finish_reason
    except InvalidRequestError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 2
    end = time.perf_counter()
    ttft = (first or end) - t0
    decode_tps = (n - 1) / (end - first) if first and n > 1 and end > first else 0.0
    spec = ""
    if engine.spec is not None:
        st = engine.spec.stats
        spec = f", {args.spec} {st.acceptance_length:.2f} tokens/forward"
    print(f"\n\n[{n} tokens, finish={reason}, TTFT {ttft * 1000:.0f} ms, "
          f"decode {decode_tps:.1f} tokens/s, {engine.config.device}{spec}]", file=sys.stderr)
    return 0


def _check_paths(cfg) -> None:
    """FileNotFoundError for a missing model or head folder where they load here."""
    if cfg.mode != "colocated" and (cfg.ray_address or os.environ.get("RAY_ADDRESS")):
        return  # another node's disk
    if cfg.model.path is not None:
        from engine.loader import resolve

        resolve(cfg.model.path)
    from cluster.engine_args import missing_head

    head = cfg.speculation.head
    if cfg.speculation.method == "eagle3" and head is not None and (why := missing_head(head)):
        raise FileNotFoundError(f"speculation.head: {why}")


def cmd_serve(args) -> int:
    """Serve tandem.v1.Generation until interrupted: the disaggregated cluster (Ray prefill and
    decode actors, KV over UCX) or, with --colocated, one engine in this process."""
    import asyncio
    import threading

    from cluster.config import ConfigError, apply_overrides, load_config
    from cluster.engine_args import engine_kwargs
    from engine.metrics import Metrics
    from router.auth import server_security
    from router.server import GenerationService, start_server

    sets = list(args.set) + (["mode=colocated"] if args.colocated else [])
    try:
        cfg = apply_overrides(load_config(args.config), sets)
        _check_paths(cfg)  # before anything loads
        subcommands.check_ports(args, cfg)
        security = server_security(cfg.security)  # PEM and token files read before loading
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    host = args.host if args.host is not None else cfg.router.host
    port = args.port if args.port is not None else cfg.router.port
    print(f"starting {cfg.mode} serving…", file=sys.stderr, flush=True)
    if cfg.mode == "colocated":
        from engine import Engine
        from engine.jit_watch import use_cache_dir
        from router.backends import LocalBackend

        use_cache_dir(cfg.engine.triton_cache_dir)  # before anything compiles
        started = time.perf_counter()

        def make() -> Engine:  # on the engine's own thread (`EngineLoop`)
            engine = Engine.from_pretrained(cfg.model.path, **engine_kwargs(cfg, "colocated"))
            # graphs, frozen objects, compiles logged and counted from here on
            engine.prepare_to_serve(progress=True, started=started)
            return engine

        try:
            backend = LocalBackend(chat_special_tokens=cfg.router.chat_special_tokens, make=make)
        except KeyboardInterrupt:  # the build goes on on its thread: leave without waiting
            print("interrupted while loading", file=sys.stderr, flush=True)
            os._exit(130)
        except Exception as e:  # noqa: BLE001 - the engine refused its config (size, device)
            print(f"error: the engine did not start: {one_line(e)}", file=sys.stderr)
            return 2
        print(f"engine {backend.engine.ready}", file=sys.stderr, flush=True)
        close = backend.close
    else:
        from cluster import launcher

        try:
            cluster = launcher.start_from_config(cfg)
        except ConnectionError as e:  # no Ray cluster there, or it wants a token (`join`)
            print(f"error: {e}", file=sys.stderr)
            return 2
        except Exception as e:  # noqa: BLE001 - an actor's engine refused its config
            print(f"error: the cluster did not start: {one_line(e)}", file=sys.stderr)
            return 2
        backend, close = cluster.backend, cluster.shutdown
        for name, p in zip(cfg.components()[1:], cluster.metrics_ports):
            if p is not None:
                print(f"{name} metrics on http://{cfg.metrics.host}:{p}/metrics",
                      file=sys.stderr)
    metrics = Metrics("colocated" if cfg.mode == "colocated" else "router",  # (one process)
                      model_name=backend.info()["model"]) if cfg.metrics.enabled else None
    if cfg.mode != "colocated":
        backend.metrics = metrics  # streams moved off dead workers
    elif metrics is not None:  # one process: the engine's gauges and counters are the router's
        backend.watch(metrics)
    if metrics is not None:
        _, mport = metrics.serve(cfg.metrics.host, cfg.metrics_ports()["router"])
        print(f"metrics on http://{cfg.metrics.host}:{mport}/metrics", file=sys.stderr)

    async def run() -> int:
        """Serve until the demo is done, a signal, or the workers are lost (then 3)."""
        service, server = GenerationService.from_config(backend, cfg.router, metrics), None
        try:  # the demo takes a free HTTP port unless given one: it only talks gRPC
            server, bound = await start_server(service, host, port, **security)
            http = await _start_http(service, cfg, host, 0 if args.demo and args.http_port
                                     is None else args.http_port, security)
        except OSError as e:
            print(f"error: the {'HTTP' if server else 'gRPC'} port: {e}", file=sys.stderr)
            await server.stop(0) if server else None
            service.close()
            return 2
        info = backend.info()
        print(f"serving tandem.v1.Generation on {host}:{bound} ({info['model']}, "
              f"{cfg.mode}, speculation {info['speculation']})", file=sys.stderr, flush=True)
        if args.demo:
            args.address, args.chat, args.prompt = f"{host}:{bound}", args.demo, None
            done = asyncio.Event()
            loop = asyncio.get_running_loop()
            result = [2]

            def demo() -> None:
                try:
                    result[0] = cmd_remote_generate(args)
                except Exception as e:  # noqa: BLE001 - reported, and the server still stops
                    print(f"\nerror: {one_line(e)}", file=sys.stderr)
                finally:
                    loop.call_soon_threadsafe(done.set)

            threading.Thread(target=demo, daemon=True).start()
            await done.wait()
            await server.stop(1)
        else:
            lost = None if cfg.mode == "colocated" else asyncio.ensure_future(
                service.supervise(give_up_s=cfg.router.worker_loss_exit_s))
            signalled = asyncio.ensure_future(_until_signalled())
            await asyncio.wait([t for t in (lost, signalled) if t is not None],
                               return_when=asyncio.FIRST_COMPLETED)
            signalled.cancel()
            grace = 0.0 if lost is not None and lost.done() else cfg.router.drain_grace_s
            print(f"draining: {len(service.inflight)} streams in flight, up to {grace:g} s…",
                  file=sys.stderr, flush=True)
            await service.drain(grace)
            await server.stop(1)
        if http is not None:
            await http.stop()
        service.close()
        if args.demo:
            return result[0]  # the demo's own status: 0 when its completion came
        return 3 if lost is not None and lost.done() else 0

    status = 0
    try:
        status = asyncio.run(run())
    except KeyboardInterrupt:  # a second Ctrl-C during the drain
        pass
    finally:
        close()
    print("stopped: the workers were lost" if status == 3 else "stopped", file=sys.stderr)
    return status


async def _start_http(service, cfg, host: str, port: int | None, security: dict):
    """The OpenAI-compatible API on `port` (None: router.http_port), same TLS and tokens as
    gRPC; None when router.http is off."""
    if not cfg.router.http:
        return None
    from router.openai_http import OpenAIServer, bearer_of, ssl_context

    http = OpenAIServer(service, bearer_of(security))
    tls = ssl_context(cfg.security)
    bound = await http.start(host, cfg.router.http_port if port is None else port, tls)
    print(f"serving the OpenAI-compatible API on {'https' if tls else 'http'}://{host}:{bound}"
          "/v1", file=sys.stderr, flush=True)
    return http


async def _until_signalled() -> None:
    """Until SIGTERM (`ray job stop`, Kubernetes) or SIGINT (Ctrl-C); a second one ends the
    process at once."""
    import asyncio
    import signal

    loop, stop = asyncio.get_running_loop(), asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)


def cmd_remote_generate(args) -> int:
    """`tandem generate --address`: stream from a running server through the SDK."""
    from tandem_client import Client
    from tandem_client.errors import TandemError

    security = client_security(args)
    if security is None:
        return 2
    t0 = time.perf_counter()
    first, n, last = None, 0, None
    kw = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
              max_tokens=args.max_tokens, stop=args.stop or None)
    try:
        with Client(args.address, **security) as c:
            stream = (c.generate(messages=[{"role": "user", "content": args.chat}], **kw)
                      if args.chat else c.generate(args.prompt, **kw))
            for chunk in stream:
                first = first or time.perf_counter()
                n += len(chunk.token_ids)
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                last = chunk
    except (TandemError, ValueError) as e:  # ValueError: a flag out of its field's range
        print(f"\nerror: {e}", file=sys.stderr)
        return 2
    end = time.perf_counter()
    tps = (n - 1) / (end - first) if first and n > 1 and end > first else 0.0
    acc = last.usage.accepted_draft_tokens if last and last.usage else 0
    print(f"\n\n[{n} tokens, finish={last.finish_reason if last else None}, TTFT "
          f"{((first or end) - t0) * 1000:.0f} ms, decode {tps:.1f} tokens/s, {acc} draft tokens "
          f"accepted, via {args.address}]", file=sys.stderr)
    return 0


def cmd_status(args) -> int:
    """Health and model of a running server."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tandem_client import Client
    from tandem_client.errors import TandemError

    security = client_security(args)
    if security is None:
        return 2
    try:
        with Client(args.address, timeout=5, retries=0, **security) as c:
            health = health_pb2_grpc.HealthStub(c.channel).Check(
                health_pb2.HealthCheckRequest(service="tandem.v1.Generation"), timeout=5,
                metadata=c.metadata)
            info = c.model_info()
    except (grpc.RpcError, TandemError) as e:
        # one line: an RpcError's str is the whole multi-line debug record
        why = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) and \
            hasattr(e, "code") else str(e)
        print(f"{args.address}: unreachable ({why})", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)
    print(f"{args.address}: {status}\n{info}")
    return 0 if health.status == health_pb2.HealthCheckResponse.SERVING else 1


def _port(value: str) -> int:
    """An argparse type: a TCP port number, 0..65535."""
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {value!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port: want 0..65535")
    return port


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tandem-serve")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem", description="tandem LLM serving")
    ap.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="stream one completion in the terminal")
    g.add_argument("prompt", nargs="?", default=None, help="raw prompt text")
    g.add_argument("--chat", default=None, help="a user message, rendered with the chat template")
    g.add_argument("--address", default=None, type=subcommands.grpc_address,
                   help="host:port of a running tandem server (default: run the engine here)")
    _add_model_args(g)
    _add_sampling_args(g)
    _add_client_security_args(g)
    g.set_defaults(fn=lambda a: cmd_remote_generate(a) if a.address else cmd_generate(a))
    sv = sub.add_parser("serve", help="serve the gRPC and OpenAI-compatible HTTP APIs "
                        "(disaggregated cluster by default)")
    sv.add_argument("--config", default=None, help="topology YAML (deploy/examples/*.yaml)")
    sv.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config value, e.g. decode.replicas=2 (repeatable)")
    sv.add_argument("--colocated", action="store_true", help="one engine, no Ray")
    sv.add_argument("--host", default=None,
                    help="interface of the gRPC port (default: router.host, 127.0.0.1; "
                         "0.0.0.0: every interface)")
    sv.add_argument("--port", type=_port, default=None,
                    help="gRPC port, 0..65535 (default: router.port, 50051; 0: a free one)")
    sv.add_argument("--http-port", type=_port, default=None,
                    help="OpenAI-compatible HTTP port on the same host, 0..65535 (default: "
                         "router.http_port, 8000; 0: a free one; off: --set router.http=false)")
    sv.add_argument("--demo", default=None, metavar="MESSAGE",
                    help="stream one chat completion through the server, then exit")
    _add_server_security_args(sv)
    _add_sampling_args(sv)
    sv.set_defaults(fn=cmd_serve)
    st = sub.add_parser("status", help="health and model of a running server")
    st.add_argument("--address", default="127.0.0.1:50051", type=subcommands.grpc_address)
    _add_client_security_args(st)
    st.set_defaults(fn=cmd_status)
    argv = list(argv if argv is not None else sys.argv[1:])
    subcommands.add_parsers(sub, argv)
    args = ap.parse_args(argv)
    args.argv = argv
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
