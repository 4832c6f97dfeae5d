"""sits-agent's build hook: its sources lie in the checkout's deployer/, beside this folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class AgentSources(BuildHookInterface):
    """Force-include what `only-include` names from the checkout (hatchling selects only files
    under the project folder). Not into an editable wheel: forced files would land in site-packages
    and shadow the checkout's deployer package (pypa/hatch#1627); dev-mode-dirs puts it on sys.path."""

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        """Add the checkout's files to a wheel or sdist built from the checkout."""
        checkout = Path(self.root).parent
        if version == "editable" or not (checkout / "deployer" / "agent").is_dir():
            return  # editable, or built from an unpacked sdist, which holds the sources itself
        for relative in self.build_config.only_include.values():
            build_data["force_include"][str(checkout / relative)] = relative
