"""kernel_peers.prebuild_flashinfer picks the prebuild API of the installed FlashInfer release.

FlashInfer is not installed in CI, so each test puts stand-in modules shaped like one release
into ``sys.modules``: their generators record what they were asked for and the build records
what it was given, so a wrong dispatch (a 0.2 module path on 0.7, the public prefill module
where the release builds another, a build when an API is missing) fails here."""
from __future__ import annotations

import sys
import types

import pytest

from pagedkv.bench import kernel_peers


class FakeTorch:
    float16, bfloat16, int32 = "f16", "bf16", "i32"


def _module(monkeypatch, name, **attrs):
    m = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(m, k, v)
    monkeypatch.setitem(sys.modules, name, m)
    return m


def _gen(log, tag):
    def gen(*args):
        log.append((tag, args))
        return f"{tag}-spec-{len(log)}"
    return gen


@pytest.fixture
def no_flashinfer(monkeypatch):
    """Every flashinfer module a test reaches is one of its stand-ins (a real one, if
    installed, is shadowed by the stand-in parents and restored afterwards)."""
    for k in [k for k in sys.modules if k.split(".")[0] == "flashinfer"]:
        monkeypatch.delitem(sys.modules, k)


def release_0_2(monkeypatch, log, built):
    fi = _module(monkeypatch, "flashinfer", __version__="0.2.14.post1")
    _module(monkeypatch, "flashinfer.jit")
    _module(monkeypatch, "flashinfer.jit.attention")
    _module(monkeypatch, "flashinfer.jit.attention.pytorch",
            gen_batch_decode_module=_gen(log, "decode"),
            gen_batch_prefill_module=_gen(log, "prefill"))
    _module(monkeypatch, "flashinfer.jit.core", build_jit_specs=built.append)
    return fi


def release_0_7(monkeypatch, log, built, version="0.7.2.post1", primary=True, build=True):
    fi = _module(monkeypatch, "flashinfer", __version__=version)
    jit = dict(gen_batch_decode_module=_gen(log, "decode"),
               gen_batch_prefill_module=_gen(log, "public-prefill"))
    if build:
        jit["build_jit_specs"] = built.append
    _module(monkeypatch, "flashinfer.jit", **jit)
    _module(monkeypatch, "flashinfer.jit.attention")
    if primary:
        _module(monkeypatch, "flashinfer.jit.attention.modules",
                _gen_batch_prefill_primary_module=_gen(log, "primary-prefill"))
    return fi


def test_release_numbers():
    assert kernel_peers.flashinfer_release("0.2.14.post1") == (0, 2)
    assert kernel_peers.flashinfer_release("0.7.2.post1") == (0, 7)
    assert kernel_peers.flashinfer_release("1.10.0rc1") == (1, 10)
    assert kernel_peers.flashinfer_release("?") is None
    assert kernel_peers.flashinfer_release(None) is None


def test_0_2_builds_through_jit_attention_pytorch(monkeypatch, no_flashinfer):
    log, built = [], []
    fi = release_0_2(monkeypatch, log, built)
    res = kernel_peers.prebuild_flashinfer(FakeTorch, ["float16", "bfloat16"], 128, fi)
    assert res == dict(flashinfer_version="0.2.14.post1", flashinfer_prebuilt=True,
                       flashinfer_prebuild="flashinfer.jit.attention.pytorch")
    assert [t for t, _ in log] == ["decode", "prefill", "decode", "prefill"]
    assert log[0][1] == ("f16", "f16", "f16", "i32", 128, 128, 0, False, False)
    assert log[3][1] == ("fa2", "bf16", "bf16", "bf16", "i32", 128, 128, 0, False, False,
                         False)
    assert built == [["decode-spec-1", "prefill-spec-2", "decode-spec-3", "prefill-spec-4"]]


def test_0_7_builds_the_prefill_module_its_decode_wrapper_uses(monkeypatch, no_flashinfer):
    log, built = [], []
    fi = release_0_7(monkeypatch, log, built)
    res = kernel_peers.prebuild_flashinfer(FakeTorch, ["bfloat16"], 64, fi)
    assert res["flashinfer_prebuilt"] and res["flashinfer_version"] == "0.7.2.post1"
    assert "_gen_batch_prefill_primary_module" in res["flashinfer_prebuild"]
    assert [t for t, _ in log] == ["decode", "primary-prefill"]      # not the public one
    assert log[1][1][:2] == ("fa2", "bf16") and log[1][1][5:7] == (64, 64)
    assert built == [["decode-spec-1", "primary-prefill-spec-2"]]
    # and the 0.2 module path, absent here, was not needed
    assert "flashinfer.jit.attention.pytorch" not in sys.modules


def test_a_later_release_without_the_private_module_uses_the_public_one(
        monkeypatch, no_flashinfer):
    log, built = [], []
    fi = release_0_7(monkeypatch, log, built, version="0.4.1", primary=False)
    res = kernel_peers.prebuild_flashinfer(FakeTorch, ["float16"], 128, fi)
    assert res["flashinfer_prebuild"] == "flashinfer.jit"
    assert [t for t, _ in log] == ["decode", "public-prefill"]
    assert len(built) == 1


def test_missing_api_skips_with_a_note_and_builds_nothing(monkeypatch, no_flashinfer):
    log, built = [], []
    fi = release_0_7(monkeypatch, log, built, build=False)
    res = kernel_peers.prebuild_flashinfer(FakeTorch, ["float16"], 128, fi)
    assert res["flashinfer_prebuilt"] is False
    assert res["flashinfer_prebuild"].startswith("skipped: FlashInfer 0.7.2.post1")
    assert "build_jit_specs" in res["flashinfer_prebuild"]
    assert built == []


def test_version_decides_the_module_path(monkeypatch, no_flashinfer):
    """A 0.2 version string with only the later layout present: the 0.2 path is looked
    for, is missing, and nothing is built (rather than guessing)."""
    log, built = [], []
    fi = release_0_7(monkeypatch, log, built, version="0.2.9")
    res = kernel_peers.prebuild_flashinfer(FakeTorch, ["float16"], 128, fi)
    assert not res["flashinfer_prebuilt"] and "ModuleNotFoundError" in res[
        "flashinfer_prebuild"]
    assert log == [] and built == []


def test_unknown_version_skips(monkeypatch, no_flashinfer):
    log, built = [], []
    fi = release_0_7(monkeypatch, log, built, version="dev")
    res = kernel_peers.prebuild_flashinfer(FakeTorch, ["float16"], 128, fi)
    assert res == dict(flashinfer_version="dev", flashinfer_prebuilt=False,
                       flashinfer_prebuild="skipped: version 'dev' is not one this knows")
    assert built == []


def test_a_failed_build_is_recorded_not_raised(monkeypatch, no_flashinfer):
    log, built = [], []
    fi = release_0_7(monkeypatch, log, built)

    def broken(specs):
        raise RuntimeError("ninja: build stopped: subcommand failed.")
    monkeypatch.setattr(sys.modules["flashinfer.jit"], "build_jit_specs", broken)
    res = kernel_peers.prebuild_flashinfer(FakeTorch, ["float16"], 128, fi)
    assert res["flashinfer_prebuilt"] is False
    assert res["flashinfer_prebuild"].startswith("failed: flashinfer.jit")
    assert "ninja: build stopped" in res["flashinfer_prebuild"]
