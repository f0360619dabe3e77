"""``aenv server``: one process serving the REST API, the sandbox proxy and the orchestrator.

This module only wires parts together: store → orchestrator (with the node's machines) →
API and proxy behind one listener. Everything with behaviour lives in those packages.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .api.app import create_api
from .api.auth import load_api_key
from .cluster.drain import drain_router
from .cluster.node_agent import PublishAfterChange
from .cluster.node_setup import node_agent, node_id
from .cluster.owners import owner_router
from .cluster.shared_secrets import SharedSecrets
from .config import Settings
from .egress.setup import node_proxy
from .envd.signing import Operation
from .envd.signing import signature as envd_signature
from .orchestrator.admission import Budget
from .orchestrator.builds import Builder
from .orchestrator.from_image import RegistryImages
from .orchestrator.machine import Machines
from .orchestrator.metrics import MetricsCollector
from .orchestrator.service import Limits, Orchestrator
from .orchestrator.template_records import BASE_TEMPLATE, builtin_base
from .orchestrator.volumes import Volumes
from .proxy import ProxyRouter, Route, RouteTable
from .proxy.front import Front
from .storage.shared_volumes import SharedVolumes
from .storage.volumes import volumes_dir
from .store import (
    VM_STATES,
    Database,
    SandboxState,
    SandboxStore,
    TemplateStore,
)
from .store.secret_box import SecretBox, load_key
from .store.secrets import LocalSecrets, Secrets, SecretStore
from .store.volumes import VolumeStore

log = logging.getLogger("aenv.server")

CLOSE_STEP_S = 25.0  # how long a part of the server may take to stop before it is left


def _warn_of_local_volumes(store: VolumeStore, settings: Settings) -> None:
    """Volumes this node made before it had a shared store stay in its own directory, and a
    node with one serves only the shared store's: say so at every start, by name, rather
    than let them vanish from the API unexplained (their files are kept)."""
    local = store.list()
    if local:
        log.warning("%d volume(s) made before AENV_SHARED_STORE was set are kept under %s "
                    "but not served while it is: %s", len(local),
                    volumes_dir(settings), ", ".join(sorted(v.name for v in local)))


async def _close_step(name: str, step: Any, *, bound_s: float = CLOSE_STEP_S) -> None:
    """Await ``step`` (a coroutine or task) for at most ``bound_s``; log a slow one, and
    leave one that is still running then (cancelled, not awaited: a step that ignores its
    cancellation must not hold the stop up either)."""
    task = asyncio.ensure_future(step)
    t0 = time.monotonic()
    done, _ = await asyncio.wait({task}, timeout=bound_s)
    took = time.monotonic() - t0
    if not done:
        task.cancel()
        log.error("stopping: %s did not stop within %.0f s; left behind", name, bound_s)
        return
    if took > 2:
        log.warning("stopping: %s took %.1f s", name, took)
    task.result()

AUTO_RESUME_MIN_TIMEOUT_S = 300
# Host work that blocks (spawning VMMs, netlink, writing guest memory, disk clones) runs in
# threads that mostly wait in syscalls. asyncio's default pool has cpu+4 threads, so the
# children of one fork x16 queued behind each other for seconds.
BLOCKING_THREADS = 64


@dataclass
class ServerOptions:
    domain: str = "localhost"
    limits: Limits = field(default_factory=Limits)
    budget: Budget = field(default_factory=Budget)
    ttl_interval: float = 1.0
    metrics_interval: float = 5.0
    default_cpu: int = 1
    default_memory_mb: int = 512
    default_disk_mb: int = 2048
    # Snapshot the built-in template at start-up (off: every create from it cold boots).
    snapshot_base: bool = True
    # Root filesystems made on the host for builds: registry pulls (fromImage) and COPY
    # steps laid into the base image. Off for machines that boot no images (the tests'
    # host-process sandboxes): such builds are then refused or run their steps in the guest.
    host_images: bool = True

    @classmethod
    def from_settings(cls, settings: Settings) -> ServerOptions:
        """What ``aenv server`` runs with: the settings' domain, limits and budget."""
        s = settings
        return cls(
            domain=s.domain, snapshot_base=s.snapshot_base,
            limits=Limits(max_sandboxes=s.max_sandboxes, max_starting=s.max_starting,
                          max_fork=s.max_fork, retention_s=s.retention_hours * 3600,
                          start_queue=s.start_queue,
                          start_queue_timeout_s=s.start_queue_timeout),
            budget=Budget(cpu_overcommit=s.cpu_overcommit,
                          memory_overcommit=s.memory_overcommit,
                          disk_reserve_mb=s.disk_reserve_mb,
                          max_cpu_per_sandbox=s.max_sandbox_cpu,
                          max_memory_mb_per_sandbox=s.max_sandbox_memory_mb,
                          max_disk_mb_per_sandbox=s.max_sandbox_disk_mb))


class Server:
    def __init__(self, settings: Settings, machines: Machines,
                 options: ServerOptions | None = None) -> None:
        self.settings = settings
        self.options = options or ServerOptions()
        self.db = Database(settings.home / "aenv.db")
        self.sandboxes = SandboxStore(self.db)
        self.templates = TemplateStore(self.db)
        # With a shared store, volumes live there and any node serves them (shared_volumes).
        self.volumes = Volumes(
            VolumeStore(self.db), self.sandboxes, settings,
            SharedVolumes(settings.shared_store, node_id(settings))
            if settings.shared_store else None)
        self._volume_users: asyncio.Task[None] | None = None
        if settings.shared_store:
            _warn_of_local_volumes(VolumeStore(self.db), settings)
        self.secrets = SecretStore(self.db, SecretBox(load_key(settings.secrets_dir)))
        self.machines = machines
        # In a cluster the secrets are the cluster's (``aenv.cluster.shared_secrets``): one
        # made through any gateway fills the egress transforms of this node's sandboxes.
        # The node keeps a copy, written back should Redis lose them.
        self.shared_secrets = SharedSecrets.from_url(
            settings.cluster, settings.cluster_secret or "",
            mirror=settings.secrets_dir / "cluster-secrets.json") if settings.cluster else None
        self._secrets_mirror: asyncio.Task[None] | None = None
        secrets: Secrets = self.shared_secrets or LocalSecrets(self.secrets)
        self.egress = node_proxy(settings, secrets)
        if getattr(machines, "pool", None) is not None:  # VMs in network slots
            machines.pool.egress = self.egress  # type: ignore[attr-defined]
            machines.egress_ca = self.egress.ca.pem  # type: ignore[attr-defined]
        self.orchestrator = Orchestrator(
            self.sandboxes, self.templates, machines,
            limits=self.options.limits, budget=self.options.budget,
            ttl_interval=self.options.ttl_interval,
        )
        self.builder = Builder(self.templates, machines, settings.cache_dir / "build-files",
                               pins=self.orchestrator.pins,
                               admission=self.orchestrator.admission,
                               images=RegistryImages(settings, kernel_flavor=getattr(
                                   machines, "kernel_flavor", "cloud"))
                               if self.options.host_images else None)
        pool = getattr(machines, "pool", None)
        self.metrics = MetricsCollector(  # no guest asked while a fork's children start
            self.sandboxes, interval=self.options.metrics_interval,
            hold=pool.fanning_out if pool is not None else None)
        self.proxy = ProxyRouter(RouteTable(self._route))
        self.orchestrator.on_stop.append(self.proxy.forget)
        if self.volumes.shared is not None:
            self.orchestrator.on_stop.append(self.volumes.sandbox_stopped)
        self.orchestrator.shared_volumes = self.volumes.shared
        self.api_key, self.api_key_file = load_api_key(settings.secrets_dir, settings.api_key)

        @asynccontextmanager
        async def lifespan(_: Any) -> AsyncIterator[None]:
            await self.start()
            try:
                yield
            finally:
                await self.close()

        self.cluster = node_agent(
            settings, self.sandboxes, queued=self.orchestrator.start_queue.queued_sizes,
            volumes=None if self.volumes.shared else
            lambda: {v.id: v.name for v in self.volumes.all()}) \
            if settings.cluster else None
        api = create_api(
            self.orchestrator, api_key=self.api_key, domain=self.options.domain,
            metrics=self.metrics, logs=self.machines.logs, lifespan=lifespan,
            builder=self.builder, upload_secret=self.api_key.encode(),
            cluster_secret=settings.cluster_secret if settings.cluster else None,
            secret_store=secrets,
            extra_routers=(drain_router(self.cluster),
                           owner_router(self._signed_lookup, self._token_lookup))
            if self.cluster else (),
            volume_service=self.volumes,
        )
        if self.cluster is not None:
            api = PublishAfterChange(api, self.cluster)
        self.app = Front(api, self.proxy, self._signed_lookup, self._token_lookup)

    async def start(self) -> None:
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(BLOCKING_THREADS, thread_name_prefix="aenv-host"))
        await self.egress.start()  # before slots are adopted with their policies
        if self.shared_secrets is not None:
            self._secrets_mirror = asyncio.create_task(self.shared_secrets.keep_mirror(),
                                                       name="cluster-secrets-mirror")
        if self.volumes.shared is not None:
            self._volume_users = asyncio.create_task(self.volumes.keep_users(),
                                                     name="volume-users")
        live = self.sandboxes.live()
        await self.machines.prepare({r.slot for r in live if r.slot is not None},
                                    {Path(r.vm_dir).name for r in live if r.vm_dir})
        self._builtin_templates()
        self.builder.recover()
        await self.orchestrator.start()
        key = self.machines.image_key()
        if key and self.options.snapshot_base:
            # base is a snapshot too: creates restore it (~0.1 s) instead of booting (~5 s).
            await self.orchestrator.snapshot_template(BASE_TEMPLATE, key)
        await self.metrics.start()
        if self.cluster is not None:  # last: ready for the creates a gateway sends
            await self.cluster.start()
        log.info("aenv server ready; API key in %s", self.api_key_file or "$AENV_API_KEY")

    def _builtin_templates(self) -> None:
        """``base`` exists out of the box: the node's base image with default size."""
        if self.templates.get(BASE_TEMPLATE) is None:
            self.templates.insert(builtin_base(
                cpu_count=self.options.default_cpu, memory_mb=self.options.default_memory_mb,
                disk_size_mb=self.options.default_disk_mb, now=time.time()))

    async def drain(self, poll_s: float = 0.5) -> None:
        """In a cluster: go ``draining`` (no new creates), then wait until no sandbox holds
        a VM or ``drain_timeout`` passes (``aenv.cluster.drain``)."""
        if self.cluster is None:
            return
        await self.cluster.drain(stopping=True)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.drain_timeout
        while (running := sum(r.state in VM_STATES for r in self.sandboxes.live())):
            if loop.time() >= deadline:
                log.info("drained for %.0f s; stopping with %d sandbox(es) running",
                         self.settings.drain_timeout, running)
                return
            await asyncio.sleep(poll_s)
        log.info("drained: no sandbox running; stopping")

    async def close(self) -> None:
        """Stop every part, in order. A part that does not finish within its bound is left
        behind with an error that names it, so that a stop asked for (SIGTERM, a drain)
        ends: what it leaves (a pooled VMM, a slot) is swept by the next start."""
        if self.cluster is not None:  # first: no new creates while the node stops
            await _close_step("cluster agent", self.cluster.close())
        await _close_step("metrics", self.metrics.close())
        await _close_step("builder", self.builder.close())
        await _close_step("orchestrator", self.orchestrator.close())
        # the VMM pool waits up to 30 s for a VMM being made before it ends the others
        await _close_step("machines", self.machines.close(), bound_s=2 * CLOSE_STEP_S)
        await _close_step("egress proxy", self.egress.close())
        if self._secrets_mirror is not None:
            self._secrets_mirror.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await _close_step("secrets mirror", self._secrets_mirror)
        if self.shared_secrets is not None:
            await _close_step("cluster secrets", self.shared_secrets.close())
        if self._volume_users is not None:
            self._volume_users.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await _close_step("volume users", self._volume_users)
            # what the node leaves mounting shared volumes (paused sandboxes), said last
            with contextlib.suppress(OSError):
                await _close_step("volume users",
                                  asyncio.to_thread(self.volumes.publish_users))
        await _close_step("volumes", asyncio.to_thread(self.volumes.close))
        await _close_step("proxy", self.proxy.close())
        self.db.close()

    async def _route(self, sandbox_id: str) -> Route | None:
        rec = self.sandboxes.get(sandbox_id)
        if rec is None:
            return None
        # "pausing" too: the API already reports it as paused, and connect waits for the
        # pause to finish (it holds the sandbox's lock) before resuming.
        if rec.state in (SandboxState.PAUSING, SandboxState.PAUSED) and rec.auto_resume:
            log.info("sandbox %s: traffic while %s, resuming", sandbox_id, rec.state)
            rec, _ = await self.orchestrator.connect(sandbox_id, AUTO_RESUME_MIN_TIMEOUT_S)
        if rec.state != SandboxState.RUNNING or not rec.host_ip:
            return None
        return Route(
            sandbox_id=rec.id, host_ip=rec.host_ip, generation=f"{rec.vm_pid}:{rec.host_ip}",
            envd_token=rec.envd_token, traffic_token=rec.traffic_token,
            public_traffic=(rec.network or {}).get("allowPublicTraffic") is not False,
            mask_host=(rec.network or {}).get("maskRequestHost"),
            https_ports=frozenset((rec.network or {}).get("httpsPorts") or ()),
        )

    async def _signed_lookup(self, path: str, op: Operation, user: str | None, signature: str,
                             expiration: str | None) -> str | None:
        """The running sandbox whose token produced ``signature`` (signed URLs carry no
        routing headers)."""
        exp = int(expiration) if expiration and expiration.isdigit() else None
        return self._owner_of(lambda t: hmac.compare_digest(
            envd_signature(path, op, user or "", t, exp), signature))

    async def _token_lookup(self, token: str) -> str | None:
        """The running sandbox whose envd access token is ``token`` (see ``Front``)."""
        return self._owner_of(lambda t: hmac.compare_digest(t, token))

    def _owner_of(self, matches: Callable[[str], bool]) -> str | None:
        """The running sandbox whose envd access token ``matches``."""
        for rec in self.sandboxes.in_states((SandboxState.RUNNING,)):
            if rec.envd_token and matches(rec.envd_token):
                return rec.id
        return None


