"""Moving modules changed no wire format: a patch and a signed release made by the code as it stood
before the layout move (commit 26734b2) are reproduced byte for byte (the release's content; its
canonical form moved to RFC 8785 later, on purpose), and the release signed then still verifies now.

The goldens were made from the seeded tiny checkpoint (seed 0) and a copy with its first three
weights moved by 0.01 (seed 7), built int8 as 1.0.0 and 1.1.0, a patch between them, and a release
(counter 2, created 2026-06-01, ten years) signed with the throwaway key in golden/.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from deployer.core.release import PatchRef, make_release, read_envelope
from deployer.core.verify import Installed, load_trusted_keys, verify_release
from deployer.release.delta import create_patch
from tests.release.helpers import build, perturb

GOLDEN = Path(__file__).with_name("golden")
V1_ID = "d053b0ce121fcce508d9cc828ffd2775cdffc76649e624537a2975dfa21c5afa"
V2_ID = "b6430e54a128e248e669bec49976405379b46e20589412610df797501caf0069"
PATCH_SHA256 = "88aa553a398197a949ff9b74ee97459636142ea30a0c054c12f71b4526eb9bfe"
PATCH_SIZE = 52925
SIGNED_SHA256 = "f6507d73a5c9f6d94960feeb37b20184ee901d19003506a050fb8259170e9d39"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def artifacts(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("wire")
    changed = perturb(tiny_model_dir, tmp / "src2", names=3, scale=0.01, seed=7)
    return build(tiny_model_dir, tmp / "store", "1.0.0"), build(changed, tmp / "store", "1.1.0")


def test_artifacts_and_patch_are_byte_identical(artifacts: tuple[Path, Path], tmp_path: Path) -> None:
    v1, v2 = artifacts
    assert (_sha(v1 / "sits-manifest.json"), _sha(v2 / "sits-manifest.json")) == (V1_ID, V2_ID)
    patch = tmp_path / "p.patch"
    create_patch(v1, v2, patch)
    assert (_sha(patch), patch.stat().st_size) == (PATCH_SHA256, PATCH_SIZE)


def test_signed_release_content_is_unchanged(artifacts: tuple[Path, Path]) -> None:
    """The move changed nothing in a release; issue 14 then moved new releases to format 2 (RFC 8785
    canonical JSON) on purpose, so the content is pinned field by field and the format separately."""
    _, v2 = artifacts
    ref = PatchRef(base_version="1.0.0", base_sha256=V1_ID, sha256=PATCH_SHA256, size=PATCH_SIZE)
    release = make_release(
        v2, counter=2, expires_in=timedelta(days=3650), now=datetime(2026, 6, 1, tzinfo=UTC), patch=ref
    )
    old = read_envelope(GOLDEN / "release-before-move.json")
    assert hashlib.sha256(old.signed_bytes()).hexdigest() == SIGNED_SHA256
    now = json.loads(release.canonical())
    assert (old.signed["format_version"], now.pop("format_version")) == (1, 2)
    assert now == {k: v for k, v in old.signed.items() if k != "format_version"}


def test_a_release_signed_before_the_move_still_verifies() -> None:
    envelope = read_envelope(GOLDEN / "release-before-move.json")
    trusted = load_trusted_keys([GOLDEN / "release-key.pub"])
    device = Installed(counter=1, artifact_sha256=V1_ID)  # runs 1.0.0, the patch's base
    release = verify_release(envelope, trusted, now=datetime(2026, 12, 1, tzinfo=UTC), installed=device)
    assert (release.model.version, release.counter) == ("1.1.0", 2)
