"""The trainer's spans: one ``trainer.step`` per optimizer step, linked to the groups it consumed, holding
``queue.get``, ``forward_backward``, ``optimizer.step`` and ``weights.publish``, whose context the
publisher sends on."""

from __future__ import annotations

import asyncio

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tauflow.core.staleness import UNBOUNDED
from tauflow.core.telemetry import traceparent_of
from tauflow.trainer.backend import TorchBackend, TorchBackendConfig
from tauflow.trainer.config import TrainerConfig
from tauflow.trainer.loop import TrainerLoop
from tauflow.trainer.optim import OptimConfig
from tauflow.trainer.ports import Batch


def _memory_exporter() -> InMemorySpanExporter:
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(TracerProvider())
    exporter = InMemorySpanExporter()
    trace.get_tracer_provider().add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


class TracedQueue:
    """Hands out groups one per Get (so a step takes two Gets), each with its rollout's traceparent."""

    def __init__(self, groups, traceparents) -> None:
        self.pending = list(zip(groups, traceparents, strict=True))
        self.n = 0

    async def set_version(self, version: int, rebase: bool = False) -> None:
        pass

    async def get_batch(self, n_groups, consumer_version, wait_s, lease_s):
        if not self.pending:
            await asyncio.sleep(0.01)
            return None
        (g, tp), self.pending = self.pending[0], self.pending[1:]
        self.n += 1
        return Batch(f"lease-{self.n}", [g], trace_contexts=[tp])

    async def ack(self, lease_id: str) -> None:
        pass

    async def nack(self, lease_id: str) -> None:
        pass

    async def renew(self, lease_id: str, lease_s: float) -> None:
        pass


class ContextPublisher:
    """Records the trace context current while publishing: what SidecarPublisher puts in PublishRequest."""

    def __init__(self) -> None:
        self.contexts: dict[int, str] = {}

    async def publish(self, version, tensors, rebase=False):
        self.contexts[version] = traceparent_of()[0]

    async def latest_version(self) -> int | None:
        return max(self.contexts, default=None)


def test_a_step_span_links_its_groups_with_their_staleness_and_holds_its_phases(
    tiny_model_dir, make_groups, tmp_path
) -> None:
    exporter = _memory_exporter()
    rollout = TracerProvider().get_tracer("rollout")  # the producer's side, in another "process"
    groups = make_groups(1, 4, version=0)  # all made by version 0: step 1 trains them one version stale
    roots = []
    for g in groups:
        with rollout.start_as_current_span("queue.put") as root:
            roots.append(root)
    queue = TracedQueue(groups, [traceparent_of(r)[0] for r in roots])
    publisher = ContextPublisher()
    backend_config = TorchBackendConfig(model_path=str(tiny_model_dir), optim=OptimConfig(lr=1e-3))
    config = TrainerConfig(
        backend=backend_config,
        groups_per_step=2,
        max_staleness=UNBOUNDED,
        total_steps=2,
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_every_steps=100,
        lease_s=60,
        get_wait_s=0.1,
        history_steps=100,
    )
    asyncio.run(TrainerLoop(TorchBackend(backend_config), queue, publisher, config).run())

    spans = exporter.get_finished_spans()
    steps = sorted((s for s in spans if s.name == "trainer.step"), key=lambda s: s.attributes["rl.step"])
    assert [s.attributes["rl.step"] for s in steps] == [0, 1]
    for k, step in enumerate(steps):
        assert step.parent is None  # a root: its groups' traces are linked, not parents
        assert step.attributes["rl.policy_version"] == k + 1 and step.attributes["rl.committed"] is True
        assert step.attributes["rl.trained_tokens"] > 0 and "rl.loss" in step.attributes
        assert "rl.reward_mean" in step.attributes and step.attributes["rl.groups"] == 2
        linked = {(link.context.trace_id, link.context.span_id): link.attributes for link in step.links}
        for g, root in zip(groups[2 * k : 2 * k + 2], roots[2 * k : 2 * k + 2], strict=True):
            ctx = root.get_span_context()
            attrs = linked[(ctx.trace_id, ctx.span_id)]
            assert attrs["rl.group_id"] == g.group_id and attrs["rl.staleness"] == k  # k - version 0
        children = [s for s in spans if s.parent is not None and s.parent.span_id == step.context.span_id]
        names = [s.name for s in sorted(children, key=lambda s: s.start_time)]
        assert names == ["queue.get", "queue.get", "forward_backward", "optimizer.step", "weights.publish"]
        by_name = {s.name: s for s in children}
        assert all(s.context.trace_id == step.context.trace_id for s in children)
        assert step.start_time <= min(s.start_time for s in children)
        assert max(s.end_time for s in children) <= step.end_time
        publish = by_name["weights.publish"]
        assert publish.attributes["rl.policy_version"] == k + 1
        # the publish's context went to the publisher (PublishRequest.trace_context)
        ctx = publish.context
        assert publisher.contexts[k + 1].startswith(f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-")
