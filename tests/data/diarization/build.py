"""How this folder was built (kept for audit; the committed files are what the tests use).

    python tests/data/diarization/build.py PYANNOTE_GIT AMI_SETUP_GIT PYAUDIOANALYSIS_GIT SHARED

Each argument is a local git directory of the public repository (or, for SHARED, the project's
``../shared/corpus-diarization``). For every recording: the upstream file is read from its
pinned commit, checked against its git blob id, decoded (the AMI fixtures are float32 WAVs
whose samples are exact 16-bit values, so 16-bit FLAC is lossless), written as 16 kHz mono
16-bit FLAC, and its reference RTTM is derived as the manifest's ``reference_source.how``
says. Inclusion rule, fixed before any system was run on these files: at least two reference
speakers and at least 10 s of reference speech in the excerpt (this drops pyannote's
trn01/trn02/tst01 fixtures: 0.5, 0.5 and 5.0 s of speech). The split (``split``) was fixed
by the same rule-before-results: the four shared recordings are ``tune`` (the diarizer was
already tuned on them); of the new ones, the recordings whose AMI speakers also appear in
the two AMI excerpts kept outside the project for independent evaluation (EN2001*, EN2006*),
plus the only broadcast recording and EN2005a, are ``heldout``.
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
from pathlib import Path

import av
import numpy as np
import scipy.io.wavfile

HERE = Path(__file__).parent
PYANNOTE_COMMIT = "b749285c5cdd4636b2edc7f766f1352c8dde9369"
AMI_SETUP_COMMIT = "2509d8933721023fab4def2618aabd5c28eb82e9"
PAA_COMMIT = "HEAD"  # resolved to a hash in the manifest
AMI_LICENSE = ("audio: AMI Meeting Corpus, CC BY 4.0 (attribution: AMI Consortium / Carletta et "
               "al. 2006), redistributed inside pyannote/pyannote-audio (MIT) as a test fixture; "
               "reference: derived from the AMI manual annotations v1.6.2 (CC BY 4.0) via "
               "BUTSpeechFIT/AMI-diarization-setup (Apache-2.0)")
# fixture -> (AMI meeting, split): excerpt 0-30 s of the meeting (found by matching the fixture's
# own RTTM against every meeting's reference: best offset 0.02-0.07 s, IoU 0.76-1.0)
AMI = {"dev01": ("ES2003b", "tune"), "trn04": ("EN2003a", "tune"), "trn05": ("EN2004a", "tune"),
       "trn09": ("EN2009b", "tune"), "trn03": ("EN2001e", "heldout"),
       "trn06": ("EN2005a", "heldout"), "trn07": ("EN2006a", "heldout")}


def git(repo: Path, *args: str) -> bytes:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True).stdout


def flac(samples: np.ndarray, path: Path) -> None:
    """16 kHz mono 16-bit FLAC of int16 samples."""
    with av.open(str(path), "w", format="flac") as out:
        st = out.add_stream("flac", rate=16000, layout="mono")
        frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
        frame.rate = 16000
        for p in st.encode(frame):
            out.mux(p)
        for p in st.encode(None):
            out.mux(p)


def to_int16(data: bytes) -> np.ndarray:
    sr, x = scipy.io.wavfile.read(io.BytesIO(data))
    assert sr == 16000 and x.ndim == 1, (sr, x.shape)
    if x.dtype.kind == "f":
        y = np.round(x.astype(np.float64) * 32768)
        assert np.array_equal(y, x.astype(np.float64) * 32768), "not exact 16-bit samples"
        x = y
    return x.astype(np.int16)


def rttm_window(lines: list[str], uri: str, t0: float, t1: float) -> list[tuple[float, float, str]]:
    out = []
    for line in lines:
        p = line.split()
        s, e = float(p[3]), float(p[3]) + float(p[4])
        if e > t0 and s < t1:
            out.append((round(max(s, t0) - t0, 3), round(min(e, t1) - t0, 3), p[7]))
    return sorted(out)


def write(rid: str, samples: np.ndarray, turns: list[tuple[float, float, str]],
          meta: dict[str, object]) -> dict[str, object]:
    (HERE / "audio").mkdir(exist_ok=True)
    (HERE / "rttm").mkdir(exist_ok=True)
    audio = HERE / "audio" / f"{rid}.flac"
    flac(samples, audio)
    (HERE / "rttm" / f"{rid}.rttm").write_text("".join(
        f"SPEAKER {rid} 1 {s:.3f} {e - s:.3f} <NA> <NA> {k} <NA> <NA>\n" for s, e, k in turns))
    dur = len(samples) / 16000
    frames = np.zeros((round(dur * 100) + 1, len({k for *_, k in turns}) or 1))
    names = sorted({k for *_, k in turns})
    for s, e, k in turns:
        frames[round(s * 100): round(e * 100), names.index(k)] = 1
    spk_time = {k: round(sum(e - s for s, e, j in turns if j == k), 2) for k in names}
    return {"id": rid, "file": f"audio/{rid}.flac", "rttm": f"rttm/{rid}.rttm",
            "duration_s": round(dur, 3), "speakers": len(names), "speaker_labels": names,
            "speaker_time_s": spk_time,
            "speech_s": round(float((frames.sum(1) > 0).sum()) / 100, 2),
            "overlap_s": round(float((frames.sum(1) > 1).sum()) / 100, 2),
            "sample_rate": 16000, "channels": 1, "encoding": "FLAC 16-bit",
            "bytes": audio.stat().st_size,
            "sha256": hashlib.sha256(audio.read_bytes()).hexdigest(),
            "samples_sha256": hashlib.sha256(samples.tobytes()).hexdigest(), **meta}


def main() -> None:
    pyannote, ami_setup, paa, shared = (Path(a) for a in sys.argv[1:5])
    items = []
    for fixture, (meeting, split) in AMI.items():
        path = f"tests/data/{fixture}.wav"
        data = git(pyannote, "show", f"{PYANNOTE_COMMIT}:{path}")
        blob = git(pyannote, "rev-parse", f"{PYANNOTE_COMMIT}:{path}").decode().strip()
        ami_split = next(s for s in ("train", "dev", "test") if git(
            ami_setup, "ls-tree", "--name-only", AMI_SETUP_COMMIT,
            f"only_words/rttms/{s}/{meeting}.rttm").strip())
        ref_path = f"only_words/rttms/{ami_split}/{meeting}.rttm"
        lines = git(ami_setup, "show", f"{AMI_SETUP_COMMIT}:{ref_path}").decode().splitlines()
        rid = f"ami-{meeting.lower()}-0000-0030"
        items.append(write(rid, to_int16(data), rttm_window(lines, meeting, 0.0, 30.0), {
            "split": split, "source": "AMI Meeting Corpus (meeting, headset mix, English)",
            "license": AMI_LICENSE, "source_repo": "pyannote/pyannote-audio",
            "source_path": path, "source_commit": PYANNOTE_COMMIT, "source_git_blob": blob,
            "source_sha256": hashlib.sha256(data).hexdigest(),
            "reference_source": {"repo": "BUTSpeechFIT/AMI-diarization-setup",
                                 "path": ref_path, "commit": AMI_SETUP_COMMIT,
                                 "how": f"segments of {meeting} overlapping [0, 30] s, clipped"},
            "ami_meeting": meeting, "ami_split": ami_split, "excerpt_start_s": 0.0}))
    commit = git(paa, "rev-parse", PAA_COMMIT).decode().strip()
    path = "pyAudioAnalysis/data/diarizationExample.wav"
    data = git(paa, "show", f"{commit}:{path}")
    seg = git(paa, "show", f"{commit}:pyAudioAnalysis/data/diarizationExample.segments").decode()
    turns = [(float(a), float(b), k) for a, b, k in (ln.split() for ln in seg.splitlines() if ln)]
    items.append(write("radio-phonein-uk", to_int16(data), turns, {
        "split": "heldout", "source": "radio phone-in programme (broadcast, UK English)",
        "license": ("Apache-2.0 as distributed in tyiannak/pyAudioAnalysis (repository and its "
                    "data folder); the broadcast it was cut from is not documented upstream, so "
                    "its original licence is unverified"),
        "source_repo": "tyiannak/pyAudioAnalysis", "source_path": path, "source_commit": commit,
        "source_git_blob": git(paa, "rev-parse", f"{commit}:{path}").decode().strip(),
        "source_sha256": hashlib.sha256(data).hexdigest(),
        "reference_source": {"repo": "tyiannak/pyAudioAnalysis",
                             "path": "pyAudioAnalysis/data/diarizationExample.segments",
                             "commit": commit, "how": "upstream turns (0.1 s resolution, "
                             "contiguous: pauses inside and between turns count as speech)"}}))
    for line in (shared / "manifest.jsonl").read_text().splitlines():
        m = json.loads(line)
        x = to_int16((shared / m["file"]).read_bytes())
        ref = (shared / m["rttm"]).read_text().splitlines()
        turns = rttm_window(ref, m["id"], 0.0, float(m["duration_s"]))
        keep = {k: m[k] for k in ("license", "source_repo", "source_path", "source_commit",
                                  "source_git_blob", "reference_source", "ami_meeting",
                                  "ami_split", "excerpt_start_s") if k in m}
        items.append(write(m["id"], x, turns, {
            "split": "tune", "shared": True,
            "source": ("telephone call (US English)" if m["id"] == "pyannote-sample"
                       else "AMI Meeting Corpus (meeting, headset mix, English)"),
            "source_sha256": m["sha256"], **keep}))
    (HERE / "manifest.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    (HERE / "SHA256SUMS").write_text("".join(f"{i['sha256']}  {i['file']}\n" for i in items))


if __name__ == "__main__":
    main()
