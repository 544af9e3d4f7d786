"""WER of the service vs calling whisperx directly, one clip at a time, same model and options
(whisperx's transcripts kept between runs and spot-checked against it each run:
tests/references.py)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from loadtest.lib.corpus import READ_SPEECH, Clip
from tests.conftest import COLD, Server
from tests.references import peer_reference
from tests.wer import wer

pytestmark = pytest.mark.model

RESULTS = Path(__file__).resolve().parent / "results"


def whisperx_one_by_one(clips: list[Clip], model_dir: str) -> list[str]:
    """The reference: whisperx's own pipeline (pyannote VAD), batch_size=1, language given."""
    import torch
    import whisperx
    from faster_whisper.audio import decode_audio

    torch.set_num_threads(1)
    pipe = whisperx.load_model(model_dir, device="cpu", compute_type="int8", language="en",
                               vad_method="pyannote", threads=2,
                               asr_options={"beam_size": 1, "best_of": 1})
    out = []
    for c in clips:
        res = pipe.transcribe(decode_audio(str(c.path)), batch_size=1, language="en")
        out.append(" ".join(s["text"].strip() for s in res["segments"]))
    return out


def service_all_at_once(server: Server, clips: list[Clip]) -> list[str]:
    def one(c: Clip) -> str:
        with server.client() as client, c.path.open("rb") as f:
            r = client.post("/transcribe", params={"wait": "true"},
                            files={"file": (c.path.name, f)}, data={"language": "en"})
            assert r.status_code == 200 and r.json()["status"] == "done", r.text
            return str(r.json()["result"]["text"])

    with ThreadPoolExecutor(16) as pool:  # concurrent, so the service really batches
        return list(pool.map(one, clips))


@pytest.fixture(scope="module")
def read_clips(clips: list[Clip]) -> list[Clip]:
    read = [c for c in clips if c.set in READ_SPEECH]
    assert len(read) >= 30
    return read


@pytest.fixture(scope="module")
def whisperx_hyps(read_clips: list[Clip]) -> list[str]:
    """whisperx's transcripts, kept between runs and spot-checked (tests/references.py)."""
    from importlib.metadata import version

    from models.provision import default_cache_dir

    model = default_cache_dir() / "whisper-base"
    by_path = {c.path: c for c in read_clips}
    return peer_reference(
        "whisperx-one-by-one", [(c.id, c.path) for c in read_clips],
        lambda paths: whisperx_one_by_one([by_path[p] for p in paths], str(model)),
        {"whisperx": version("whisperx"), "faster-whisper": version("faster-whisper"),
         "ctranslate2": version("ctranslate2"), "torch": version("torch")}, model)


def record(name: str, read: list[Clip], svc: list[str], ref_hyps: list[str]) -> tuple[float, float]:
    refs = [c.reference for c in read]
    wer_service, wer_whisperx = wer(refs, svc), wer(refs, ref_hyps)

    def by_set(hyps: list[str], s: str) -> float:
        return round(wer([c.reference for c in read if c.set == s],
                         [h for c, h in zip(read, hyps, strict=True) if c.set == s]), 4)

    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"accuracy-{name}.json").write_text(json.dumps({
        "service_vad": name, "sets": list(READ_SPEECH), "clips": len(read),
        "wer_service": round(wer_service, 4), "wer_whisperx_one_by_one": round(wer_whisperx, 4),
        "per_set": {s: {"service": by_set(svc, s), "whisperx": by_set(ref_hyps, s)}
                    for s in READ_SPEECH},
    }, indent=2) + "\n")
    return wer_service, wer_whisperx


def test_service_with_whisperx_vad_matches_whisperx(
        make_server: type[Server], tmp_path: Path, read_clips: list[Clip],
        whisperx_hyps: list[str]) -> None:
    """Same VAD as whisperx (pyannote): the batched service must land within 0.5 WER point."""
    srv = make_server(tmp_path / "pyannote", env={**COLD, "BATCHSCRIBE_MODEL__VAD": "pyannote"}).start()
    svc = service_all_at_once(srv, read_clips)
    wer_service, wer_whisperx = record("pyannote", read_clips, svc, whisperx_hyps)
    assert abs(wer_service - wer_whisperx) <= 0.005, (wer_service, wer_whisperx)
    assert wer_service < 0.10  # whisper-base's read-speech accuracy, not a broken pipeline


def test_default_service_is_no_worse_than_whisperx(
        server: Server, read_clips: list[Clip], whisperx_hyps: list[str]) -> None:
    """The default CPU set-up (Silero VAD, 14x faster than pyannote) loses no accuracy."""
    svc = service_all_at_once(server, read_clips)
    wer_service, wer_whisperx = record("silero", read_clips, svc, whisperx_hyps)
    assert wer_service <= wer_whisperx + 0.005, (wer_service, wer_whisperx)
    assert wer_service < 0.10
