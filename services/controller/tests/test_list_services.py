"""ListServices' filter: a kind this server does not know is INVALID_ARGUMENT naming the field (proto3 keeps an
unknown enum number as it is: it answered OK with nothing, as if the run had no such service)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from tauflow.api.controller.v1 import controller_pb2 as pb
from tauflow.controller.adapters.servicer import ControllerServicer
from tauflow.controller.app import build_run
from tauflow.controller.config import RunConfig


class Refused(Exception):
    pass


class Context:
    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Refused(code, details)


def test_an_unknown_kind_is_refused_naming_the_field(tmp_path: Path) -> None:
    roles = ("queue", "reward", "weights", "trainer", "rollout")
    config = RunConfig(model="m", dataset="d", steps=2, out_dir=str(tmp_path), launcher="external",
                       external={role: "127.0.0.1:9" for role in roles})  # fmt: skip
    servicer = ControllerServicer(build_run(config, serve_metrics=False))
    with pytest.raises(Refused) as refused:
        asyncio.run(servicer.ListServices(pb.ListServicesRequest(kind=99), Context()))  # type: ignore[arg-type]
    assert refused.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT and "kind" in refused.value.args[1]
    for kind in pb.ServiceKind.values():  # every known kind answers
        asyncio.run(servicer.ListServices(pb.ListServicesRequest(kind=kind), Context()))  # type: ignore[arg-type]
