"""An OpenAI-compatible HTTP server on the engine, and a chat page that draws the pool live.

    python -m pagedkv.serve [--host 127.0.0.1] [--port 8000] [--num-blocks N] [--prefix-caching]

Three parts, as in the peers' front doors (vLLM's and transformers' servers):

* :mod:`~pagedkv.serve.loop`: one thread owns the engine; requests and cancellations reach
  it through a queue, and it steps the engine and sends each request's new text back;
* :mod:`~pagedkv.serve.protocol` and :mod:`~pagedkv.serve.app`: the HTTP layer, which only
  translates OpenAI's bodies into jobs and the loop's events into chunks;
* ``static/``: the chat page at ``/``, served from the package (no CDN).

The stack is Starlette on uvicorn. Starlette is the small ASGI toolkit FastAPI is built on:
routing, streaming responses and static files are all a server of five routes needs, and
without FastAPI's pydantic validation every bad input gets the project's own OpenAI-style
message (FastAPI would answer 422 in its own format unless overridden). uvicorn is the
ASGI server both are documented with; it handles Ctrl-C as a graceful shutdown. Both are
well kept (Encode's projects, releases every few weeks).
"""
from .loop import EngineLoop, Job

__all__ = ["EngineLoop", "Job", "main"]


def main(argv=None) -> int:
    from .__main__ import main as _main
    return _main(argv)
