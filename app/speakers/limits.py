"""What one request may carry of known speakers: plain data, no code.

The API (app/api: the form limits of ``POST /transcribe`` and ``/v1/audio/transcriptions``,
and the streaming field meter in app/api/middleware/fields.py) and the speaker code that checks
the references (app/speakers/named.py) read the same numbers from here. A module of constants
alone, so the door contract (pyproject.toml) can let the API import it without letting it reach
the speaker models, as it lets it import ``app.engine.languages``.
"""

from __future__ import annotations

MAX_KNOWN = 4  # known speakers per request: OpenAI's limit
# A reference clip's form part: a data URL field on /v1 (10 s of 48 kHz stereo 16-bit WAV in
# base64), a file on /transcribe.
PART_BYTES = 4 * 1024 * 1024
