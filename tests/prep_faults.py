"""Fault injection inside a prep process (tests/test_prep_procs.py): the process's entry point,
with the decoder made to crash the process on an upload whose name says ``poison`` (what a
decoder bug on a hostile file does: the process dies mid-step, no exception, no record)."""

from __future__ import annotations

import os
import signal
from typing import Any


def crashing_main(*args: Any) -> None:
    import app.audio.decoder as decoder
    from app.audio.procs import child

    read = decoder.AudioDecoder.read

    def crash_on_poison(self: decoder.AudioDecoder, n: int) -> Any:
        if "poison" in str(self._container.name):
            os.kill(os.getpid(), signal.SIGKILL)
        return read(self, n)

    decoder.AudioDecoder.read = crash_on_poison  # type: ignore[method-assign]
    child.main(*args)
