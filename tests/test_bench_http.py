"""``python -m pagedkv.bench.http``: reading server-sent events and the statistics, on
hand-made inputs; then a ``--quick`` run end to end on the tiny model, where the command
starts the server itself (127.0.0.1, a free port) and stops it before it returns."""
import asyncio
import concurrent.futures
import json
import time

import pytest

from pagedkv.bench import http, serve

REQUIRED = ("output_tokens_per_s", "ttft_ms", "itl_ms", "completed", "errors")


def chunk(text, finish=None):
    return "data: " + json.dumps({"object": "text_completion", "choices": [
        {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]})


def usage(tokens):
    return "data: " + json.dumps({"choices": [], "usage": {
        "prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": 5 + tokens}})


def consume(lines):
    """``http.consume`` over ``lines``, on a clock that ticks 0.1 s at every call."""
    ticks = iter(range(1, 1000))

    async def source():
        for line in lines:
            yield line
    # (on a thread of its own: a browser test's driver may run an event loop on this one)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, http.consume(source(), http.blank(),
                                                     lambda: next(ticks) / 10)).result()


def test_sse_data_reads_data_lines_only():
    assert http.sse_data('data: {"a": 1}') == '{"a": 1}'
    assert http.sse_data("data:[DONE]") == "[DONE]"
    for other in ("", ": a comment", "event: message", "id: 3"):
        assert http.sse_data(other) is None


def test_consume_keeps_content_chunks_usage_and_finish():
    rec = consume([chunk("ab"), "", chunk(""), "", chunk("c", "length"), "", usage(3), "",
                   "data: [DONE]", "", chunk("after the end")])
    # a tick per line read: the chunks with text came on the 1st and the 5th line
    assert rec["times"] == [0.1, 0.5] and rec["texts"] == ["ab", "c"]
    assert rec["tokens"] == 3 and rec["finish"] == "length" and rec["error"] is None


def test_consume_reports_an_error_object_and_a_stream_cut_short():
    rec = consume([chunk("a"), "", 'data: {"error": {"message": "the engine failed"}}', ""])
    assert rec["error"] == "error in the stream: the engine failed"
    assert rec["times"] == [0.1]
    assert consume([chunk("a"), ""])["error"] == "the stream ended without [DONE]"


def record(due, times, tokens, end, error=None):
    return dict(http.blank(), due=due, sent=due + 0.001, times=times, tokens=tokens,
                end=end, error=error, texts=["x"] * len(times))


def test_summarize_on_hand_made_records():
    records = [record(0.0, [0.1, 0.2, 0.4], 3, 0.5),
               record(0.5, [0.7, 0.8], 4, 1.0),          # its second chunk: three tokens
               record(0.2, [], None, 0.3, error="HTTP 429: busy")]
    s = http.summarize(records)
    assert s["output_tokens"] == 7 and s["wall_s"] == pytest.approx(1.0)
    assert s["output_tokens_per_s"] == pytest.approx(7.0)
    assert s["completed"] == 2 and s["errors"] == 1
    assert s["error_examples"] == ["HTTP 429: busy"]
    ms = pytest.approx
    assert s["ttft_ms"]["p50"] == ms(150) and s["ttft_ms"]["max"] == ms(200)   # 0.1, 0.2
    assert s["itl_ms"]["p50"] == ms(100) and s["itl_ms"]["max"] == ms(200)     # .1 .2 .1
    assert s["tpot_ms"]["max"] == pytest.approx(150)            # (0.4 - 0.1) / 2
    assert s["tpot_ms"]["p50"] == pytest.approx((150 + 100 / 3) / 2)
    assert s["tokens_per_chunk"] == pytest.approx(7 / 5)
    assert s["send_lag_ms"]["max"] == pytest.approx(1)
    assert s["completion_tokens"] == [3, 4, None]


def test_bad_arguments_are_refused_before_a_server_starts():
    for bad in (["--concurrency", "0"], ["--clients", "0"], ["--rate", "-1"],
                ["--url", "http://127.0.0.1:9", "--audit"], ["--stream-interval", "0"],
                ["--stream-interval", "8", "8"],
                ["--url", "http://127.0.0.1:9", "--stream-interval", "8"]):
        with pytest.raises(SystemExit):
            http.main(["--quick", "--model", "tiny", *bad])


def test_quick_run_end_to_end(tmp_path, capsys):
    out = tmp_path / "http.json"
    t = time.monotonic()
    # --audit is not this command's flag: it goes to the server, which then checks the
    # pool's invariants after every engine step
    assert http.main(["--quick", "--model", "tiny", "--ttft-probe", "3", "--audit",
                      "--json", str(out)]) == 0
    elapsed = time.monotonic() - t
    print(capsys.readouterr().out)                     # the table, for the log
    assert elapsed < 60
    r = json.loads(out.read_text())
    for side in ("http", "engine"):
        assert set(REQUIRED) <= set(r[side]), (side, sorted(r[side]))
        assert r[side]["completed"] == 12 and r[side]["errors"] == 0
        assert r[side]["ttft_ms"]["p50"] > 0 and r[side]["itl_ms"]["p99"] > 0
    assert r["server_exit"] == 0 and r["server_log_tail"] == ""
    assert "--audit" in r["server_flags"] and r["command"].startswith(
        "python -m pagedkv.bench.http --quick")
    assert r["ttft_probe"]["errors"] == 0 and r["ttft_probe"]["p50"] > 0
    asked = [o for *_, o in serve.make_requests(12, 8, 40, seed=0)]
    assert r["engine"]["output_tokens"] == sum(asked)       # the engine ignores its EOS
    # the server honours "ignore_eos": every answer has exactly the tokens asked for
    h = r["http"]
    assert h["completion_tokens"] == asked and set(h["finish_reasons"]) == {"length"}


def test_stream_intervals_side_by_side(tmp_path, capsys):
    """``--stream-interval 1 8``: a server at each, the same requests; every answer whole
    at both, and at 8 fewer chunks carry more tokens each (the first text still at
    once: the TTFT probe answers)."""
    out = tmp_path / "http.json"
    assert http.main(["--quick", "--model", "tiny", "--ttft-probe", "2", "--no-engine",
                      "--stream-interval", "1", "8", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    print(table)
    assert "http/1" in table and "http/8" in table and "stream interval 8: p50" in table
    r = json.loads(out.read_text())
    runs = r["stream_intervals"]
    asked = [o for *_, o in serve.make_requests(12, 8, 40, seed=0)]
    for k in ("1", "8"):
        h = runs[k]["http"]
        assert h["stream_interval"] == int(k) and runs[k]["server_exit"] == 0
        assert h["completed"] == 12 and h["errors"] == 0
        assert h["completion_tokens"] == asked
        assert runs[k]["ttft_probe"]["errors"] == 0
        assert runs[k]["server_flags"][-4:-2] == ["--stream-interval", k]
    per_chunk = {k: runs[k]["http"]["tokens_per_chunk"] for k in runs}
    assert per_chunk["8"] > max(3, per_chunk["1"]), per_chunk
    assert r["http"] == runs["1"]["http"]                   # the first run's on top
