"""Live transcription: OpenAI's Realtime transcription protocol (``?intent=transcription``) as
transport-independent code (issue 34, phase A).

* :mod:`app.live.protocol`: client events (pydantic), :func:`~app.live.protocol.parse_client_event`
* :mod:`app.live.events`: server events, in the SDK's shapes and the order sessions send them
* :mod:`app.live.audio`: base64 PCM16 (24/16 kHz) and G.711 (8 kHz) to 16 kHz float32; the buffer
* :mod:`app.live.turns`: server VAD on Silero's probabilities (threshold, prefix padding, silence)
* :mod:`app.live.agreement`: interim text by local agreement; the deltas join to the transcript
* :mod:`app.live.decoding`: the ``decode(audio, options, kind)`` awaitable and its adapters
* :mod:`app.live.config`: the session's effective configuration and :class:`LiveLimits`
* :mod:`app.live.session`: :class:`~app.live.session.LiveSession`, the state machine, and
  :func:`~app.live.session.serve`, which runs one over any transport

Phase B wires it into the service: a ``/v1/realtime`` WebSocket route (API key from the
``Authorization`` header or a short-lived client secret) that accepts, builds
``LiveSession(decoder, vad, limits, executor)`` and calls ``serve(session, receive, send)``;
``vad`` is the service's one ``SileroVad`` (each session takes its own probability stream from
it), ``executor`` the prep pool, ``limits`` a ``live`` block of the settings, and ``decoder``
:func:`~app.live.decoding.batcher_decoder` once the batcher has priority classes (finals first,
interim decodes droppable: raise :class:`~app.live.decoding.Shed`). ``session.items`` holds every
committed turn for keeping the session as a job; ``session.counts`` feeds the metrics.
"""
