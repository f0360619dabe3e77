"""envd's control routes: ``/health``, ``/init``, ``/envs``, ``/metrics``.

``/init`` is how the host hands a (re)started or resumed guest its identity: access token,
sandbox-wide environment, default user and workdir, the host's clock, and the volumes to
mount (``mounts``).
"""

from __future__ import annotations

import asyncio
import json

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .auth import UNAUTHORIZED
from .errors import json_error
from .guest import GuestHooks
from .metrics import MetricsSampler
from .mounts import MountError, load_modules, mount_all
from .mounts import parse as parse_mounts
from .state import ENVD_VERSION, EnvdState


def routes(state: EnvdState, hooks: GuestHooks,
           sampler: MetricsSampler | None = None) -> list[Route]:
    """``sampler``: the one ``/metrics`` answers from (``aenv.envd.app`` also serves it past
    Starlette, ``metrics.MetricsEndpoint``)."""
    sampler = sampler or MetricsSampler()

    async def health(_: Request) -> Response:
        return Response(status_code=204, headers={"Cache-Control": "no-store"})

    async def init(request: Request) -> Response:
        if not state.token_matches(request.headers.get("x-access-token")):
            return json_error(401, UNAUTHORIZED)
        raw = await request.body()
        try:
            body = json.loads(raw) if raw.strip() else {}
        except ValueError:
            return json_error(400, "request body is not valid JSON")
        if not isinstance(body, dict):
            return json_error(400, "request body must be a JSON object")
        env_vars = body.get("envVars")
        if env_vars is not None and not (
            isinstance(env_vars, dict) and all(isinstance(v, str) for v in env_vars.values())
        ):
            return json_error(400, "envVars must be an object of strings")
        for key in ("accessToken", "defaultUser", "defaultWorkdir", "timestamp"):
            if body.get(key) is not None and not isinstance(body[key], str):
                return json_error(400, f"{key} must be a string")
        mounts = None
        if body.get("volumeMounts") is not None:
            try:
                mounts = parse_mounts(body["volumeMounts"])
            except MountError as e:
                return json_error(400, str(e))

        if "accessToken" in body:
            state.access_token = body["accessToken"] or None
        if env_vars is not None:
            state.env_vars = dict(env_vars)
        if body.get("defaultUser"):
            state.default_user = body["defaultUser"]
        if "defaultWorkdir" in body:
            state.default_workdir = body["defaultWorkdir"] or None
        if body.get("timestamp"):
            hooks.sync_clock(body["timestamp"])
        if body.get("entropy"):
            hooks.reseed(body["entropy"])
        if isinstance(body.get("caBundle"), str) and body["caBundle"]:
            # the node's egress CA (aenv.egress.ca)
            state.tls_env = hooks.trust_ca(body["caBundle"]) or state.tls_env
        if body.get("volumeModules") is True and hooks.enabled:
            # aenv: a template's snapshot carries the NFS client, so that sandboxes made
            # from it mount volumes without loading modules first (seconds under TCG).
            try:
                await asyncio.to_thread(load_modules)
            except (MountError, OSError) as e:
                return json_error(500, f"loading the NFS modules failed: {e}")
        if mounts and hooks.enabled:  # only a guest's envd mounts (volumes, mounts.py)
            try:
                await asyncio.to_thread(mount_all, mounts)
            except (MountError, OSError) as e:
                return json_error(500, f"volume mount failed: {e}")
        return Response(status_code=204, headers={"X-Envd-Version": ENVD_VERSION})

    async def envs(_: Request) -> Response:
        return JSONResponse(state.env_vars)

    async def metrics(_: Request) -> Response:
        return JSONResponse(sampler.sample())

    return [
        Route("/health", health, methods=["GET"]),
        Route("/init", init, methods=["POST"]),
        Route("/envs", envs, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]


