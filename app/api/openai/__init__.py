"""The OpenAI family: /v1/audio/transcriptions, /v1/audio/translations, /v1/models.

As vLLM's ``entrypoints/openai`` separates them: protocol.py (the request's fields and their
parsing, the answers' shapes for /docs), serving.py (a parsed request run through the door and
made an answer), stream.py (``stream=true``'s Server-Sent Events), api_router.py (the routes,
thin: parse, call serving). Errors go out in OpenAI's shape (app/api/errors.py: ``OpenAIRoute``).

A thin layer over the job API: the upload is accepted exactly like POST /transcribe (spooled,
probed, backpressured, committed), goes through the same micro-batcher, and the request waits
for its job. If the client hangs up first, the job is cancelled: nobody can collect the answer
of a synchronous call (the OpenAI client would retry and pay twice). Errors on these routes use
OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``; the rest of the API keeps
the native shape.

Clients that retry: the OpenAI SDK resends the whole upload on 408/409/429/5xx and on its own
600 s time-out, unless the answer says ``x-should-retry: false``. So every answer no retry can
change says so (a job that failed on its audio answers with that error's 4xx, as the upload
check would have); the request is answered within ``limits.openai_wait_s`` (540 s), and audio
too long to finish in that time at the current speed is refused up front (413, naming
``POST /transcribe``); a job still running at the deadline is cancelled, never left running
behind a 504 while the SDK uploads it again.

Segments: verbose_json, srt and vtt are decoded with word alignment, so segments are sentences
(OpenAI-like, subtitle-sized) instead of whole 30 s windows; words are returned only when
``timestamp_granularities[]`` asks for them.

Speakers: ``response_format=diarized_json`` runs the job with ``diarize=true`` and answers in the
shape of OpenAI's diarization model (``TranscriptionDiarized`` in the ``openai`` package: ``task``,
``duration``, ``text``, ``segments`` of ``type`` ``transcript.text.segment`` with ``id``,
``speaker``, ``start``, ``end``, ``text``, and ``usage`` by duration). Speakers are named as
OpenAI names them without known speakers: ``A``, ``B``, ... in order of first appearance.
``model`` may be ``gpt-4o-transcribe-diarize`` (what clients of that model send).
``chunking_strategy``'s ``server_vad`` object sets the VAD for the request (protocol.py reads it,
app/audio/server_vad.py applies it);
``include[]=logprobs`` adds token log-probabilities (app/results/logprobs.py).
``known_speaker_names[]`` with ``known_speaker_references[]`` (data URLs, up to 4) name the
speakers they match (app/speakers/named.py); unmatched ones keep letters, and the answer's
``known_speakers`` says how similar each reference was.
"""
