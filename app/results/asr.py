"""whisper-asr-webservice's answers (``POST /asr``): the shapes its faster-whisper engine's
writers produce, which Bazarr and similar clients parse (app/api/asr serves them)."""

from __future__ import annotations

import json
from typing import Any

from app.results.formats import CueOptions, render, segment_words


def asr_json(result: dict[str, Any], words: bool) -> dict[str, Any]:
    """faster-whisper's result as whisper-asr-webservice writes it: ``language``, ``segments``
    (``dataclasses.asdict`` of faster-whisper's Segment, texts with Whisper's leading space) and
    ``text``, their concatenation."""
    segments = []
    for k, (s, ws) in enumerate(segment_words(result)):
        segments.append({
            "id": k + 1, "seek": s.get("seek", 0), "start": s["start"], "end": s["end"],
            "text": " " + str(s["text"]).strip(), "tokens": s.get("tokens", []),
            "avg_logprob": s.get("avg_logprob"), "compression_ratio": s.get("compression_ratio"),
            "no_speech_prob": s.get("no_speech_prob"),
            "words": [{"start": w["start"], "end": w["end"], "word": " " + str(w["word"]).strip(),
                       "probability": w.get("probability")} for w in ws or []] if words else None,
            "temperature": s.get("temperature"),
        })
    return {"language": result.get("language"), "segments": segments,
            "text": "".join(s["text"] for s in segments)}


def asr_body(result: dict[str, Any], output: str, words: bool, cue: CueOptions) -> str:
    if output == "json":
        return json.dumps(asr_json(result, words), ensure_ascii=False)
    if output == "txt":  # one line per segment
        return "".join(f"{s['text'].strip()}\n" for s, _ in segment_words(result))
    return render(result, output, cue)
