"""The connector's options are checked at start-up: a typo or a bad value is refused naming what
kvpool takes (before this, ``extra.get`` ignored a misspelt key silently)."""

import pytest

from kvpool.vllm.options import OPTIONS, check_options, role_actions


def test_a_misspelt_option_is_refused_naming_the_closest_and_every_known_option():
    with pytest.raises(ValueError) as e:
        check_options({"config": "kvpool.toml", "asyn_loads": False})
    msg = str(e.value)
    assert "'asyn_loads'" in msg and "did you mean 'async_loads'" in msg
    for key in OPTIONS:
        assert key in msg


@pytest.mark.parametrize("extra,needle", [
    ({"lookup_timeout_ms": 0}, "positive integer"),
    ({"lookup_timeout_ms": "soon"}, "positive integer"),
    ({"lookup_timeout_ms": True}, "positive integer"),
    ({"async_loads": "sometimes"}, "true, false or \"always\""),
    ({"save_decode_tokens": "yes"}, "true or false"),
    ({"stage_node_memory_copies": 2}, "true or false"),
    ({"transfer": "fast"}, "auto, native, torch"),
    ({"socket_dir": 3}, "a path"),
    ({"consumer_saves": "maybe"}, "true or false"),
    ({"weights_id": ""}, "non-empty string"),
    ({"weights_id": 7}, "non-empty string"),
])
def test_a_bad_value_is_refused(extra, needle):
    with pytest.raises(ValueError, match="kvpool: option") as e:
        check_options(extra)
    assert needle in str(e.value)


def test_defaults_and_values_as_given():
    o = check_options({})
    assert (o.save_decode_tokens, o.lookup_timeout_ms, o.async_loads, o.transfer) == \
        (False, 5000, True, "auto")
    o = check_options({"save_decode_tokens": "true", "lookup_timeout_ms": "250",
                       "async_loads": "always", "transfer": "torch", "socket_dir": "/run/x",
                       "config": {"local_cpu": {"max_size": "1GiB"}}, "pool": "unix:///s"})
    assert (o.save_decode_tokens, o.lookup_timeout_ms, o.async_loads, o.transfer,
            o.socket_dir) == (True, 250, "always", "torch", "/run/x")
    assert o.weights_id is None
    assert check_options({"weights_id": " llama-3-8b@rev7 "}).weights_id == "llama-3-8b@rev7"


def test_every_option_is_in_the_configuration_reference():
    import os

    doc = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs",
                            "configuration.md")).read()
    section = doc[doc.index("## The vLLM connector's options"):]
    for key in OPTIONS:
        assert f"| `{key}` |" in section, key


@pytest.mark.parametrize("role,extra,actions", [
    (None, {}, (True, True)),
    ("kv_both", {}, (True, True)),
    ("kv_producer", {}, (False, True)),
    ("kv_consumer", {}, (True, False)),
    ("kv_consumer", {"consumer_saves": True}, (True, True)),
])
def test_kv_role_decides_loads_and_saves(role, extra, actions):
    assert role_actions(role, check_options(extra)) == actions


@pytest.mark.parametrize("role,extra,needle", [
    ("kv_producer", {"consumer_saves": True}, "'consumer_saves' is for kv_role"),
    ("kv_both", {"consumer_saves": True}, "'consumer_saves' is for kv_role"),
    ("kv_prefill", {}, "kv_role 'kv_prefill' is not one of"),
])
def test_a_role_that_makes_no_sense_is_refused(role, extra, needle):
    with pytest.raises(ValueError) as e:
        role_actions(role, check_options(extra))
    assert needle in str(e.value)


@pytest.mark.parametrize("value, async_scheduling, data_parallel, expected", [
    (True, False, 1, "auto"),
    (True, False, 2, "leased"),  # an idle rank steps with the others: no idle rule
    (True, True, 1, "always"),
    ("always", False, 1, "always"),
    (False, False, 2, "never"),
])
def test_when_loads_are_asynchronous(value, async_scheduling, data_parallel, expected):
    from types import SimpleNamespace

    from kvpool.vllm.connector import load_timing

    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(async_scheduling=async_scheduling),
        parallel_config=SimpleNamespace(data_parallel_size=data_parallel))
    assert load_timing({"async_loads": value}, config) == expected
