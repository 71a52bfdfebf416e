"""folio.serve.token_channel on its own (one event loop, real sockets on loopback): chunks round-trip whole and in
order, one frame per event-loop turn, strangers without the secret are dropped, a lost connection fails the streams
it may have lost chunks of (not later ones), and a request's stream ends as its replica call does."""

from __future__ import annotations

import asyncio
import time

import pytest

from folio import EosReason
from folio.serve import token_channel
from folio.serve.errors import ReplicaUnavailable
from folio.serve.schema import Chunk, Finish, Timings, TopTokens, Usage
from folio.serve.token_channel import ChannelSender, ChannelServer, channel_chunks

pytestmark = pytest.mark.timeout(60)


def _chunks() -> list[Chunk]:
    return [Chunk(text="Once", token_ids=[5, 6], token_probs=[0.5, 0.25],
                  top_tokens=[TopTokens([5, 9], [0.5, 0.1]), TopTokens([6], [0.25])]),
            Chunk(text=" upon", token_ids=[7], suppressed_text="ban"),
            Chunk(text="", token_ids=[], finish=Finish(
                reason=EosReason.STOP_STRING, stop_token_id=None, stop_string="\n",
                usage=Usage(prompt_tokens=3, cached_tokens=2, completion_tokens=3, accepted_draft_tokens=1),
                timings=Timings(queued_s=0.1, prefill_s=0.2, generate_s=0.3, time_to_first_token_s=0.4, total_s=0.9),
                replica_id="r1"))]


def test_chunks_round_trip_in_order_one_frame_a_turn(monkeypatch):
    frames = []
    real_frame = token_channel._frame
    monkeypatch.setattr(token_channel, "_frame", lambda payload: frames.append(payload) or real_frame(payload))

    async def run():
        server, sender = ChannelServer(), ChannelSender()
        await server.start("127.0.0.1")
        queues = {rid: server.open(rid) for rid in ("a", "b")}
        since = time.monotonic()
        for chunk in _chunks():  # one event-loop turn: both requests' chunks in one frame
            sender.send(server.address, "a", chunk, since)
            sender.send(server.address, "b", chunk, since)
        sender.send(server.address, "gone", _chunks()[0], since)  # a request nobody waits for: dropped
        await sender.flush(server.address, since)
        got = {rid: [await asyncio.wait_for(q.get(), 5) for _ in range(3)] for rid, q in queues.items()}
        await server.stop()
        return got

    got = asyncio.run(run())
    assert got["a"] == got["b"] == _chunks()
    assert len(frames) == 2  # the secret, then one frame of all 7 chunks


def test_a_connection_without_the_secret_is_dropped():
    async def run():
        server = ChannelServer()
        await server.start("127.0.0.1")
        queue = server.open("a")
        host_port = server.address.split("/")[0]
        sender = ChannelSender()
        since = time.monotonic()
        sender.send(f"{host_port}/{'0' * 32}", "a", _chunks()[0], since)  # the wrong secret
        await sender.flush(f"{host_port}/{'0' * 32}", since)
        await asyncio.sleep(0.2)
        await server.stop()
        return queue.qsize()

    assert asyncio.run(run()) == 0


def test_an_unreachable_ingress_fails_the_streams_that_lost_chunks_only():
    async def run():
        server = ChannelServer()
        await server.start("127.0.0.1")
        address = server.address
        await server.stop()  # nothing listens there any more
        sender = ChannelSender()
        before = time.monotonic()
        sender.send(address, "a", _chunks()[0], before)
        with pytest.raises(ConnectionError, match="cannot be reached"):
            await sender.flush(address, before)
        with pytest.raises(ConnectionError):
            sender.send(address, "a", _chunks()[1], before)
        # a stream that began after the failure is not failed for it: its send goes out (on a new connection),
        # and it fails only when that write fails in turn
        await asyncio.sleep(0.01)
        later = time.monotonic()
        sender.send(address, "b", _chunks()[0], later)
        with pytest.raises(ConnectionError):
            await sender.flush(address, later)

    asyncio.run(run())


async def _call(*, error: BaseException | None = None, delay_s: float = 0.0):
    """Stands in for a replica call's Ray stream: yields nothing, ends (or fails) after delay_s."""
    await asyncio.sleep(delay_s)
    if error is not None:
        raise error
    return
    yield  # (an async generator)


def test_stream_ends_with_the_finish_even_after_the_call_ended():
    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        for chunk in _chunks()[:1]:
            queue.put_nowait(chunk)
        asyncio.get_running_loop().call_later(0.1, lambda: [queue.put_nowait(c) for c in _chunks()[1:]])
        return [c async for c in channel_chunks(queue, _call(delay_s=0.0))]

    assert asyncio.run(run()) == _chunks()


def test_stream_fails_as_its_call_does():
    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(_chunks()[0])
        got = []
        with pytest.raises(RuntimeError, match="replica failed"):
            async for chunk in channel_chunks(queue, _call(error=RuntimeError("replica failed"), delay_s=0.05)):
                got.append(chunk)
        return got

    assert asyncio.run(run()) == _chunks()[:1]


def test_stream_whose_last_chunks_never_come_is_unavailable():
    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        return [c async for c in channel_chunks(queue, _call(), grace_s=0.1)]

    with pytest.raises(ReplicaUnavailable, match="never arrived"):
        asyncio.run(run())


def test_an_unreachable_ingress_is_reported_and_not_retried_at_once(monkeypatch):
    async def run():
        server = ChannelServer()
        await server.start("127.0.0.1")
        address = server.address
        await server.stop()
        sender = ChannelSender()
        attempts = []
        real_writer = sender._writer

        async def counted(addr):
            attempts.append(addr)
            return await real_writer(addr)

        monkeypatch.setattr(sender, "_writer", counted)
        first, second = await sender.reachable(address), await sender.reachable(address)
        return first, second, len(attempts)

    assert asyncio.run(run()) == (False, False, 1)


async def _call_yielding(chunks: list[Chunk]):
    """A replica call that streamed its chunks through Ray (it could not reach the channel)."""
    for chunk in chunks:
        await asyncio.sleep(0)
        yield chunk


def test_stream_takes_chunks_the_call_carries_itself():
    async def run():
        return [c async for c in channel_chunks(asyncio.Queue(), _call_yielding(_chunks()))]

    assert asyncio.run(run()) == _chunks()
