"""A consumer's wait for a handed-off prompt (``kvpool.vllm.handoff``), on a fake clock: what
is expected of a hand-off, how often a waiting request is looked up, when the wait ends, and
that a request asked again after it settled is not waited for nor counted twice."""

from types import SimpleNamespace

import pytest

from kvpool.vllm.handoff import HANDOFF_KEY, WAITS_KEY, Handoffs, handoff_params


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def request(req_id, prompt_len, params):
    return SimpleNamespace(request_id=req_id, prompt_token_ids=list(range(prompt_len)),
                           kv_transfer_params=params)


def test_expected_is_the_handed_off_tokens_a_lookup_can_load():
    h = Handoffs(2.0, 16, clock=Clock())
    assert h.expected(request("a", 100, None)) is None
    assert h.expected(request("a", 100, {"do_remote_decode": True})) is None
    assert h.expected(request("a", 100, handoff_params(64, "p"))) == 64
    # Never past the last whole block before the last prompt token.
    assert h.expected(request("a", 100, handoff_params(96, "p"))) == 96
    assert h.expected(request("a", 97, handoff_params(96, "p"))) == 96
    assert h.expected(request("a", 96, handoff_params(96, "p"))) == 80
    for bad in ({HANDOFF_KEY: {"tokens": -1}}, {HANDOFF_KEY: {"tokens": "9"}},
                {HANDOFF_KEY: {"tokens": True}}, {HANDOFF_KEY: 5}):
        assert h.expected(request("a", 100, bad)) is None, bad


def test_a_wait_ends_when_the_tokens_are_found_or_at_the_timeout_with_lookups_spaced_out():
    clock = Clock()
    h = Handoffs(2.0, 16, clock=clock)
    assert h.may_look_up("a")
    assert not h.settle("a", 64, 0)
    assert not h.may_look_up("a"), "looked up again at once"
    step = 1 / 128  # past the first interval (5 ms), short of the second (10 ms)
    clock.now += step
    assert h.may_look_up("a")
    assert not h.settle("a", 64, 32)
    clock.now += step
    assert not h.may_look_up("a"), "the second interval is longer"
    clock.now += step
    assert h.may_look_up("a")
    clock.now += 0.5
    assert h.settle("a", 64, 64)
    assert h.take_counts() == {"handoffs_waited": 1, "handoff_wait_ms": 523,
                               "handoffs_received": 1, "handoffs_complete": 1,
                               WAITS_KEY: [pytest.approx(0.5 + 3 * step)]}
    # Settled: asked again (blocks not allocated, preempted), it is not waited for again.
    assert h.expected(request("a", 100, handoff_params(64, "p"))) is None
    h.forget("a")
    assert h.expected(request("a", 100, handoff_params(64, "p"))) == 64
    # A hand-off never found: the wait ends at the timeout, with what is there.
    assert not h.settle("b", 64, 0)
    clock.now += 1.5
    assert not h.settle("b", 64, 16)
    clock.now += 0.5
    assert h.settle("b", 64, 16)
    assert h.take_counts() == {"handoffs_waited": 1, "handoff_wait_ms": 2000,
                               "handoffs_received": 1, "handoffs_timed_out": 1,
                               WAITS_KEY: [pytest.approx(2.0)]}
    assert h.take_counts() == {}


def test_a_hand_off_keyed_in_another_scope_is_not_waited_for():
    """A producer whose keys differ (one-sided ``weights_id``, another TP size or layout)
    could never be found: the consumer looks the request up as any other at once."""
    h = Handoffs(2.0, 16, clock=Clock(), scope="aa" * 16)
    assert h.expected(request("a", 100, handoff_params(64, "p", "aa" * 16))) == 64
    assert h.expected(request("b", 100, handoff_params(64, "p", "bb" * 16))) is None
    assert h.expected(request("b2", 100, handoff_params(64, "p", "bb" * 16))) is None
    assert h.take_counts() == {"handoffs_received": 2, "handoffs_mismatched": 2}
    assert h.foreign_scopes == {"bb" * 16}, "one warning per producer scope"
    # Asked again (blocks not allocated): neither waited for nor counted twice.
    assert h.expected(request("b", 100, handoff_params(64, "p", "bb" * 16))) is None
    assert h.take_counts() == {}
    # A hand-off without a scope (an older producer) is waited for as before.
    assert h.expected(request("c", 100, handoff_params(64, "p"))) == 64
    assert handoff_params(64, "p", "cc")["kvpool_handoff"]["scope"] == "cc"


def test_a_request_found_whole_at_once_is_not_counted_as_waiting():
    h = Handoffs(2.0, 16, clock=Clock())
    assert h.settle("a", 64, 96)
    assert h.take_counts() == {"handoffs_received": 1, "handoffs_complete": 1}
    h.forget("a")
    assert not h.waiting and not h.settled


def test_waits_reach_vllms_prometheus_as_a_histogram_summed_over_intervals():
    """The waits travel in the connector's stats as a list, joined when vLLM aggregates
    intervals, and become observations of ``vllm:kvpool_handoff_wait_seconds``."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvpool.vllm.reports import KvpoolConnectorStats, KvpoolPromMetrics

    registry = CollectorRegistry()
    types = {cls: type(cls.__name__, (cls,), {"__init__": (
        lambda self, *a, _base=cls, **k: _base.__init__(self, *a, registry=registry, **k))})
        for cls in (Gauge, Counter, Histogram)}
    a = KvpoolConnectorStats(data={"handoffs_waited": 1, WAITS_KEY: [0.003]})
    b = KvpoolConnectorStats(data={"handoffs_waited": 2, WAITS_KEY: [0.2, 1.5]})
    total = a.aggregate(b)
    assert total.data == {"handoffs_waited": 3, WAITS_KEY: [0.003, 0.2, 1.5]}
    assert total.reduce() == {"handoffs_waited": 3}
    metrics = KvpoolPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"],
                                {0: ["m", "0"]})
    metrics.observe(total.data, 0)
    labels = {"model_name": "m", "engine": "0"}
    sample = registry.get_sample_value
    assert sample("vllm:kvpool_handoff_wait_seconds_count", labels) == 3
    assert sample("vllm:kvpool_handoff_wait_seconds_sum", labels) == pytest.approx(1.703)
    assert sample("vllm:kvpool_handoff_wait_seconds_bucket", {**labels, "le": "0.005"}) == 1
    assert sample("vllm:kvpool_handoff_wait_seconds_bucket", {**labels, "le": "0.25"}) == 2
    assert sample("vllm:kvpool_handoffs_waited_total", labels) == 3
