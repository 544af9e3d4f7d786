"""``Idempotency-Key`` on POST /transcribe, /v1/audio/transcriptions and /v1/audio/translations.

The same key from the same caller (API key owner, or the single keyless tenant) within
``storage.idempotency_window_s`` (24 h) names the first job instead of making a new one: a
client that lost the answer to its POST (a timeout, a crash, a resumed ``batchscribe dataset``
run) sends it again and gets that job, never a second transcription of the same file.

* Storage, and two POSTs with one key at once: the core's (app/jobs/intake.py); the request
  that loses the race answers with the first one's job, its own upload dropped.
* POST /transcribe: :class:`app.api.middleware.idempotency.IdempotencyGate` looks the key up
  before the body is read, and a known key is answered as the route would answer (202 with the
  job; ``?wait=true`` waits). The upload is read and thrown away, never spooled, probed or
  stored: answering before reading it would make the server close a connection with unread
  bytes, which resets it under the client (it may never see the answer). A replay bypasses the
  backlog gate: it adds no work.
* /v1 needs its form fields (``response_format``) to answer, so its lookup runs after the form is
  parsed, still before spooling. A /v1 request with a key keeps its job when the client hangs up
  (without one the job is cancelled: nobody could collect it; with one, the retry will).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Header

from app.errors import BadRequest

HEADER = "Idempotency-Key"
MAX_KEY_CHARS = 255
REPLAYED = "Idempotent-Replayed"  # response header on an answer that names an earlier job

KeyHeader = Annotated[str | None, Header(
    alias=HEADER,
    description="The same key from the same caller within 24 h answers with the first job made "
    "with it instead of making a new one: a retry after a lost answer is not transcribed twice.",
)]


def parse_key(raw: str | None) -> str | None:
    """The key of a header value; None when absent. 400 (not retryable) when malformed.

    A structured-field string (``"abc"``, as the IETF draft writes it) and a bare token (as
    Stripe's clients send it) name the same key.
    """
    if raw is None:
        return None
    key = raw.strip()
    if len(key) >= 2 and key[0] == key[-1] == '"':
        key = key[1:-1]
    if not key or len(key) > MAX_KEY_CHARS or not (key.isascii() and key.isprintable()):
        raise BadRequest(f"{HEADER} must be 1-{MAX_KEY_CHARS} printable ASCII characters",
                         field=HEADER, no_retry=True)
    return key
