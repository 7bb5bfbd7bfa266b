# Stubs for mooncake.engine (pybind11, Mooncake 0.3.13), written from the binding's signatures.
# Older bindings lack argument names, so every parameter is positional-only: pdkv calls positionally.
# Return conventions: 0 ok / non-zero failure for setup calls; a batch id <= 0 is a failed submission;
# get_batch_transfer_status blocks until the batches end (0 all ok, negative any failed or timed out);
# transfer_check_status inspects task 0 only (1 done, 0 in progress, -1 failed, -2 timeout).

SUPPORT_CUDA: bool
SUPPORT_HIP: bool
SUPPORT_MUSA: bool
SUPPORT_EFA: bool
SUPPORT_MNNVL: bool
SUPPORT_INTRA_NVLINK: bool

class TransferOpcode:
    Read: TransferOpcode
    Write: TransferOpcode
    @property
    def name(self) -> str: ...
    @property
    def value(self) -> int: ...

class TransferNotify:
    name: str
    msg: str

class TransferEngine:
    def __init__(self) -> None: ...
    def initialize(
        self, local_hostname: str, metadata_server: str, protocol: str, device_name: str, /
    ) -> int: ...
    def initialize_ext(
        self,
        local_hostname: str,
        metadata_server: str,
        protocol: str,
        device_name: str,
        metadata_type: str,
        /,
    ) -> int: ...
    def get_rpc_port(self) -> int: ...
    def register_memory(self, buffer_addr: int, capacity: int, location: str = ..., /) -> int: ...
    def unregister_memory(self, buffer_addr: int, /) -> int: ...
    def batch_register_memory(
        self, buffer_addresses: list[int], capacities: list[int], location: str = ..., /
    ) -> int: ...
    def batch_unregister_memory(self, buffer_addresses: list[int], /) -> int: ...
    def allocate_managed_buffer(self, length: int, /) -> int: ...
    def free_managed_buffer(self, buffer_addr: int, length: int, /) -> int: ...
    def transfer_sync_write(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = ...,
        /,
    ) -> int: ...
    def transfer_sync_read(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = ...,
        /,
    ) -> int: ...
    def batch_transfer_sync_write(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        transport_hint: str = ...,
        /,
    ) -> int: ...
    def batch_transfer_sync_read(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        transport_hint: str = ...,
        /,
    ) -> int: ...
    def batch_transfer_async_write(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        transport_hint: str = ...,
        /,
    ) -> int: ...
    def batch_transfer_async_read(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        transport_hint: str = ...,
        /,
    ) -> int: ...
    def get_batch_transfer_status(self, batch_ids: list[int], /) -> int: ...
    def transfer_submit_write(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = ...,
        /,
    ) -> int: ...
    def transfer_check_status(self, batch_id: int, /) -> int: ...
    def get_notifies(self) -> list[TransferNotify]: ...
    def send_probe(self, peer_server_name: str, /) -> int: ...
    def get_first_buffer_address(self, segment_name: str, /) -> int: ...
    def read_bytes_from_buffer(self, buffer_addr: int, length: int, /) -> bytes: ...
    # The binding declares std::string (shown as str); pybind11 also accepts bytes for it.
    def write_bytes_to_buffer(self, buffer_addr: int, data: str, length: int, /) -> int: ...
    def get_local_topology(self, device_name: str | None = ..., /) -> str: ...
