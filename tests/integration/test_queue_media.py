"""Multimodal prompts through the queue service (common.v1 revision 3): a group's media parts travel once
per group through Put, the write-ahead log and Get, byte for byte, and through the external port with
tauflow-client; bad media is refused with INVALID_ARGUMENT naming the part, and changes nothing."""

from __future__ import annotations

import hashlib
import re
import signal
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest

from tauflow import media
from tauflow.api.common.v1 import common_pb2
from tauflow.api.queue.v1 import queue_pb2 as q
from tauflow.client import QueueClient, make_group
from tauflow.core.testing import make_group as plain_group
from tauflow.core.testing import queue_stub
from tauflow.media import wire as media_wire


def _parts(root: Path) -> list[media.PromptPart]:
    rng = np.random.default_rng(0)
    t = np.arange(8000) / 16000
    clip = np.stack([np.full((32, 32, 3), 40 * i, np.uint8) for i in range(4)])
    on_disk = media.image(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8))
    (root / "big.png").write_bytes(on_disk.data or b"")
    by_uri = media.Media(
        media.Modality.IMAGE, "image/png", uri=f"file://{root}/big.png",
        sha256=hashlib.sha256(on_disk.data or b"").hexdigest(), width=40, height=40,
    )  # fmt: skip
    return [
        media.Text("shapes: "),
        media.image(rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)),
        media.Text(" tones: "),
        media.audio((0.4 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 16000),
        media.video(clip, fps=2),
        by_uri,
    ]


def _group(group_id: str, parts: list[media.PromptPart]) -> common_pb2.Group:
    g = plain_group(group_id)
    g.prompt_parts.extend(media_wire.to_proto(parts))
    return g


def _metric(port: int, name: str, modality: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    m = re.search(rf'^{name}{{modality="{modality}"}} (\S+)$', text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def test_media_parts_travel_through_put_the_log_and_get_byte_for_byte(service_process, tmp_path: Path) -> None:
    root = tmp_path / "media"
    root.mkdir()
    parts = _parts(root)
    queue = service_process("queue", {"max_staleness": -1, "wal.dir": "wal", "media.roots": [str(root)]})
    stub = queue_stub(queue.address)
    sent = _group("mm-0", parts)
    assert stub.Put(q.PutRequest(group=sent)).outcome == q.PUT_OUTCOME_ACCEPTED
    assert _metric(queue.info["metrics_port"], "tauflow_queue_put_media_parts_total", "image") == 2
    assert _metric(queue.info["metrics_port"], "tauflow_queue_put_media_bytes_total", "audio") == len(
        parts[3].data or b""
    )
    # the log keeps them: killed and restarted, the queue delivers the same bytes
    assert queue.kill(signal.SIGKILL) == -signal.SIGKILL
    queue.start()
    stub = queue_stub(queue.address)
    got = stub.Get(q.GetRequest(consumer_id="t", max_groups=1))
    [delivered] = got.groups
    assert delivered.group.SerializeToString() == sent.SerializeToString()
    assert media_wire.from_proto(delivered.group.prompt_parts) == parts
    stub.Ack(q.AckRequest(lease_id=got.lease.lease_id))


BAD_MEDIA = [
        ("undecodable", lambda p: p.media.__setattr__("data", b"\x89PNG\r\n\x1a\n" + b"\0" * 64),
         "prompt_parts[1].media: the data does not decode as image/png"),
        ("wrong type", lambda p: p.media.__setattr__("media_type", "image/jpeg"),
         "prompt_parts[1].media: the data does not decode as image/jpeg"),
        ("not a type of its modality", lambda p: p.media.__setattr__("media_type", "video/mp4"),
         "prompt_parts[1].media.media_type 'video/mp4' is not a image type"),
        ("inconsistent size", lambda p: p.media.__setattr__("width", 33),
         "prompt_parts[1].media.width is 33 but the media decodes to 32"),
        ("too many pixels", lambda p: p.media.__setattr__("data", media.image(np.zeros((80, 80, 3), np.uint8)).data),
         "prompt_parts[1].media: the image is 80 x 80 pixels, more than 4096"),
        ("no modality", lambda p: p.media.__setattr__("modality", common_pb2.MODALITY_UNSPECIFIED),
         "prompt_parts[1].media.modality must be IMAGE, AUDIO or VIDEO"),
        ("empty part", lambda p: p.ClearField("media"), "prompt_parts[1] has neither text nor media"),
        ("uri outside the roots", lambda p: p.media.__setattr__("uri", "file:///etc/passwd"),
         "prompt_parts[1].media.uri is not under a media root"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "mutate", "says"), BAD_MEDIA, ids=[c[0] for c in BAD_MEDIA])
def test_bad_media_is_refused_naming_the_part_and_changes_nothing(
    service_process, tmp_path: Path, name: str, mutate, says: str
) -> None:
    root = tmp_path / "media"
    root.mkdir()
    queue = service_process(
        "queue", {"max_staleness": -1, "wal.dir": "wal", "media.roots": [str(root)], "media.max_image_pixels": 4096}
    )
    stub = queue_stub(queue.address)
    bad = _group("bad", _parts(root)[:2])
    mutate(bad.prompt_parts[1])
    before = stub.Stats(q.StatsRequest())
    with pytest.raises(grpc.RpcError) as err:
        stub.Put(q.PutRequest(group=bad))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert f"group bad: group.{says}" in (err.value.details() or ""), err.value.details()
    after = stub.Stats(q.StatsRequest())
    assert (after.accepted_groups, after.depth_groups, after.depth_bytes) == (
        before.accepted_groups, before.depth_groups, before.depth_bytes)  # fmt: skip
    # the same id with good media is still accepted: the refusal recorded nothing
    assert stub.Put(q.PutRequest(group=_group("bad", _parts(root)[:2]))).outcome == q.PUT_OUTCOME_ACCEPTED


def test_the_external_port_takes_media_from_tauflow_client(service_process, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("agent: s3cret-token-agent\n")
    queue = service_process("queue", {
        "max_staleness": -1, "wal.dir": "wal", "external.enabled": True, "external.port": 0,
        "external.tokens_file": str(tokens),
    })  # fmt: skip
    parts = _parts(tmp_path)[:5]  # data parts only: this queue has no media roots
    client = QueueClient(f"127.0.0.1:{queue.info['external_port']}", "s3cret-token-agent")
    sample = plain_group("x").samples[0]
    assert client.put(make_group([sample], group_id="ext-0", prompt_parts=parts)).accepted
    got = queue_stub(queue.address).Get(q.GetRequest(consumer_id="t", max_groups=1))
    assert media_wire.from_proto(got.groups[0].group.prompt_parts) == parts
    with pytest.raises(Exception, match=r"prompt_parts\[1\].media: the data does not decode"):
        client.put(make_group([sample], group_id="ext-1", prompt_parts=[
            media.Text("a"), media.Media(media.Modality.IMAGE, "image/png", data=b"not a png")]))  # fmt: skip
