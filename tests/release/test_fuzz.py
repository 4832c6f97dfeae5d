"""Property-based fuzzing of the patch and release-manifest parsers: they refuse, never crash."""

from __future__ import annotations

import contextlib
import hashlib
import json

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from deployer.core.patch_apply import apply_patch
from deployer.core.patch_format import PREFIX_BYTES, TRAILER_BYTES, decompress_header, parse_header
from deployer.core.release import parse_envelope
from deployer.core.verify import Installed, verify_release
from deployer.errors import FormatError, IntegrityError, UnsafePathError
from tests.release.helpers import NOW, split_patch, tree

pytestmark = pytest.mark.fuzz
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


def _replace_leaf(doc: object, path: list[int], value: object) -> object:
    """Replace the leaf (or subtree) that `path` walks to with `value`."""
    if not path or not isinstance(doc, dict | list) or not doc:
        return value
    keys = list(doc) if isinstance(doc, dict) else list(range(len(doc)))
    key = keys[path[0] % len(keys)]
    copy = dict(doc) if isinstance(doc, dict) else list(doc)
    copy[key] = _replace_leaf(doc[key], path[1:], value)
    return copy


@FUZZ
@given(raw=st.binary(max_size=512))
def test_patch_header_parser_on_random_bytes(raw):
    with pytest.raises((FormatError, UnsafePathError)):
        parse_header(raw)


@FUZZ
@given(raw=st.binary(max_size=512))
def test_compressed_header_reader_on_random_bytes(raw):
    with contextlib.suppress(FormatError):
        parse_header(decompress_header(raw))


@FUZZ
@given(path=st.lists(st.integers(0, 50), min_size=1, max_size=6), value=json_values)
def test_patch_header_parser_on_mutated_headers(fleet, path, value):
    doc = _replace_leaf(split_patch(fleet.patch)[0], path, value)
    with contextlib.suppress(FormatError, UnsafePathError):
        parse_header(json.dumps(doc).encode())


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, 10**9), st.integers(1, 255)), min_size=1, max_size=4))
def test_apply_on_mutated_patch_bytes(fleet, tmp_path_factory, edits):
    original = fleet.patch.read_bytes()
    data = bytearray(original)
    for position, mask in edits:
        data[position % len(data)] ^= mask
    assume(bytes(data) != original)
    work = tmp_path_factory.mktemp("fuzz")
    patch, staging = work / "p.patch", work / "staging"
    patch.write_bytes(bytes(data))
    staging.mkdir()
    with pytest.raises(IntegrityError):
        apply_patch(patch, fleet.v1, staging)
    assert list(staging.iterdir()) == []


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, 10**9), st.integers(1, 255)), min_size=1, max_size=4))
def test_apply_on_mutated_payload_with_a_valid_checksum(fleet, tmp_path_factory, edits):
    """The checksum cannot save the decoders here: a corrupt stream is refused, never crashes them,
    and never installs other bytes than the target's (a flip in padding bits may change nothing)."""
    original = fleet.patch.read_bytes()
    start = PREFIX_BYTES + int.from_bytes(original[8:PREFIX_BYTES], "little")
    body = bytearray(original[:-TRAILER_BYTES])
    for position, mask in edits:
        body[start + position % (len(body) - start)] ^= mask
    assume(bytes(body) != original[:-TRAILER_BYTES])
    work = tmp_path_factory.mktemp("fuzz")
    patch, staging = work / "p.patch", work / "staging"
    patch.write_bytes(bytes(body) + hashlib.sha256(body).digest())
    staging.mkdir()
    try:
        apply_patch(patch, fleet.v1, staging)
    except IntegrityError:
        assert list(staging.iterdir()) == []
    else:
        assert tree(staging) == tree(fleet.v2)


@FUZZ
@given(raw=st.binary(max_size=512))
def test_envelope_parser_on_random_bytes(raw):
    with pytest.raises(FormatError):
        parse_envelope(raw, "fuzz")


@FUZZ
@given(path=st.lists(st.integers(0, 50), min_size=1, max_size=6), value=json_values)
def test_release_verification_on_mutated_manifests(fleet, path, value):
    doc = json.loads(fleet.release().to_bytes())
    mutated = _replace_leaf(doc, path, value)
    try:
        envelope = parse_envelope(json.dumps(mutated).encode(), "fuzz")
        verify_release(envelope, fleet.trusted(), now=NOW, installed=Installed(1, None))
    except IntegrityError:
        return
    assert mutated == doc  # only an unchanged manifest may pass
