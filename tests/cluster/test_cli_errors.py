"""`tandem generate`: a bad flag value or path ends with exit 2 and one line naming it,
before (or instead of) loading any weights; never a traceback."""

import pytest

from cluster import subcommands
from cluster.cli import main


@pytest.mark.parametrize("argv, says", [
    (["--spec", "eagle3", "--spec-tokens", "99"], "--spec-tokens: num_tokens must be in 0..16"),
    (["--spec", "eagle3", "--spec-tokens", "-1"], "--spec-tokens"),
    (["--spec", "eagle3", "--spec-head", "/nonexistent/head"], "--spec-head: no EAGLE-3 head"),
    (["--spec-head", "assets/eagle3-smollm2-135m-instruct"], "--spec-head needs --spec eagle3"),
    (["--device", "tpu"], "--device: 'tpu' is not cpu, cuda or cuda:N"),
    (["--model", "/nonexistent/model"], "no model at '/nonexistent/model'"),
    (["--max-tokens", "0"], "max_tokens must be > 0"),
])
def test_generate_refuses_bad_flags_in_one_line(argv, says, capsys, monkeypatch):
    import engine

    def no_load(*a, **k):
        raise AssertionError("weights loaded for a refused command")

    monkeypatch.setattr(engine.Engine, "from_pretrained", no_load)
    assert main(["generate", "--device", "cpu", *argv, "hello"]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_generate_without_a_prompt_refuses_before_loading(capsys, monkeypatch):
    import engine

    monkeypatch.setattr(engine.Engine, "from_pretrained",
                        lambda *a, **k: pytest.fail("weights loaded without a prompt"))
    assert main(["generate", "--device", "cpu"]) == 2
    assert "give a prompt or --chat" in capsys.readouterr().err


def test_a_model_file_the_loader_cannot_parse_is_one_line(capsys, tmp_path):
    """Not a GGUF, empty, a header alone, a file cut short: one line naming the file."""
    import os

    from engine import loader

    ck = loader.embedded_checkpoint()
    with open(os.path.join(ck.folder, ck.gguf_file), "rb") as f:
        head = f.read(16 << 20)  # the metadata and the first tensors, not all of them
    for name, data, says in [("text.gguf", b"hello\n", "is not a GGUF file"),
                             ("empty.gguf", b"", "shorter than its header"),
                             ("header.gguf", head[:4096], "a torn or malformed GGUF file"),
                             ("cut.gguf", head, "ends past the file's end")]:
        path = tmp_path / name
        path.write_bytes(data)
        assert main(["generate", "--device", "cpu", "--model", str(path), "hi"]) == 2
        err = capsys.readouterr().err
        assert f"error: {path}" in err and says in err and "Traceback" not in err, err


@pytest.mark.parametrize("address, says", [
    ("127.0.0.1:99999", "the port must be 1..65535"), ("localhost:", "the port must be"),
    ("", "is not HOST:PORT"), ("::1", "an IPv6 address goes in brackets")])
def test_an_address_gRPC_would_rewrite_is_refused(address, says, capsys):
    with pytest.raises(SystemExit) as e:
        main(["status", "--address", address])
    assert e.value.code == 2 and says in capsys.readouterr().err
    # a host alone means tandem's port, not gRPC's 443; gRPC's own target forms pass
    assert subcommands.grpc_address("localhost") == "localhost:50051"
    assert subcommands.grpc_address("[::1]:7") == "[::1]:7"
    assert subcommands.grpc_address("unix:/tmp/t.sock") == "unix:/tmp/t.sock"


def test_cuda_asked_for_without_cuda_is_refused(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["generate", "--device", "cuda", "hello"]) == 2
    assert "no CUDA device here" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["--colocated", "--set", "decode.replicas=-1"], "decode.replicas must be in 1..1024"),
    (["--set", "nonsense"], "is not of the form section.key=value"),
    (["--config", "/nonexistent/tandem.yaml"], "/nonexistent/tandem.yaml"),
    (["--colocated", "--set", "model.path=/nonexistent/model"], "no model at"),
    (["--colocated", "--set", "speculation.head=/nonexistent/head"], "no EAGLE-3 head"),
    (["--set", "speculation.head=/nonexistent/head"], "no EAGLE-3 head"),  # before Ray starts
    (["--set", "decode.replicas=100000000"], "decode.replicas must be in 1..1024"),
    (["--colocated", "--set", "decode.replicas=2"], "decode.replicas must be 1, got 2"),
    (["--config", "/"], "cannot read it as a config file"),
    (["--colocated", "--host", "no.such.host.invalid"], "--host no.such.host.invalid: not an"),
])
def test_serve_refuses_a_bad_config_in_one_line(argv, says, capsys, monkeypatch):
    import engine

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(engine.Engine, "from_pretrained",
                        lambda *a, **k: pytest.fail("weights loaded for a refused config"))
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_an_engine_that_refuses_its_config_is_one_line(capsys, monkeypatch):
    import engine

    def refuse(*a, **k):
        raise ValueError("max_model_len 1000000 is beyond the model's 8192")

    monkeypatch.setattr(engine.Engine, "from_pretrained", refuse)
    assert main(["serve", "--colocated", "--port", "0", "--demo", "hi"]) == 2
    err = capsys.readouterr().err
    assert "error: the engine did not start: ValueError: max_model_len 1000000" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("flag", [["--seed", "-1"], ["--max-tokens", "-1"], ["--top-k", "-1"]])
def test_generate_against_a_server_refuses_out_of_range_flags_in_one_line(flag, capsys):
    assert main(["generate", "--address", "127.0.0.1:1", *flag, "hello"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err


def test_status_of_no_server_says_so_in_one_line(capsys):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["status", "--address", f"127.0.0.1:{port}"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"127.0.0.1:{port}: unreachable (UNAVAILABLE") and "\n" not in err


@pytest.mark.parametrize("port, says", [("70000", "70000 is not a port: want 0..65535"),
                                        ("-1", "-1 is not a port"), ("http", "not a port")])
def test_serve_refuses_a_port_out_of_range(port, says, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--port", port])
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("tandem ") and out.split()[1][0].isdigit()


def test_serve_binds_grpc_and_http_on_the_host_given(capsys, monkeypatch):
    """`serve --host`: both ports listen on that interface only (127.0.0.2 here, so the
    default 127.0.0.1 refuses a connection); the demo's client is pointed at it."""
    import re
    import socket

    import engine
    from cluster import cli
    from engine.testing import tiny_engine

    monkeypatch.setattr(engine.Engine, "from_pretrained", lambda *a, **k: tiny_engine(0))
    seen = {}

    def reach(host: str, port: int) -> bool:
        try:
            socket.create_connection((host, port), timeout=5).close()
            return True
        except OSError:
            return False

    def demo(args) -> int:  # instead of a chat completion: where the servers listen
        host, port = args.address.rsplit(":", 1)
        http = int(re.search(r"OpenAI-compatible API on http://[\d.]+:(\d+)/v1",
                             capsys.readouterr().err)[1])
        seen.update(host=host, grpc=[reach(h, int(port)) for h in ("127.0.0.2", "127.0.0.1")],
                    http=[reach(h, http) for h in ("127.0.0.2", "127.0.0.1")])
        return 0

    monkeypatch.setattr(cli, "cmd_remote_generate", demo)
    assert main(["serve", "--colocated", "--host", "127.0.0.2", "--port", "0",
                 "--set", "metrics.enabled=false", "--demo", "hi"]) == 0
    assert seen == {"host": "127.0.0.2", "grpc": [True, False], "http": [True, False]}


@pytest.mark.parametrize("outcome", ["fails", "raises"])
def test_serve_demo_exits_with_the_demos_status(outcome, capsys, monkeypatch):
    """A demo whose completion failed (or that raised) stops the server and exits 2."""
    import engine
    from cluster import cli
    from engine.testing import tiny_engine

    monkeypatch.setattr(engine.Engine, "from_pretrained", lambda *a, **k: tiny_engine(0))

    def demo(args) -> int:
        if outcome == "raises":
            raise ValueError("Value out of range: -1")
        return 2

    monkeypatch.setattr(cli, "cmd_remote_generate", demo)
    assert main(["serve", "--colocated", "--port", "0", "--set", "metrics.enabled=false",
                 "--demo", "hi"]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_a_second_server_on_a_port_in_use_is_refused(capsys, monkeypatch):
    import socket

    import engine
    from engine.testing import tiny_engine

    with socket.socket() as s:  # a port another server listens on, as gRPC's own would
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        argv = ["serve", "--colocated", "--port", str(port), "--set", "metrics.enabled=false",
                "--demo", "hi"]
        built = []
        monkeypatch.setattr(engine.Engine, "from_pretrained",
                            lambda *a, **k: built.append(1) or tiny_engine(0))
        assert main(argv) == 2  # found before the engine loads
        err = capsys.readouterr().err
        assert f"error: the gRPC port 127.0.0.1:{port}: Address already in use" in err
        assert not built and "Traceback" not in err
        # taken between that check and the bind (a race): refused once loaded, as cleanly
        monkeypatch.setattr(subcommands, "check_ports", lambda args, cfg: None)
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error: the gRPC port: cannot listen on" in err and "Traceback" not in err
