"""Builds the rollout service: the engine (from_pretrained on a local folder), the producer loop when a
data set is configured, the RolloutService API, and membership of the weight sidecar."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tauflow.api.rollout.v1 import rollout_pb2
from tauflow.api.weights.v1 import weights_pb2, weights_pb2_grpc
from tauflow.core.app import service_main
from tauflow.core.channel import create_channel
from tauflow.core.decoding import servicer_adder
from tauflow.core.server import ServiceApp, ServiceBinding
from tauflow.rollout import __version__
from tauflow.rollout.clients import GrpcQueue, GrpcReward, GrpcSidecar
from tauflow.rollout.config import RolloutConfig
from tauflow.rollout.dataset import epochs, load_prompts
from tauflow.rollout.engine import SamplingParams, engine_class
from tauflow.rollout.membership import SidecarMembership
from tauflow.rollout.metrics import RolloutMetrics
from tauflow.rollout.producer import Producer, ProducerSettings
from tauflow.rollout.servicer import Limits, RolloutServicer


def _tokenizer(model_path: str):  # type: ignore[no-untyped-def]
    if not (Path(model_path) / "tokenizer_config.json").exists():
        return None, None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    return (lambda text: list(tok.encode(text))), (lambda ids: tok.decode(ids, skip_special_tokens=True))


async def build(config: RolloutConfig) -> ServiceApp:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    engine = engine_class(config.engine).from_pretrained(
        config.model_path, engine_id=f"{config.server_id}-{config.engine}", seed=config.seed, **config.engine_options
    )
    encode, decode = _tokenizer(config.model_path)
    metrics = RolloutMetrics()
    sidecar_channel = sidecar = None
    if config.weights_address:
        sidecar_channel = create_channel(
            config.weights_address, [weights_pb2.DESCRIPTOR.services_by_name["WeightsService"]], config.channel
        )
        sidecar = weights_pb2_grpc.WeightsServiceStub(sidecar_channel)
    producer = queue = reward = None
    if config.dataset:
        prompts = load_prompts(
            config.dataset, encode, prompt_field=config.prompt_field, id_field=config.id_field,
            metadata_fields=tuple(config.metadata_fields),
        )
        queue = GrpcQueue(config.queue_address, config.server_id, config.channel)
        reward = GrpcReward(config.reward_address, config.reward_fn, config.channel)
        s = config.sampling
        producer = Producer(
            engine, epochs(prompts, config.seed), queue, reward,
            ProducerSettings(
                producer_id=config.server_id, group_size=config.group_size,
                groups_per_ticket=config.groups_per_ticket, tickets_in_flight=config.tickets_in_flight,
                sampling=SamplingParams(
                    max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                    stop_token_ids=tuple(s.stop_token_ids),
                ),
            ),
            decode=decode,
            metrics=metrics,
        )
    servicer = RolloutServicer(
        config.server_id, engine, encode, decode, config.sampling.max_new_tokens, sidecar, producer,
        limits=Limits(max_n=config.max_n, max_in_flight=config.max_in_flight, max_wait_s=config.max_wait_s),
    )
    metrics.watch(engine, servicer, producer)
    port_holder: dict[str, int] = {}

    async def join_sidecar() -> None:
        # Join once serving (the sidecar calls back into this server), and stay a member.
        while "port" not in port_holder:
            await asyncio.sleep(0.05)
        assert sidecar is not None
        membership = SidecarMembership(
            GrpcSidecar(sidecar, model=config.model_path),
            config.server_id,
            f"{config.advertise_host or config.server.host}:{port_holder['port']}",
            lambda: engine.policy_version,
            servicer.receiver.reset,
            check_every_s=config.weights_check_s,
            metrics=metrics,
        )
        await membership.run()

    background = []
    if sidecar is not None:
        background.append(join_sidecar)
    if producer is not None:
        background.append(producer.run)

    async def close() -> None:
        if sidecar is not None:
            try:
                await sidecar.Leave(weights_pb2.LeaveRequest(member_id=config.server_id, reason="shutdown"), timeout=5)
            except Exception:  # noqa: BLE001 - the sidecar drops dead members by itself
                pass
            await sidecar_channel.close()  # type: ignore[union-attr]
        for client in (queue, reward):
            if client is not None:
                await client.close()
        engine.close()

    service = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"]
    return ServiceApp(
        bindings=[ServiceBinding(service, servicer, servicer_adder(service))],
        background=background,
        close=close,
        info={"policy_version": engine.policy_version},
        on_serving=lambda port: port_holder.setdefault("port", port),
    )


main = service_main(
    "rollout", RolloutConfig, build, __version__,
    description="tauflow rollout: generates groups with the current policy, scores them, puts them in the queue",
)
