"""HTTP: each API family in its own package, as vLLM's ``entrypoints/openai`` keeps its
families (a protocol module, a serving module, a router), and what they share beside them.

Families (none imports another: pyproject.toml's "families" contract):

- ``native``: ``POST /transcribe`` and ``/jobs`` (status, results, listing, events);
- ``openai``: ``/v1/audio/transcriptions``, ``/v1/audio/translations``, ``/v1/models``;
- ``asr``: whisper-asr-webservice's ``/asr`` and ``/detect-language`` (Bazarr);
- ``realtime``: ``/v1/realtime`` (WebSocket) and its client secrets.

Shared: ``errors`` (the one place an error becomes an answer), ``deps`` (the door, the
caller), ``uploads`` (decoding options and the hand-over of a request's audio), ``waiting``
(synchronous routes), ``idempotency``, ``json_form``, the service's own routes (``health``,
``docs``, ``web``, ``webhooks``), and every ASGI middleware (``middleware``). Everything here
reaches the core through its door (app/jobs/door.py) alone.
"""
