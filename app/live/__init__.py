"""Live transcription: OpenAI's Realtime transcription protocol (``?intent=transcription``) as
transport-independent code (issue 34).

* :mod:`app.live.protocol`: client events (pydantic), :func:`~app.live.protocol.parse_client_event`
* :mod:`app.live.events`: server events, in the SDK's shapes and the order sessions send them
* :mod:`app.live.audio`: base64 PCM16 (24/16 kHz) and G.711 (8 kHz) to 16 kHz float32; the buffer
* :mod:`app.live.turns`: server VAD on Silero's probabilities (threshold, prefix padding, silence)
* :mod:`app.live.agreement`: interim text by local agreement; the deltas join to the transcript
* :mod:`app.live.decoding`: the ``decode(audio, options, kind)`` awaitable and its adapters
* :mod:`app.live.config`: the session's effective configuration and :class:`LiveLimits`
* :mod:`app.live.session`: :class:`~app.live.session.LiveSession`, the state machine, and
  :func:`~app.live.session.serve`, which runs one over any transport

The service runs it at ``/v1/realtime`` (app/api/realtime, through the door to
app/jobs/live.py): keys or a short-lived client secret on the handshake, sessions bounded per key
and in total, decodes through the shared batcher (:func:`~app.live.decoding.batcher_decoder`,
urgency passed in one place for the batcher's priority classes), the transcript kept as a job.
"""
