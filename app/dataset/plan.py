"""How many actors, with what, for the cluster Ray reports: sized for the hardware.

* **GPU** (a node with GPUs, device not forced to cpu): one actor per GPU (``num_gpus=1``; Ray
  sets the actor's ``CUDA_VISIBLE_DEVICES``, so its pipeline sees one GPU and starts one
  engine), with its node's CPUs shared out per GPU for prep (decode and VAD run on the actor's
  prep threads). The engine batch cap is not chosen here: each actor's warm-up measures it on
  its own GPU as the service does (app/engine/sizing.py), and the OOM backoff adapts it. Rows
  running per actor (``storage.max_active_jobs``) are 128: the H200
  run (loadtest/results/gpu-h200.json) had the engine alone at ~1000x real time on whisper-base
  and the service at 160-370x, bounded by CPU prep, so a GPU actor needs many rows decoding at
  once to keep up with one engine.
* **CPU**: one actor per node, using the node's cores, with one CTranslate2 worker of one
  thread per core and one prep thread per core: the service's own layout, measured on 2 cores as
  the best engine configuration (two workers of one thread beat one of two; see README,
  Performance) with prep beside it at a few per cent of the CPU. Two actors on one node would
  load the model twice and halve the windows each batcher can pool. 64 rows running per actor:
  the service's ``max_active_jobs``.
* Twice as many rows are handed to an actor as it runs (``calls x batch_rows``): the rows of
  the next batches wait their turn inside the actor (FIFO), so when a batch's last rows finish
  the next rows are already there and the engine never waits for Ray to schedule a call.
* Ray reserves one CPU less than an actor's threads use (see :func:`reserve`): Ray Data's own
  tasks (reading files) need a CPU to run beside it.

tcmalloc is preloaded in the actors when the driver has it (``scripts/env.sh``): measured on 2
cores, CPU batches of 32 run at 38x real time with it, 16x with glibc malloc.
"""

from __future__ import annotations

import glob
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

CPU_BATCH_ROWS, CPU_CALLS = 16, 8
GPU_BATCH_ROWS, GPU_CALLS = 32, 8


@dataclass(frozen=True)
class Plan:
    device: str  # "cpu" or "cuda"
    actors: int
    cpus_per_actor: float  # what Ray reserves for an actor: its node's share, less one CPU
    threads: int  # cores its engine workers and prep threads use (the node's share)
    gpus_per_actor: float
    batch_rows: int  # rows per map_batches call (and per part file)
    calls: int  # batches in flight per actor (their rows share the engine's batches)
    env: dict[str, str] = field(default_factory=dict)  # the actors' environment

    @property
    def rows_in_flight(self) -> int:
        return self.batch_rows * self.calls

    def map_kwargs(self) -> dict[str, Any]:
        """``Dataset.map_batches`` arguments for the stage."""
        from ray.data import ActorPoolStrategy

        kw: dict[str, Any] = {
            "batch_size": self.batch_rows, "batch_format": "pandas",
            "compute": ActorPoolStrategy(size=self.actors,
                                         max_tasks_in_flight_per_actor=self.calls,
                                         max_concurrent_calls_per_actor=self.calls),
            "num_cpus": self.cpus_per_actor}
        if self.gpus_per_actor:
            kw["num_gpus"] = self.gpus_per_actor
        return kw

    def describe(self) -> str:
        per = (f"{self.gpus_per_actor:g} GPU + {self.threads} cores" if self.gpus_per_actor
               else f"{self.threads} cores")
        return (f"{self.actors} actor(s) on {self.device}, {per} each, {self.batch_rows} rows per "
                f"batch, {self.calls} batches in flight per actor")


def nodes() -> list[dict[str, float]]:
    """CPU and GPU of every live node of the connected cluster."""
    import ray

    return [{"CPU": float(n["Resources"].get("CPU", 0)), "GPU": float(n["Resources"].get("GPU", 0))}
            for n in ray.nodes() if n.get("Alive")]


def plan(cluster: Sequence[Mapping[str, float]], device: str = "auto", actors: int | None = None,
         batch_rows: int | None = None, calls: int | None = None,
         environ: Mapping[str, str] | None = None) -> Plan:
    environ = os.environ if environ is None else environ
    gpu_nodes = [n for n in cluster if n.get("GPU", 0) >= 1]
    use_gpu = device in ("auto", "cuda") and bool(gpu_nodes)
    if device == "cuda" and not gpu_nodes:
        raise ValueError("BATCHSCRIBE_MODEL__DEVICE=cuda but the Ray cluster has no GPU")
    if use_gpu:
        n = actors or int(sum(math.floor(x["GPU"]) for x in gpu_nodes))
        # The smallest share of a node's cores per GPU, so an actor fits on every GPU node.
        threads = max(1, min(math.floor(x.get("CPU", 0)) // math.floor(x["GPU"])
                             for x in gpu_nodes))
        cpus = min(reserve(math.floor(x.get("CPU", 0)), math.floor(x["GPU"])) for x in gpu_nodes)
        rows, k = batch_rows or GPU_BATCH_ROWS, calls or GPU_CALLS
        env = {"BATCHSCRIBE_MODEL__DEVICE": "cuda", "BATCHSCRIBE_PREP__WORKERS": str(threads)}
        p = Plan("cuda", n, cpus, threads, 1.0, rows, k, env)
    else:
        cpu_nodes = [x for x in cluster if x.get("CPU", 0) >= 1]
        if not cpu_nodes:
            raise ValueError("the Ray cluster has no CPU to run an actor on")
        cores = min(math.floor(x["CPU"]) for x in cpu_nodes)
        n = actors or len(cpu_nodes)
        per_node = max(1, math.ceil(n / len(cpu_nodes)))  # several: the cores shared out
        threads = max(1, cores // per_node)
        rows, k = batch_rows or CPU_BATCH_ROWS, calls or CPU_CALLS
        env = {"BATCHSCRIBE_MODEL__DEVICE": "cpu", "BATCHSCRIBE_MODEL__NUM_WORKERS": str(threads),
               "BATCHSCRIBE_MODEL__CPU_THREADS": "1", "BATCHSCRIBE_PREP__WORKERS": str(threads)}
        p = Plan("cpu", n, reserve(cores, per_node), threads, 0.0, rows, k, env)
    env = {**p.env, "BATCHSCRIBE_STORAGE__MAX_ACTIVE_JOBS": str(max(p.rows_in_flight // 2, 1))}
    # The operator's own settings win over the plan's.
    env = {k: v for k, v in env.items() if k not in environ}
    return Plan(p.device, p.actors, p.cpus_per_actor, p.threads, p.gpus_per_actor, p.batch_rows,
                p.calls, {**env, **runtime_env_vars(environ)})


def reserve(cores: int, actors_per_node: int) -> float:
    """Ray CPUs an actor reserves: its share of the node less one CPU for the node (at least
    half a CPU: Ray's CPUs may be fractions). Its threads use the whole share anyway (Ray's
    CPUs are logical): the spare CPU is for Ray Data's own tasks. Measured here: an actor
    holding both CPUs of a 2-CPU Ray left ``read_binary_files``' task no CPU, and the dataset
    never finished."""
    return max(0.5, round((cores - 1) / actors_per_node, 2))


def runtime_env_vars(environ: Mapping[str, str]) -> dict[str, str]:
    """What the actors' processes need from the driver's environment: every BATCHSCRIBE_
    setting, tcmalloc, and the service's own process settings (app/__main__.py, scripts/env.sh)."""
    env = {k: v for k, v in environ.items() if k.startswith("BATCHSCRIBE_")}
    preload = environ.get("LD_PRELOAD", "")
    if "libtcmalloc" not in preload:
        found = sorted(glob.glob("/usr/lib/*/libtcmalloc_minimal.so.4"))
        preload = ":".join(x for x in (found[0] if found else "", preload) if x)
    if preload:
        env["LD_PRELOAD"] = preload
    env.setdefault("OMP_WAIT_POLICY", environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    env.setdefault("HF_HUB_OFFLINE", environ.get("HF_HUB_OFFLINE", "1"))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # as app/__main__.py: CUDA numbers as NVML
    if "PYTHONPATH" in environ:
        env["PYTHONPATH"] = environ["PYTHONPATH"]
    return env
