#!/usr/bin/env python3
"""A loopback TCP proxy that delays every message by a fixed latency: a stand-in network for rpc-server.

    python scripts/rpc_proxy.py --listen 50100 --to 127.0.0.1:50052 --delay-ms 1 --lifetime 1800

Each byte is forwarded `--delay-ms` after it arrived, in both directions and in order, so a request and its
reply each take the delay (a round trip costs twice it) and a burst of messages is not serialized by it:
latency, not bandwidth. A reader thread per direction timestamps what it receives, a writer thread sends it
when due; each connection gets its own four threads and its own connection to the server. It binds 127.0.0.1
only and exits after --lifetime seconds whatever happens (used by scripts/bench_rpc.py).
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import threading
import time


def _pipe(src: socket.socket, dst: socket.socket, delay: float) -> None:
    pending: queue.Queue = queue.Queue()

    def read() -> None:
        while True:
            try:
                data = src.recv(1 << 16)
            except OSError:
                data = b""
            pending.put((time.monotonic() + delay, data))
            if not data:
                return

    def write() -> None:
        while True:
            due, data = pending.get()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            if not data:
                break
            try:
                dst.sendall(data)
            except OSError:
                break
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    threading.Thread(target=read, daemon=True).start()
    threading.Thread(target=write, daemon=True).start()


def serve(listen_port: int, target: tuple[str, int], delay: float) -> None:
    with socket.create_server(("127.0.0.1", listen_port)) as server:
        while True:
            client, _ = server.accept()
            upstream = socket.create_connection(target)
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _pipe(client, upstream, delay)
            _pipe(upstream, client, delay)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--listen", type=int, required=True, help="port on 127.0.0.1")
    ap.add_argument("--to", required=True, help="host:port of the rpc-server")
    ap.add_argument("--delay-ms", type=float, required=True, help="latency added to every message, each way")
    ap.add_argument("--lifetime", type=float, default=1800, help="seconds before it exits (default 1800)")
    args = ap.parse_args()
    host, _, port = args.to.rpartition(":")
    threading.Timer(args.lifetime, lambda: os._exit(0)).start()
    serve(args.listen, (host, int(port)), args.delay_ms / 1000)


if __name__ == "__main__":
    main()
