"""System metrics per node, on the job's one MLflow run, that survive a tracking-server outage.

The local rank 0 of every node starts one :class:`NodeSystemMetrics` (``tracking.system_metrics``);
rank 0 created the run and broadcast its id and store. Every ``tracking.system_metrics_interval``
seconds it samples MLflow's own system monitors (``mlflow.system_metrics``: CPU and system memory,
disk, network, NVIDIA/AMD GPU when present; psutil) and logs them as
``system/node<k>/<name>`` (``k`` = the node rank, :func:`node_layout`) at the
current training step, plus a ``node<k>.host`` tag with the host name.

MLflow's ``SystemMetricsMonitor`` returns from its thread for good after one failed call (and
checks the run over the network every sample); here the sampling thread never talks to the network:
it hands each sample to the same retrying background sender the tracker uses
(:class:`scaletrain.tracking.sender.Sender`: exponential backoff, one warning, the backlog sent when the
server is back, bounded memory). So a monitor that loses the server keeps sampling and its samples
reach the run once the server answers again. With ``journal_dir`` (training: ``<out_dir>/tracking/
system/node<k>``) every sample is also appended to ``journal.jsonl`` there first, so ``scaletrain
tracking sync`` uploads what the server never got (e.g. the job ended during an outage).
"""
from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Callable, Mapping

from scaletrain.tracking.journal import Journal, now_ms
from scaletrain.tracking.sender import Sender
from scaletrain.tracking.store import fast_failing_http, tracking_client

log = logging.getLogger("scaletrain")

__all__ = ["NodeSystemMetrics", "mlflow_monitors", "node_layout"]


def node_layout(rank: int, world_size: int, env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(this process's node rank, number of nodes) from the launcher's environment: the ``deepspeed``
    launcher's ``CROSS_RANK``/``CROSS_SIZE``, torchrun's (and ``accelerate launch``'s) ``GROUP_RANK``/
    ``GROUP_WORLD_SIZE``, else ``rank // local size`` with ``LOCAL_WORLD_SIZE`` or ``LOCAL_SIZE``."""
    env = os.environ if env is None else env
    for r_key, n_key in (("CROSS_RANK", "CROSS_SIZE"), ("GROUP_RANK", "GROUP_WORLD_SIZE")):
        if env.get(r_key, "").isdigit() and env.get(n_key, "").isdigit():
            return int(env[r_key]), max(1, int(env[n_key]))
    local = env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or ""
    local_n = int(local) if local.isdigit() and int(local) > 0 else world_size
    return rank // local_n, max(1, -(-world_size // local_n))


def mlflow_monitors() -> list:
    """MLflow's metric monitors for this machine: CPU/memory, disk, network, and the GPU one that
    initialises (NVIDIA via pynvml, else AMD via pyrsmi), as ``SystemMetricsMonitor`` picks them."""
    from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
    from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
    from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor

    monitors = [CPUMonitor(), DiskMonitor(), NetworkMonitor()]
    for mod, cls in (("gpu_monitor", "GPUMonitor"), ("rocm_monitor", "ROCMMonitor")):
        try:
            m = __import__(f"mlflow.system_metrics.metrics.{mod}", fromlist=[cls])
            monitors.append(getattr(m, cls)())
            break
        except Exception:  # noqa: BLE001 - no such GPU / library on this node
            continue
    return monitors


class NodeSystemMetrics:
    """Samples this node's system metrics every ``interval`` seconds into run ``run_id`` at ``uri``.

    ``step``: a callable giving the training step to log at (the job's step axis; resumed jobs stay
    monotone). ``start()`` / ``stop(timeout)``; ``stop`` takes a last sample and waits at most
    ``timeout`` seconds for the sender (what is still queued then is dropped: these are samples)."""

    def __init__(self, uri: str, run_id: str, node_id: str, *, interval: float = 10.0,
                 step: Callable[[], int] | None = None, max_backoff: float = 30.0, host: str | None = None,
                 journal_dir=None):
        self.uri, self.run_id, self.node_id = uri, run_id, node_id
        self.interval = float(interval)
        self.step = step or (lambda: 0)
        self.max_backoff = max_backoff
        self.host = host or socket.gethostname()
        self.samples = 0
        self._client = None
        self._sender = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._monitors = mlflow_monitors()
        self._journal = Journal(journal_dir) if journal_dir is not None else None
        fast_failing_http(uri)

    # runs on the sender thread
    def _execute(self, kind: str, payload) -> None:
        if self._client is None:
            self._client = tracking_client(self.uri)
        if kind == "metrics":
            self._client.log_batch(self.run_id, metrics=payload)
        elif kind == "tags":
            self._client.log_batch(self.run_id, tags=payload)
        else:  # pragma: no cover
            raise AssertionError(kind)

    def start(self) -> "NodeSystemMetrics":
        from mlflow.entities import RunTag

        self._sender = Sender(self._execute, max_backoff=self.max_backoff, name=f"-system-{self.node_id}",
                               max_queued=100_000)
        self._sender.submit("tags", [RunTag(f"{self.node_id}.host", self.host)])
        self._thread = threading.Thread(target=self._loop, name=f"scaletrain-system-{self.node_id}", daemon=True)
        self._thread.start()
        return self

    def sample(self) -> dict[str, float]:
        """One sample of every monitor, as ``{system/<node>/<name>: value}``."""
        metrics: dict[str, float] = {}
        for m in self._monitors:
            try:
                m.collect_metrics()
                metrics.update(m.aggregate_metrics())
            except Exception as e:  # noqa: BLE001 - a monitor failing (e.g. a GPU lost) skips its values
                log.debug("system metrics: %s failed: %s", type(m).__name__, e)
            finally:
                m.clear_metrics()
        return {f"system/{self.node_id}/{k}": float(v) for k, v in metrics.items()}

    def _log_sample(self) -> None:
        from mlflow.entities import Metric

        vals = self.sample()
        if not vals:
            return
        ts, step = now_ms(), int(self.step())
        if self._journal is not None:
            self._journal.append({"t": "m", "run_id": self.run_id, "s": step, "ts": ts, "v": vals})
        self._sender.submit("metrics", [Metric(k, v, ts, step) for k, v in vals.items()], size=len(vals))
        self.samples += 1

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._log_sample()
            except Exception as e:  # noqa: BLE001 - never let sampling end the thread
                log.warning("system metrics on %s: sample failed (%s); continuing", self.node_id, e)

    def stop(self, timeout: float = 10.0) -> bool:
        """Last sample, then wait at most ``timeout`` s for delivery. True if everything reached the store."""
        if self._thread is None:
            return True
        self._stop.set()
        self._thread.join()
        self._thread = None
        try:
            self._log_sample()
        except Exception as e:  # noqa: BLE001
            log.warning("system metrics on %s: last sample failed (%s)", self.node_id, e)
        ok = self._sender.wait(timeout=timeout)
        if self._journal is not None:
            self._journal.close()
        self._sender.stop(abandon=not ok)  # the thread ends and is joined (a few seconds at most)
        if not ok:
            log.warning("system metrics of %s: the tracking server did not take the last samples (%s)%s",
                        self.node_id, self._sender.last_error,
                        "; they are in the journal: `scaletrain tracking sync RUN_DIR` uploads them"
                        if self._journal is not None else "")
        return ok
