"""The start-up check of the running vLLM: the tested version passes quietly, an untested one
is warned about with what was tested, and one whose connector API differs from what kvpool
implements is refused with a message naming the difference."""

import logging

import pytest
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager

from kvpool.vllm.compat import TESTED_VLLM_VERSIONS, api_differences, check_vllm
from kvpool.vllm.connector import KvpoolConnector
from kvpool.vllm.tier import KvpoolTier

BASES = (KVConnectorBase_V1, SupportsHMA)


def test_the_vllm_under_test_is_a_tested_version_with_the_api_kvpool_implements(caplog):
    assert vllm.__version__.split("+")[0] in TESTED_VLLM_VERSIONS
    assert api_differences(KvpoolConnector, BASES) == []
    assert api_differences(KvpoolTier, (SecondaryTierManager,)) == []
    with caplog.at_level(logging.WARNING, logger="kvpool.vllm"):
        check_vllm(vllm.__version__, KvpoolConnector, BASES)
    assert not caplog.records


def test_an_untested_version_with_the_same_api_is_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="kvpool.vllm"):
        check_vllm("0.99.0", KvpoolConnector, BASES)
    assert "vLLM 0.99.0 is NOT a version kvpool was tested against" in caplog.text
    assert TESTED_VLLM_VERSIONS[0] in caplog.text


def test_a_connector_api_that_differs_is_refused_naming_the_difference():
    class ChangedBase(KVConnectorBase_V1):
        """A vLLM whose scheduler passes one more argument."""

        def update_state_after_alloc(self, request, blocks, num_external_tokens, group):
            raise AssertionError

    with pytest.raises(RuntimeError) as refused:
        check_vllm("0.40.0", KvpoolConnector, (ChangedBase, SupportsHMA))
    message = str(refused.value)
    assert "vLLM 0.40.0's KV connector API differs" in message
    assert ("`update_state_after_alloc` takes (self, request, blocks, num_external_tokens, "
            "group)") in message
    assert "pip install 'kvpool[vllm]'" in message
    # A vLLM without hybrid-model support (no SupportsHMA): a method kvpool implements is
    # not one vLLM calls.
    with pytest.raises(RuntimeError, match="`request_finished_all_groups` is not part of "
                                           "vLLM's connector API"):
        check_vllm("0.20.0", KvpoolConnector, (KVConnectorBase_V1,))
