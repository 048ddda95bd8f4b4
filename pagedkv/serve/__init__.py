"""An OpenAI-compatible HTTP server on the engine, and a chat page that draws the pool live.

    python -m pagedkv.serve [--host 127.0.0.1] [--port 8000] [--num-blocks N] [--prefix-caching]

Its parts, as in the peers' front doors (vLLM's and transformers' servers):

* :mod:`~pagedkv.serve.loop`: one loop owns the engine; requests and cancellations reach it
  through a queue, and it steps the engine and sends each request's new text back. Its two
  halves, :class:`~.loop.EngineCore` (the engine, token ids) and :class:`~.loop.Texts`
  (text, stop strings, events), run on one thread, or, by default, with the core in a
  process of its own (:mod:`~pagedkv.serve.engine_process`);
* :mod:`~pagedkv.serve.protocol`, :mod:`~pagedkv.serve.app` and :mod:`~pagedkv.serve.limits`:
  the HTTP layer, which checks and bounds what comes in, and only translates OpenAI's bodies
  into jobs and the loop's events into chunks;
* ``static/``: the chat page at ``/``, served from the package (no CDN).

The stack is Starlette on uvicorn. Starlette is the small ASGI toolkit FastAPI is built on:
routing, streaming responses and static files are all a server of five routes needs, and
without FastAPI's pydantic validation every bad input gets the project's own OpenAI-style
message (FastAPI would answer 422 in its own format unless overridden). uvicorn is the
ASGI server both are documented with; it handles Ctrl-C as a graceful shutdown. Both are
well kept (Encode's projects, releases every few weeks).
"""
from .engine_process import EngineProcess
from .loop import EngineCore, EngineLoop, Job, Texts

__all__ = ["EngineLoop", "EngineProcess", "EngineCore", "Texts", "Job", "main"]


def main(argv=None) -> int:
    from .__main__ import main as _main
    return _main(argv)
