"""A trace of the batcher's decisions, from inside a real server, for ``loadtest.stall``.

Started as the server's entry point (``python -c "import loadtest.lib.batch_trace as t; t.main()"``
with ``BATCHSCRIBE_BATCH_TRACE=<path>``): it wraps :meth:`Batcher.submit` and
:meth:`Batcher._engine` (one engine call; no service file changes) and writes one JSON line per call, stamped
with ``time.monotonic()`` (CLOCK_MONOTONIC: the same clock as the load generator's on this host,
so a slow request is placed among the batches around it). A line per engine call names its
stage, its windows (job, rank, padded samples, job size, when each was queued and encoded), and
when the call began and ended; a line per submit names the job and its windows' padded lengths.
Each line costs ~20 us on the event loop: nothing against a batch's 0.1-10 s.
"""

from __future__ import annotations

import json
import os
import runpy
import time
from collections.abc import Sequence
from typing import Any, TextIO

_out: TextIO | None = None


def _write(rec: dict[str, Any]) -> None:
    if _out is not None:
        _out.write(json.dumps(rec) + "\n")
        _out.flush()


def install(path: str) -> None:
    """Wrap the batcher's entry points; every line goes to ``path``."""
    global _out
    from app.batching.batcher import Batcher
    from app.batching.owner import Call
    from app.windows import DecodeOptions, Window

    _out = open(path, "a", buffering=1)  # noqa: SIM115 - open for the process's life
    submit, engine = Batcher.submit, Batcher._engine

    def traced_submit(self: Batcher, job_id: str, windows: Sequence[Window],
                      options: DecodeOptions, **kw: Any) -> Any:
        futures = submit(self, job_id, windows, options, **kw)
        padded = [self._stages.padded(w) if self._stages else 0 for w in windows]
        _write({"ev": "submit", "t": time.monotonic(), "job": job_id, "n": len(windows),
                "first_rank": kw.get("first_rank", 0), "job_windows": kw.get("job_windows"),
                "padded": padded, "dur": [round(w.duration, 2) for w in windows]})
        return futures

    async def traced_engine(self: Batcher, call: Call) -> None:
        t0 = time.monotonic()
        try:
            await engine(self, call)
        finally:
            _write({"ev": "call", "stage": call.stage, "t0": t0, "t1": time.monotonic(),
                    "bulk": call.bulk, "cost_s": call.cost_s,
                    "items": [{"job": i.job_id, "rank": i.rank, "padded": i.padded,
                               "job_windows": i.job_windows, "enq": i.enqueued,
                               "pooled": i.pooled or None, "dur": round(i.window.duration, 2),
                               "urgency": int(i.urgency)}
                              for i in call.items]})

    Batcher.submit = traced_submit  # type: ignore[method-assign]
    Batcher._engine = traced_engine  # type: ignore[method-assign]


def main() -> None:
    path = os.environ.get("BATCHSCRIBE_BATCH_TRACE")
    if path:
        install(path)
    runpy.run_module("app", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
