"""Test harness hooks, loaded by every interpreter the server tests start (this folder is first on their
PYTHONPATH): see ``tests.servers.hooks``. Nothing here runs in a process the tests did not start."""

import os

if os.environ.get("PDKV_TEST_HOOKS"):
    from tests.servers import hooks

    hooks.install()
