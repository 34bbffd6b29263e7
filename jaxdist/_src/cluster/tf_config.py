"""``TFConfigClusterResolver``: the cluster from the ``TF_CONFIG`` environment variable.

``TF_CONFIG`` is the JSON that Kubeflow's TFJob (and ``python -m jaxdist.launch``) sets on each
task::

    {"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"]},
     "task": {"type": "worker", "index": 0},
     "rpc_layer": "grpc", "session_master": "...", "environment": "cloud", "token": "..."}

``"token"`` is a jaxdist extension: the shared secret services of the cluster require. It is
never printed: no error message and no ``repr`` contains it.

What is accepted is what TF accepts, read strictly: any job name made of letters, digits,
``_``, ``-`` and ``.`` (TF's tests use ``worker1``, ``sun``, ``123456``); a job is a non-empty
list of ``"host:port"`` or a non-empty object of task index -> ``"host:port"``; ``"type"`` is
a string or an integer (cast to ``str`` as TF does); ``"index"`` an integer or a decimal
string. Rejected with ``TFConfigError`` (a ``ValueError``) naming the key and quoting the bad
part: invalid JSON, a duplicate JSON key, a wrong type anywhere, an empty job, a duplicate
address, a port that is not canonical decimal 1..65535 (``"+80"``, ``" 80"``, ``"080"``,
``"0"``, ``"65536"``), a host with spaces, control characters or other symbols, an IPv6 address
without brackets (write ``"[::1]:2222"``), an index beyond 2**31 - 1. TF's multi-worker rules
(known task types, one chief) are the strategies' business: see ``jaxdist._src.cluster.validation``.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import socket
from typing import Any

from jaxdist._src.cluster.cluster_env import ClusterEnvironment
from jaxdist._src.cluster.cluster_spec import ClusterSpec
from jaxdist._src.cluster.errors import TFConfigError
from jaxdist._src.cluster.resolver import TOKEN_ENV, ClusterResolver, format_master_url
from jaxdist._src.cluster.validation import quote

TF_CONFIG_ENV = "TF_CONFIG"
MAX_TF_CONFIG_CHARS = 8 << 20
MAX_TASK_INDEX = 2**31 - 1
_STRING_KEYS = ("rpc_layer", "session_master", "environment", "token")
_TASK_KEYS = ("type", "index", "trial")
_JOB_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_\-]{0,61}[A-Za-z0-9_])?"
_HOST_RE = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")
_PORT_RE = re.compile(r"[1-9][0-9]{0,4}")
_IPV4ISH_RE = re.compile(r"[0-9a-fx.]+")  # what inet_aton may read as an IPv4 address
_INDEX_RE = re.compile(r"0|[1-9][0-9]{0,9}")
_RPC_LAYER_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]{0,63}")
_PRINTABLE_RE = re.compile(r"[^\x00-\x20\x7f]{1,1024}")


def _key(*parts: Any) -> str:
    """``"cluster"."worker"[1]``: where in TF_CONFIG a value is."""
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (("." if out else "") + quote(p, 80))
    return out


def _fail(key: str, message: str) -> TFConfigError:
    return TFConfigError(f"TF_CONFIG {key or 'document'} {message}", key)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise TFConfigError(
                f"TF_CONFIG has the key {quote(k, 80)} twice in one object; JSON parsers keep "
                f"only one of them, so say it once", quote(k, 80)
            )
        out[k] = v
    return out


class _HugeNumber:
    """A JSON integer too long to be a task index or a port (kept out of ``int``)."""

    def __init__(self, digits: str):
        self.digits = len(digits)

    def __repr__(self) -> str:
        return f"<a number with {self.digits} digits>"


def _parse_int(text: str) -> int | _HugeNumber:
    return int(text) if len(text) <= 30 else _HugeNumber(text)


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def check_address(address: Any, key: str = "address") -> str:
    """Checks one ``"host:port"`` of ``TF_CONFIG`` strictly and returns it.

    The host is a DNS name or IPv4 address (letters, digits, ``-``, ``_``, ``.``) or a
    bracketed IPv6 address; the port is canonical decimal in 1..65535.

    Raises:
        TFConfigError: the message quotes the bad part and says what was expected.

    Example:
        >>> from jaxdist._src.cluster.tf_config import check_address
        >>> check_address("[::1]:2222")
        '[::1]:2222'
        >>> check_address("host: 80")
        Traceback (most recent call last):
        jaxdist.TFConfigError: TF_CONFIG address is "host: 80": the port " 80" is not ...
    """
    if not isinstance(address, str):
        raise _fail(key, f"is {quote(address)}: expected a \"host:port\" string")
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise _fail(key, f"is {quote(address)}: expected \"host:port\" (e.g. \"10.0.0.1:2222\")")
    if host.startswith("["):
        if not (host.endswith("]") and _is_ipv6(host[1:-1])):
            raise _fail(key, f"is {quote(address)}: the host {quote(host)} is not a bracketed "
                             f"IPv6 address like \"[::1]\"")
    elif ":" in host and _is_ipv6(host):
        raise _fail(key, f"is {quote(address)}: an IPv6 address must be in brackets, e.g. "
                         f"\"[{host}]:{port}\"")
    elif len(host) > 253 or not _HOST_RE.fullmatch(host):
        raise _fail(key, f"is {quote(address)}: the host {quote(host)} is not a valid host name "
                         f"(letters, digits, '-', '_' and '.'; no spaces or control characters)")
    if not _PORT_RE.fullmatch(port) or int(port) > 65535:
        raise _fail(key, f"is {quote(address)}: the port {quote(port)} is not a port number "
                         f"1..65535 written in plain digits (no sign, spaces or leading zeros)")
    return address


def canonical_address(address: str) -> str:
    """The one spelling of a checked ``"host:port"`` that two names of the same socket share.

    Host names are compared without case and without a trailing dot; ``localhost`` is
    ``127.0.0.1`` (jaxdist binds it there); an IPv4 literal is read as the C resolver reads it
    (``127.1`` and ``0x7f.0.0.1`` are ``127.0.0.1``); an IPv6 literal is compressed
    (``[0:0:0:0:0:0:0:1]`` is ``[::1]``), and an IPv4-mapped one is its IPv4 address. No name
    is looked up in DNS.

    Example:
        >>> from jaxdist._src.cluster.tf_config import canonical_address
        >>> canonical_address("[0:0:0:0:0:0:0:1]:2222"), canonical_address("LocalHost.:2222")
        ('[::1]:2222', '127.0.0.1:2222')
    """
    host, _, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        ip = ipaddress.IPv6Address(host[1:-1])
        if ip.ipv4_mapped is not None:
            return f"{ip.ipv4_mapped}:{port}"
        return f"[{ip.compressed}]:{port}"
    host = host.lower().rstrip(".") or host
    if host == "localhost":
        return f"127.0.0.1:{port}"
    if _IPV4ISH_RE.fullmatch(host):
        try:
            return f"{socket.inet_ntoa(socket.inet_aton(host))}:{port}"
        except OSError:
            pass
    return f"{host}:{port}"


def _check_job_name(job: str) -> None:
    if not _JOB_RE.fullmatch(job):
        raise _fail(_key("cluster", job), "is not a valid job name: expected letters, digits, "
                                          "'_', '-' or '.' (e.g. \"worker\", \"worker1\")")


def _check_index(raw: Any, key: str) -> int:
    if isinstance(raw, bool) or not isinstance(raw, (int, str)):
        raise _fail(key, f"is {quote(raw, 80)}: expected a non-negative integer task index")
    if isinstance(raw, str):
        if not _INDEX_RE.fullmatch(raw):
            raise _fail(key, f"is {quote(raw, 80)}: expected a task index written in plain "
                             f"decimal digits (\"0\", \"1\", ...)")
        raw = int(raw)
    if not 0 <= raw <= MAX_TASK_INDEX:
        raise _fail(key, f"is {quote(raw, 80)}: expected a task index in 0..{MAX_TASK_INDEX}")
    return raw


def _check_cluster(cluster: Any) -> dict[str, Any]:
    if cluster is None:
        return {}
    if not isinstance(cluster, dict):
        raise _fail(_key("cluster"), f"is {quote(cluster)}: expected an object of job name -> "
                                     f"list of \"host:port\"")
    out: dict[str, Any] = {}
    seen: dict[str, str] = {}
    for job, tasks in cluster.items():
        if not isinstance(job, str):
            raise _fail(_key("cluster"), f"has the job name {quote(job, 80)}: expected a string")
        _check_job_name(job)
        jkey = _key("cluster", job)
        if isinstance(tasks, (list, tuple)):
            items = list(enumerate(tasks))
        elif isinstance(tasks, dict):
            items = [(_check_index(k, f"{jkey} key {quote(k, 80)}"), v) for k, v in tasks.items()]
            if len({i for i, _ in items}) != len(items):
                raise _fail(jkey, f"is {quote(tasks)}: it names one task index twice")
        else:
            raise _fail(jkey, f"is {quote(tasks)}: expected a list of \"host:port\" addresses "
                              f"(e.g. [\"10.0.0.1:2222\"]) or an object of task index -> address")
        if not items:
            raise _fail(jkey, f"is {quote(tasks)}: the job is empty; list its tasks' addresses "
                              f"or leave the job out")
        for idx, addr in items:
            akey = f"{jkey}[{idx}]"
            check_address(addr, akey)
            norm = canonical_address(addr)
            if norm in seen:
                raise _fail(akey, f"is {quote(addr)}, the same address as {seen[norm]}: every "
                                  f"task needs its own host:port")
            seen[norm] = akey
        out[job] = ({i: a for i, a in items} if isinstance(tasks, dict) else list(tasks))
    return out


def _check_task(task: Any) -> dict[str, Any]:
    if task is None:
        return {}
    if not isinstance(task, dict):
        raise _fail(_key("task"), f"is {quote(task)}: expected {{\"type\": ..., \"index\": ...}}")
    if not task:
        return {}
    unknown = sorted(set(task) - set(_TASK_KEYS))
    if unknown:
        raise _fail(_key("task"), f"is {quote(task)}: unknown key(s) {quote(unknown)}; expected "
                                  f"\"type\" and \"index\"")
    out = dict(task)
    if "type" not in task:
        raise _fail(_key("task"), f"is {quote(task)}: it has no \"type\" (chief, worker, ps or "
                                  f"evaluator)")
    task_type = task["type"]
    if (isinstance(task_type, bool) or not isinstance(task_type, (str, int))
            or (isinstance(task_type, int) and not -10**30 < task_type < 10**30)):
        raise _fail(_key("task", "type"), f"is {quote(task_type, 80)}: expected a string such "
                                          f"as \"worker\"")
    out["type"] = str(task_type)  # TF casts the task type to str
    if not _JOB_RE.fullmatch(out["type"]):
        raise _fail(_key("task", "type"), f"is {quote(task_type, 80)}: expected a task type "
                                          f"such as \"worker\" (letters, digits, '_', '-', '.')")
    if "index" in task:
        out["index"] = _check_index(task["index"], _key("task", "index"))
    return out


def tf_config_sections(environ: Any = None) -> dict:
    """``TF_CONFIG``'s JSON object, read leniently for the sections beyond cluster and task.

    The TLS paths (``"tls"``) and the coordinator token (``"coordinator_token"``...) are read
    through this one function; an absent or unreadable ``TF_CONFIG`` gives ``{}`` here
    (``TFConfigClusterResolver`` is the one that reports a malformed one).

    Example:
        >>> from jaxdist._src.cluster.tf_config import tf_config_sections
        >>> tf_config_sections({"TF_CONFIG": '{"tls": {"ca": "c"}}'})
        {'tls': {'ca': 'c'}}
    """
    env = os.environ if environ is None else environ
    try:
        config = json.loads(env.get(TF_CONFIG_ENV) or "{}")
    except (ValueError, RecursionError):
        return {}
    return config if isinstance(config, dict) else {}


def parse_tf_config(raw: str | dict | None) -> dict[str, Any]:
    """Parses ``TF_CONFIG`` text (or a dict) and checks every part strictly.

    Returns:
        The configuration with ``"task"`` normalised (``"type"`` a ``str``, ``"index"`` an
        ``int``) and ``"cluster"`` checked; other keys are kept as they are.

    Raises:
        TFConfigError: anything wrong, whatever the input (never another exception type); the
            message names the key and quotes the bad part, never the token.

    Example:
        >>> from jaxdist._src.cluster.tf_config import parse_tf_config
        >>> parse_tf_config('{"cluster": {"worker": ["h:2222"]}, "task": {"type": "worker",'
        ...                 ' "index": "0"}}')["task"]
        {'type': 'worker', 'index': 0}
    """
    if raw is None or raw == "":
        return {"cluster": {}, "task": {}}
    if isinstance(raw, (bytes, bytearray)):
        raw = bytes(raw).decode("utf-8", errors="replace")
    if isinstance(raw, str):
        if len(raw) > MAX_TF_CONFIG_CHARS:
            raise _fail("", f"has {len(raw)} characters: more than the {MAX_TF_CONFIG_CHARS} "
                            f"a cluster description needs")
        try:
            config = json.loads(raw, object_pairs_hook=_no_duplicate_keys, parse_int=_parse_int)
        except TFConfigError:
            raise
        except json.JSONDecodeError as e:
            # No excerpt of the text: it may hold the token.
            raise _fail("", f"is not valid JSON: {e.msg} at line {e.lineno} column {e.colno} "
                            f"(character {e.pos})") from None
        except RecursionError:
            raise _fail("", "is nested too deeply to be a cluster description") from None
        except ValueError as e:  # e.g. a number with more digits than Python converts
            raise _fail("", f"is not usable JSON: {str(e).split(';')[0]}") from None
    else:
        config = raw
    if not isinstance(config, dict):
        raise _fail("", f"is {quote(config, 120)}: expected a JSON object with \"cluster\" and "
                        f"\"task\"")
    for key in _STRING_KEYS:
        value = config.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            shown = "" if key == "token" else f"{quote(value, 80)} "
            kind = "int" if isinstance(value, _HugeNumber) else type(value).__name__
            raise _fail(_key(key), f"is {shown}of type {kind}: expected a string")
        if key == "rpc_layer" and value and not _RPC_LAYER_RE.fullmatch(value):
            raise _fail(_key(key), f"is {quote(value, 80)}: expected a protocol name such as "
                                   f"\"grpc\"")
        if key == "session_master" and value:
            scheme, sep, address = value.rpartition("://")
            if sep and not _RPC_LAYER_RE.fullmatch(scheme):
                raise _fail(_key(key), f"is {quote(value, 80)}: expected \"host:port\" or "
                                       f"\"protocol://host:port\"")
            check_address(address, _key(key))
        if key == "environment" and value and not _PRINTABLE_RE.fullmatch(value):
            raise _fail(_key(key), f"is {quote(value, 80)}: expected printable text without "
                                   f"spaces")
        if key == "token" and not _PRINTABLE_RE.fullmatch(value):
            raise _fail(_key(key), "must be 1..1024 printable characters without spaces (the "
                                   "value is not shown)")
    out = dict(config)
    out["cluster"] = _check_cluster(config.get("cluster"))
    out["task"] = _check_task(config.get("task"))
    return out


class TFConfigClusterResolver(ClusterResolver):
    """Reads the cluster and this task from ``TF_CONFIG`` (``TFConfigClusterResolver``).

    ``TF_CONFIG`` is read when the resolver is asked, so it may be set after construction.
    It is checked strictly (see this module's docstring); TF's multi-worker rules (task
    types, one chief) are checked by the strategies that use the resolver.

    Args:
        task_type: override ``TF_CONFIG["task"]["type"]`` (cast to ``str``, as in TF).
        task_id: override ``TF_CONFIG["task"]["index"]`` (cast to ``int``).
        rpc_layer: override ``TF_CONFIG["rpc_layer"]``.
        environment: override ``TF_CONFIG["environment"]``.
        tf_config: use this JSON string or dict instead of the environment variable.

    Raises:
        TFConfigError: (from any property or ``cluster_spec()``) ``TF_CONFIG`` is malformed;
            the message names the key and quotes the offending part.

    Example:
        >>> import json, os
        >>> from jaxdist.cluster_resolver import TFConfigClusterResolver
        >>> os.environ["TF_CONFIG"] = json.dumps({
        ...     "cluster": {"worker": ["localhost:12345", "localhost:23456"]},
        ...     "task": {"type": "worker", "index": 1}})
        >>> r = TFConfigClusterResolver()
        >>> r.task_type, r.task_id, r.master()
        ('worker', 1, 'localhost:23456')
    """

    config_source = "TF_CONFIG"

    def __init__(self, task_type: str | None = None, task_id: int | None = None,
                 rpc_layer: str | None = None, environment: str | None = None,
                 tf_config: str | dict | None = None):
        self._task_type = task_type
        self._task_id = task_id
        self._rpc_layer = rpc_layer
        self._environment = environment
        self._tf_config = tf_config

    def _config(self) -> dict[str, Any]:
        raw = self._tf_config if self._tf_config is not None else os.environ.get(TF_CONFIG_ENV)
        return parse_tf_config(raw)

    @property
    def task_type(self) -> str | None:  # type: ignore[override]
        if self._task_type is not None:
            return str(self._task_type)
        return self._config()["task"].get("type")

    @task_type.setter
    def task_type(self, value: str | None) -> None:
        self._task_type = value

    @property
    def task_id(self) -> int | None:  # type: ignore[override]
        if self._task_id is not None:
            return int(self._task_id)
        return self._config()["task"].get("index")

    @task_id.setter
    def task_id(self, value: int | None) -> None:
        self._task_id = value

    @property
    def rpc_layer(self) -> str | None:  # type: ignore[override]
        if self._rpc_layer is not None:
            return self._rpc_layer
        return self._config().get("rpc_layer")

    @rpc_layer.setter
    def rpc_layer(self, value: str | None) -> None:
        self._rpc_layer = value

    @property
    def environment(self) -> str:  # type: ignore[override]
        if self._environment is not None:
            return self._environment
        return self._config().get("environment") or ""

    @property
    def cluster_token(self) -> str | None:  # type: ignore[override]
        token = self._config().get("token")
        return token or os.environ.get(TOKEN_ENV) or None

    def cluster_spec(self) -> ClusterSpec:
        """The cluster of ``TF_CONFIG`` (empty without one)."""
        return ClusterSpec(self._config()["cluster"])

    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        """TF's rule: ``session_master`` if set; ``""`` for a one-task cluster; else the
        address of the task (default: this one), prefixed ``rpc_layer://`` when set."""
        config = self._config()
        if config.get("session_master") is not None:
            return config["session_master"]
        spec = self.cluster_spec()
        if not spec.jobs or (len(spec.jobs) == 1 and len(spec.job_tasks(spec.jobs[0])) == 1):
            return ""
        task_type = task_type if task_type is not None else self.task_type
        task_id = task_id if task_id is not None else self.task_id
        if task_type is None or task_id is None:
            return ""
        rpc_layer = rpc_layer if rpc_layer is not None else self.rpc_layer
        return format_master_url(spec.task_address(task_type, task_id), rpc_layer)


class TFConfigEnvironment(ClusterEnvironment):
    """A job described by ``TF_CONFIG`` (tried first: a launcher that sets it, such as
    ``python -m jaxdist.launch`` or ``python -m jaxdist.slurm``, says exactly who is who)."""

    name = "tf_config"
    priority = 10
    variables = (TF_CONFIG_ENV,)

    @classmethod
    def resolver(cls) -> TFConfigClusterResolver:
        return TFConfigClusterResolver()


__all__ = [
    "MAX_TASK_INDEX",
    "TFConfigClusterResolver",
    "TFConfigEnvironment",
    "TF_CONFIG_ENV",
    "check_address",
    "parse_tf_config",
    "tf_config_sections",
]
