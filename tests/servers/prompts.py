"""The prompts both server tests send (token ids of ``tests.servers.tiny_model``'s vocabulary).

``PROMPTS``: 11 prompts of 3 to 400 tokens; two share a 100-token prefix with a third (a prefix hit on a
cache that has one), the longest is several chunks of 64 tokens. ``CONTROL_PROMPTS``: four 150-token
prompts sharing nothing with the others or each other (a corrupted request's KV must not reach another
one through a prefix cache). ``DISCONNECT_PROMPT``: 1,000 tokens, 16 chunks.
"""

from __future__ import annotations

from tests.servers.tiny_model import SPECIAL, VOCAB


def _tokens(seed: int, n: int) -> list[int]:
    """Deterministic word ids (never the special ids 0-2), different for every seed."""
    words = VOCAB - len(SPECIAL)
    return [len(SPECIAL) + (seed * 7919 + j * (2 * seed + 31) + (j * j) % 17) % words for j in range(n)]


_PREFIX = _tokens(1, 100)
PROMPTS: list[list[int]] = [
    _tokens(2, 3),
    _tokens(3, 17),
    _tokens(4, 31),
    _tokens(5, 64),
    _PREFIX,
    _PREFIX + _tokens(6, 20),
    _PREFIX + _tokens(7, 57),
    _tokens(8, 150),
    _tokens(9, 200),
    _tokens(10, 257),
    _tokens(11, 400),
]
CONTROL_PROMPTS: list[list[int]] = [_tokens(20 + i, 150) for i in range(4)]
DISCONNECT_PROMPT: list[int] = _tokens(30, 1000)
