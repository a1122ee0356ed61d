"""vLLM's disaggregation proxy protocol over NIXL: two `h2o-vllm serve` on vLLM's
``NixlConnector`` settings (both ``kv_both``); the decode reads the prefill's kept KV from its
memory and answers whole, equal to the dense oracle (``check_proxy_protocol``). A module of
its own so no other pair idles beside it: on this 2-core machine UCX moves the bytes over TCP
loopback, served by the producer's progress thread, and a crowded core has stretched one
read to 28 s (``h2o_nixl_timeout_s`` here is generous for that; GPU nodes read over RDMA)."""
import json

import pytest
from harness import Server
from test_kv_transfer_server import FLAGS, check_proxy_protocol

from h2o_vllm.kv_transfer.transfer_config import nixl_missing

pytestmark = pytest.mark.skipif(nixl_missing() is not None, reason=f"nixl does not import here ({nixl_missing()})")


@pytest.fixture(scope="module")
def nixl_pair(tiny_llama_dir):
    config = {"kv_connector": "NixlConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"h2o_staging_mib": 16, "h2o_nixl_timeout_s": 150}}
    servers = [Server(tiny_llama_dir, [*FLAGS, "--kv-transfer-config", json.dumps(config)]) for _ in range(2)]
    try:
        for server in servers:
            server.wait_ready()
            server.model = server.client().models.list().data[0].id
        yield tuple(servers)
    finally:
        for server in servers:
            server.stop()


def test_vllms_proxy_protocol_over_nixl(nixl_pair, tiny_llama_dir):
    check_proxy_protocol(nixl_pair, tiny_llama_dir, "NixlConnector")
