"""A local Ray cluster running a kvroute Serve app (``kvroute.integrations.ray_serve.build_app``) on a
free 127.0.0.1 port, for the fake-engine and the real-engine Ray tests: start, post, ask the routers, stop."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import ray
from ray import serve
from vllm_bed import free_port


class ServeApp:
    """``ray.init`` + ``serve.start`` on a free port + ``serve.run(app)``; ``close()`` shuts both down."""

    def __init__(self, app: Any, env_vars: dict[str, str] | None = None, timeout: float = 120.0, num_cpus: int = 4) -> None:
        self.port = free_port()
        self.timeout = timeout
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env_vars or {}})
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": self.port})
            serve.run(app, name="kvroute", route_prefix="/")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        serve.shutdown()
        ray.shutdown()

    def post(self, body: dict[str, Any]) -> tuple[str, bytes]:
        """POSTs a chat request; returns the ingress replica that served it and the raw answer."""
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=self.timeout) as r:
            return r.headers["x-kvroute-ingress"], r.read()

    def ingresses(self, replicas: int = 2) -> dict[str, dict[str, Any]]:
        """Each ingress replica's ``/kvroute/routers`` answer (asks until every replica answered, bounded)."""
        seen: dict[str, dict[str, Any]] = {}
        for _ in range(50):
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/kvroute/routers", timeout=30) as r:
                out = json.loads(r.read())
            seen[out["replica"]] = out
            if len(seen) == replicas:
                break
        return seen

    def routers(self, replicas: int = 2) -> dict[str, list[dict[str, Any]]]:
        """Each ingress replica's kvroute routers."""
        return {replica: out["routers"] for replica, out in self.ingresses(replicas).items()}
