"""An OpenAI-compatible HTTP server on the engine, and a chat page that draws the pool live.

    python -m pagedkv.serve [--host 127.0.0.1] [--port 8000] [--num-blocks N] [--prefix-caching]

Its parts, as in the peers' front doors (vLLM's and transformers' servers), by role:

* the HTTP layer, which checks and bounds what comes in (:mod:`~.limits`), and only
  translates OpenAI's bodies (:mod:`~.protocol`) into jobs and their events into chunks
  (:mod:`~.app`); it never waits for the engine;
* the engine's one client (:mod:`~.client`): jobs in flight, a watchdog, and the text half
  (:mod:`~.texts`: token ids into text, stop strings);
* the engine's core (:mod:`~.core`): the one place that touches the engine, and the block
  maps it shows (:mod:`~.pool`);
* between the two, typed messages (:mod:`~.messages`) over one of two transports
  (:mod:`~.transport`): a thread of the server's process, or, by default, a process of
  the engine's own, made from an :class:`~.start.EngineSpec`;
* ``static/``: the chat page at ``/``, served from the package (no CDN).

The stack is Starlette on uvicorn. Starlette is the small ASGI toolkit FastAPI is built on:
routing, streaming responses, static files, the Host and CORS middlewares are all a server
of seven routes needs, and without FastAPI's pydantic validation every bad input gets the
project's own OpenAI-style message (FastAPI would answer 422 in its own format unless
overridden). uvicorn is the ASGI server both are documented with; it handles Ctrl-C as a
graceful shutdown. Both are well kept (Encode's projects, releases every few weeks).

Importing this package imports neither the model nor the kernels.
"""

__all__ = ["main"]


def main(argv=None) -> int:
    from .__main__ import main as _main
    return _main(argv)
