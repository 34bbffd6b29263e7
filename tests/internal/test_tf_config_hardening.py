"""TF_CONFIG read strictly: bad parts rejected with one typed error that quotes them; the
cluster token never appears in an error or a repr; nothing TF's own tests accept is rejected."""

import json

import pytest

from jaxdist._src.cluster.errors import ClusterConfigError, TFConfigError
from jaxdist._src.cluster.resolver import SimpleClusterResolver, UnionResolver
from jaxdist._src.cluster.tf_config import TFConfigClusterResolver, check_address, parse_tf_config
from jaxdist._src.distributed.process_group import process_group

TOKEN = "tok-5f3c9a1e7d2b"


def _cfg(cluster, task=None, **extra):
    config = {"cluster": cluster, "token": TOKEN, **extra}
    if task is not None:
        config["task"] = task
    return json.dumps(config)


def _error(raw) -> TFConfigError:
    with pytest.raises(TFConfigError) as info:
        r = TFConfigClusterResolver(tf_config=raw)
        r.cluster_spec()
        r.task_type  # noqa: B018 - reading it parses TF_CONFIG
    e = info.value
    assert isinstance(e, ValueError) and isinstance(e, ClusterConfigError)
    assert TOKEN not in str(e) and TOKEN not in repr(e)
    return e


@pytest.mark.parametrize("address", [
    "h:+80", "h: 80", "h:080", "h:0", "h:65536", "h:80 ", "h:", "h:8o", "h:\uff11\uff12",
    "h:99999999999999999999",
])
def test_non_canonical_ports_are_rejected(address):
    e = _error(_cfg({"worker": [address]}))
    assert e.key == '"cluster"."worker"[0]'
    port = address.rpartition(":")[2]
    assert f"the port {json.dumps(port)} is not a port number 1..65535" in str(e)


@pytest.mark.parametrize("address, part", [
    ("bad host:80", "the host \"bad host\""),
    ("host\n:80", "the host \"host\\n\""),
    ("ho\x00st:80", "the host \"ho\\u0000st\""),
    ("ho\tst:80", "the host"),
    ("-host:80", "the host \"-host\""),
    ("grpc://host:80", "the host \"grpc://host\""),
    ("::1:2222", "must be in brackets, e.g. \"[::1]:2222\""),
    ("fe80::1:2222", "\"[fe80::1]:2222\""),
    ("[::1:2222", "not a bracketed IPv6"),
    ("[nothex]:2222", "not a bracketed IPv6"),
    ("localhost", "expected \"host:port\""),
    (":2222", "expected \"host:port\""),
])
def test_invalid_hosts_are_rejected_quoting_the_host(address, part):
    e = _error(_cfg({"worker": ["ok:1", address]}))
    assert e.key == '"cluster"."worker"[1]'
    assert part in str(e)


def test_duplicate_addresses_are_rejected_naming_both_tasks():
    e = _error(_cfg({"chief": ["h0:2222"], "worker": ["h1:2222", "H0:2222"]}))
    assert e.key == '"cluster"."worker"[1]'
    assert 'is "H0:2222", the same address as "cluster"."chief"[0]' in str(e)


@pytest.mark.parametrize("job", [[], {}])
def test_an_empty_job_is_rejected(job):
    e = _error(_cfg({"worker": ["h:1"], "ps": job}))
    assert e.key == '"cluster"."ps"' and "the job is empty" in str(e)


@pytest.mark.parametrize("raw, key, part", [
    ('{"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": ' + "7" * 5000
     + "}}", '"task"."index"', "<a number with 5000 digits>"),
    ('{"task": {"type": "worker", "index": 2147483648}}', '"task"."index"', "0..2147483647"),
    ('{"task": {"type": "worker", "index": "01"}}', '"task"."index"', "plain decimal digits"),
    ('{"task": {"type": "worker", "index": 1.5}}', '"task"."index"', "is 1.5"),
    ('{"task": {"type": "worker", "index": true}}', '"task"."index"', "is true"),
    ('{"task": {"type": ["worker"], "index": 0}}', '"task"."type"', '["worker"]'),
    ('{"task": {"type": null, "index": 0}}', '"task"."type"', "is null"),
    ('{"task": {"type": "a b", "index": 0}}', '"task"."type"', '"a b"'),
    ('{"cluster": {"worker": {"x": "h:1"}}}', '"cluster"."worker" key "x"', "plain decimal"),
    ('{"cluster": {"worker": {"1": "h:1", "1": "h:2"}}}', '"1"', "twice"),
    ('{"cluster": {"worker": "h:1"}}', '"cluster"."worker"', "expected a list"),
    ('{"cluster": {"worker": [5]}}', '"cluster"."worker"[0]', "is 5"),
    ('{"cluster": {"wor ker": ["h:1"]}}', '"cluster"."wor ker"', "not a valid job name"),
    ('{"cluster": ["h:1"]}', '"cluster"', '["h:1"]'),
    ('{"rpc_layer": ["grpc"]}', '"rpc_layer"', "expected a string"),
    ('{"rpc_layer": "gr pc"}', '"rpc_layer"', "protocol name"),
    ('{"session_master": 3}', '"session_master"', "expected a string"),
    ('{"session_master": "h:+1"}', '"session_master"', 'the port "+1"'),
    ('{"session_master": "a b://h:1"}', '"session_master"', "protocol://host:port"),
    ('[1, 2]', "", "expected a JSON object"),
    ('"just text"', "", "expected a JSON object"),
    ("{not json", "", "not valid JSON"),
])
def test_wrong_types_anywhere_give_one_typed_error_naming_the_key(raw, key, part):
    e = _error(raw)
    assert e.key == key
    assert part in str(e)


def test_deep_nesting_is_a_typed_error_not_a_recursion_error():
    for raw in ("[" * 100_000 + "]" * 100_000,
                '{"cluster": ' + '{"a": ' * 50_000 + "1" + "}" * 50_001):
        e = _error(raw)
        assert "nested too deeply" in str(e)
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    e = _error({"cluster": {"worker": deep}, "token": TOKEN})  # a dict, not text
    assert e.key == '"cluster"."worker"[0]'


@pytest.mark.parametrize("raw", [
    '{"token": "' + TOKEN + '", "cluster": {"worker": ["h:+1"]}}',
    '{"token": "' + TOKEN + '", "cluster": {"worker": ["h:1", "h:1"]}}',
    '{"token": "' + TOKEN + '", "task": {"type": "worker", "index": -1}}',
    '{"token": "' + TOKEN + '", "task": 7}',
    '{"token": "' + TOKEN + '", "cluster": {"worker": ["h:1"]}',      # truncated JSON
    '{"token": "' + TOKEN + '\n", "cluster": {}}',                     # control character
    '{"token": "' + TOKEN,                                            # unterminated string
    '{"token": ["' + TOKEN + '"]}',                                   # wrong type
    '{"token": "' + TOKEN + ' x"}',                                   # a space
    '{"token": "' + TOKEN + '", "token": "' + TOKEN + '"}',           # twice
])
def test_the_token_is_never_echoed(raw):
    _error(raw)
    r = TFConfigClusterResolver(tf_config=raw)
    assert TOKEN not in repr(r) and "invalid configuration" in repr(r)


def test_a_valid_config_with_a_token_keeps_it_out_of_reprs():
    raw = _cfg({"worker": ["h0:1", "h1:1"]}, {"type": "worker", "index": 1})
    r = TFConfigClusterResolver(tf_config=raw)
    assert r.cluster_token == TOKEN
    assert TOKEN not in repr(r) and TOKEN not in repr(process_group(r))
    u = UnionResolver(r, SimpleClusterResolver({"ps": ["p:1"]}))
    assert TOKEN not in repr(u)


def test_a_dict_tf_config_is_checked_the_same_way():
    e = _error({"task": {"type": 10**5000, "index": 0}, "token": TOKEN})
    assert e.key == '"task"."type"'
    e = _error({"cluster": {"worker": ("h:1", "h:1")}, "token": TOKEN})
    assert e.key == '"cluster"."worker"[1]' and "the same address" in str(e)
    r = TFConfigClusterResolver(tf_config={"cluster": {"worker": ("h:1",)},
                                           "task": {"type": "worker", "index": 0}})
    assert r.cluster_spec().as_dict() == {"worker": ["h:1"]}


def test_what_tf_accepts_is_accepted():
    raw = json.dumps({
        "cluster": {"123456": ["ps0:2222"], "worker1": ["w10:2222"], "sun": {"3": "h.x:1"},
                    "moon": ["[::1]:2222", "10.0.0.1:65535", "a_b-c.example.com.:1"]},
        "task": {"type": 123456, "index": "0"}, "rpc_layer": "grpc+verbs",
        "session_master": "grpc://sessionmaster:2222", "environment": "cloud",
        "extra": {"any": [1]}})
    r = TFConfigClusterResolver(tf_config=raw)
    assert (r.task_type, r.task_id, r.rpc_layer) == ("123456", 0, "grpc+verbs")
    assert r.cluster_spec().task_address("sun", 3) == "h.x:1"
    assert r.master() == "grpc://sessionmaster:2222"
    assert parse_tf_config(raw)["extra"] == {"any": [1]}  # unknown top-level keys are kept
    assert check_address("[fe80::1%eth0]:22") == "[fe80::1%eth0]:22"


def test_strategies_keep_tfs_multi_worker_rules_for_any_job_name():
    r = TFConfigClusterResolver(tf_config=json.dumps(
        {"cluster": {"sun": ["a:1"], "moon": ["b:1"]}, "task": {"type": "sun", "index": 0}}))
    assert r.cluster_spec().jobs == ["sun", "moon"] and r.master() == "a:1"
    with pytest.raises(ClusterConfigError, match="Disallowed task type found in cluster spec"):
        process_group(r)


def test_parameter_server_strategy_keeps_tfs_multi_worker_rules():
    import jaxdist

    r = SimpleClusterResolver({"sun": ["a:1"], "ps": ["b:1"]}, task_type="sun", task_id=0)
    with pytest.raises(ClusterConfigError, match="Disallowed task type found in cluster spec"):
        jaxdist.ParameterServerStrategy(r)
    r = SimpleClusterResolver({"worker": ["a:1"], "ps": ["b:1"]}, task_type="chief", task_id=0)
    with pytest.raises(ClusterConfigError, match="`task_type` 'chief' not found in cluster_spec"):
        jaxdist.ParameterServerStrategy(r)
