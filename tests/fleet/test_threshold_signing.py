"""k-of-n release signatures through `apply`: one local device that trusts two keys and wants both.

`apply` signs with `signing.private_key` alone, so it must refuse before sending anything; the second
key holder signs the stored release with `sits-deployer sign`, and the next `apply` reuses it.
"""

from __future__ import annotations

import json
import sys

import yaml

from deployer.release.sign import generate_key
from tests.fleet.conftest import local_devices, make_project


def test_unmet_threshold_is_refused_before_sending_then_a_second_signature_lets_it_through(
    tmp_path, tiny_model_dir
):
    base = tmp_path / "project"
    project = make_project(base, {"1.0.0": tiny_model_dir}, local_devices(base, ("solo",), sys.executable))
    generate_key(base / "keys/second.key", base / "keys/second.pub", passphrase=None, unencrypted=True)
    doc = yaml.safe_load(project.config_path.read_text())
    doc["signing"]["trusted_keys"].append("keys/second.pub")
    doc["signing"]["threshold"] = 2
    project.config_path.write_text(yaml.safe_dump(doc, sort_keys=False))
    try:
        refused = project.run("apply")
        assert refused.exit_code != 0
        assert "1 valid signature(s) from trusted keys, 2 required" in refused.output
        assert "nothing was sent" in refused.output
        assert not (project.device_root("solo") / "var/lib/sits/incoming").exists()

        manifests = sorted((base / ".sits/releases").glob("[0-9]*.json"))
        assert len(manifests) == 1
        signed = project.cli("sign", str(manifests[0]), "--key", str(base / "keys/second.key"))
        assert signed.exit_code == 0, signed.output

        result = project.run("apply", "--output", "json")
        assert result.exit_code == 0, result.output
        assert [r["status"] for r in json.loads(result.stdout)["results"]] == ["updated"]
        state = json.loads((project.device_root("solo") / "var/lib/sits/state.json").read_text())
        assert state["installed_version"] == "1.0.0"
    finally:
        project.stop_agents()
