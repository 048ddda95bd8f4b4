"""Run ``python -m pagedkv.serve`` as a child process: on a free port, ready when it
answers, stopped with Ctrl-C's signal. The tests and the book use it."""
from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from ..errors import PagedKVError

__all__ = ["free_port", "ServerProcess", "get_json"]


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (the system's choice)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 10.0, api_key: str | None = None):
    headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                timeout=timeout) as r:
        return json.loads(r.read())


class ServerProcess:
    """``python -m pagedkv.serve ARGS`` on 127.0.0.1 and a free port.

    :meth:`start` returns once ``GET /v1/models`` answers (or raises, with the server's
    log, if it exits or takes longer than ``timeout`` seconds); :meth:`stop` sends SIGINT,
    as Ctrl-C does, and returns the exit status. A context manager does both.
    ``api_key``: the server's ``--api-key``, given to it in its environment
    (``$PAGEDKV_API_KEY``: a command line is visible to every user of the machine).
    """

    def __init__(self, *args, python: str = sys.executable, env: dict | None = None,
                 host: str = "127.0.0.1", port: int | None = None, timeout: float = 60.0,
                 cwd: str | None = None, api_key: str | None = None):
        self.host, self.port = host, port or free_port(host)
        self.cmd = [python, "-m", "pagedkv.serve", "--host", host, "--port",
                    str(self.port), *map(str, args)]
        if api_key is not None:
            env = {**(os.environ if env is None else env), "PAGEDKV_API_KEY": api_key}
        self.env, self.timeout, self.cwd, self.proc = env, timeout, cwd, None
        self.api_key = api_key
        self._log = tempfile.TemporaryFile(mode="w+")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """What an OpenAI client takes as ``base_url``."""
        return self.url + "/v1"

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read()

    def start(self) -> "ServerProcess":
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.env, cwd=self.cwd, text=True)
        atexit.register(self._kill)          # a failed caller leaves no server behind
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PagedKVError(f"the server exited with status {self.proc.returncode}:"
                                   f"\n{self.log()}")
            try:
                self.model = get_json(self.url + "/v1/models", 2,
                                      self.api_key)["data"][0]["id"]
                return self
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.1)
        self.proc.kill()
        self.proc.wait()
        raise PagedKVError(f"the server did not answer within {self.timeout} s:\n{self.log()}")

    def stop(self, timeout: float = 20.0) -> int:
        """SIGINT, then wait for the exit (killed, and an error, after ``timeout`` s)."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise PagedKVError(f"the server did not stop within {timeout} s of SIGINT:\n"
                               f"{self.log()}") from None

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        self._log.close()

