"""The run token: who may steer a run (this module: the token, its file and the methods it guards, without
gRPC, so that domain code may use it; the server's check is ``tauflow.core.auth``).

Reading a role (status, manifests, stats) and the data-plane calls an agent makes (``Generate``,
``ComputeLogprobs``, ``Score``) are open to any caller on the run's network. The methods that change what
is trained or what is served — publishing and loading weights, consuming and acknowledging groups,
putting groups on the internal port, moving the trainer's version or τ, pausing, checkpointing, scaling,
stopping — are *control methods* (``CONTROL_METHODS``): with a run token configured
(``auth.token_file``), a call of one of them without ``authorization: Bearer <run token>`` is refused
UNAUTHENTICATED before its request is read, and changes nothing.

Every process of a run reads the same token file (``tauflow run`` writes one per run, 0600; a cluster
mounts a Secret) and sends the token on the control calls of the channels ``tauflow.core.channel`` makes
(never on an open method: a judge or teacher of another deployment never sees it; on the few open methods
where the run's calls take precedence, ``RUN_PREFERRED_METHODS``, a token derived from it that steers
nothing), and on none of those to servers outside the run (a remote reward service: ``send_run_token=False``). The token is
compared as SHA-256 digests, in constant time, and never logged. It guards against callers that do not
hold it, not against a reader of the traffic: on a network you do not trust, add TLS (a service mesh).
Decisions: docs/reliability.md, "The run token".
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# The methods a run token guards, by service; every other method of these services is open. The queue's
# external port is not guarded by it (its clients have their own tokens: tauflow.queue.tokens).
CONTROL_METHODS: Mapping[str, frozenset[str]] = {
    "tauflow.api.queue.v1.QueueService": frozenset(
        {
            # producers: outside programs put through the external port, with their own tokens
            "Reserve",
            "ReleaseReservation",
            "ReleaseProducerReservations",
            "Put",
            "PutStream",
            "PutBatch",
            # the consumer and the dial
            "Get",
            "Deliver",
            "Ack",
            "Nack",
            "RenewLease",
            "SetTrainerVersion",
            "SetMaxStaleness",
        }
    ),
    "tauflow.api.weights.v1.WeightsService": frozenset({"Publish", "Join", "Leave", "ConfirmVersion"}),
    "tauflow.api.rollout.v1.RolloutService": frozenset(
        {
            "InitWeightsUpdateGroup",
            "UpdateWeightsFromDistributed",
            "UpdateWeightsFromTensor",
            "DestroyWeightsUpdateGroup",
        }
    ),
    "tauflow.api.trainer.v1.TrainerService": frozenset({"SaveCheckpoint", "Pause", "Resume", "SetMaxStaleness"}),
    "tauflow.api.controller.v1.ControllerService": frozenset({"SetMaxStaleness", "ScaleRollout", "StopRun"}),
}


# Open methods on which the run's own processes say they are the run's: the server admits any caller, and gives
# the run's calls precedence (the reward service keeps Score slots for them and hands them a free worker first),
# so that callers without the token cannot starve the run (64 anonymous Score calls of sleeping `code` samples
# took every slot, and the run stopped for as long). They send not the run token but one derived from it
# (``preferred_token``), good for that precedence only: a server outside the run that is sent it (a shared
# reward service) cannot steer the run with it. A call with a wrong token is anyone's call.
RUN_PREFERRED_METHODS: Mapping[str, frozenset[str]] = {
    "tauflow.api.reward.v1.RewardService": frozenset({"Score"}),
}


def _method(path: str | bytes) -> tuple[str, str]:
    text = path.decode("ascii", "replace") if isinstance(path, bytes) else path
    service, _, method = text.lstrip("/").rpartition("/")
    return service, method


def control_method(path: str | bytes) -> bool:
    """Whether the gRPC method ``/<service>/<method>`` is a control method."""
    service, method = _method(path)
    return method in CONTROL_METHODS.get(service, ())


def token_for(path: str | bytes) -> str:
    """What a run's channel sends on ``/<service>/<method>`` (``authorization: Bearer <it>``): the run token on
    a control method, the token derived from it (``preferred_token``) on one of ``RUN_PREFERRED_METHODS``,
    nothing elsewhere or without a run token."""
    token = run_token()
    service, method = _method(path)
    if not token:
        return ""
    if method in CONTROL_METHODS.get(service, ()):
        return token
    if method in RUN_PREFERRED_METHODS.get(service, ()):
        return preferred_token(token)
    return ""


def preferred_token(token: str) -> str:
    """The credential of the run's calls of ``RUN_PREFERRED_METHODS``: HMAC-SHA256 of the run token over a
    fixed label (it tells the run's calls apart; it does not give the run token away)."""
    return hmac.new(token.encode("utf-8", "surrogatepass"), b"tauflow run-preferred v1", hashlib.sha256).hexdigest()


MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 512


class TokenFileError(ValueError):
    """The token file cannot be read or holds no usable token (the message names the file, never the token)."""


def new_token() -> str:
    import secrets

    return secrets.token_urlsafe(32)


def write_token_file(path: str | os.PathLike[str], token: str) -> None:
    """Writes ``token`` to ``path``, readable by this user only, replacing the file at once."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")  # (nodes may share the folder)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as out:
            out.write(token + "\n")
        os.chmod(partial, 0o600)  # (a file left by an earlier try keeps its mode through O_CREAT)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The token in ``path``: one line of 16-512 printable ASCII characters without spaces (a gRPC
    metadata value), surrounding whitespace ignored."""
    try:
        # O_NONBLOCK: a FIFO put in its place must not hold the process (and its restart) forever
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise TokenFileError(f"auth.token_file {path}: {e.strerror or e}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise TokenFileError(f"auth.token_file {path}: not a regular file")
        data = os.read(fd, MAX_TOKEN_CHARS + 64)
    except OSError as e:
        raise TokenFileError(f"auth.token_file {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    token = data.strip()
    if len(data) > MAX_TOKEN_CHARS + 32 or len(token) > MAX_TOKEN_CHARS:
        raise TokenFileError(f"auth.token_file {path}: the token is longer than {MAX_TOKEN_CHARS} characters")
    if len(token) < MIN_TOKEN_CHARS:
        raise TokenFileError(f"auth.token_file {path}: the token needs at least {MIN_TOKEN_CHARS} characters")
    if any(not 0x21 <= b <= 0x7E for b in token):
        raise TokenFileError(f"auth.token_file {path}: the token must be printable ASCII without spaces")
    return token.decode("ascii")


class _RunToken:
    """The process's run token (one run per process): what its channels send."""

    token = ""
    path = ""


def use_run_token(token: str, path: str = "") -> None:
    """Makes ``token`` (read from ``path``) the one this process's channels send from now on ("": none)."""
    _RunToken.token, _RunToken.path = token, str(path)


def load_run_token(path: str | os.PathLike[str]) -> str:
    """Reads the token file and makes its token the process's (``use_run_token``); returns it."""
    token = read_token_file(path)
    use_run_token(token, str(path))
    return token


def run_token() -> str:
    return _RunToken.token


def run_token_file() -> str:
    return _RunToken.path


def bearer_token(metadata: Sequence[tuple[str, Any]] | None) -> tuple[str, str]:
    """(token, "") from ``authorization: Bearer <token>``, or ("", why not)."""
    values = [v for k, v in metadata or () if k == "authorization"]
    if not values:
        return "", "missing `authorization: Bearer <token>` metadata"
    value = values[0].decode(errors="replace") if isinstance(values[0], bytes) else values[0]
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return "", "the authorization metadata must be `Bearer <token>`"
    return token.strip(), ""


def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def from_the_run(metadata: Sequence[tuple[str, Any]] | None) -> bool:
    """Whether a call of one of ``RUN_PREFERRED_METHODS`` with this metadata is one of the run's own: it carries
    the token derived from this process's run token, or the run token itself (compared as digests, in constant
    time), or the process has none (a role started by hand: every call is the run's)."""
    own = run_token()
    if not own:
        return True
    token, _ = bearer_token(metadata)
    if not token:
        return False
    sent = digest(token)
    return hmac.compare_digest(sent, digest(preferred_token(own))) | hmac.compare_digest(sent, digest(own))
