"""The API key of lab agents: lab devices serve on the lab network, beyond loopback, where
deploy.yaml requires agent.api_keys."""

from __future__ import annotations

from pathlib import Path

LAB_API_KEY = "sk-lab-" + "k" * 40  # lab devices serve beyond loopback, so their API needs a key


def lab_agent(project_dir: Path, port: int) -> dict:
    """agent: for lab devices serving on the lab network: its API key in a secrets file beside
    deploy.yaml (written here), as deploy.yaml requires for a host beyond loopback."""
    secrets = project_dir / "secrets"
    secrets.mkdir(exist_ok=True)
    (secrets / "api-keys").write_text(LAB_API_KEY + "\n")
    return {"host": "0.0.0.0", "port": port, "max_tokens": 16, "api_keys": {"file": "secrets/api-keys"}}
