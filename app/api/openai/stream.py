"""OpenAI ``stream=true`` on /v1/audio/transcriptions: Server-Sent Events as windows finish.

OpenAI's API and speaches answer a streamed transcription with ``data:`` lines carrying
``{"type": "transcript.text.delta", "delta": ...}`` events and a last
``{"type": "transcript.text.done", "text": ...}``; the ``openai`` client's stream iterator reads
exactly these. For a long upload it is the only way a synchronous client sees text before its
own time-out, so the stream has no time limit of its own and sends a comment line as a
keep-alive whenever nothing else was sent for ``KEEPALIVE_S``.

The stream follows its job as everything else does (``Door.follow``, app/jobs/events.py): it
wakes when the job's one feed has news, so a thousand streams on a job read the store once per
change, not once each. Deltas follow the upload's order: a window's text is sent once it and
every window before it have finished (:meth:`app.jobs.door.Door.finished_texts`), joined with
single spaces as the final transcript joins them, so the deltas add up to the ``done`` event's
text. A job run by another replica streams too: keep-alives while the store says it runs
(re-read every ``RECHECK_S``), then one delta with the whole text. A failed or cancelled job
ends the stream with OpenAI's error event (``{"error": {...}}``, which the client raises as
``APIError``). When the client hangs up, the job is cancelled: nobody can collect its answer
(as for the non-streamed call).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from app.api.errors import openai_body
from app.errors import public_error
from app.jobs.door import Door, EventFeed, JobView

log = logging.getLogger(__name__)
# Proxies commonly drop a connection idle for 60 s (nginx's proxy_read_timeout default).
KEEPALIVE_S = 10.0
_cleanups: set[asyncio.Task[None]] = set()  # cancellations of abandoned jobs, until they finish


def event(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n".encode()


def delta_event(delta: str, logprobs: list[dict[str, Any]] | None = None) -> bytes:
    return event({"type": "transcript.text.delta", "delta": delta, "logprobs": logprobs})


def stream_response(d: Door, job_id: str, owner: str | None, headers: dict[str, str],
                    logprobs: bool = False) -> StreamingResponse:
    return StreamingResponse(
        transcript_events(d, job_id, owner, logprobs), media_type="text/event-stream",
        # no-transform / X-Accel-Buffering: proxies must not buffer or compress the stream.
        headers={**headers, "Cache-Control": "no-cache, no-transform", "X-Accel-Buffering": "no"},
    )


async def transcript_events(d: Door, job_id: str, owner: str | None, logprobs: bool = False
                            ) -> AsyncIterator[bytes]:
    """With ``logprobs``, each delta carries its window's token log-probabilities and the
    done event all of them (app/results/logprobs.py), as OpenAI's events do."""
    sent_windows = 0
    text = ""
    ended = False
    sub = d.follow(job_id, owner)
    feed = sub.feed
    try:
        while True:
            sub.wake.clear()  # before reading: news during the reads wakes the next wait
            for piece, probs in _finished(d, job_id, sent_windows, logprobs):
                sent_windows += 1
                piece = piece.strip()
                if piece:
                    delta = f" {piece}" if text else piece
                    text += delta
                    yield delta_event(delta, probs)
            if feed.final is not None or feed.gone:
                ended = True
                for chunk in _end(feed.final, job_id, text, logprobs):
                    yield chunk
                return
            if feed.closed:  # draining (this job will not finish here), or the store is away
                yield event(_closed(feed))
                return
            try:
                async with asyncio.timeout(KEEPALIVE_S):  # not wait_for: see app/jobs/webhooks.py
                    await sub.wake.wait()
            except TimeoutError:
                yield b": keep-alive\n\n"
    finally:
        sub.release()
        if not ended:  # the client hung up, or the service is draining
            task = asyncio.get_running_loop().create_task(_cancel(d, job_id, owner))
            _cleanups.add(task)
            task.add_done_callback(_cleanups.discard)


def _finished(d: Door, job_id: str, start: int, logprobs: bool
              ) -> list[tuple[str, list[dict[str, Any]] | None]]:
    """The texts of the windows finished in order from ``start`` (and their tokens' log-
    probabilities when asked for)."""
    if logprobs:
        return [(t, p) for t, p in d.finished_logprobs(job_id, start) or ()]
    return [(t, None) for t in d.finished_texts(job_id, start) or ()]


def _closed(feed: EventFeed) -> dict[str, Any]:
    if feed.failed:
        return openai_body(503, "the job store is unavailable for a moment; retry shortly",
                           code="store_unavailable")
    return openai_body(503, "the service is restarting; retry the request", code="shutting_down")


def _end(row: JobView | None, job_id: str, sent: str, logprobs: bool = False) -> list[bytes]:
    if row is None:
        return [event(openai_body(404, f"job {job_id} no longer exists", code="not_found"))]
    if row.status == "failed":
        err = public_error(row.error) or {}
        return [event(openai_body(500, str(err.get("message", "transcription failed")),
                                  code=str(err.get("type", "transcription_failed"))))]
    if row.status != "done" or row.result is None:
        return [event(openai_body(409, f"job {job_id} was {row.status}", code=row.status))]
    final = str(row.result.get("text", ""))
    out = []
    if final.startswith(sent):
        if rest := final[len(sent):]:
            out.append(delta_event(rest))  # the windows not seen here (another replica ran them)
    else:  # the transcript was assembled differently from the windows' texts
        log.warning("stream of job %s: deltas are not a prefix of the final text", job_id)
    every = (row.result.get("logprobs") or []) if logprobs else None
    out.append(event({"type": "transcript.text.done", "text": final, "logprobs": every}))
    return out


async def _cancel(d: Door, job_id: str, owner: str | None) -> None:
    try:
        await d.cancel(job_id, owner)  # a job that ended meanwhile stays as it ended
    except Exception:  # the store is closing: the job stays; a restart resumes it
        log.warning("could not cancel job %s after its stream ended", job_id, exc_info=True)
