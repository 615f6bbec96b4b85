"""The `tandem` subcommands beside generate, serve and status: train-eagle3, bench, diagnose
and soak, each registered from its own module (`cluster.cli` builds the parser); and what the
commands share: the checks of --address and of serve's ports that run before anything
connects or loads, and errors told in one line."""

from __future__ import annotations

import os
import re
import sys

# Subcommands whose modules import torch at their top, with their help: registered in full
# only when invoked, so that `tandem serve` (a router process must not load torch) and the
# light commands build their parser without them.
HEAVY = {"train-eagle3": "self-distil and train an EAGLE-3 draft head",
         "bench": "run the benchmark figures (bench/suite.py), one JSON per figure"}


def _add_heavy_parsers(sub, argv: list[str]) -> None:
    """Register `HEAVY`'s subcommands: in full the one argv invokes, the others by name and
    help alone (what `tandem --help` lists)."""
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, help_ in HEAVY.items():
        if name != wanted:
            sub.add_parser(name, help=help_)
        elif name == "bench":
            _add_bench_parser(sub)
        else:
            from cluster import train_eagle3

            train_eagle3.add_parser(sub, help_)


def _add_bench_parser(sub) -> None:
    """`tandem bench`: the figures of the `bench` package (`bench.suite`)."""
    desc = HEAVY["bench"]
    try:
        from bench import suite
    except ImportError as e:
        err = f"the bench package is not importable ({e}); install tandem from a source checkout"
        b = sub.add_parser("bench", help=desc, description=err)
        b.set_defaults(fn=lambda a: print(f"error: {err}", file=sys.stderr) or 2)
        return
    b = sub.add_parser("bench", help=desc, description=suite.__doc__.split("\n")[0],
                       epilog="figures: " + ", ".join(f"{n} {v[0]}"
                                                      for n, v in suite.FIGURES.items()))
    suite.add_arguments(b)
    b.set_defaults(fn=suite.run)


def _add_diagnose_parser(sub) -> None:
    """`tandem diagnose`: findings from a running deployment's metrics (`cluster.diagnose`)."""
    from cluster import diagnose

    d = sub.add_parser("diagnose", help="read a deployment's metrics endpoints and say what is "
                       "wrong", description=diagnose.__doc__)
    diagnose.add_arguments(d)
    d.set_defaults(fn=diagnose.run)


def add_parsers(sub, argv: list[str]) -> None:
    """Register these subcommands on the CLI's subparsers, `HEAVY`'s in full only where argv
    invokes them."""
    _add_heavy_parsers(sub, argv)
    _add_diagnose_parser(sub)
    from cluster import soak

    soak.add_parser(sub)


SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")  # gRPC's own forms


def grpc_address(text: str) -> str:
    """argparse type of --address: HOST:PORT (port 1..65535), [IPv6]:PORT, or a host alone
    (port 50051, not gRPC's 443); gRPC's scheme forms (dns:, unix:, ...) pass as they are."""
    import argparse

    if text.startswith(SCHEMES):
        return text
    m = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+)(?::(\S*))?", text)
    if m is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not HOST:PORT (an IPv6 address goes in brackets: [::1]:50051)")
    host, port = m.group(1), m.group(2)
    if port is None:
        return f"{host}:50051"
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: the port must be 1..65535")
    return text


def check_ports(args, cfg) -> None:
    """ValueError where serve's gRPC or HTTP port cannot be bound (in use, or a host that is
    not this machine's): found before minutes of loading, not after."""
    import socket

    host = args.host if args.host is not None else cfg.router.host
    ports = {"gRPC": args.port if args.port is not None else cfg.router.port}
    if cfg.router.http and not args.demo:
        ports["HTTP"] = args.http_port if args.http_port is not None else cfg.router.http_port
    for what, port in ports.items():
        try:
            infos = socket.getaddrinfo(host, port or None, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            raise ValueError(f"--host {host}: not an address here ({e.strerror})") from None
        if not port:
            continue  # 0: a free one
        family, kind, proto, _, where = infos[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
            try:
                s.bind(where)
            except OSError as e:
                raise ValueError(f"the {what} port {host}:{port}: {e.strerror}") from None


def one_line(e: BaseException) -> str:
    """An error in one line (of Ray's wrapped ones, with an actor's traceback: its cause)."""
    text = str(e).strip()
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    if len(lines) > 1:
        named = [x for x in lines if re.match(r"^[A-Za-z_.]*(Error|Exception)\b.*:", x)]
        return (named[-1] if named else lines[-1])[:500]
    return f"{type(e).__name__}: {text}"[:500]


def unwritable(folder: str) -> str | None:
    """Why this process cannot write files into `folder` (None: it can; the folder is made
    now where missing), for refusing an output path before minutes of work, not after."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        return e.strerror or str(e)
    return None if os.access(folder, os.W_OK | os.X_OK) else \
        "not a folder this process can write in"
