"""vLLM 0.33.0 (the official wheel, .venv-vllm): its real ``Scheduler`` drives the pdkv connector's
scheduler side through consumer and producer flows, aborts, load errors and refusals.

The scenarios run in one child process (``scheduler_child``; vLLM is never imported here) and each
becomes one test below.
"""

from __future__ import annotations

import pytest

from tests.adapters.vllm.helpers import VLLM_PYTHON, Child, read_json, requires_vllm

pytestmark = [requires_vllm, pytest.mark.slow]

SCENARIOS = [
    "consumer_loads_then_computes_only_the_last_token",
    "consumer_load_error_recomputes_from_the_first_bad_block",
    "consumer_load_error_fails_the_request_under_fail_policy",
    "consumer_abort_holds_blocks_until_the_worker_releases_them",
    "consumer_without_transfer_id_computes_locally",
    "producer_layer_saves_then_holds_blocks_until_sent",
    "producer_chunked_prefill_sends_the_whole_request_at_finish",
    "producer_abort_after_the_forward_aborts_the_room",
    "producer_abort_before_the_forward_frees_at_once",
    "producer_preemption_fails_the_layered_room_before_its_blocks_are_reused",
    "both_roles_load_and_send_in_one_scheduler",
    "refusals_at_construction",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    workdir = tmp_path_factory.mktemp("vllm-scheduler")
    result = workdir / "result.json"
    child = Child(VLLM_PYTHON, "tests.adapters.vllm.scheduler_child", [str(result)], workdir, "scheduler")
    try:
        code = child.wait(timeout_s=300)
        assert code == 0 and result.exists(), f"scheduler child exited {code}:\n{child.log_tail()}"
    finally:
        child.stop()
    data: dict[str, str | None] = read_json(result)
    assert sorted(data) == sorted(SCENARIOS), "scenario lists differ between scheduler_child and this test"
    return data


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_vllm_0_33_scheduler(results: dict[str, str | None], scenario: str) -> None:
    failure = results[scenario]
    assert failure is None, f"vLLM 0.33.0 scheduler scenario {scenario} failed:\n{failure}"
