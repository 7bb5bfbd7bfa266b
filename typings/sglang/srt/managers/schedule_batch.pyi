# The request object SGLang's disaggregation queues take (only what tests/adapters reads or sets).
from array import array
from typing import Any

from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.sampling.sampling_params import SamplingParams

class Req:
    rid: str
    origin_input_ids: array[int]
    output_ids: array[int]
    bootstrap_room: int | None
    start_send_idx: int
    pending_bootstrap: bool
    extend_end: int | None
    kv: Any
    disagg_kv_sender: Any
    time_stats: Any
    def __init__(
        self,
        rid: str,
        origin_input_text: str,
        origin_input_ids: array[int],
        sampling_params: SamplingParams,
        *,
        bootstrap_host: str | None = None,
        bootstrap_port: int | None = None,
        bootstrap_room: int | None = None,
        disagg_mode: DisaggregationMode | None = None,
    ) -> None: ...
