"""What a registration leaves out: a prefill rank's answer to a Register under its layout policy, and
what a decode rank tells its scheduler about a room whose transfer left draft buffers out.

Owns: ``answer_register`` (pure: the two layouts and the policy in, the reply and its log line out),
``RegisterAnswer``, and ``DraftSkipped`` (per room, on the decode: ``receiver.draft_skipped()``). The
prefill endpoint's registration row calls ``answer_register`` and carries out the answer: it sends
``reply``, keeps ``compatibility`` in its record of the decode rank (what the pair's transfers leave
out), and emits ``warning`` once for that pair (when the record is new, or its layout changed; not
for a repeated Register of a registered rank). Must not hold registration state (draining,
epochs, the peer machine): those rules are the endpoint's rows. No I/O, no clock.

The decision is ``pdkv.mapping.layout_policy.compatibility(prefill layout, decode layout, policy)``:
refused -> ``RegisterReject`` naming the difference (both lists); accepted -> ``RegisterAck`` naming
the buffers each side leaves out (both empty when the layouts match). The decode rank applies its own
policy to the ack (a strict decode refuses a pair that leaves buffers out), so either side being
strict keeps a deployment strict.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from pdkv.mapping.layout import BufferLayout
from pdkv.mapping.layout_policy import (
    BufferKey,
    LayoutCompatibility,
    LayoutPolicy,
    compatibility,
    describe_keys,
)
from pdkv.protocol.effects import Notice, NoticeLevel
from pdkv.protocol.messages import MAX_REASON_CHARS, Origin, Register, RegisterAck, RegisterReject


@attrs.frozen(kw_only=True)
class RegisterAnswer:
    """What a prefill rank answers one Register: the decision (from its own side), the reply to send,
    and the WARNING for a pair whose transfers leave buffers out (None otherwise)."""

    compatibility: LayoutCompatibility
    reply: RegisterAck | RegisterReject
    warning: Notice | None = None

    @property
    def accepted(self) -> bool:
        return isinstance(self.reply, RegisterAck)


def answer_register(
    origin: Origin, layout: BufferLayout, register: Register, policy: LayoutPolicy
) -> RegisterAnswer:
    """The reply of the prefill rank ``origin`` (buffers ``layout``) to ``register`` under ``policy``.

    ``RegisterReject`` (fatal, ``retry`` False) reads ``layout mismatch with prefill <origin>: <the
    difference>``, as it always did; ``RegisterAck`` carries ``prefill_left_out`` (buffers of
    ``layout`` the transfers to that decode rank leave out) and ``decode_left_out`` (the decode's
    buffers nothing writes).
    """
    decision = compatibility(layout, register.layout, policy)
    if decision.refusal is not None:
        reason = _clip(f"layout mismatch with prefill {origin}: {decision.refusal}")
        return RegisterAnswer(compatibility=decision, reply=RegisterReject(origin=origin, reason=reason))
    ack = RegisterAck(
        origin=origin, prefill_left_out=decision.left_out_mine, decode_left_out=decision.left_out_theirs
    )
    warning = None
    if decision.degraded:
        warning = Notice(
            level=NoticeLevel.WARNING,
            text=_clip(
                f"decode rank {register.origin} registered with a layout that differs in draft-model "
                f"buffers: {decision.describe(here='this prefill', there='that decode')}; its rooms "
                "are served without them"
            ),
        )
    return RegisterAnswer(compatibility=decision, reply=ack, warning=warning)


def _key_tuple(value: Iterable[BufferKey]) -> tuple[BufferKey, ...]:
    return tuple(sorted(set(value), key=lambda k: k.sort_key))


def _name_tuple(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(sorted(set(value)))


@attrs.frozen(kw_only=True)
class DraftSkipped:
    """What of the draft model a successful room did not receive (a rolling deployment: its prefill
    ranks and this decode rank register different draft-model buffers). The target model's bytes are
    all there; the scheduler should not run speculative decoding from this room's draft state.

    ``not_written``: this rank's draft buffers no prefill rank wrote for the room (they hold whatever
    they held); ``not_sent``: the prefill ranks' draft buffers this rank has no counterpart for;
    ``peers``: the prefill ranks (``instance:tpN/cpM``) whose registration left them out."""

    not_written: tuple[BufferKey, ...] = attrs.field(default=(), converter=_key_tuple)
    not_sent: tuple[BufferKey, ...] = attrs.field(default=(), converter=_key_tuple)
    peers: tuple[str, ...] = attrs.field(default=(), converter=_name_tuple)

    def describe(self) -> str:
        return (
            f"draft state not transferred: not written here {describe_keys(self.not_written)}, not sent "
            f"by {', '.join(self.peers) or 'the prefill'} {describe_keys(self.not_sent)}"
        )

    def __str__(self) -> str:
        return self.describe()


def _clip(text: str) -> str:
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."


__all__ = ["DraftSkipped", "RegisterAnswer", "answer_register"]
