"""A prompt's parts to and from the contract's ``PromptPart`` (common.v1 revision 3): the one
conversion every service and the client use. The only module of tauflow.media that touches protobuf."""

from __future__ import annotations

from collections.abc import Iterable

from tauflow.api.common.v1 import common_pb2
from tauflow.media.parts import InvalidMedia, Media, MediaLimits, Modality, PromptPart, Text, check_structure

_MODALITY = {
    Modality.IMAGE: common_pb2.MODALITY_IMAGE,
    Modality.AUDIO: common_pb2.MODALITY_AUDIO,
    Modality.VIDEO: common_pb2.MODALITY_VIDEO,
}
_FROM_PROTO = {v: k for k, v in _MODALITY.items()}


def to_proto(parts: Iterable[PromptPart]) -> list[common_pb2.PromptPart]:
    out = []
    for p in parts:
        if isinstance(p, Text):
            out.append(common_pb2.PromptPart(text=p.text))
            continue
        m = common_pb2.Media(
            modality=_MODALITY[p.modality], media_type=p.media_type, sha256=p.sha256, width=p.width,
            height=p.height, sample_rate=p.sample_rate, num_samples=p.num_samples, num_frames=p.num_frames,
            fps=p.fps, grid_thw=list(p.grid_thw), num_tokens=p.num_tokens,
        )  # fmt: skip
        if p.data is not None:
            m.data = p.data
        else:
            m.uri = p.uri
        out.append(common_pb2.PromptPart(media=m))
    return out


def from_proto(parts: Iterable[common_pb2.PromptPart], where: str = "prompt_parts") -> list[PromptPart]:
    """The domain parts; a part with no content or no modality is refused, naming it."""
    out: list[PromptPart] = []
    for i, p in enumerate(parts):
        which = p.WhichOneof("content")
        if which == "text":
            out.append(Text(p.text))
            continue
        if which != "media":
            raise InvalidMedia(f"{where}[{i}] has neither text nor media")
        m = p.media
        if m.modality not in _FROM_PROTO:
            raise InvalidMedia(f"{where}[{i}].media.modality must be IMAGE, AUDIO or VIDEO")
        source = m.WhichOneof("source")
        out.append(
            Media(
                _FROM_PROTO[m.modality], m.media_type, data=m.data if source == "data" else None,
                uri=m.uri if source == "uri" else "", sha256=m.sha256, width=m.width, height=m.height,
                sample_rate=m.sample_rate, num_samples=m.num_samples, num_frames=m.num_frames, fps=m.fps,
                grid_thw=tuple(m.grid_thw), num_tokens=m.num_tokens,
            )
        )  # fmt: skip
    return out


def checked_parts(parts: Iterable[common_pb2.PromptPart], where: str = "prompt_parts",
                  limits: MediaLimits | None = None) -> list[PromptPart]:  # fmt: skip
    """``from_proto`` with the contract's structural bounds checked (counts, lengths, types, sources): what a
    port checks before it takes a prompt's parts. Raises InvalidMedia naming the part."""
    out = from_proto(parts, where)
    check_structure(out, limits or MediaLimits(), where)
    return out


def field_bounds(prefix: str = "prompt_parts", limits: MediaLimits | None = None) -> dict[str, int]:
    """The contract's bounds of a ``PromptPart`` list at ``prefix``, as tauflow.core.decoding.check_bounds
    takes per-field bounds (its default for a string or bytes field is far smaller than a media part)."""
    lim = limits or MediaLimits()
    return {
        prefix: lim.max_parts,
        f"{prefix}.text": lim.max_text_chars,
        f"{prefix}.media.data": lim.max_media_bytes,
        f"{prefix}.media.uri": lim.max_uri_chars,
        f"{prefix}.media.media_type": lim.max_media_type_chars,
        f"{prefix}.media.grid_thw": 3,
    }
