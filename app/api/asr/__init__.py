"""The whisper-asr-webservice family: ``POST /asr`` and ``POST /detect-language``.

protocol.py reads its requests (raw PCM bodies, the query's fields, the answers' shapes for
/docs); api_router.py runs them through the door and answers as that service does.

Bazarr's Whisper provider, and other tools written for ahmetoner/whisper-asr-webservice, call
these routes. That service runs one request at a time; here the uploads go through the same
job store and micro-batcher as every other route (same keys, limits, backpressure), so several
Bazarr calls at once share batches. Parameters, content types and answers follow its
``app/webservice.py`` (1.9) and its faster-whisper engine's writers:

* query ``encode`` (default true): false means the body is raw s16le 16 kHz mono PCM, which is
  what Bazarr sends (its own ffmpeg extracts the track); it is wrapped in a WAV header as it is
  spooled, so the rest of the pipeline sees an ordinary file.
* ``/asr``: ``task``, ``language``, ``initial_prompt``, ``word_timestamps``, ``output`` =
  txt|json|vtt|srt|tsv, answered as ``text/plain`` with ``Asr-Engine`` and an attachment
  ``Content-Disposition`` named ``<upload name>.<output>``. ``vad_filter`` is accepted and has
  no effect: this service always cuts uploads at speech. Subtitle cues follow
  ``max_line_width``, ``max_line_count`` and ``max_cue_s`` (this service's own additions).
* ``/detect-language``: ``{"detected_language": "english", "language_code": "en",
  "confidence": 0.98}``, from the first speech window. With no speech at all the code is
  ``und`` (Bazarr treats that as "could not detect").

Unknown query parameters (Bazarr's ``video_file``) are ignored, as they are there.
"""
