"""The command line, ``python -m pagedkv``, run in subprocesses: bad input is one line on stderr,
exit status 2, no traceback, and it is refused before any work starts."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedkv.__main__ import _parser
from pagedkv.errors import ConfigError


def cli(*args, env=None, timeout=120):
    full_env = {**os.environ, **(env or {})}
    full_env.setdefault("PAGEDKV_BACKEND", "numpy")
    return subprocess.run([sys.executable, "-m", "pagedkv", *args], capture_output=True,
                          text=True, env=full_env, timeout=timeout)


def assert_refused(out, *words):
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr + out.stdout
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("python -m pagedkv: error: ")
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert "workload" not in out.stdout          # refused before the simulation ran


def _gpu_usable() -> bool:
    from pagedkv import backend
    return backend._cupy_if_usable()[0] is not None


@pytest.mark.parametrize("args, words", [
    (["--seed", "-1"], ["--seed", "non-negative", "-1"]),
    (["--seed", "x"], ["--seed", "'x'"]),
    (["--concurrency", "0"], ["--concurrency", "positive", "0"]),
    (["--block-size", "0"], ["--block-size"]),
    (["--requests", "0"], ["--requests"]),
    (["--preset", "sharegpt"], ["--preset", "sharegpt"]),
    (["--scale", "0"], ["--scale", "positive"]),
    (["--scale", "-5"], ["--scale"]),
    (["--bookkeeping", "quick"], ["--bookkeeping"]),
    (["--frobnicate"], ["--frobnicate"]),
])
def test_bad_arguments(args, words):
    out = cli(*args)
    assert_refused(out, *words)
    assert "max_seqs" not in out.stderr          # the option's name, not the internal one


def test_too_many_requests_are_refused_up_front_with_the_memory_they_need():
    out = cli("--requests", "1000000000", timeout=60)
    assert_refused(out, "--requests 1000000000", "would need about", "TB", "use at most")


def test_too_large_a_scale_is_refused_before_the_first_run():
    out = cli("--scale", str(10**11), timeout=60)
    assert_refused(out, "--scale", "would need about")


def test_a_pool_too_small_for_one_block_is_one_line():
    out = cli("--block-size", str(10**9))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert len(out.stderr.splitlines()) == 1 and "smaller than one block" in out.stderr


def test_unknown_backend_is_one_line():
    assert_refused(cli(env={"PAGEDKV_BACKEND": "tpu"}), "PAGEDKV_BACKEND", "tpu")


@pytest.mark.skipif(_gpu_usable(), reason="a GPU is usable here, so cupy can be had")
def test_cupy_without_a_gpu_is_one_line():
    assert_refused(cli(env={"PAGEDKV_BACKEND": "cupy"}), "PAGEDKV_BACKEND=cupy")


def test_fast_bookkeeping_when_it_cannot_be_used_is_refused_before_the_run():
    from pagedkv import sim
    try:
        sim.check_bookkeeping("fast")
    except ConfigError:
        pass
    else:
        pytest.skip("pagedkv.fast is usable here")
    assert_refused(cli("--scale", "5", "--bookkeeping", "fast"), "pagedkv.fast")


def test_help_is_plain_text_with_help_for_every_option():
    out = cli("--help")
    assert out.returncode == 0 and out.stderr == ""
    for marker in ("``", ":func:", ":class:", ":mod:", "::"):
        assert marker not in out.stdout, marker
    for action in _parser()._actions:
        assert action.help, action.option_strings
        for opt in action.option_strings:
            assert opt in out.stdout


def test_a_good_run_prints_the_dashboard():
    out = cli("--requests", "4", "--concurrency", "2", "--seed", "3")
    assert out.returncode == 0, out.stderr
    assert "4 completions" in out.stdout and "0 corrupted" in out.stdout
    assert out.stderr == ""
