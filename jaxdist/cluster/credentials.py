"""The coordinator credential: the right to run code on worker tasks, apart from the ps token.

A cluster has two secrets:

* the **cluster token** (TF_CONFIG ``"token"`` / ``JAXDIST_CLUSTER_TOKEN``): pull and push
  parameters on the ps tasks. Every task holds it.
* the **coordinator token** (TF_CONFIG ``"coordinator_token"`` /
  ``JAXDIST_COORDINATOR_TOKEN``): send functions to worker tasks, which unpickle and run them
  (``ClusterCoordinator``). Only the coordinator (the chief) holds it. Worker tasks hold only
  its SHA-256 digest (TF_CONFIG ``"coordinator_token_sha256"`` /
  ``JAXDIST_COORDINATOR_TOKEN_SHA256``), enough to check it, not to present it: a worker cannot
  run code on another worker, and a ps client holding the cluster token cannot run code on any.

Example:
    >>> token = new_coordinator_token()
    >>> verifier = coordinator_verifier(environ={"JAXDIST_COORDINATOR_TOKEN_SHA256":
    ...                                          token_digest(token)})
    >>> verifier.accepts(token)
    True
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping

from jaxdist.cluster.errors import ClusterConfigError

COORDINATOR_TOKEN_ENV = "JAXDIST_COORDINATOR_TOKEN"
COORDINATOR_DIGEST_ENV = "JAXDIST_COORDINATOR_TOKEN_SHA256"
COORDINATOR_METADATA_KEY = "x-jaxdist-coordinator-token"


def new_coordinator_token() -> str:
    """A fresh random coordinator token.

    Example:
        >>> len(new_coordinator_token())
        64
    """
    return secrets.token_hex(32)


def token_digest(token: str) -> str:
    """The hex SHA-256 of a token (what worker tasks are given).

    Example:
        >>> token_digest("a")[:8]
        'ca978112'
    """
    return hashlib.sha256(token.encode()).hexdigest()


def _tf_config(env: Mapping[str, str]) -> dict:
    from jaxdist.cluster.tf_config import tf_config_sections

    return tf_config_sections(env)


def coordinator_token(token: str | None = None,
                      environ: Mapping[str, str] | None = None) -> str | None:
    """The coordinator token: ``token``, TF_CONFIG ``"coordinator_token"``, or the environment.

    Example:
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


class CoordinatorVerifier:
    """Checks a presented coordinator token against a stored SHA-256 digest (constant time).

    Args:
        digest_hex: the hex SHA-256 of the coordinator token.

    Example:
        >>> CoordinatorVerifier(token_digest("c0")).accepts("c0")
        True
    """

    def __init__(self, digest_hex: str):
        try:
            self._digest = bytes.fromhex(digest_hex)
        except ValueError:
            raise ClusterConfigError(
                "the coordinator token digest is not hex (expected the 64-digit SHA-256 of "
                "the coordinator token)") from None
        if len(self._digest) != 32:
            raise ClusterConfigError(
                f"the coordinator token digest has {len(self._digest)} bytes: expected the "
                f"32-byte SHA-256 of the coordinator token")

    def accepts(self, presented: str | bytes | None) -> bool:
        """True when ``presented`` is the coordinator token."""
        if not presented:
            return False
        raw = presented.encode() if isinstance(presented, str) else presented
        return hmac.compare_digest(hashlib.sha256(raw).digest(), self._digest)

    @property
    def digest(self) -> bytes:
        """The 32-byte digest (also the key workers sign their results with)."""
        return self._digest


def coordinator_verifier(token_or_digest: str | None = None,
                         environ: Mapping[str, str] | None = None
                         ) -> CoordinatorVerifier | None:
    """What a worker task checks the coordinator token with (``None``: none configured).

    Reads, in order: the argument (a 64-hex-digit digest, else taken as the token itself),
    TF_CONFIG ``"coordinator_token_sha256"``, ``JAXDIST_COORDINATOR_TOKEN_SHA256``, and finally
    the token itself (TF_CONFIG ``"coordinator_token"`` / ``JAXDIST_COORDINATOR_TOKEN``).

    Example:
        >>> coordinator_verifier(token_digest("c0")).accepts("c0")
        True
    """
    if token_or_digest:
        if len(token_or_digest) == 64 and all(c in "0123456789abcdef" for c in token_or_digest):
            return CoordinatorVerifier(token_or_digest)
        return CoordinatorVerifier(token_digest(token_or_digest))
    env = os.environ if environ is None else environ
    digest = _tf_config(env).get("coordinator_token_sha256") or env.get(COORDINATOR_DIGEST_ENV)
    if digest:
        if not isinstance(digest, str):
            raise ClusterConfigError("TF_CONFIG \"coordinator_token_sha256\" must be a string")
        return CoordinatorVerifier(digest.strip().lower())
    token = coordinator_token(None, env)
    return CoordinatorVerifier(token_digest(token)) if token else None


__all__ = [
    "COORDINATOR_DIGEST_ENV",
    "COORDINATOR_METADATA_KEY",
    "COORDINATOR_TOKEN_ENV",
    "CoordinatorVerifier",
    "coordinator_token",
    "coordinator_verifier",
    "new_coordinator_token",
    "token_digest",
]
