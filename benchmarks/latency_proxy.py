"""A TCP proxy that delays every byte by a fixed one-way latency: a loopback object store
made to answer like a remote one.

Each direction of each connection is a queue of (arrival time, bytes); the sender forwards a
chunk once ``rtt / 2`` has passed since it arrived. So latency is paid once per round trip, not
once per chunk, and concurrent requests on separate connections overlap as they would on a real
network (no bandwidth limit is modelled: the objects here are small).

    proxy = LatencyProxy("127.0.0.1", upstream_port, rtt_s=0.02)
    endpoint = proxy.start()   # "http://127.0.0.1:<port>"
    ...
    proxy.stop()
"""

from __future__ import annotations

import asyncio
import threading
import time


class LatencyProxy:
    def __init__(self, host: str, port: int, rtt_s: float):
        self.upstream = (host, port)
        self.one_way_s = rtt_s / 2
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="latency-proxy")
        self.server: asyncio.Server | None = None

    def start(self) -> str:
        """Listen on a free loopback port; returns the proxy's endpoint URL."""
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self.loop).result(timeout=10)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def stop(self) -> None:
        async def close() -> None:
            self.server.close()
            # the client keeps its connections alive: end their pipes rather than leave them pending
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self.server is not None:
            asyncio.run_coroutine_threadsafe(close(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection(*self.upstream)
        try:
            await asyncio.gather(self._pipe(client_r, up_w), self._pipe(up_r, client_w), return_exceptions=True)
        except asyncio.CancelledError:  # stop(): the connection ends with the proxy
            pass
        finally:
            for w in (client_w, up_w):
                w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pending: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def send() -> None:
            while True:
                arrived, data = await pending.get()
                await asyncio.sleep(max(0.0, arrived + self.one_way_s - time.monotonic()))
                if not data:  # end of stream, after everything before it
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(send())
        try:
            while data := await reader.read(1 << 16):
                pending.put_nowait((time.monotonic(), data))
            pending.put_nowait((time.monotonic(), b""))
            await sender
        finally:
            sender.cancel()  # a no-op after a clean end; on stop() the sender goes with its pipe
