# Stubs for nixl_cu12 (NIXL 1.5.1's Python API, CUDA 12 build), written from its _api.py: the names
# pdkv uses (pdkv.engine.nixl, pdkv.bench.transfer's raw agent). tests/engine/test_nixl_stubs.py checks
# them against the installed package.
from nixl_cu12._api import nixl_agent as nixl_agent
from nixl_cu12._api import nixl_agent_config as nixl_agent_config
from nixl_cu12._api import nixl_xfer_handle as nixl_xfer_handle
