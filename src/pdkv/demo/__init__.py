"""``pdkv demo``: the main job (real processes over Mooncake), or ``--protocol-only`` (in memory)."""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] = ()) -> int:
    args = list(argv)
    if "--protocol-only" in args:
        from pdkv.demo.protocol import main as protocol_main

        args.remove("--protocol-only")
        return protocol_main(args)
    from pdkv.demo.cluster import main as cluster_main

    return cluster_main(args)
