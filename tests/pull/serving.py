"""A pull-mode device that also serves: a real AgentServer (torch engine, tiny model) over a device
root that already holds a version, and a poller whose installs hot-swap it (POST /admin/reload)."""

from __future__ import annotations

import json
from http.client import HTTPConnection

from deployer.agent.cli import http_reloader
from deployer.agent.engines import make_engine
from deployer.agent.http.server import AgentServer
from deployer.agent.ota.poll import Poller
from deployer.agent.ota.updater import Updater
from deployer.agent.settings import AgentSettings, SmokePrompt


def serve(device: Poller) -> tuple[AgentServer, Poller]:
    """Start serving what `device` installed; return the server and a poller that hot-swaps it."""
    settings = AgentSettings(
        port=0,
        root=device.store.root,
        context_length=256,
        max_prompt_tokens=128,
        threads=1,
        smoke_prompts=(SmokePrompt(prompt="Hi", max_tokens=2),),
    )
    server = AgentServer(settings, lambda: make_engine("torch", context_length=256, threads=1))
    port = server.start()
    if not server.reload(reason="start").ok:
        server.stop()
        raise RuntimeError(f"{device.store.root}: the installed version did not load")
    reloader = http_reloader(settings.model_copy(update={"port": port}))
    return server, Poller(device.store, Updater(device.store, reloader=reloader), device.settings)


def chat(port: int) -> int:
    """One small chat completion against 127.0.0.1:`port`; returns the HTTP status."""
    conn = HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()
