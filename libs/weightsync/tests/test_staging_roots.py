"""The reader opens a staging file only inside its staging roots, and its refusals say nothing of a file's
contents: a hostile Publish named any file the sidecar could read (file:///path), learnt the sha256 of its first
bytes from the checksum error and its size from the length error, then published it as a version."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

from tauflow.weightsync import (
    ChecksumMismatch,
    Manifest,
    Stager,
    StagingError,
    StagingNotFound,
    confined_staging_path,
    default_staging_dir,
    read_staged,
)
from tauflow.weightsync.manifest import BucketSpec, TensorSpec

SECRET = b"agent: tok-" + b"x" * 28 + b"\nother: tok-" + b"y" * 28 + b"\n"


def raw_manifest(n: int, checksum: str, algorithm: str = "sha256") -> Manifest:
    """What a hostile caller sends: one uint8 tensor of ``n`` bytes."""
    tensor = TensorSpec(name="x", dtype="uint8", shape=(n,), offset_bytes=0, size_bytes=n)
    bucket = BucketSpec(index=0, tensors=(tensor,), offset_bytes=0, size_bytes=n)
    return Manifest(policy_version=1, buckets=(bucket,), total_bytes=n, checksum_algorithm=algorithm, checksum=checksum)


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    """(root, secret): a staging root, and a secret file outside it."""
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "outside").mkdir()
    secret = tmp_path / "outside" / "tokens.yaml"
    secret.write_bytes(SECRET)
    return root, secret


def refused(uri: str, manifest: Manifest, roots: list[Path] | None) -> StagingError:
    buf = torch.zeros(manifest.total_bytes, dtype=torch.uint8)
    with pytest.raises(StagingError) as e:
        read_staged(uri, manifest, buf, roots=roots)
    assert not buf.any(), "nothing may be copied from a refused staging area"
    return e.value


def test_a_file_outside_the_roots_is_refused_before_it_is_opened(tree: tuple[Path, Path]) -> None:
    root, secret = tree
    m = raw_manifest(16, "00")
    for uri in (
        f"file://{secret}",
        f"file://{secret.parent}/absent",  # the same answer: nothing says whether a file exists outside
        f"file://{root}/../outside/{secret.name}",  # '..' is refused even where it would stay inside
        f"file://{root}/./x",
        f"file://{root}",  # the root itself is no file in it
        f"file://{root}2/x",  # a sibling whose name starts with the root's
    ):
        err = refused(uri, m, [root])
        assert not isinstance(err, StagingNotFound) and "staging_uri" in str(err), uri
    assert "outside the staging roots" in str(refused(f"file://{secret}", m, [root]))
    assert "outside the staging roots" in str(refused(f"file://{secret}", m, []))  # no root: nothing is read


def test_a_symbolic_link_or_hard_link_out_of_a_root_is_refused(tree: tuple[Path, Path]) -> None:
    root, secret = tree
    m = raw_manifest(16, "00")
    (root / "link").symlink_to(secret)
    (root / "dir").symlink_to(secret.parent, target_is_directory=True)
    assert "symbolic link" in str(refused(f"file://{root}/link", m, [root]))
    assert "symbolic link" in str(refused(f"file://{root}/dir/{secret.name}", m, [root]))
    os.link(secret, root / "hard")
    assert "hard links" in str(refused(f"file://{root}/hard", m, [root]))


def test_a_root_that_is_itself_a_link_is_followed_and_files_below_it_are_read(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    alias = root.parent / "alias"
    alias.symlink_to(root, target_is_directory=True)  # e.g. /tmp -> /private/tmp: the operator's choice
    (root / "sub").mkdir()
    stager = Stager(f"file://{root}/sub/staged")
    m = stager.stage({"w": torch.arange(8.0)}, 1)
    for uri, roots in ((stager.uri, [alias]), (f"file://{alias}/sub/staged", [alias]), (stager.uri, [root])):
        buf = torch.empty(m.total_bytes, dtype=torch.uint8)
        assert read_staged(uri, m, buf, roots=roots) == m.checksum
    # a link that is not a root is a path outside the roots, wherever it points
    assert "outside the staging roots" in str(refused(f"file://{alias}/sub/staged", m, [root]))
    assert confined_staging_path(stager.uri, [root.parent, root]) == (root.resolve(), ("sub", "staged"))


def test_refusals_quote_neither_the_files_checksum_nor_its_size(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    staged = root / "staged"
    staged.write_bytes(SECRET)
    digest = hashlib.sha256(SECRET[:16]).hexdigest()
    buf = torch.empty(16, dtype=torch.uint8)
    with pytest.raises(ChecksumMismatch) as wrong:
        read_staged(f"file://{staged}", raw_manifest(16, "00"), buf, roots=[root])
    assert digest not in str(wrong.value) and wrong.value.actual == digest  # (kept for a log line)
    assert "does not match the manifest's 00" in str(wrong.value)
    with pytest.raises(StagingError) as short:
        read_staged(f"file://{staged}", raw_manifest(4096, "00"), torch.empty(4096, dtype=torch.uint8), roots=[root])
    assert str(len(SECRET)) not in str(short.value) and "shorter than the 4096 bytes" in str(short.value)


def test_by_default_the_root_is_where_a_stager_names_its_own_file(
    tree: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, secret = tree
    monkeypatch.setenv("TAUFLOW_STAGING_DIR", str(root))
    assert default_staging_dir() == root
    stager = Stager()
    try:
        m = stager.stage({"w": torch.ones(4)}, 1)
        assert read_staged(stager.uri, m, torch.empty(m.total_bytes, dtype=torch.uint8)) == m.checksum
        assert "outside the staging roots" in str(refused(f"file://{secret}", raw_manifest(16, "00"), None))
    finally:
        stager.close()
    monkeypatch.delenv("TAUFLOW_STAGING_DIR")
    assert default_staging_dir() in (Path("/dev/shm"), Path("/tmp"))
