class ServerArgs:
    model_path: str
    host: str
    port: int
    tp_size: int
    pp_size: int
    dp_size: int
    attn_cp_size: int
    nnodes: int
    enable_dp_attention: bool
    enable_pd_role_switch: bool
    disaggregation_mode: str
    disaggregation_transfer_backend: str
    disaggregation_bootstrap_port: int
    disaggregation_ib_device: str | None
    disaggregation_decode_enable_radix_cache: bool
    def __init__(self, **kwargs: object) -> None: ...

def prepare_server_args(argv: list[str]) -> ServerArgs: ...
