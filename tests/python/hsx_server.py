"""Start and stop real hsx-server processes for the tests.

The server is started on 127.0.0.1 with port 0 and reports the ports it bound
on stderr ("hsx-server: listening on 127.0.0.1:PORT", "hsx-server: metrics on
127.0.0.1:PORT"); start() waits until grpc.health.v1 reports SERVING.
"""

import re
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import grpc

LISTEN_RE = re.compile(r"hsx-server: listening on (\S+)")
METRICS_RE = re.compile(r"hsx-server: metrics on (\S+)")


class HsxServer:
    def __init__(self, bin_dir, model, *args, listen="127.0.0.1:0", metrics=True, env=None):
        self.cmd = [str(Path(bin_dir) / "hsx-server"), "--model", str(model), "--listen", listen]
        if metrics:
            self.cmd += ["--metrics-listen", "127.0.0.1:0"]
        self.cmd += [str(a) for a in args]
        self.env = env
        self.proc = None
        self.address = None
        self.metrics_address = None
        self.log = []
        self._reader = None

    def start(self, timeout=60, wait_serving=True):
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, env=self.env)
        self._reader = threading.Thread(target=self._read_log, daemon=True)
        self._reader.start()
        deadline = time.time() + timeout
        while self.address is None:
            if self.proc.poll() is not None:
                raise self._exited()
            if time.time() > deadline:
                raise TimeoutError(f"hsx-server did not report its address:\n{self.text()}")
            time.sleep(0.02)
        if wait_serving:
            self.wait_serving(deadline - time.time())
        return self

    def _read_log(self):
        for line in self.proc.stderr:
            self.log.append(line)
            if m := LISTEN_RE.search(line):
                self.address = m.group(1)
            if m := METRICS_RE.search(line):
                self.metrics_address = m.group(1)

    def text(self):
        return "".join(self.log)

    def _exited(self):
        """The error for a server that exited: with its whole log, so the reader thread (which
        may not have reached the last lines when the exit was seen) is first let reach the end."""
        self._reader.join(5)
        return RuntimeError(f"hsx-server exited with {self.proc.returncode}:\n{self.text()}")

    def health(self, service=""):
        from grpc_health.v1 import health_pb2, health_pb2_grpc  # here: the trainers' venv has no grpc_health
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

    def wait_serving(self, timeout=60):
        """Until grpcio's health client reports SERVING."""
        from grpc_health.v1 import health_pb2
        self._wait(lambda: self.health() == health_pb2.HealthCheckResponse.SERVING, "SERVING", timeout)

    def wait_ready(self, timeout=60):
        """Until the server logs "ready:" (when its health turns SERVING), for environments
        without grpc_health (the trainers' venv)."""
        self._wait(lambda: "ready: " in self.text(), "ready", timeout)

    def _wait(self, done, what, timeout):
        deadline = time.time() + timeout
        while True:
            try:
                if done():
                    return
            except grpc.RpcError:
                pass
            if self.proc.poll() is not None:
                raise self._exited()
            if time.time() > deadline:
                raise TimeoutError(f"hsx-server not {what} after {timeout}s:\n{self.text()}")
            time.sleep(0.05)

    def signal(self, sig):
        self.proc.send_signal(sig)

    def kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout=60):
        """SIGTERM and wait; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._reader:
            self._reader.join(5)
        return self.proc.returncode

    def scrape(self):
        """The /metrics values by series ('name' or 'name{labels}'); needs metrics=True."""
        with urllib.request.urlopen(f"http://{self.metrics_address}/metrics", timeout=5) as r:
            text = r.read().decode()
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                values[key] = float(value)
        return values

    def rss_bytes(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        if self.proc and self.proc.poll() is None:
            self.stop()
        return False
