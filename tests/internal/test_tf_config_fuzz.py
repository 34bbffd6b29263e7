"""Fuzz test of TF_CONFIG parsing (hypothesis, bounded): arbitrary JSON values, arbitrary text
and mutated valid configs give either a usable resolver or the one typed error,
``TFConfigError`` (naming the key, never the token); never another exception.

Bounded: 200 derandomized examples per test, about 5 s for the file on one core."""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxdist._src.cluster.cluster_spec import ClusterSpec
from jaxdist._src.cluster.errors import ClusterConfigError, TFConfigError
from jaxdist._src.cluster.tf_config import TFConfigClusterResolver
from jaxdist._src.distributed.process_group import process_group

TOKEN = "fuzz-token-8c1d0e"
FUZZ = settings(max_examples=200, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

scalars = (st.none() | st.booleans() | st.integers(-2**40, 2**40)
           | st.integers().map(lambda i: i * 10**40) | st.floats(allow_nan=True)
           | st.text(max_size=12) | st.sampled_from(
               ["worker", "chief", "ps", "evaluator", "h:1", "[::1]:2", "::1:2", "h:+80",
                "h:080", "a b:1", "0", "01", "-1", "grpc"]))
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8) | st.sampled_from(
        ["cluster", "task", "type", "index", "worker", "ps", "token", "rpc_layer"]),
        children, max_size=4),
    max_leaves=16)

VALID = {
    "cluster": {"chief": ["h0:2222"], "worker": ["h1:2222", "[::1]:2223"], "ps": {"1": "h3:1"}},
    "task": {"type": "worker", "index": 1},
    "rpc_layer": "grpc",
    "token": TOKEN,
}
PATHS = [("cluster",), ("cluster", "chief"), ("cluster", "worker"), ("cluster", "worker", 0),
         ("cluster", "worker", 1), ("cluster", "ps"), ("cluster", "ps", "1"), ("task",),
         ("task", "type"), ("task", "index"), ("rpc_layer",), ("token",), ("session_master",),
         ("environment",), ("cluster", "new job")]


def _mutate(path, value):
    config = json.loads(json.dumps(VALID))
    node = config
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return config


def _exercise(raw) -> None:
    """Everything a strategy reads: a valid resolver answers, a bad one raises TFConfigError."""
    r = TFConfigClusterResolver(tf_config=raw)
    assert TOKEN not in repr(r)
    try:
        spec = r.cluster_spec()
        task_type, task_id = r.task_type, r.task_id
        r.rpc_layer, r.environment, r.cluster_token  # noqa: B018 - each one parses
    except TFConfigError as e:
        assert TOKEN not in str(e) and TOKEN not in repr(e)
        assert isinstance(e, ValueError) and isinstance(e.key, str)
        return
    assert isinstance(spec, ClusterSpec)
    assert task_type is None or isinstance(task_type, str)
    assert task_id is None or (isinstance(task_id, int) and task_id >= 0)
    if task_type in spec and task_id in spec.task_indices(task_type):
        master = r.master()
        assert (spec.task_address(task_type, task_id) in master
                or master == r._config().get("session_master"))
    try:  # the strategies' TF rules: a typed error or a group, nothing else
        process_group(r)
    except ClusterConfigError as e:
        assert TOKEN not in str(e)


@FUZZ
@given(json_values)
def test_any_json_value_is_a_resolver_or_the_typed_error(value):
    _exercise(json.dumps(value))
    if isinstance(value, dict):
        _exercise(dict(value, token=TOKEN))  # the dict form, with a token to leak


@FUZZ
@given(st.sampled_from(PATHS), json_values)
def test_mutated_valid_configs_are_a_resolver_or_the_typed_error(path, value):
    _exercise(json.dumps(_mutate(path, value)))


@FUZZ
@given(st.text(max_size=60), st.integers(0, len(json.dumps(VALID))))
def test_arbitrary_text_spliced_into_a_valid_config(text, at):
    raw = json.dumps(VALID)
    _exercise(raw[:at] + text + raw[at:])
