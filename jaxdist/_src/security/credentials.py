"""The coordinator credentials: the right to run code on worker tasks, apart from the ps token.

A cluster has two secrets:

* the **cluster token** (TF_CONFIG ``"token"`` / ``JAXDIST_CLUSTER_TOKEN``): pull and push
  parameters on the ps tasks. Every task holds it.
* the **coordinator token** (TF_CONFIG ``"coordinator_token"`` /
  ``JAXDIST_COORDINATOR_TOKEN``): held by the coordinator (the chief) only, and never sent
  to anyone. From it the chief derives (``CoordinatorKeys``):

  - an **Ed25519 signing key**: every request to a worker (``RunClosures``,
    ``CreateResource``, ...) is signed with it, bound to the target task's name, its
    incarnation and a per-worker counter. Workers hold only the **public key** (TF_CONFIG
    ``"coordinator_public_key"`` / ``JAXDIST_COORDINATOR_PUBLIC_KEY``, 64 hex digits): enough
    to check a request, not to make one, so a worker cannot run code on another worker.
  - one **answer key per worker** (HMAC-SHA256 of the token and the task's name): the worker
    MACs its answers with it (TF_CONFIG ``"coordinator_answer_key"`` /
    ``JAXDIST_COORDINATOR_ANSWER_KEY``, 64 hex digits), and the chief checks each worker's
    answers with that worker's key, so a worker cannot answer in another's name.

``CoordinatorKeys.worker_env(task)`` gives one worker task its two values
(``python -m jaxdist.launch`` and ``jaxdist.testing.LocalCluster`` do this).

Example:
    >>> from jaxdist.coordinator import CoordinatorKeys, new_coordinator_token
    >>> keys = CoordinatorKeys(new_coordinator_token())
    >>> cred = keys.worker_credential("worker:0")
    >>> cred.verify(keys.sign(b"m"), b"m"), cred.answer_key == keys.answer_key("worker:0")
    (True, True)
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from jaxdist._src.cluster.errors import ClusterConfigError

COORDINATOR_TOKEN_ENV = "JAXDIST_COORDINATOR_TOKEN"
COORDINATOR_PUBLIC_KEY_ENV = "JAXDIST_COORDINATOR_PUBLIC_KEY"
COORDINATOR_ANSWER_KEY_ENV = "JAXDIST_COORDINATOR_ANSWER_KEY"
#: The coordinator token's SHA-256: what workers held before requests were signed. It is no
#: longer accepted (it let a worker check the token, so the token had to be sent to it).
COORDINATOR_DIGEST_ENV = "JAXDIST_COORDINATOR_TOKEN_SHA256"

_SIGNING_LABEL = b"jaxdist/coordinator-signing-key/v1"
_ANSWER_LABEL = b"jaxdist/coordinator-answer-key/v1\0"


def new_coordinator_token() -> str:
    """A fresh random coordinator token.

    Example:
        >>> from jaxdist.coordinator import new_coordinator_token
        >>> len(new_coordinator_token())
        64
    """
    return secrets.token_hex(32)


def token_digest(token: str) -> str:
    """The hex SHA-256 of a token.

    Example:
        >>> from jaxdist._src.security.credentials import token_digest
        >>> token_digest("a")[:8]
        'ca978112'
    """
    return hashlib.sha256(token.encode()).hexdigest()


def _tf_config(env: Mapping[str, str]) -> dict:
    from jaxdist._src.cluster.tf_config import tf_config_sections

    return tf_config_sections(env)


def coordinator_token(token: str | None = None,
                      environ: Mapping[str, str] | None = None) -> str | None:
    """The coordinator token: ``token``, TF_CONFIG ``"coordinator_token"``, or the environment.

    Example:
        >>> from jaxdist._src.security.credentials import coordinator_token
        >>> coordinator_token(environ={"JAXDIST_COORDINATOR_TOKEN": "c0"})
        'c0'
    """
    if token:
        return token
    env = os.environ if environ is None else environ
    value = _tf_config(env).get("coordinator_token")
    if value is not None and not isinstance(value, str):
        raise ClusterConfigError("TF_CONFIG \"coordinator_token\" must be a string")
    return value or env.get(COORDINATOR_TOKEN_ENV) or None


def _hex32(value: object, what: str) -> bytes:
    """32 bytes from 64 hex digits, or a ``ClusterConfigError`` naming ``what``."""
    if not isinstance(value, str):
        raise ClusterConfigError(f"{what} must be a string of 64 hex digits, got "
                                 f"{type(value).__name__}")
    try:
        raw = bytes.fromhex(value.strip())
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise ClusterConfigError(f"{what} is not 64 hex digits (32 bytes): got "
                                 f"{len(value)} characters")
    return raw


class WorkerCredential:
    """What one worker task holds: the chief's public key and its own answer key.

    Args:
        public_key: the coordinator's Ed25519 public key (64 hex digits).
        answer_key: this worker's answer key (64 hex digits).

    Raises:
        ClusterConfigError: either is not 64 hex digits.

    Example:
        >>> from jaxdist.coordinator import CoordinatorKeys, WorkerCredential
        >>> keys = CoordinatorKeys("c0")
        >>> cred = WorkerCredential(keys.public_key, keys.answer_key("worker:0").hex())
        >>> cred.verify(keys.sign(b"x"), b"x"), cred.verify(b"0" * 64, b"x")
        (True, False)
    """

    def __init__(self, public_key: str, answer_key: str):
        self.public_key = public_key.strip().lower()
        self._verifier = Ed25519PublicKey.from_public_bytes(
            _hex32(public_key, "the coordinator public key"))
        self.answer_key = _hex32(answer_key, "the coordinator answer key")

    def verify(self, signature: bytes, message: bytes) -> bool:
        """True when ``signature`` is the coordinator's Ed25519 signature of ``message``."""
        try:
            self._verifier.verify(signature, message)
        except (InvalidSignature, ValueError, TypeError):
            return False
        return True


class CoordinatorKeys:
    """The chief's keys, derived from the coordinator token (never sent to anyone).

    Args:
        token: the coordinator token.

    Example:
        >>> from jaxdist.coordinator import CoordinatorKeys
        >>> keys = CoordinatorKeys("c0")
        >>> len(keys.public_key), len(keys.sign(b"m")), len(keys.answer_key("worker:1"))
        (64, 64, 32)
    """

    def __init__(self, token: str):
        if not token:
            raise ClusterConfigError("the coordinator token is empty")
        self._token = token.encode()
        seed = hmac.digest(self._token, _SIGNING_LABEL, "sha256")
        self._signer = Ed25519PrivateKey.from_private_bytes(seed)
        self.public_key = self._signer.public_key().public_bytes(
            Encoding.Raw, PublicFormat.Raw).hex()

    def sign(self, message: bytes) -> bytes:
        """The Ed25519 signature of ``message`` (64 bytes)."""
        return self._signer.sign(message)

    def answer_key(self, task: str) -> bytes:
        """The key worker ``task`` (``"worker:0"``) MACs its answers with."""
        return hmac.digest(self._token, _ANSWER_LABEL + task.encode(), "sha256")

    def worker_credential(self, task: str) -> WorkerCredential:
        """What worker ``task`` is given (public key and its answer key)."""
        return WorkerCredential(self.public_key, self.answer_key(task).hex())

    def worker_env(self, task: str) -> dict[str, str]:
        """Worker ``task``'s credential as environment variables.

        Example:
            >>> from jaxdist.coordinator import CoordinatorKeys
            >>> sorted(CoordinatorKeys("c0").worker_env("worker:0"))
            ['JAXDIST_COORDINATOR_ANSWER_KEY', 'JAXDIST_COORDINATOR_PUBLIC_KEY']
        """
        return {COORDINATOR_PUBLIC_KEY_ENV: self.public_key,
                COORDINATOR_ANSWER_KEY_ENV: self.answer_key(task).hex()}


def worker_credential(task: str, value: WorkerCredential | str | None = None,
                      environ: Mapping[str, str] | None = None) -> WorkerCredential | None:
    """What worker ``task`` checks requests and MACs answers with (``None``: none configured).

    Reads, in order: ``value`` (a ``WorkerCredential``, or the coordinator token itself, from
    which the credential is derived), TF_CONFIG ``"coordinator_public_key"`` and
    ``"coordinator_answer_key"``, ``JAXDIST_COORDINATOR_PUBLIC_KEY`` and
    ``JAXDIST_COORDINATOR_ANSWER_KEY``, and finally the token itself (TF_CONFIG
    ``"coordinator_token"`` / ``JAXDIST_COORDINATOR_TOKEN``; a worker given the token can act
    as the chief, so give workers the two keys instead).

    Raises:
        ClusterConfigError: only one of the two keys, a key that is not 64 hex digits, or only
            the token's SHA-256 (``coordinator_token_sha256``), which is no longer enough.

    Example:
        >>> from jaxdist._src.security.credentials import worker_credential
        >>> from jaxdist.coordinator import CoordinatorKeys
        >>> keys = CoordinatorKeys("c0")
        >>> cred = worker_credential("worker:0", environ=keys.worker_env("worker:0"))
        >>> cred.public_key == keys.public_key
        True
    """
    if isinstance(value, WorkerCredential):
        return value
    if value:
        return CoordinatorKeys(value).worker_credential(task)
    env = os.environ if environ is None else environ
    config = _tf_config(env)
    public = config.get("coordinator_public_key") or env.get(COORDINATOR_PUBLIC_KEY_ENV)
    answer = config.get("coordinator_answer_key") or env.get(COORDINATOR_ANSWER_KEY_ENV)
    if public or answer:
        if not (public and answer):
            missing = "coordinator_answer_key" if public else "coordinator_public_key"
            raise ClusterConfigError(
                f"{task}: TF_CONFIG {missing!r} (or JAXDIST_{missing.upper()}) is missing: a "
                f"worker needs both the coordinator's public key and its own answer key")
        return WorkerCredential(public, answer)
    token = coordinator_token(None, env)
    if token:
        return CoordinatorKeys(token).worker_credential(task)
    if config.get("coordinator_token_sha256") or env.get(COORDINATOR_DIGEST_ENV):
        raise ClusterConfigError(
            f"{task}: the coordinator token's SHA-256 (coordinator_token_sha256 / "
            f"{COORDINATOR_DIGEST_ENV}) is no longer accepted: the chief now signs its "
            f"requests. Give the worker TF_CONFIG 'coordinator_public_key' and "
            f"'coordinator_answer_key' (jaxdist._src.security.credentials.CoordinatorKeys(token)"
            f".worker_env({task!r}) computes them)")
    return None


__all__ = [
    "COORDINATOR_ANSWER_KEY_ENV",
    "COORDINATOR_DIGEST_ENV",
    "COORDINATOR_PUBLIC_KEY_ENV",
    "COORDINATOR_TOKEN_ENV",
    "CoordinatorKeys",
    "WorkerCredential",
    "coordinator_token",
    "new_coordinator_token",
    "token_digest",
    "worker_credential",
]
