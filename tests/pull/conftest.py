"""Fixtures for pull mode: a controller project that publishes, a mirror serving it, devices polling.

`mirror` serves `published/` to the devices' fetchers in this process, without a socket
(tests/pull/direct.py): most tests use it. `nginx` runs the Debian nginx binary on a free loopback
port with a generated config, serving `published/` (tests/pull/nginx.py), for the few tests of real
HTTP (the `nginx` marker, applied from the fixture, keeps them out of the fast tier). `project` is a
deploy.yaml over the tiny seeded checkpoints with an unencrypted release key. `make_device` gives a
device root that trusts that key and polls one channel.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from deployer.agent.ota import poll
from deployer.config import load_config
from deployer.release.desired import Releaser, build_target
from tests.pull.direct import DirectMirror
from tests.pull.nginx import NGINX, Nginx, start_nginx, stop_nginx
from tests.pull.project import Project, make_project


@pytest.fixture
def mirror(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> DirectMirror:
    """tmp_path/published served at `mirror.url` to every poll this process makes (the CLI's too)."""
    served = DirectMirror(tmp_path / "published")
    served.root.mkdir()
    monkeypatch.setattr(poll, "PullFetcher", served.fetcher)
    return served


@pytest.fixture
def nginx(tmp_path: Path) -> Iterator[Nginx]:
    """nginx serving tmp_path/published on loopback, stopped at teardown."""
    if not Path(NGINX).exists():
        pytest.skip("nginx is not installed (apt-get install -y nginx)")
    proc, server = start_nginx(tmp_path / "published", tmp_path / "nginx")
    try:
        yield server
    finally:
        stop_nginx(proc)


@pytest.fixture(scope="session")
def sources(tiny_model_dir: Path, tiny_model_dir_b: Path) -> dict[str, Path]:
    """Checkpoints for versions 1.0.0 and 2.0.0."""
    return {"1.0.0": tiny_model_dir, "2.0.0": tiny_model_dir_b}


@pytest.fixture(scope="session")
def built_store(tmp_path_factory: pytest.TempPathFactory, sources: dict[str, Path]) -> Path:
    """A `.sits/` holding both versions' artifacts and the patch between them, made once;
    projects start from a copy (store and patches only)."""
    template = make_project(tmp_path_factory.mktemp("template"), sources)
    built = []
    for version in sources:
        template.write(version)
        config = load_config(template.dir / "deploy.yaml")
        built.append(build_target(config))
    Releaser(config).patch(built[0], built[1])  # cached under .sits/patches, copied with the store
    return template.dir / ".sits"


@pytest.fixture
def project(tmp_path: Path, sources: dict[str, Path], built_store: Path) -> Project:
    """A fresh project (its own keys, releases and channels) in tmp_path/project."""
    return make_project(tmp_path / "project", sources, built_store)
