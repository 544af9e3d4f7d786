"""The first minute on a GPU host: does CTranslate2 run there, and do the engine's GPU paths?

Run after ``loadtest.gpu.bundle unpack`` with its ``env``; needs only CTranslate2, torch, numpy,
whisperx's mel filters and the tiny model of part 1 (``GPU_BUNDLE_PROBE``). Records as it goes
to ``--out`` (JSON, rewritten after every step), so a probe cut short still says how far it got:

1. the host: GPU, driver, torch and its CUDA, the cuBLAS libraries on it;
2. CTranslate2: version, GPUs seen, compute types (the dlopen of ``libcublas.so.12`` is tried
   in a child process per route, so a crash in one route does not end the probe);
3. the tiny model on CUDA against the same model on the CPU (float32): encoder output and
   greedy tokens;
4. the engine's own device paths (:func:`app.engine.mel.encoder_input`,
   :func:`app.engine.decoding.batch_rows`): the same encoder output as through the host.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

CHILD = r"""
import json, sys, time
import numpy as np
import ctranslate2
out = {"ctranslate2": ctranslate2.__version__}
out["cuda_devices"] = ctranslate2.get_cuda_device_count()
out["compute_types"] = sorted(ctranslate2.get_supported_compute_types("cuda", 0))
path = sys.argv[1]
rng = np.random.default_rng(0)
feats = rng.standard_normal((4, 80, 3000)).astype(np.float32)
prompts = [[50258, 50259, 50359, 50363]] * 4
cpu = ctranslate2.models.Whisper(path, device="cpu", compute_type="float32")
ref = np.asarray(cpu.encode(ctranslate2.StorageView.from_array(feats)))
ref_tokens = [r.sequences_ids[0] for r in cpu.generate(
    ctranslate2.StorageView.from_array(ref), prompts, max_length=12, beam_size=1)]
for ct in ("float16", "bfloat16", "int8_float16"):
    if ct not in out["compute_types"]:
        continue
    t0 = time.monotonic()
    gpu = ctranslate2.models.Whisper(path, device="cuda", compute_type=ct)
    enc = gpu.encode(ctranslate2.StorageView.from_array(feats))
    # float32 first: the array interface has no bfloat16 (the first H200 probe stopped there)
    host = np.asarray(enc.to(ctranslate2.DataType.float32).to_device(ctranslate2.Device.cpu))
    rel = float(np.linalg.norm(host - ref) / np.linalg.norm(ref))
    tokens = [r.sequences_ids[0] for r in gpu.generate(enc, prompts, max_length=12, beam_size=1)]
    out[ct] = {"encoder_rel_error": rel, "finite": bool(np.isfinite(host).all()),
               "tokens_equal_cpu": tokens == ref_tokens, "s": round(time.monotonic() - t0, 2)}
print("RESULT " + json.dumps(out))
"""


class Record:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S")}

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        print(f"probe: {key}: {json.dumps(value, default=str)[:600]}", flush=True)


def sh(cmd: str) -> str:
    got = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=60)
    return (got.stdout + got.stderr).strip()


def host() -> dict[str, Any]:
    info: dict[str, Any] = {
        "nvidia_smi": sh("nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,"
                         "clocks.max.sm,power.limit --format=csv,noheader"),
        "cuda_driver_version": sh("nvidia-smi | grep -o 'CUDA Version: [0-9.]*'"),
        "python": sys.version.split()[0],
        "cublas": sh("find /usr /opt /lib /lib64 /root -name 'libcublas*.so*' 2>/dev/null | head -20"),
        "nvcc": sh("nvcc --version | tail -2"),
    }
    try:
        import torch

        info.update({"torch": torch.__version__, "torch_cuda": torch.version.cuda,
                     "gpu": torch.cuda.get_device_name(0),
                     "capability": list(torch.cuda.get_device_capability(0))})
    except Exception as exc:
        info["torch_error"] = str(exc)[:300]
    return info


def routes(probe_model: str) -> list[tuple[str, dict[str, str]]]:
    base = {**os.environ, "CT2_VERBOSE": "1"}  # logs the cuBLAS version it loaded
    lib = base.get("LD_LIBRARY_PATH", "")
    out = [("libcublas.so.12 -> the host's cuBLAS (LD_LIBRARY_PATH)", base)]
    thirteen = sh("find /usr /opt /lib /lib64 /root -name 'libcublas.so.13' 2>/dev/null | head -1")
    if thirteen:
        lt = thirteen.replace("libcublas.so.13", "libcublasLt.so.13")
        out.append(("the same with libcublasLt and libcublas preloaded",
                    {**base, "LD_PRELOAD": f"{lt}:{thirteen}", "LD_LIBRARY_PATH": lib}))
    return out


def ctranslate2_routes(probe_model: str) -> list[dict[str, Any]]:
    results = []
    for name, env in routes(probe_model):
        t0 = time.monotonic()
        try:
            got = subprocess.run([sys.executable, "-c", CHILD, probe_model], env=env,
                                 capture_output=True, text=True, timeout=180)
            line = [x for x in got.stdout.splitlines() if x.startswith("RESULT ")]
            results.append({"route": name, "rc": got.returncode,
                            "result": json.loads(line[0][7:]) if line else None,
                            "stderr_tail": got.stderr[-1500:], "s": round(time.monotonic() - t0, 1)})
        except subprocess.TimeoutExpired:
            results.append({"route": name, "rc": None, "error": "timed out after 180 s"})
        if results[-1].get("rc") == 0 and results[-1].get("result"):
            break
    return results


def engine_paths(probe_model: str) -> dict[str, Any]:
    """The engine's GPU-resident features and row gathers against the host round trip."""
    import ctranslate2
    import numpy as np

    from app.engine.decoding import batch_rows
    from app.engine.mel import batch_features, encoder_input

    rng = np.random.default_rng(1)
    audios = [0.1 * rng.standard_normal(n * 16000).astype(np.float32) for n in (3, 12, 29, 7)]
    model = ctranslate2.models.Whisper(probe_model, device="cuda", compute_type="float16")
    host_feats = batch_features(audios, 480000, 80, "cuda:0")
    via_host = model.encode(ctranslate2.StorageView.from_array(host_feats))
    view = encoder_input(audios, 480000, 80, "cuda:0")
    on_device = model.encode(view)
    a = np.asarray(via_host.to_device(ctranslate2.Device.cpu)).astype(np.float32)
    b = np.asarray(on_device.to_device(ctranslate2.Device.cpu)).astype(np.float32)
    rows = batch_rows(on_device, [2, 0])
    r = np.asarray(rows.to_device(ctranslate2.Device.cpu)).astype(np.float32)
    prompts = [[50258, 50259, 50359, 50363]] * 2
    t_rows = [x.sequences_ids[0] for x in model.generate(rows, prompts, max_length=8)]
    host_rows = ctranslate2.StorageView.from_array(np.ascontiguousarray(a[[2, 0]]).astype(np.float16))
    t_host = [x.sequences_ids[0] for x in model.generate(host_rows, prompts, max_length=8)]
    return {"features_view_device": view.device,
            "encoder_device_vs_host_rel": float(np.linalg.norm(a - b) / np.linalg.norm(a)),
            "rows_device": rows.device, "rows_equal": bool(np.array_equal(r, b[[2, 0]])),
            "rows_tokens_equal_host_rows": t_rows == t_host}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")) / "probe.json")
    ap.add_argument("--model", default=os.environ.get("GPU_BUNDLE_PROBE", ""))
    args = ap.parse_args(argv)
    rec = Record(args.out)
    for key, step in (("host", host), ("ctranslate2", lambda: ctranslate2_routes(args.model)),
                      ("engine_paths", lambda: engine_paths(args.model))):
        try:
            rec.put(key, step())
        except Exception:
            rec.put(key, {"error": traceback.format_exc()[-3000:]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
