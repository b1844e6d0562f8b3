"""Peer tier get throughput vs a raw loopback socket transfer of the same bytes.

Both servers run in a child process on 127.0.0.1; the client side is this process.

- raw socket: one request per chunk, the server sends the chunk's bytes, the client
  reads them into a preallocated buffer (the floor: no framing, no auth, no checks);
- peer get: ``PeerBackend.get(key, out)`` against ``lmcache-peer-serve`` (pooled
  authenticated connection, framed reply, serde frame verified by key and checksum,
  copied into the output tensor) -- what the engine does per chunk;
- peer get_many: the same chunks in one batched GET per round trip;
- peer client.get: raw frames over the protocol, not decoded (protocol cost only).

Usage: python bench/bench_peer.py [--quick] [--chunks N] [--chunk-mib M] [--rounds R]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lib.options import add_chunk_options, chunk_plan
from lib.servers import first_line, start_peer_serve
from lmcache_backend_peer import PeerClient, create_peer_backend
from lmcache_core.keys import KeyNamespace
from lmcache_core.serde import RawCodec, encode
from lmcache_core.testing import make_context

RAW_SERVER = r"""
import os, socket, struct, sys
size = int(sys.argv[1])
data = os.urandom(size)
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
mv = memoryview(data)
while True:
    req = conn.recv(8)
    if len(req) < 8:
        break
    (n,) = struct.unpack(">Q", req)
    conn.sendall(mv[:n])
"""


def recv_exact(sock: socket.socket, buf: memoryview) -> None:
    got = 0
    while got < buf.nbytes:
        r = sock.recv_into(buf[got:])
        if r == 0:
            raise SystemExit("raw server closed")
        got += r


def bench(n: int, size: int, rounds: int) -> dict[str, list[float]]:
    """Rounds alternate between the raw and the peer paths, so load from other
    processes on the machine hits both alike."""
    proc = subprocess.Popen([sys.executable, "-c", RAW_SERVER, str(size)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(first_line(proc))
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(size)
        mv = memoryview(buf)
        req = size.to_bytes(8, "big")

        def raw_round() -> float:
            t0 = time.perf_counter()
            for _ in range(n):
                sock.sendall(req)
                recv_exact(sock, mv)
            return n * size / (time.perf_counter() - t0)

        res = bench_peer(n, size, rounds, raw_round)
        sock.close()
        return res
    finally:
        proc.kill()
        proc.wait()


def bench_peer(n: int, size: int, rounds: int, raw_round) -> dict[str, list[float]]:
    secret = os.urandom(16).hex()
    tmp = Path(tempfile.mkdtemp())
    (tmp / "secret").write_text(secret)
    proc, address = start_peer_serve(n * size + (64 << 20), tmp / "secret")
    try:
        host, port = address.rsplit(":", 1)
        ns = KeyNamespace(model="bench")
        shape = (size // 2,)
        chunks = [torch.randn(shape).to(torch.float16) for _ in range(n)]
        keys = [ns.key(os.urandom(16)) for _ in range(n)]
        pusher = PeerClient((host, int(port)), secret.encode(), timeout=30)
        for k, c in zip(keys, chunks):
            assert pusher.put(k, encode(k, c, RawCodec()))
        pusher.close()
        backend = create_peer_backend(
            {"peers": [address], "secret": secret, "max_size": 0, "timeout_s": 30.0}, make_context(pool_bytes=1 << 20)
        )
        client = PeerClient((host, int(port)), secret.encode(), timeout=30)
        outs = [torch.empty(shape, dtype=torch.float16) for _ in range(n)]
        res: dict[str, list[float]] = {
            "raw socket": [],
            "peer get": [],
            "peer get_many": [],
            "peer client.get": [],
        }
        assert backend.get(keys[0], outs[0])  # warm the connections
        for _ in range(rounds):
            res["raw socket"].append(raw_round())
            for name, b in (("peer get", backend),):
                t0 = time.perf_counter()
                if b.contains(keys) != n:  # as the engine does: lookup, then get chunk by chunk
                    raise SystemExit("peer lookup missed")
                for k, o in zip(keys, outs):
                    if not b.get(k, o):
                        raise SystemExit("peer get missed")
                res[name].append(n * size / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            batch = 8
            for lo in range(0, n, batch):
                if not all(backend.get_many(keys[lo : lo + batch], outs[lo : lo + batch])):
                    raise SystemExit("peer get_many missed")
            res["peer get_many"].append(n * size / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            for k in keys:
                if client.get([k])[0] is None:
                    raise SystemExit("client get missed")
            res["peer client.get"].append(n * size / (time.perf_counter() - t0))
        for c, o in zip(chunks, outs):
            if not torch.equal(c, o):
                raise SystemExit("peer returned wrong bytes")
        backend.close()
        client.close()
        return res
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16 chunks, 2 rounds")
    add_chunk_options(ap)
    args = ap.parse_args()
    n, rounds, size = chunk_plan(args)
    torch.set_num_threads(1)
    peer = bench(n, size, rounds)
    base = statistics.median(peer.pop("raw socket"))
    print(f"peer get throughput vs raw loopback socket: {n} chunks x {size / (1 << 20):.1f} MiB, {rounds} rounds, median")
    print(f"{'path':<26}{'GiB/s':>10}{'ratio vs raw':>15}")
    print(f"{'raw socket':<26}{base / (1 << 30):>10.2f}{1.0:>15.2f}")
    for name, vals in peer.items():
        med = statistics.median(vals)
        print(f"{name:<26}{med / (1 << 30):>10.2f}{med / base:>15.2f}")
    ratio = statistics.median(peer["peer get"]) / base
    print(f"target: peer get >= 0.70 x raw -> {'met' if ratio >= 0.7 else 'NOT met'} ({ratio:.2f})")


if __name__ == "__main__":
    main()
