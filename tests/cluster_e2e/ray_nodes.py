"""Ray nodes of the cluster tests' own on this machine, token auth on: `ray start --block`
processes with ports, a temp dir and a token of their own. Stopping one kills its process group
and nothing else (`ray stop` would stop every Ray on the machine)."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

BIN = os.path.dirname(sys.executable)
RAY = shutil.which("ray", path=BIN) or shutil.which("ray")
TANDEM = shutil.which("tandem", path=BIN) or shutil.which("tandem")
# Ports every node binds; the defaults may be held by another Ray on this machine (its job
# agent then cannot bind, and every submission says "No available agent").
NODE_PORTS = ("node-manager", "object-manager", "dashboard-agent-listen", "dashboard-agent-grpc",
              "runtime-env-agent", "metrics-export")
# GPUs the session's Ray instance is told it has, and its node's own CUDA_VISIBLE_DEVICES (as
# on a shared host): Ray trusts the count, so test_gpu_visibility places GPU actors without a
# GPU. Actors that book no GPU (the cluster's, on the CPU) are not affected by either.
NODE_GPUS = "4,5,6,7"


_GIVEN: set[int] = set()  # ports free_port handed out in this process


def free_port() -> int:
    """A port free now that this process has not handed out before: two picks can return the
    same port, and Ray refuses a node whose components share one."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def torch_threads() -> int:
    """Torch threads of each process that computes at once in a cluster test (the test's own
    and two actors'): OMP_NUM_THREADS where set (`make test` sets it per worker), else the
    cores shared out between three."""
    given = os.environ.get("OMP_NUM_THREADS")
    return int(given) if given else max(1, (os.cpu_count() or 1) // 3)


def client_env(env: dict | None = None) -> dict:
    """This process's environment without Ray's address and auth settings, to set afresh,
    with `torch_threads()` for the processes it starts."""
    env = dict(os.environ if env is None else env)
    for key in [k for k in env if k.startswith("RAY_AUTH") or k == "RAY_ADDRESS"]:
        del env[key]
    return {**env, "UCX_WARN_UNUSED_ENV_VARS": "n", "OMP_NUM_THREADS": str(torch_threads())}


class RayNodes:
    """A head and the worker nodes added to it. The head finds the cluster's token in
    RAY_AUTH_TOKEN_PATH and, as Ray does by default when it finds one, checks it on every
    call; `env` is a client's environment that sends it."""

    def __init__(self, head_cpus: int = 2, head_resources: str | None = None):
        # Short: Ray's unix socket paths under it must fit in 107 characters.
        self.root = tempfile.mkdtemp(prefix="tdm-ray-", dir="/tmp")
        self.token_path = os.path.join(self.root, "token")
        with open(self.token_path, "w") as f:
            f.write(secrets.token_hex(32))
        self.env = {**client_env(), "RAY_AUTH_MODE": "token",
                    "RAY_AUTH_TOKEN_PATH": self.token_path}
        self.procs: list[subprocess.Popen] = []
        try:
            self.add(head_cpus, head_resources, head=True)
        except BaseException:
            self.close()
            raise

    def add(self, cpus: int, resources: str | None = None, head: bool = False):
        """Start a node (a worker node of this head unless `head`) with `cpus` CPUs and
        `resources` (JSON), once its processes are up. A node that exits before it is up is
        tried once more on fresh ports (another process may have taken one of those
        `free_port` picked; a head's address and dashboard follow its ports); the error
        carries `ray start`'s output."""
        # A head turns token auth on where it finds a token (Ray's default); a node joining
        # it is told to.
        env = {k: v for k, v in self.env.items() if k != "RAY_AUTH_MODE"} if head else self.env
        for attempt in (1, 2):
            if head:
                self.gcs, self.dash = free_port(), free_port()
                self.address = f"127.0.0.1:{self.gcs}"
                self.dashboard = f"http://127.0.0.1:{self.dash}"
                flags = ["--head", f"--port={self.gcs}", "--dashboard-host=127.0.0.1",
                         f"--dashboard-port={self.dash}",
                         f"--ray-client-server-port={free_port()}"]
            else:
                flags = [f"--address={self.address}"]
            argv = [RAY, "start", "--block", *flags,
                    "--node-ip-address=127.0.0.1", f"--num-cpus={cpus}",
                    "--disable-usage-stats", f"--temp-dir={self.root}/ray",
                    *[f"--{name}-port={free_port()}" for name in NODE_PORTS],
                    *([f"--resources={resources}"] if resources else [])]
            proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)
            self.procs.append(proc)
            lines = []
            for line in proc.stdout:  # --block prints this once the node's processes are up
                if "will now block forever" in line:
                    threading.Thread(target=proc.stdout.read, daemon=True).start()  # drained
                    return proc
                lines.append(line)
            code = proc.wait()  # stays in self.procs: close() clears what it left
            if attempt == 2:
                tail = "".join(lines[-20:])
                raise AssertionError(
                    f"ray start {' '.join(argv[3:5])} exited with {code}:\n{tail}")

    def close(self) -> None:
        """Stop the nodes, the last added first, then remove the temp dir."""
        for proc in reversed(self.procs):
            proc.terminate()  # `ray start --block` stops the processes it started
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
            try:  # whatever of its group is left (a worker process, an agent)
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.procs.clear()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> RayNodes:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def retry_agent(run, timeout: float = 120):
    """`run()` (a CompletedProcess of a `ray job` command) again while the head's job agent is
    not ready yet (it says so)."""
    end = time.monotonic() + timeout
    while True:
        done = run()
        if "No available agent" not in done.stdout + done.stderr or time.monotonic() > end:
            return done
        time.sleep(0.25)
