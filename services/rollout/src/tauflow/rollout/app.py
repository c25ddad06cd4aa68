"""Builds the rollout service: the engine (from_pretrained on a local folder), the producer loop when a
data set is configured, the RolloutService API, the weight loader, and membership of the weight sidecar."""

from __future__ import annotations

import asyncio

from tauflow import media
from tauflow.api.rollout.v1 import rollout_pb2
from tauflow.core.app import service_main
from tauflow.core.decoding import servicer_adder
from tauflow.core.server import ServiceApp, ServiceBinding
from tauflow.media import wire as media_wire
from tauflow.models.processor import PartsProcessor
from tauflow.rollout import __version__
from tauflow.rollout.adapters.queue_client import GrpcQueue
from tauflow.rollout.adapters.reward_client import GrpcReward
from tauflow.rollout.adapters.servicer import RolloutServicer
from tauflow.rollout.adapters.weights_client import GrpcSidecar
from tauflow.rollout.config import RolloutConfig
from tauflow.rollout.dataset import epochs, load_prompts
from tauflow.rollout.engine import engine_class
from tauflow.rollout.engine.base import MAX_STOP_CHARS, MAX_STOP_STRINGS, EngineState
from tauflow.rollout.membership import SidecarMembership
from tauflow.rollout.metrics import RolloutMetrics
from tauflow.rollout.producer import Producer
from tauflow.rollout.text import TextCodec
from tauflow.rollout.weights import WeightLoader

ENGINE_WATCH_S = 1.0  # how often the service looks whether its engine still serves

# A Generate's media parts, text and chats are far larger than the default bounds of a string or bytes field.
GENERATE_BOUNDS = {
    **media_wire.field_bounds(),
    "prompt_text": 1 << 18,
    "prompt_messages": media.MAX_MESSAGES,
    "prompt_messages.role": 32,
    "prompt_messages.content": 1 << 18,
    "sampling.stop": MAX_STOP_STRINGS,
    "sampling.stop[]": MAX_STOP_CHARS,
}


async def build(config: RolloutConfig) -> ServiceApp:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    codec = TextCodec.from_folder(config.model_path)  # None: a model that takes token ids only
    eos = codec.eos_token_id if codec is not None else None
    engine = engine_class(config.engine).from_pretrained(
        config.model_path,
        engine_id=f"{config.server_id}-{config.engine}",
        seed=config.seed,
        **({"detokenize": codec.decode} if codec is not None else {}),  # for stop strings
        # the tokenizer's EOS (an instruct model's end of turn) stops generation too, where the checkpoint's
        # generation_config does not list it
        **({"extra_eos_token_ids": (eos,)} if eos is not None else {}),
        **config.engine_options,
    )
    decode = codec.decode if codec is not None else None
    metrics = RolloutMetrics()
    sidecar = (
        GrpcSidecar(config.weights_address, config.channel, model=config.model_path) if config.weights_address else None
    )
    weights = WeightLoader(engine, config.server_id, sidecar)
    producer = queue = reward = None
    # a multimodal model's processor (None: a text model), from the same folder the trainer reads
    processor = PartsProcessor.from_pretrained(config.model_path, media.MediaLimits.of(config.media.model_dump()))
    if config.dataset:
        prompts = load_prompts(config.dataset, codec, config.data.model_dump())
        queue = GrpcQueue(config.queue_address, config.server_id, config.channel)
        reward = GrpcReward(config.reward_address, config.reward_fn, config.channel)
        producer = Producer(
            engine, epochs(prompts, config.seed), queue, reward, config, decode=decode, metrics=metrics,
            processor=processor,
        )  # fmt: skip
    servicer = RolloutServicer(config, engine, weights, producer, codec, processor)
    metrics.watch(engine, servicer, producer)
    bound_port: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def join_sidecar() -> None:
        # Join once serving (the sidecar calls back into this server), and stay a member.
        assert sidecar is not None
        address = f"{config.advertise_host or config.server.host}:{await bound_port}"
        membership = SidecarMembership(
            sidecar,
            config.server_id,
            address,
            lambda: engine.policy_version,
            weights.forget_group,
            check_every_s=config.weights_check_s,
            metrics=metrics,
        )
        await membership.run()

    async def end_when_the_engine_fails() -> None:
        # An engine that stopped serving (its SGLang server lost its weights, or stays paused) ends the service,
        # non-zero: its launcher restarts it, and the new engine attaches afresh and loads the current weights.
        # (With a producer the next ticket fails first; a rollout without one answered UNAVAILABLE for good.)
        while (stats := engine.stats()).state != EngineState.FAILED:
            await asyncio.sleep(ENGINE_WATCH_S)
        raise RuntimeError(f"the engine {stats.engine_id} stopped serving: {stats.last_error}")

    background = [end_when_the_engine_fails]
    if sidecar is not None:
        background.append(join_sidecar)
    if producer is not None:
        background.append(producer.run)

    async def close() -> None:
        if sidecar is not None:
            await sidecar.leave(config.server_id, reason="shutdown")
            await sidecar.close()
        for client in (queue, reward):
            if client is not None:
                await client.close()
        servicer.close()
        weights.close()
        engine.close()

    service = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"]
    return ServiceApp(
        # a Generate's media parts are far larger than the default bound of a bytes field
        bindings=[ServiceBinding(service, servicer, servicer_adder(service, {"Generate": GENERATE_BOUNDS}))],
        background=background,
        close=close,
        info={"policy_version": engine.policy_version},
        on_serving=bound_port.set_result,
    )


main = service_main(
    "rollout",
    RolloutConfig,
    build,
    __version__,
    description="tauflow rollout: generates groups with the current policy, scores them, puts them in the queue",
)
