"""The queue's typed configuration (``tauflow-queue --print-config`` shows it resolved)."""

from __future__ import annotations

from pydantic import Field, model_validator

from tauflow.core.config import (
    MAX_MESSAGE_BYTES,
    MIN_MESSAGE_BYTES,
    MediaConfig,
    MetricsConfig,
    ServerConfig,
    ServiceConfig,
    StrictModel,
)
from tauflow.queue.wal import FsyncPolicy, OnCorruption

GiB = 1024**3
MiB = 1024**2
# What a Put request carries besides its group: the group's tag and length, and a ticket_id of up to 256
# characters (1 KiB of UTF-8) with its own; generous, so that a group at the limit always fits.
PUT_FRAMING_BYTES = 16 * 1024


def external_message_bytes(max_group_bytes: int, max_message_bytes: int) -> int:
    """The external port's default message limit: what its largest request, a Put of the largest group the
    queue accepts, needs (never below what health and reflection answers need)."""
    largest_group = min(max_group_bytes, max_message_bytes)
    return min(max(largest_group + PUT_FRAMING_BYTES, MIN_MESSAGE_BYTES), MAX_MESSAGE_BYTES)


class WalConfig(StrictModel):
    dir: str = Field("./tauflow-queue-data", description="directory of the write-ahead log")
    fsync: FsyncPolicy = Field(
        FsyncPolicy.ALWAYS,
        description="always: fsync before Put, Ack and SetTrainerVersion return; interval/never: written before "
        "they return (survives SIGKILL, not a power loss)",
    )
    on_corruption: OnCorruption = Field(
        OnCorruption.REFUSE,
        description="records lost to damage before the log's last record: refuse to start (changing nothing), "
        "or proceed with every intact record (the damaged file is kept as queue.wal.corrupt-<UTC time>)",
    )
    fsync_interval_s: float = Field(0.05, gt=0, description="period of the 'interval' policy")
    compact_min_bytes: int = Field(64 * MiB, ge=0, description="compact once this many bytes are dead")


class ExternalConfig(ServerConfig):
    """The external port: a second gRPC server for producers outside tauflow (docs/external-sources.md).

    It serves only what a producer needs (Reserve, ReleaseReservation, Put, Stats), each call
    authenticated by a per-client bearer token, optionally over TLS."""

    enabled: bool = Field(False, description="serve the external port")
    port: int = Field(50061, ge=0, le=65535, description="0 picks a free port")
    tokens_file: str = Field(
        "",
        description="YAML mapping of client name to bearer token (`name: token` lines); re-read when it "
        "changes. Tokens are never config values, so that --print-config and process listings never show them",
    )
    tls_cert_file: str = Field("", description="PEM certificate chain; with tls_key_file, the port speaks TLS")
    tls_key_file: str = Field("", description="PEM private key of tls_cert_file")
    max_concurrent_streams: int = Field(
        32,
        ge=1,
        description="calls one client connection may have in progress at once (HTTP/2; a producer needs its few "
        "waiting Reserves and Puts): gRPC receives each call's message, up to max_message_bytes, before its "
        "token is checked. Further calls wait for one to end",
    )
    # What one client, and all of them together, may hold of the queue's room (docs/queue.md, "External
    # clients"): a client's tickets hold pacing room that tauflow's own rollout then cannot have.
    max_reserve_groups: int = Field(
        64, ge=1, description="largest n_groups of one Reserve on this port (more: INVALID_ARGUMENT)"
    )
    max_reserved_groups: int = Field(
        256,
        ge=1,
        description="reserved groups, not yet put, that one client may hold; a Reserve past it is "
        "RESOURCE_EXHAUSTED (put or release first)",
    )
    reserved_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="share of the pacing window ((tau + 1) x groups_per_step) and of capacity_groups that the "
        "clients of this port together may hold (each rounded down, at least 1 group): their reserved groups not "
        "yet put, and their groups put without a ticket while stored; the rest is kept for tauflow's own "
        "producers. A Reserve past it waits for room like any other, even one over the share of the window (it "
        "follows tau, which SetMaxStaleness changes live); over the share of capacity_groups it is "
        "INVALID_ARGUMENT. A Put without a ticket past it, or past this share of capacity_bytes (for those "
        "groups' bytes), is RESOURCE_EXHAUSTED (ERROR_REASON_QUEUE_FULL)",
    )
    max_waiting_reserves: int = Field(
        8,
        ge=1,
        description="Reserves of one client waiting for room at a time; one more is answered at once, "
        "RESOURCE_EXHAUSTED when it gets no ticket",
    )

    @model_validator(mode="after")
    def _complete(self) -> ExternalConfig:
        if self.enabled and not self.tokens_file:
            raise ValueError("external.tokens_file must be set when the external port is enabled")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("external.tls_cert_file and external.tls_key_file go together: set both or neither")
        return self


class QueueConfig(ServiceConfig):
    server: ServerConfig = ServerConfig(port=50051)
    metrics: MetricsConfig = MetricsConfig(port=9461)
    max_staleness: int = Field(1, ge=-1, description="tau: 0 on-policy, N bounded, -1 unbounded")
    groups_per_step: int = Field(8, ge=1, description="groups the trainer consumes per step")
    capacity_groups: int = Field(100_000, ge=1)
    capacity_bytes: int = Field(8 * GiB, ge=1)
    max_group_bytes: int = Field(64 * MiB, ge=1, description="largest group Put accepts")
    default_lease_s: float = Field(600.0, gt=0)
    max_lease_s: float = Field(
        7 * 86400.0,
        gt=0,
        description="longest lease_duration a Get or RenewLease may ask for (longer: INVALID_ARGUMENT)",
    )
    reservation_ttl_s: float = Field(600.0, gt=0, description="unused tickets are released after this")
    max_wait_s: float = Field(60.0, ge=0, description="cap on the long-poll of Reserve and Get")
    stream_window: int = Field(
        8, ge=1, le=256, description="groups of one PutStream validated and stored ahead of their answers"
    )
    sweep_interval_s: float = Field(0.5, gt=0, description="how often expired leases are redelivered")
    dedup_window: int = Field(1_000_000, ge=0, description="acked group ids remembered for idempotent Put")
    media: MediaConfig = MediaConfig()
    wal: WalConfig = WalConfig()
    external: ExternalConfig = ExternalConfig()

    @model_validator(mode="after")
    def _external_message_limit(self) -> QueueConfig:
        # The external port does not inherit the internal one's limit (256 MiB, sized for Get's batches): gRPC
        # receives a whole message before the bearer token is checked, so any caller could make the queue hold
        # that much per call. Its largest request is a Put of one group.
        # (by default max_group_bytes plus framing; max_concurrent_streams bounds how many at once per connection)
        if "max_message_bytes" not in self.external.model_fields_set:
            limit = external_message_bytes(self.max_group_bytes, self.server.max_message_bytes)
            if self.external.max_message_bytes != limit:
                self.external.max_message_bytes = limit
                self.external.model_fields_set.discard("max_message_bytes")  # still the default: follows its inputs
        return self
