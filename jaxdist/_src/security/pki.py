"""A throwaway certificate authority and per-task certificates for a local cluster.

``python -m jaxdist.launch`` and ``jaxdist.testing.LocalCluster`` call ``local_pki`` once per
cluster: it creates a private directory (mode 0700), a CA whose private key never touches the
disk (nobody can sign another certificate once the call returns), and one EC P-256 key and
certificate per task, valid for the loopback names, readable only by the owner (0600). Every
certificate is good for both server and client authentication (tasks are both).

Example:
    >>> from jaxdist.testing.tls import local_pki
    >>> pki = local_pki(["chief:0", "worker:0", "ps:0", "client"])
    >>> pki.identities["ps:0"].cert
    '/tmp/jaxdist-tls-.../ps-0.pem'
    >>> pki.cleanup()
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence

from jaxdist._src.security.tls import TLSConfig

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


@dataclasses.dataclass
class LocalPKI:
    """The files of a generated PKI: a CA and one ``TLSConfig`` identity per name (``identities``),
    ``cleanup()``.

    Attributes:
        directory: the private directory holding them.
        ca: path of the CA certificate.
        identities: ``name -> TLSConfig`` (the task's certificate and key).

    Example:
        >>> from jaxdist.testing.tls import local_pki
        >>> pki = local_pki(["worker:0", "ps:0"])
        >>> env = {}
        >>> env.update(pki.identities["worker:0"].env())
        >>> sorted(env)
        ['JAXDIST_TLS_CA', 'JAXDIST_TLS_CERT', 'JAXDIST_TLS_KEY']
        >>> pki.cleanup()
    """

    directory: str
    ca: str
    identities: dict[str, TLSConfig]

    def cleanup(self) -> None:
        """Deletes the directory and every key in it.

        Example:
            >>> from jaxdist.testing.tls import local_pki
            >>> pki = local_pki(["worker:0"])
            >>> pki.cleanup()
        """
        shutil.rmtree(self.directory, ignore_errors=True)


def _write(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _san(hosts: Sequence[str]):
    from cryptography import x509

    names: list = []
    for h in dict.fromkeys(hosts):
        h = h.strip("[]")
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


def _new_ca(days: int):
    """A fresh CA: ``(key, name, certificate, not_before, not_after)``; the key stays in memory."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "jaxdist throwaway CA")])
    ca_cert = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                     False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    return ca_key, ca_name, ca_cert, start, end


def _issue(ca, name: str, hosts: Sequence[str]) -> tuple[bytes, bytes]:
    """One task's certificate (for ``hosts``) and private key, PEM: ``(cert, key)``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_key, ca_name, _, start, end = ca
    key = ec.generate_private_key(ec.SECP256R1())
    job = name.split(":")[0]
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name),
                         x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, job)])
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(ca_name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                              ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .add_extension(_san(hosts), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


def _ca_pem(ca) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return ca[2].public_bytes(serialization.Encoding.PEM)


def local_pki(names: Sequence[str], hosts: Sequence[str] = LOOPBACK_NAMES,
              directory: str | None = None, days: int = 7) -> LocalPKI:
    """Generates a CA and one certificate per name in a new private directory (tests and small
    clusters; use your own PKI in production).

    Args:
        names: identities to issue (task names like ``"worker:0"``, or ``"client"``).
        hosts: host names / IPs the certificates are valid for (loopback by default).
        directory: parent of the new directory (default: the system temp directory).
        days: validity.

    Returns:
        The ``LocalPKI`` (call ``cleanup()`` when the cluster is gone).

    Example:
        >>> from jaxdist.testing.tls import local_pki
        >>> pki = local_pki(["ps:0", "client"])
        >>> server_tls, client_tls = pki.identities["ps:0"], pki.identities["client"]
    """
    root = tempfile.mkdtemp(prefix="jaxdist-tls-", dir=directory)  # mode 0700
    os.chmod(root, 0o700)
    ca = _new_ca(days)
    ca_path = os.path.join(root, "ca.pem")
    _write(ca_path, _ca_pem(ca))
    identities: dict[str, TLSConfig] = {}
    for name in names:
        cert, key = _issue(ca, name, hosts)
        stem = re.sub(r"[^A-Za-z0-9_.-]", "-", name)
        cert_path, key_path = os.path.join(root, f"{stem}.pem"), os.path.join(root, f"{stem}.key")
        _write(cert_path, cert)
        _write(key_path, key)
        identities[name] = TLSConfig(ca_path, cert_path, key_path)
    return LocalPKI(root, ca_path, identities)


class TaskCA:
    """A throwaway CA held in memory that issues task certificates as PEM bytes.

    For launchers that hand each task its files over a channel of their own (``python -m
    jaxdist.launch --backend ray`` passes them to the task's actor): the CA's private key never
    leaves this object and never touches the disk.

    Args:
        days: validity of the CA and of every certificate it issues.

    Example:
        >>> from jaxdist._src.security.pki import TaskCA
        >>> ca = TaskCA()
        >>> cert, key = ca.issue("worker:0", ["10.0.0.2"])
        >>> ca.ca_pem.startswith(b"-----BEGIN CERTIFICATE"), key.startswith(b"-----BEGIN")
        (True, True)
    """

    def __init__(self, days: int = 7):
        self._ca = _new_ca(days)
        self.ca_pem: bytes = _ca_pem(self._ca)

    def issue(self, name: str, hosts: Sequence[str]) -> tuple[bytes, bytes]:
        """Task ``name``'s certificate, valid for ``hosts`` only, and its private key (PEM)."""
        return _issue(self._ca, name, hosts)


def per_task_pki(tasks: Mapping[str, tuple[str, Sequence[str]]], days: int = 7) -> LocalPKI:
    """A CA and one certificate per task, each task's files in a directory of its own.

    For clusters whose tasks run on other hosts (``python -m jaxdist.slurm``): task ``name``'s
    certificate is valid for its own host's names only, and its directory (created, mode
    0700) holds ``ca.pem``, ``cert.pem`` and ``key.pem`` (0600) and nothing of another task.
    The CA's private key never touches the disk.

    Args:
        tasks: task name -> ``(directory, hosts)``.
        days: validity.

    Returns:
        A ``LocalPKI`` whose ``directory`` is the parent of the first task's directory.

    Example:
        >>> from jaxdist._src.security.pki import per_task_pki
        >>> import tempfile
        >>> root = tempfile.mkdtemp()
        >>> pki = per_task_pki({"worker:0": (f"{root}/task-0", ["n1", "127.0.0.1"])})
        >>> pki.identities["worker:0"].key.endswith("task-0/key.pem")
        True
    """
    ca = TaskCA(days)
    identities: dict[str, TLSConfig] = {}
    first = ""
    for name, (task_dir, hosts) in tasks.items():
        first = first or os.path.dirname(os.path.abspath(task_dir))
        identities[name] = write_task_identity(task_dir, ca.ca_pem, *ca.issue(name, hosts))
    return LocalPKI(first, "", identities)


def write_task_identity(task_dir: str, ca_pem: bytes, cert_pem: bytes,
                        key_pem: bytes) -> TLSConfig:
    """Creates ``task_dir`` (mode 0700) holding one task's ``ca.pem``, ``cert.pem`` and
    ``key.pem`` (0600, each created anew); returns the task's ``TLSConfig``.

    Raises:
        FileExistsError: ``task_dir`` exists (a task's directory is never reused).

    Example:
        >>> import os
        >>> from jaxdist._src.security.pki import TaskCA, write_task_identity
        >>> import tempfile
        >>> ca = TaskCA()
        >>> task_dir = f"{tempfile.mkdtemp()}/t"
        >>> tls = write_task_identity(task_dir, ca.ca_pem, *ca.issue("ps:0", ["n1"]))
        >>> os.path.basename(tls.key)
        'key.pem'
    """
    os.makedirs(task_dir, mode=0o700)
    os.chmod(task_dir, 0o700)
    paths = [os.path.join(task_dir, f) for f in ("ca.pem", "cert.pem", "key.pem")]
    for path, data in zip(paths, (ca_pem, cert_pem, key_pem)):
        _write(path, data)
    return TLSConfig(*paths)


_SECURITY_ENV = ("JAXDIST_TLS_CA", "JAXDIST_TLS_CERT", "JAXDIST_TLS_KEY",
                 "JAXDIST_TLS_SERVER_NAME", "JAXDIST_INSECURE", "JAXDIST_COORDINATOR_TOKEN",
                 "JAXDIST_COORDINATOR_TOKEN_SHA256", "JAXDIST_COORDINATOR_PUBLIC_KEY",
                 "JAXDIST_COORDINATOR_ANSWER_KEY")


def apply_task_security(env: dict[str, str], job: str, index: int, pki: LocalPKI | None,
                        coordinator_token: str | None) -> dict[str, str]:
    """Sets one local task's TLS identity and coordinator credential in ``env`` (in place).

    Inherited ``JAXDIST_TLS_*`` / ``JAXDIST_INSECURE`` / coordinator variables are dropped
    first. ``pki=None`` means plaintext on loopback (``JAXDIST_INSECURE=1``). The chief gets
    the coordinator token; each worker gets the chief's public key (enough to check a signed
    request, not to sign one) and its own answer key; other tasks nothing.

    Example:
        >>> from jaxdist._src.security.pki import apply_task_security
        >>> from jaxdist.testing.tls import local_pki
        >>> env = {"JAXDIST_INSECURE": "1"}             # inherited: dropped
        >>> pki = local_pki(["worker:0"])
        >>> _ = apply_task_security(env, "worker", 0, pki, coordinator_token=None)
        >>> sorted(env)
        ['JAXDIST_TLS_CA', 'JAXDIST_TLS_CERT', 'JAXDIST_TLS_KEY']
        >>> pki.cleanup()
    """
    from jaxdist._src.security.credentials import COORDINATOR_TOKEN_ENV, CoordinatorKeys
    from jaxdist._src.security.tls import INSECURE_ENV

    for key in _SECURITY_ENV:
        env.pop(key, None)
    if pki is None:
        env[INSECURE_ENV] = "1"
    else:
        env.update(pki.identities[f"{job}:{index}"].env())
    if coordinator_token and job == "chief":
        env[COORDINATOR_TOKEN_ENV] = coordinator_token
    elif coordinator_token and job == "worker":
        env.update(CoordinatorKeys(coordinator_token).worker_env(f"worker:{index}"))
    return env

__all__ = ["LOOPBACK_NAMES", "LocalPKI", "TaskCA", "apply_task_security", "local_pki",
           "per_task_pki", "write_task_identity"]
