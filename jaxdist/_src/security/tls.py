"""TLS for jaxdist's gRPC services: where the certificates are, and the plaintext opt-out.

Every ps and worker server, and every client of them, uses mutual TLS: the server presents a
certificate signed by the cluster's CA and requires one from the client (``require_client_auth``).
The three PEM files (CA certificate, this task's certificate, its private key) come from, in
order:

1. an argument (``tls=TLSConfig(ca, cert, key)``);
2. ``TF_CONFIG``'s optional jaxdist key ``"tls"``:
   ``{"tls": {"ca": "/etc/jaxdist/ca.pem", "cert": "/etc/jaxdist/task.pem",
   "key": "/etc/jaxdist/task.key", "server_name": "optional SAN to verify"}}``;
3. the environment: ``JAXDIST_TLS_CA``, ``JAXDIST_TLS_CERT``, ``JAXDIST_TLS_KEY`` (and
   ``JAXDIST_TLS_SERVER_NAME``).

Plaintext is used only when asked for explicitly (``tls="insecure"`` or ``JAXDIST_INSECURE=1``)
and only on loopback addresses; without TLS material and without that flag a server refuses to
start and a client refuses to connect, with a message saying how to fix it.
``python -m jaxdist.launch`` and ``jaxdist.testing.LocalCluster`` generate a throwaway CA and
per-task certificates (``jaxdist._src.security.pki``) and set the environment for each task.

Example:
    >>> import os
    >>> from jaxdist._src.security.tls import open_channel, resolve_tls
    >>> from jaxdist.testing.tls import local_pki
    >>> pki = local_pki(["ps:0", "worker:0"])
    >>> os.environ.update(pki.identities["worker:0"].env())   # as a task's launcher sets it
    >>> tls = resolve_tls()                 # from TF_CONFIG / the environment
    >>> channel = open_channel("127.0.0.1:2222", tls, "ps:0")
    >>> channel.close(); pki.cleanup()
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from collections.abc import Mapping, Sequence
from typing import Any

from jaxdist._src.cluster.errors import ClusterConfigError

TLS_CA_ENV = "JAXDIST_TLS_CA"
TLS_CERT_ENV = "JAXDIST_TLS_CERT"
TLS_KEY_ENV = "JAXDIST_TLS_KEY"
TLS_SERVER_NAME_ENV = "JAXDIST_TLS_SERVER_NAME"
INSECURE_ENV = "JAXDIST_INSECURE"
TF_CONFIG_TLS_KEY = "tls"
INSECURE = "insecure"  # tls=INSECURE asks for plaintext (loopback only)

_FIX = (
    "give it TLS material: TF_CONFIG \"tls\": {\"ca\": ..., \"cert\": ..., \"key\": ...}, or "
    f"{TLS_CA_ENV}/{TLS_CERT_ENV}/{TLS_KEY_ENV} (PEM paths), or tls=TLSConfig(...); "
    "`python -m jaxdist.launch` generates them for local clusters. For plaintext on loopback "
    f"only, set {INSECURE_ENV}=1 (or pass tls='insecure' / launch --insecure)"
)


class TLSConfigError(ClusterConfigError):
    """TLS material is missing or unreadable, or plaintext was asked for off loopback."""


@dataclasses.dataclass(frozen=True)
class TLSConfig:
    """Paths of the PEM files of one task's mutual-TLS identity (CA, certificate, key), for
    ``Server``, ``PSClient`` and the coordinator's ``tls=`` arguments.

    Attributes:
        ca: the cluster CA certificate (peers must present certificates it signed).
        cert: this task's certificate (presented as server and as client).
        key: this task's private key.
        server_name: the name to verify in servers' certificates instead of the host of the
            address dialled (``grpc.ssl_target_name_override``); ``None``: the host.

    Example:
        >>> from jaxdist import TLSConfig
        >>> tls = TLSConfig("/tls/ca.pem", "/tls/worker-0.pem", "/tls/worker-0.key")
        >>> creds = tls.channel_credentials()   # reads the files  # doctest: +SKIP
    """

    ca: str
    cert: str
    key: str
    server_name: str | None = None

    def _read(self) -> tuple[bytes, bytes, bytes]:
        out = []
        for what, path in (("CA certificate", self.ca), ("certificate", self.cert),
                           ("private key", self.key)):
            try:
                with open(path, "rb") as f:
                    out.append(f.read())
            except OSError as e:
                raise TLSConfigError(
                    f"cannot read the TLS {what} {path!r}: {e.strerror or e}") from None
        return out[0], out[1], out[2]

    def server_credentials(self) -> Any:
        """``grpc.ssl_server_credentials`` requiring a client certificate signed by ``ca``.

        Example:
            >>> import grpc
            >>> from concurrent import futures
            >>> from jaxdist.testing.tls import local_pki
            >>> pki = local_pki(["ps:0"])
            >>> tls = pki.identities["ps:0"]
            >>> server = grpc.server(futures.ThreadPoolExecutor(1))
            >>> port = server.add_secure_port("127.0.0.1:0", tls.server_credentials())
            >>> pki.cleanup()
        """
        import grpc

        ca, cert, key = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> Any:
        """``grpc.ssl_channel_credentials`` presenting this task's certificate.

        Example:
            >>> import grpc
            >>> from jaxdist.testing.tls import local_pki
            >>> pki = local_pki(["worker:0"])
            >>> tls = pki.identities["worker:0"]
            >>> channel = grpc.secure_channel("127.0.0.1:2222", tls.channel_credentials())
            >>> channel.close(); pki.cleanup()
        """
        import grpc

        ca, cert, key = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                            certificate_chain=cert)

    def env(self) -> dict[str, str]:
        """The environment variables that make a task read this identity.

        Example:
            >>> from jaxdist import TLSConfig
            >>> tls = TLSConfig("/tls/ca.pem", "/tls/worker-0.pem", "/tls/worker-0.key")
            >>> env = dict(tls.env())
            >>> env["JAXDIST_TLS_CA"]
            '/tls/ca.pem'
        """
        out = {TLS_CA_ENV: self.ca, TLS_CERT_ENV: self.cert, TLS_KEY_ENV: self.key}
        if self.server_name:
            out[TLS_SERVER_NAME_ENV] = self.server_name
        return out


def insecure_requested(environ: Mapping[str, str] | None = None) -> bool:
    """True when ``JAXDIST_INSECURE`` is set to ``1``/``true``/``yes``.

    Example:
        >>> from jaxdist._src.security.tls import insecure_requested
        >>> insecure_requested({"JAXDIST_INSECURE": "1"})
        True
    """
    env = os.environ if environ is None else environ
    return env.get(INSECURE_ENV, "").strip().lower() in ("1", "true", "yes")


def _from_tf_config(env: Mapping[str, str]) -> TLSConfig | None:
    from jaxdist._src.cluster.tf_config import tf_config_sections

    section = tf_config_sections(env).get(TF_CONFIG_TLS_KEY)  # bad JSON: the resolver says so
    if section is None:
        return None
    if not isinstance(section, dict) or not all(
            isinstance(section.get(k), str) and section.get(k) for k in ("ca", "cert", "key")):
        keys = sorted(section) if isinstance(section, dict) else type(section).__name__
        raise TLSConfigError(
            f"TF_CONFIG \"tls\" must be an object with string paths \"ca\", \"cert\" and "
            f"\"key\" (and optional \"server_name\"); got keys {keys}")
    name = section.get("server_name")
    return TLSConfig(section["ca"], section["cert"], section["key"],
                     name if isinstance(name, str) and name else None)


def _from_env(env: Mapping[str, str]) -> TLSConfig | None:
    paths = [env.get(k) or "" for k in (TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV)]
    if not any(paths):
        return None
    if not all(paths):
        missing = [k for k, p in zip((TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV), paths) if not p]
        raise TLSConfigError(f"TLS is half configured: {missing} not set (need all three)")
    return TLSConfig(paths[0], paths[1], paths[2], env.get(TLS_SERVER_NAME_ENV) or None)


def resolve_tls(tls: TLSConfig | str | bool | None = None, who: str = "this task",
                environ: Mapping[str, str] | None = None) -> TLSConfig | None:
    """The TLS identity to use; ``None`` means plaintext was explicitly asked for.

    Args:
        tls: a ``TLSConfig``; ``"insecure"`` or ``False`` for plaintext; ``None`` to read
            ``TF_CONFIG`` / the environment (see the module docstring).
        who: the task or client named in errors.
        environ: the environment to read (default ``os.environ``).

    Raises:
        TLSConfigError: no TLS material and plaintext not asked for (the message says how to
            fix it), or half of the environment variables set.

    Example:
        >>> from jaxdist._src.security.tls import resolve_tls
        >>> resolve_tls(environ={"JAXDIST_INSECURE": "1"}) is None
        True
    """
    if isinstance(tls, TLSConfig):
        return tls
    if tls is False or tls == INSECURE:
        return None
    if tls is not None and tls is not True:
        raise TypeError(f"tls must be a TLSConfig, 'insecure' or None, got {tls!r}")
    env = os.environ if environ is None else environ
    found = _from_tf_config(env) or _from_env(env)
    if found is not None:
        return found
    if insecure_requested(env) and tls is not True:
        return None
    raise TLSConfigError(f"{who} has no TLS certificate and plaintext was not asked for: {_FIX}")


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (``127.0.0.0/8``, ``::1``).

    Example:
        >>> from jaxdist._src.security.tls import is_loopback
        >>> is_loopback("127.0.0.1"), is_loopback("10.0.0.1")
        (True, False)
    """
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_plaintext_allowed(who: str, address: str) -> None:
    """Refuses plaintext gRPC to or from an address that is not loopback.

    Raises:
        TLSConfigError: ``address``'s host is not a loopback address.

    Example:
        >>> from jaxdist._src.security.tls import check_plaintext_allowed
        >>> check_plaintext_allowed("ps:0", "127.0.0.1:2222")     # fine
    """
    host = address.rsplit(":", 1)[0] if ":" in address else address
    if not is_loopback(host):
        raise TLSConfigError(
            f"{who}: plaintext gRPC was asked for ({INSECURE_ENV}=1 / tls='insecure') but "
            f"{address!r} is not a loopback address; plaintext is allowed only on loopback. "
            f"Configure TLS instead: TF_CONFIG \"tls\" or {TLS_CA_ENV}/{TLS_CERT_ENV}/"
            f"{TLS_KEY_ENV}")


def add_port(server: Any, address: str, tls: TLSConfig | None, who: str) -> int:
    """Binds ``address`` on a ``grpc.Server``: mutual TLS, or plaintext on loopback.

    Example:
        >>> import os
        >>> from jaxdist._src.security.tls import add_port, resolve_tls
        >>> import grpc
        >>> from concurrent import futures
        >>> os.environ["JAXDIST_INSECURE"] = "1"   # plaintext on loopback (tests, local runs)
        >>> server = grpc.server(futures.ThreadPoolExecutor(1))
        >>> port = add_port(server, "127.0.0.1:0", resolve_tls(), "ps:0")
    """
    if tls is None:
        check_plaintext_allowed(who, address)
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.server_credentials())


def open_channel(address: str, tls: TLSConfig | None, who: str,
                 options: Sequence[tuple[str, Any]] = ()) -> Any:
    """A ``grpc.Channel`` to ``address``: mutual TLS, or plaintext on loopback.

    Example:
        >>> import os
        >>> from jaxdist._src.security.tls import open_channel, resolve_tls
        >>> os.environ["JAXDIST_INSECURE"] = "1"   # plaintext on loopback (tests, local runs)
        >>> channel = open_channel("127.0.0.1:2222", resolve_tls(), "ps:0")
        >>> channel.close()
    """
    import grpc

    options = list(options)
    if tls is None:
        check_plaintext_allowed(who, address)
        return grpc.insecure_channel(address, options=options)
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.secure_channel(address, tls.channel_credentials(), options=options)


__all__ = [
    "INSECURE",
    "INSECURE_ENV",
    "TLSConfig",
    "TLSConfigError",
    "TLS_CA_ENV",
    "TLS_CERT_ENV",
    "TLS_KEY_ENV",
    "TLS_SERVER_NAME_ENV",
    "add_port",
    "check_plaintext_allowed",
    "insecure_requested",
    "is_loopback",
    "open_channel",
    "resolve_tls",
]
