"""The benchmark command runs and reports every number it promises (timings are not checked)."""
import json

from pagedkv.bench.__main__ import main


def test_bench_json_has_every_key(capsys):
    assert main(["--json", "--repeat", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("alloc_free_ns", "decode_step_us", "decode_step_in_loop_us",
                "decode_step_no_new_block_us", "fork_beams_us"):
        assert isinstance(out[key], float) and out[key] > 0, key


def test_bench_table_and_missing_peer(capsys, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "nanovllm", None)      # make the peer unimportable
    assert main(["--repeat", "1", "--peers"]) == 0
    text = capsys.readouterr().out
    assert "one block allocated and freed" in text and "nano-vllm: not importable" in text


def test_bench_rejects_zero_repeats():
    import pytest
    with pytest.raises(SystemExit):
        main(["--repeat", "0"])
