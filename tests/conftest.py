"""Shared pytest configuration.

The browser test drives Debian's Chromium (``/usr/bin/chromium``, installed by
``scripts/setup.sh``) through Playwright; Playwright's own browser downloads are never
used. pytest-playwright builds its browser from the ``browser_type_launch_args``
fixture, which is overridden here to point at that executable.
"""
from __future__ import annotations

import os
import shutil

import pytest

CHROMIUM_ARGS = [
    "--no-sandbox",            # CI runs as root, where Chromium's sandbox cannot start
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]


def chromium_executable() -> str | None:
    """The system Chromium: $CHROMIUM if set, else /usr/bin/chromium, else one on PATH."""
    for candidate in (os.environ.get("CHROMIUM"), "/usr/bin/chromium",
                      shutil.which("chromium"), shutil.which("chromium-browser")):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args):
    executable = chromium_executable()
    if executable is None:
        pytest.fail("Chromium is not installed: run `bash scripts/setup.sh` "
                    "(it installs Debian's chromium package)")
    return {
        **browser_type_launch_args,
        "executable_path": executable,
        "headless": True,
        "args": CHROMIUM_ARGS,
    }


@pytest.fixture(scope="module")
def tiny(request):
    """The tiny random Llama of ``tests/_tiny.py`` on NumPy, its weights drawn from the test
    module's ``SEED``."""
    from _tiny import tiny_llama
    return tiny_llama(request.module.SEED)


def pytest_configure(config):
    # pytest-playwright's own base_url fixture triggers this deprecation notice in every
    # run; it is about the plugin's code, not ours.
    config.addinivalue_line(
        "filterwarnings",
        "ignore:Session-scoped fixtures defined as instance methods are deprecated")
