"""Whisper's languages: their codes, their names, and the beam each gets by default.

A plain data module (no model, no torch): the API checks a request's ``language`` against
:data:`CODES` and names a detected language from :data:`LANGUAGES` without loading anything.
The list is the multilingual Whisper tokenizer's, in its order (openai-whisper's
``tokenizer.LANGUAGES``, which faster-whisper keeps as a private ``_LANGUAGE_CODES`` and whisperx
as ``utils.LANGUAGES``); ``tests/test_language.py`` checks it against faster-whisper's.
"""

from __future__ import annotations

ENGLISH = "en"

LANGUAGES: dict[str, str] = {
    "en": "english", "zh": "chinese", "de": "german", "es": "spanish", "ru": "russian",
    "ko": "korean", "fr": "french", "ja": "japanese", "pt": "portuguese", "tr": "turkish",
    "pl": "polish", "ca": "catalan", "nl": "dutch", "ar": "arabic", "sv": "swedish",
    "it": "italian", "id": "indonesian", "hi": "hindi", "fi": "finnish", "vi": "vietnamese",
    "he": "hebrew", "uk": "ukrainian", "el": "greek", "ms": "malay", "cs": "czech",
    "ro": "romanian", "da": "danish", "hu": "hungarian", "ta": "tamil", "no": "norwegian",
    "th": "thai", "ur": "urdu", "hr": "croatian", "bg": "bulgarian", "lt": "lithuanian",
    "la": "latin", "mi": "maori", "ml": "malayalam", "cy": "welsh", "sk": "slovak", "te": "telugu",
    "fa": "persian", "lv": "latvian", "bn": "bengali", "sr": "serbian", "az": "azerbaijani",
    "sl": "slovenian", "kn": "kannada", "et": "estonian", "mk": "macedonian", "br": "breton",
    "eu": "basque", "is": "icelandic", "hy": "armenian", "ne": "nepali", "mn": "mongolian",
    "bs": "bosnian", "kk": "kazakh", "sq": "albanian", "sw": "swahili", "gl": "galician",
    "mr": "marathi", "pa": "punjabi", "si": "sinhala", "km": "khmer", "sn": "shona",
    "yo": "yoruba", "so": "somali", "af": "afrikaans", "oc": "occitan", "ka": "georgian",
    "be": "belarusian", "tg": "tajik", "sd": "sindhi", "gu": "gujarati", "am": "amharic",
    "yi": "yiddish", "lo": "lao", "uz": "uzbek", "fo": "faroese", "ht": "haitian creole",
    "ps": "pashto", "tk": "turkmen", "nn": "nynorsk", "mt": "maltese", "sa": "sanskrit",
    "lb": "luxembourgish", "my": "myanmar", "bo": "tibetan", "tl": "tagalog", "mg": "malagasy",
    "as": "assamese", "tt": "tatar", "haw": "hawaiian", "ln": "lingala", "ha": "hausa",
    "ba": "bashkir", "jw": "javanese", "su": "sundanese", "yue": "cantonese",
}
CODES = frozenset(LANGUAGES)


def default_beams(language: str | None, beam_size: int | None, english: int,
                  other: int) -> tuple[int, int | None]:
    """(beam, beam of windows not in English): the request's ``beam_size`` for all; else the
    defaults, ``english`` for English and ``other`` for the rest (the settings'
    ``default_beam_size`` and ``default_beam_size_other``), decided now when the language is
    given and by the engine per window when it is detected."""
    if beam_size:
        return beam_size, None
    if language is not None:
        return (english if language == ENGLISH else other), None
    return english, (other if other != english else None)
