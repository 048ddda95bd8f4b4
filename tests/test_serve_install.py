"""The ``serve`` extra is enough: ``pip install .[serve]`` into a fresh venv (PyPI, or the
index pip is configured with), then ``python -m pagedkv.serve --model tiny`` from that venv
answers ``/v1/models`` and a completion, and stops on SIGINT with status 0.

The venv is made outside the source tree and the server runs from another directory, so
that it imports the installed package, not this checkout.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request

import pytest

from pagedkv.serve.process import ServerProcess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTALL_TIMEOUT = 300


def test_serve_extra_in_a_fresh_venv(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    build = tmp_path / "src"              # a copy: pip builds in it, the checkout stays clean
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\n")
    for f in files:
        if f and (f.startswith(("pagedkv/", "solutions/")) or f in ("pyproject.toml",
                                                                    "README.md")):
            dest = build / f
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.join(ROOT, f), dest)
    r = subprocess.run([python, "-m", "pip", "install", "--quiet",
                        "--disable-pip-version-check", f"{build}[serve]"],
                       capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
    if r.returncode and "No matching distribution" in r.stderr:
        pytest.skip(f"no package index reachable: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    with ServerProcess("--model", "tiny", python=python, env=env, timeout=60,
                       cwd=str(tmp_path)) as s:
        body = json.dumps({"model": s.model, "prompt": "hi", "max_tokens": 4,
                           "temperature": 0}).encode()
        req = urllib.request.Request(s.base_url + "/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            answer = json.loads(resp.read())
        assert answer["usage"]["completion_tokens"] >= 1
        where = subprocess.run([python, "-c", "import pagedkv; print(pagedkv.__file__)"],
                               capture_output=True, text=True, env=env, cwd=tmp_path,
                               check=True).stdout
        assert str(venv) in where, where
        html = urllib.request.urlopen(s.url + "/", timeout=30).read().decode()
        assert "pagedkv chat" in html                  # the page is in the wheel
    assert s.proc.returncode == 0, s.log()
