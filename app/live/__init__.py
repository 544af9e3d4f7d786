"""Live transcription: OpenAI's Realtime transcription protocol (``?intent=transcription``) as
transport-independent code.

* :mod:`app.live.protocol`: client events (pydantic), :func:`~app.live.protocol.parse_client_event`
* :mod:`app.live.events`: server events, in the SDK's shapes and the order sessions send them
* :mod:`app.live.audio`: base64 PCM16 (24/16 kHz) and G.711 (8 kHz) to 16 kHz float32
* :mod:`app.live.turns`: server VAD on Silero's probabilities (threshold, prefix padding, silence)
* :mod:`app.live.agreement`: interim text by local agreement; the deltas join to the transcript
* :mod:`app.live.decoding`: the ``decode(audio, options, kind)`` awaitable and its adapters
* :mod:`app.live.session`: :class:`~app.live.session.LiveSession`, the state machine
"""
