"""Streamed chunks from generator replicas to an ingress over one TCP connection per (replica, ingress) pair, every
chunk a replica's event loop produced in one turn in one frame, instead of a Ray streaming item per chunk per request.

Ray Serve moves each item a deployment method yields as a Ray object reported between the two processes' core
workers; a replica streaming to hundreds of requests spends its process's time (shared with its engine thread) on
that, whatever an item carries. With the channel (ServeConfig.token_channel), the ingress still calls the replica
through its handle (routing, cancellation, errors as before) and the call stays open until the request ends, but
the chunks travel here:

    ingress:  server = ChannelServer(); await server.start(host)      # address "host:port/secret"
              queue = server.open(request_id)  ... chunks, the last one carrying `finish` ...  server.close(request_id)
    replica:  sender = ChannelSender(); sender.send(address, request_id, chunk, since_s); await sender.flush(...)

Frames are a 4-byte big-endian length and msgpack of [[request_id, chunk], ...] (plain data: nothing a peer sends
is executed). A connection must first send the ingress's secret (random, part of the address it hands out with
each request), or it is closed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import secrets
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

import msgpack

from folio import EosReason
from folio.serve.errors import ReplicaUnavailable
from folio.serve.schema import Chunk, Finish, Timings, TopTokens, Usage

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct("!I")
CONNECT_TIMEOUT_S = 2.0
RETRY_AFTER_S = 30.0  # an ingress that could not be reached is not tried again for this long
MAX_FRAME_BYTES = 256 << 20


def chunk_to_plain(chunk: Chunk) -> dict:
    plain = dataclasses.asdict(chunk)
    if chunk.finish is not None:
        plain["finish"]["reason"] = chunk.finish.reason.value
    return plain


def chunk_from_plain(plain: dict) -> Chunk:
    finish = plain.pop("finish")
    top = plain.pop("top_tokens")
    chunk = Chunk(**plain, top_tokens=None if top is None else [TopTokens(**t) for t in top])
    if finish is not None:
        usage, timings = Usage(**finish.pop("usage")), Timings(**finish.pop("timings"))
        chunk.finish = Finish(reason=EosReason(finish.pop("reason")), usage=usage, timings=timings, **finish)
    return chunk


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {length} bytes")
    return await reader.readexactly(length)


def _frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


class ChannelServer:
    """The ingress's end: one queue of Chunks per open request."""

    def __init__(self) -> None:
        self.secret = secrets.token_hex(16)
        self.address = ""
        self._queues: dict[str, asyncio.Queue] = {}
        self._server: asyncio.AbstractServer | None = None

    async def start(self, host: str) -> str:
        self._server = await asyncio.start_server(self._serve, host, 0)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"{host}:{port}/{self.secret}"
        return self.address

    def open(self, request_id: str) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if not hmac.compare_digest(await _read_frame(reader), self.secret.encode()):
                return
            while True:
                for request_id, plain in msgpack.unpackb(await _read_frame(reader), raw=False):
                    queue = self._queues.get(request_id)
                    if queue is not None:  # (a request the client left: its chunks are dropped)
                        queue.put_nowait(chunk_from_plain(plain))
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            return  # the replica went away, or sent what no replica sends: its requests' calls fail on their own
        finally:
            writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


class ChannelSender:
    """A replica's end: chunks for each ingress address, written together once per event-loop turn. A stream that
    began at `since_s` (time.monotonic()) fails with ConnectionError once a write to its address failed after that:
    some of its chunks may be lost."""

    def __init__(self) -> None:
        self._outbox: dict[str, list] = {}
        self._writers: dict[str, asyncio.StreamWriter] = {}
        self._flushing: dict[str, asyncio.Task] = {}
        self._failed: dict[str, tuple[float, str]] = {}  # address -> when a write to it last failed, and why

    async def reachable(self, address: str) -> bool:
        """Whether a connection to `address` is open (opening one if needed; not again for RETRY_AFTER_S after a
        failure). A replica streams through Ray's call instead where it is not: the ingress takes chunks from
        either."""
        writer = self._writers.get(address)
        if writer is not None and not writer.is_closing():
            return True  # (every request asks: no task, no await, while the connection is up)
        if time.monotonic() - self._failed.get(address, (float("-inf"), ""))[0] < RETRY_AFTER_S:
            return False
        try:
            await asyncio.wait_for(self._writer(address), CONNECT_TIMEOUT_S)
            return True
        except (OSError, ValueError, TimeoutError) as error:
            why = str(error) or type(error).__name__
            self._failed[address] = (time.monotonic(), why)
            logger.warning("the ingress's token channel at %s cannot be reached (%s): streaming through Ray for "
                           "%g s", address.split("/")[0], why, RETRY_AFTER_S)
            return False

    def send(self, address: str, request_id: str, chunk: Chunk, since_s: float) -> None:
        self._check(address, since_s)
        self._outbox.setdefault(address, []).append([request_id, chunk_to_plain(chunk)])
        if address not in self._flushing:
            # runs after the chunks this turn's other streams are about to add (their tasks were woken before it)
            self._flushing[address] = asyncio.get_running_loop().create_task(self._flush(address))

    async def flush(self, address: str, since_s: float) -> None:
        """Returns once everything sent to `address` so far is written."""
        while (task := self._flushing.get(address)) is not None:
            await asyncio.shield(task)
        self._check(address, since_s)

    def _check(self, address: str, since_s: float) -> None:
        failed_s, why = self._failed.get(address, (float("-inf"), ""))
        if failed_s >= since_s:
            raise ConnectionError(f"the ingress at {address.split('/')[0]} cannot be reached: {why}")

    async def _flush(self, address: str) -> None:
        try:
            writer = await self._writer(address)
            while self._outbox.get(address):
                items, self._outbox[address] = self._outbox[address], []
                writer.write(_frame(msgpack.packb(items, use_bin_type=True)))
                await writer.drain()
        except (OSError, ValueError) as error:  # (the streams that lost chunks fail at their next send or flush)
            self._outbox.pop(address, None)
            self._writers.pop(address, None)
            self._failed[address] = (time.monotonic(), str(error) or type(error).__name__)
        finally:
            del self._flushing[address]

    async def _writer(self, address: str) -> asyncio.StreamWriter:
        writer = self._writers.get(address)
        if writer is None or writer.is_closing():
            where, secret = address.split("/", 1)
            host, port = where.rsplit(":", 1)
            _, writer = await asyncio.open_connection(host, int(port))
            writer.write(_frame(secret.encode()))
            self._writers[address] = writer
        return writer


CALL_END_GRACE_S = 30.0  # a call that ended without error: how long its last chunks may still take to arrive


async def channel_chunks(queue: asyncio.Queue, call: Any, grace_s: float = CALL_END_GRACE_S) -> AsyncIterator[Chunk]:
    """One request's chunks from its channel queue, through the one carrying `finish`. `call` is the replica call's
    Ray stream: it ends once the replica has written the request's last chunk, and carries the chunks itself where
    the replica could not reach this ingress; a failure of it (the replica's error, a lost replica) ends this with
    that error, after the chunks that came before it."""
    ended = asyncio.ensure_future(_drain(call, queue))
    call_ended = False
    try:
        while True:
            if not call_ended:
                item = await queue.get()  # (a chunk, or the call's end: _drain puts it last)
            else:
                try:
                    item = await asyncio.wait_for(queue.get(), grace_s)
                except TimeoutError:
                    raise ReplicaUnavailable("the replica's last chunks never arrived; retry") from None
            if item is _CALL_ENDED:
                ended.result()  # (raises the call's error)
                call_ended = True
                continue
            yield item
            if item.finish is not None:
                return
    finally:
        # the call ends by itself after the last chunk, or was cancelled by the caller: nobody waits for it
        ended.add_done_callback(_retrieve)


_CALL_ENDED = object()


async def _drain(call: Any, queue: asyncio.Queue) -> None:
    try:
        async for chunk in call:
            queue.put_nowait(chunk)
    finally:
        queue.put_nowait(_CALL_ENDED)  # (the task is done before its reader runs again: ended.result() is ready)


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()
