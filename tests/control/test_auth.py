"""Authentication tags: the Authenticator on frame lists, and channels that require them."""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdkv.control import AuthenticationError, Authenticator
from pdkv.control.auth import TAG_BYTES, unix_ms
from pdkv.errors import ConfigError
from pdkv.protocol import codec
from tests.control.helpers import KEY, OTHER_KEY, AnyChannel, Pusher, eventually, heartbeat

MakeChannel = Callable[..., AnyChannel]
PushTo = Callable[[str], Pusher]

NOW = 1_750_000_000_000  # a fixed unix time in ms: the tests pass time in
AUTH = Authenticator(key=KEY)
FRAMES = codec.encode(heartbeat(1))


# ---------------------------------------------------------------- the tag on frame lists


def test_signed_frames_verify_back_to_the_message_frames() -> None:
    signed = AUTH.sign(FRAMES, NOW)
    assert len(signed) == len(FRAMES) + 1
    assert len(signed[-1]) == TAG_BYTES
    assert AUTH.verify(signed, NOW) == FRAMES
    assert codec.decode(AUTH.verify(signed, NOW + 29_000)) == heartbeat(1)


def test_the_tag_is_the_documented_hmac() -> None:
    # Recomputed here from the format written in the module docstring, independently of the code.
    frames = [b"ab", b"", b"cde"]
    tag = Authenticator(key=KEY).sign(frames, NOW)[-1]  # a fresh one: its first stamp is NOW
    timestamp = struct.pack("<Q", NOW)
    body = b"pdkv-control-auth-v1\x00" + timestamp + struct.pack("<I", 3)
    body += b"".join(struct.pack("<Q", len(f)) + f for f in frames)
    assert tag == timestamp + hmac.new(KEY, body, hashlib.sha256).digest()


@pytest.mark.parametrize(
    ("forge", "reason"),
    [
        (lambda s: [s[0][:-1] + b"X", *s[1:]], "does not verify"),  # a byte of the header changed
        (lambda s: [s[0], s[1] + b"\x00", s[2]], "does not verify"),  # body padded
        (lambda s: [s[1], s[0], s[2]], "does not verify"),  # frames reordered
        (lambda s: [s[0], s[2]], "does not verify"),  # a frame dropped
        (lambda s: [s[0], b"", s[1], s[2]], "does not verify"),  # an empty frame added
        (lambda s: [s[0] + s[1][:1], s[1][1:], s[2]], "does not verify"),  # a byte moved across frames
        (lambda s: s[:-1], "no authentication tag"),  # tag stripped
        (lambda s: [*s[:-1], s[-1][:-1]], "no authentication tag"),  # tag truncated
        (lambda s: s[-1:], "no authentication tag"),  # the tag alone
        (lambda s: [*s[:-1], struct.pack("<Q", NOW + 1) + s[-1][8:]], "does not verify"),  # timestamp changed
    ],
)
def test_altered_frames_are_rejected(forge: Callable[[list[bytes]], list[bytes]], reason: str) -> None:
    signed = AUTH.sign(FRAMES, NOW)
    with pytest.raises(AuthenticationError, match=reason):
        AUTH.verify(forge(signed), NOW)


@settings(max_examples=200)
@given(
    frames=st.lists(st.binary(max_size=40), min_size=1, max_size=5),
    data=st.data(),
)
def test_any_single_byte_change_is_rejected(frames: list[bytes], data: st.DataObject) -> None:
    signed = AUTH.sign(frames, NOW)
    candidates = [i for i, f in enumerate(signed) if f]
    index = data.draw(st.sampled_from(candidates))
    position = data.draw(st.integers(0, len(signed[index]) - 1))
    flip = data.draw(st.integers(1, 255))
    altered = list(signed)
    frame = bytearray(altered[index])
    frame[position] ^= flip
    altered[index] = bytes(frame)
    with pytest.raises(AuthenticationError):
        AUTH.verify(altered, NOW)


def test_a_different_key_is_rejected() -> None:
    signed = Authenticator(key=OTHER_KEY).sign(FRAMES, NOW)
    with pytest.raises(AuthenticationError, match="wrong key"):
        AUTH.verify(signed, NOW)


@pytest.mark.parametrize("age_ms", [30_001, -30_001, 3_600_000])
def test_a_tag_outside_the_window_is_rejected(age_ms: int) -> None:
    signed = Authenticator(key=KEY).sign(FRAMES, NOW - age_ms)  # a fresh signer: exactly that stamp
    with pytest.raises(AuthenticationError, match="outside the 30 s window"):
        AUTH.verify(signed, NOW)


def test_the_window_is_configurable() -> None:
    short = Authenticator(key=KEY, window_s=1.0)
    signed = short.sign(FRAMES, NOW - 1_500)
    with pytest.raises(AuthenticationError, match="window"):
        short.verify(signed, NOW)
    assert AUTH.verify(signed, NOW) == FRAMES  # same key, 30 s window: fresh enough


def test_the_key_never_appears_in_repr() -> None:
    assert KEY.decode() not in repr(AUTH)
    assert "key" not in repr(AUTH)


# ---------------------------------------------------------------- configuration


def test_from_env_reads_the_key_only_when_set() -> None:
    assert Authenticator.from_env({}) is None
    auth = Authenticator.from_env({"PDKV_AUTH_KEY": "s3cret-s3cret-s3cret"})
    assert auth == Authenticator(key=b"s3cret-s3cret-s3cret")
    assert auth.window_s == 30.0
    tuned = Authenticator.from_env({"PDKV_AUTH_KEY": "s3cret-s3cret-s3cret", "PDKV_AUTH_WINDOW_S": "5"})
    assert tuned is not None and tuned.window_s == 5.0


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"PDKV_AUTH_KEY": ""}, "set but empty"),
        ({"PDKV_AUTH_KEY": "short"}, "at least 16"),
        ({"PDKV_AUTH_KEY": "s3cret-s3cret-s3cret", "PDKV_AUTH_WINDOW_S": "soon"}, "not a number"),
        ({"PDKV_AUTH_KEY": "s3cret-s3cret-s3cret", "PDKV_AUTH_WINDOW_S": "0"}, "window_s"),
        ({"PDKV_AUTH_KEY": "s3cret-s3cret-s3cret", "PDKV_AUTH_WINDOW_S": "nan"}, "window_s"),
    ],
)
def test_from_env_refuses_unusable_settings(env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Authenticator.from_env(env)


# ---------------------------------------------------------------- channels with a key


def test_channels_sharing_a_key_exchange_messages(make_channel: MakeChannel) -> None:
    a, b = make_channel(auth=AUTH), make_channel(auth=AUTH)
    assert a.send(b.address, heartbeat(1))
    assert b.recv(5.0) == heartbeat(1)
    assert b.statistics().unauthenticated == 0


@pytest.mark.parametrize(
    "sender_auth", [Authenticator(key=OTHER_KEY), None], ids=["key mismatch", "sender without key"]
)
def test_a_channel_with_a_key_rejects_and_counts_untagged_or_wrongly_tagged_messages(
    make_channel: MakeChannel, sender_auth: Authenticator | None, caplog: pytest.LogCaptureFixture
) -> None:
    receiver = make_channel(auth=AUTH)
    intruder, friend = make_channel(auth=sender_auth), make_channel(auth=AUTH)
    for seq in range(3):
        intruder.send(receiver.address, heartbeat(seq))
    friend.send(receiver.address, heartbeat(100))
    got = receiver.recv(5.0)
    assert got == heartbeat(100)
    # PUSH/PULL does not order different senders: keep receiving until the intruder's three were seen
    assert eventually(lambda: receiver.recv(0.05) is None and receiver.statistics().unauthenticated == 3)
    stats = receiver.statistics()
    assert (stats.unauthenticated, stats.malformed, stats.received) == (3, 0, 1)
    assert "rejected a frame set" in caplog.text


def test_a_stale_timestamp_is_rejected_and_counted(make_channel: MakeChannel, push_to: PushTo) -> None:
    receiver = make_channel(auth=AUTH)
    replayer = push_to(receiver.address)
    replayer.send_multipart(Authenticator(key=KEY).sign(FRAMES, unix_ms() - 31_000))  # backdated
    replayer.send_multipart(AUTH.sign(codec.encode(heartbeat(2)), unix_ms()))
    assert receiver.recv(5.0) == heartbeat(2)
    assert receiver.statistics().unauthenticated == 1


def test_a_channel_without_a_key_treats_a_tag_frame_as_malformed(make_channel: MakeChannel) -> None:
    receiver, signer = make_channel(), make_channel(auth=AUTH)
    signer.send(receiver.address, heartbeat(1))
    assert eventually(lambda: receiver.recv(0.05) is None and receiver.statistics().malformed == 1)
    stats = receiver.statistics()
    assert (stats.malformed, stats.unauthenticated, stats.received) == (1, 0, 0)


# ---------------------------------------------------------------- replays


def test_a_replayed_frame_set_is_rejected_within_the_window_and_forgotten_after() -> None:
    guard = AUTH.replay_guard()
    signed = Authenticator(key=KEY).sign(FRAMES, NOW)
    assert AUTH.verify(signed, NOW + 10, guard) == FRAMES
    with pytest.raises(AuthenticationError, match="replayed frame set"):
        AUTH.verify(signed, NOW + 20_000, guard)
    assert guard.replays == 1
    # Past the window the timestamp check rejects it; the guard no longer needs to remember it.
    with pytest.raises(AuthenticationError, match="outside the 30 s window"):
        AUTH.verify(signed, NOW + 31_000, guard)
    AUTH.verify(Authenticator(key=KEY).sign(FRAMES, NOW + 61_000), NOW + 61_000, guard)
    assert len(guard) == 1  # the first tag was dropped once two windows passed


def test_identical_frames_signed_in_the_same_millisecond_are_not_replays() -> None:
    signer = Authenticator(key=KEY)
    first, second = signer.sign(FRAMES, NOW), signer.sign(FRAMES, NOW)
    assert first[-1] != second[-1]  # timestamps strictly increase per signer
    guard = AUTH.replay_guard()
    assert AUTH.verify(first, NOW, guard) == AUTH.verify(second, NOW, guard) == FRAMES


def test_a_channel_rejects_and_counts_a_replayed_message(make_channel: MakeChannel, push_to: PushTo) -> None:
    receiver = make_channel(auth=AUTH)
    replayer = push_to(receiver.address)
    captured = AUTH.sign(FRAMES, unix_ms())
    replayer.send_multipart(captured)
    replayer.send_multipart(captured)  # the same bytes again, inside the window
    replayer.send_multipart(AUTH.sign(codec.encode(heartbeat(2)), unix_ms()))
    assert receiver.recv(5.0) == heartbeat(1)
    assert receiver.recv(5.0) == heartbeat(2)
    stats = receiver.statistics()
    assert (stats.replayed, stats.unauthenticated, stats.received) == (1, 1, 2)
