"""Fault-injection soak: a bounded load generator drives a ``CacheEngine`` with CPU +
disk + peer + S3 tiers from several threads while faults are injected on a schedule,
and every retrieved chunk is checked byte for byte against what was stored for it.

Everything is real and on loopback: moto's S3 server in a child process behind
:class:`~faults.S3FaultProxy` (stopped / slow / 5xx / trickling), a standalone peer
node (``lmcache-core serve``) in a child process that is SIGKILLed and restarted,
the disk tier on a small tmpfs that gets chunk files corrupted and is filled to
ENOSPC, and frames are planted in the shared tiers (disk files and S3 objects under
real chunk keys holding other data: with a valid plain checksum, or sealed with
another deployment's secret) while the engine runs with ``frame_secret``: a planted
frame must be a miss, never served. The load stops by itself after ``--duration`` seconds (every loop is bounded
in count and time). Writes a JSON report: operations, faults injected, wrong results,
calls over the latency bound, p50/p99 latency, peak RSS against configured budgets.

Run through :func:`launch`, which puts the run in a private mount namespace with a
tmpfs for the disk tier (root or user namespaces); without one, the disk-full fault
is skipped and the report says why.

    python tests/soak/soak.py --duration 60 --out report.json [--tmpfs]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "backends"))

SECRET = "soak-node-secret-0123456789abcdef"
CHUNK_TOKENS = 16
CHUNK_SHAPE = (2, CHUNK_TOKENS, 128)  # 8 KiB in float16
TMPFS_SIZE = "24m"
FAULTS = ("peer_kill", "s3_stopped", "s3_slow", "s3_5xx", "s3_trickle", "disk_corrupt", "disk_full", "planted_frame")
FRAME_SECRET = "soak-frame-secret-0123456789abcdef"
OTHER_FRAME_SECRET = "someone-else's-frame-secret-0123"
# Tier deadlines: S3 op_deadline_s 2.0, peer timeout 1.0; disk and CPU are local.
S3_DEADLINE_S, PEER_TIMEOUT_S = 2.0, 1.0
BOUND_S = S3_DEADLINE_S + PEER_TIMEOUT_S + 2.0  # any single engine call; slack for 2 shared CPUs
MiB = 1 << 20

MOTO_CHILD = """
import sys, time
from moto.server import ThreadedMotoServer
s = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
s.start()
print(s._server.server_port, flush=True)
sys.stdin.read()
"""


def rss_of(pid: int | str = "self") -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


class Moto:
    """moto's S3 server in a child process (its threads and memory stay out of the
    engine's RSS)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", MOTO_CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.strip().isdigit():
            self.proc.kill()
            raise RuntimeError(f"moto server did not start: {line!r}")
        self.port = int(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class Soak:
    def __init__(
        self,
        duration_s: float,
        threads: int,
        workdir: Path,
        tmpfs: bool,
        seed: int = 12,
        docs: int = 160,
        chunks_per_doc: int = 4,
        fault_s: float = 4.0,
        gap_s: float = 1.5,
        frame_secret: bool = True,
    ) -> None:
        import torch

        self.duration_s, self.n_threads, self.workdir, self.tmpfs = duration_s, threads, workdir, tmpfs
        self.seed, self.fault_s, self.gap_s = seed, fault_s, gap_s
        self.rng = random.Random(seed)
        self.frame_secret = frame_secret
        self.engine: Any = None
        self.planted = 0
        self.docs = [[d * 10_000 + i for i in range(chunks_per_doc * CHUNK_TOKENS)] for d in range(docs)]
        self.expected = []
        for d in range(docs):
            g = torch.Generator().manual_seed(seed * 100_000 + d)
            self.expected.append([torch.randn(CHUNK_SHAPE, generator=g).to(torch.float16) for _ in range(chunks_per_doc)])
        self.lock = threading.Lock()
        self.ops: Counter[str] = Counter()
        self.lat: dict[str, list[float]] = {"store": [], "retrieve": [], "lookup": []}
        self.wrong = 0
        self.wrong_detail: list[str] = []
        self.overruns = 0
        self.chunks_verified = 0
        self.faults: Counter[str] = Counter()
        self.fault_log: list[tuple[float, str, str]] = []
        self.skipped: dict[str, str] = {}
        self.stop = threading.Event()
        self.rss_peak = 0
        self.node_rss_peak = 0
        self.node_growth_peak = 0
        self.node_baseline = 0

    # -- set-up ---------------------------------------------------------------------
    def start_services(self) -> None:
        import boto3
        from botocore.config import Config

        from faults import S3FaultProxy
        from peer_node import PeerNode

        os.environ.update(
            {
                "AWS_ACCESS_KEY_ID": "AKIASOAKTEST00000001",
                "AWS_SECRET_ACCESS_KEY": "soak-secret-key-0000000000000000",
                "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_CONFIG_FILE": os.devnull,
                "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            }
        )
        for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION"):
            os.environ.pop(k, None)
        self.moto = Moto()
        self.bucket = "lmc-soak"
        boto3.client(
            "s3",
            endpoint_url=f"http://127.0.0.1:{self.moto.port}",
            region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}),
        ).create_bucket(Bucket=self.bucket)
        self.proxy = S3FaultProxy(("127.0.0.1", self.moto.port))
        secret_file = self.workdir / "peer.secret"
        secret_file.write_text(SECRET)
        # The node holds less than the working set, so S3 keeps serving reads too.
        self.node_budget = (3 + 8) * MiB
        self.node = PeerNode(
            ["--max-size", "3MiB", "--max-frame-size", "1MiB", "--max-inflight", "8MiB", "--timeout-s", "1"], secret_file
        )
        self.node_baseline = rss_of(self.node.pid)
        self.disk_dir = self.workdir / "disk"
        self.disk_dir.mkdir(exist_ok=True)

    def make_engine(self) -> Any:
        from lmcache_core import CacheEngine, KeyNamespace, load_config

        self.pool_budget = (2 + 16) * MiB
        cfg = load_config(
            env={},
            overrides={
                "chunk_size": CHUNK_TOKENS,
                "staging_size": "16MiB",
                **({"frame_secret": FRAME_SECRET} if self.frame_secret else {}),
                "backends": [
                    {"name": "local_cpu", "max_size": "2MiB"},
                    {"name": "disk", "path": str(self.disk_dir / "tier"), "max_size": "3MiB", "fsync": False},
                    {
                        "name": "peer",
                        "peers": [self.node.address],
                        "secret": SECRET,
                        "push": True,
                        "max_size": 0,
                        "timeout_s": PEER_TIMEOUT_S,
                        "connect_timeout_s": 0.3,
                        "retry_after_s": 0.5,
                    },
                    {
                        "name": "s3",
                        "bucket": self.bucket,
                        "endpoint_url": self.proxy.endpoint,
                        "addressing_style": "path",
                        "op_deadline_s": S3_DEADLINE_S,
                        "connect_timeout_s": 0.5,
                        "read_timeout_s": 1.0,
                        "max_attempts": 2,
                        "down_cooldown_s": 1.0,
                        "max_concurrency": 4,
                        "presence_ttl_s": 1.0,
                    },
                ],
            },
        )
        return CacheEngine(cfg, namespace=KeyNamespace(model="soak"))

    # -- load -----------------------------------------------------------------------
    def _record(self, op: str, dt: float) -> None:
        with self.lock:
            self.ops[op] += 1
            self.lat[op].append(dt)
            if dt > BOUND_S:
                self.overruns += 1

    def verify(self, engine: Any, d: int) -> float:
        import torch

        from lmcache_core.testing.tokens import retrieve_tokens

        outs = [torch.full(CHUNK_SHAPE, float("nan"), dtype=torch.float16) for _ in self.expected[d]]
        t0 = time.monotonic()
        n = retrieve_tokens(engine, self.docs[d], outs)
        dt = time.monotonic() - t0
        bad = [i for i in range(n) if not torch.equal(outs[i], self.expected[d][i])]
        with self.lock:
            self.chunks_verified += n
            if bad:
                self.wrong += len(bad)
                self.wrong_detail.append(f"doc {d} chunks {bad} of {n} retrieved")
        return dt

    def worker(self, engine: Any, i: int) -> None:
        from lmcache_core.testing.tokens import lookup_tokens, store_tokens

        rng = random.Random(self.seed * 31 + i)
        end = time.monotonic() + self.duration_s
        while not self.stop.is_set() and time.monotonic() < end:
            d = rng.randrange(len(self.docs))
            r = rng.random()
            if r < 0.3:
                t0 = time.monotonic()
                store_tokens(engine, self.docs[d], self.expected[d])
                self._record("store", time.monotonic() - t0)
            elif r < 0.5:
                t0 = time.monotonic()
                lookup_tokens(engine, self.docs[d])
                self._record("lookup", time.monotonic() - t0)
            else:
                self._record("retrieve", self.verify(engine, d))
            time.sleep(0.002)  # leave the CPUs some air: this is a soak, not a benchmark

    def sampler(self) -> None:
        while not self.stop.wait(0.2):
            self.rss_peak = max(self.rss_peak, rss_of())
            try:
                node_rss = rss_of(self.node.pid)
            except AssertionError:
                continue
            if node_rss and self.node_baseline:
                self.node_rss_peak = max(self.node_rss_peak, node_rss)
                self.node_growth_peak = max(self.node_growth_peak, node_rss - self.node_baseline)

    # -- faults ---------------------------------------------------------------------
    def _log(self, fault: str, what: str) -> None:
        self.fault_log.append((round(time.monotonic() - self.t_start, 1), fault, what))

    def inject(self, fault: str) -> bool:
        from faults import corrupt_files, fill_disk

        if fault == "peer_kill":
            self.node.kill()
        elif fault.startswith("s3_"):
            self.proxy.set_mode(fault[3:])
        elif fault == "disk_corrupt":
            n = corrupt_files(self.disk_dir / "tier", 8, self.rng)
            self._log(fault, f"corrupted {n} chunk files")
            if n == 0:
                return False
        elif fault == "planted_frame":
            n = self.plant_frames(4)
            self._log(fault, f"planted {n} forged frames")
            if n == 0:
                return False
        elif fault == "disk_full":
            if not self.tmpfs:
                self.skipped[fault] = "no private tmpfs (mount not permitted here): disk-full fault not injected"
                return False
            n = fill_disk(self.disk_dir / "filler")
            self._log(fault, f"filled the tmpfs with {n // MiB} MiB")
        self.faults[fault] += 1
        self._log(fault, "begin")
        return True

    def plant_frames(self, docs: int) -> int:
        """For ``docs`` random documents, write forged frames of every chunk key (all
        666.0, unsealed with a valid checksum, or sealed with another secret) into the
        disk tier's files and the S3 bucket, bypassing the tiers; returns how many."""
        import boto3
        import torch
        from botocore.config import Config

        from lmcache_core.serde import FrameSeal, RawCodec, encode
        from lmcache_core.testing.tokens import token_hashes

        engine = self.engine
        if engine is None:
            return 0
        disk = next(t for t in engine.tiers if t.name == "disk")
        s3 = next(t for t in engine.tiers if t.name == "s3")
        direct = boto3.client(
            "s3",
            endpoint_url=f"http://127.0.0.1:{self.moto.port}",
            region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}, connect_timeout=1, read_timeout=2, retries={"max_attempts": 1}),
        )
        other = FrameSeal(OTHER_FRAME_SECRET)
        n = 0
        for d in self.rng.sample(range(len(self.docs)), docs):
            for i, key in enumerate(engine.keys(token_hashes(engine, self.docs[d]))):
                fake = torch.full(CHUNK_SHAPE, 666.0, dtype=torch.float16)
                frame = encode(key, fake, RawCodec(), seal=other if (d + i) % 2 else None)
                path = disk.directory.chunk_path(key)
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_bytes(frame)
                    n += 1
                except OSError:
                    pass  # the disk-full fault may be on: the S3 copy still counts
                try:
                    direct.put_object(Bucket=self.bucket, Key=s3._object(key), Body=frame)
                    n += 1
                except Exception:
                    pass
        with self.lock:
            self.planted += n
        return n

    def heal(self, fault: str) -> None:
        if fault == "peer_kill":
            self.node_baseline = 0
            self.node.start()  # same port; empty, as after a crash
            self.node_baseline = rss_of(self.node.pid)
        elif fault.startswith("s3_"):
            self.proxy.set_mode("ok")
        elif fault == "disk_full":
            (self.disk_dir / "filler").unlink(missing_ok=True)
        self._log(fault, "end")

    def scheduler(self) -> None:
        i = 0
        end = self.t_start + self.duration_s
        if self.stop.wait(3.0):  # warm-up: let the tiers fill
            return
        while not self.stop.is_set() and time.monotonic() + self.fault_s < end:
            fault = FAULTS[i % len(FAULTS)]
            i += 1
            if self.inject(fault):
                self.stop.wait(self.fault_s)
                self.heal(fault)
            self.stop.wait(self.gap_s)

    # -- run ------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        t0 = time.monotonic()
        self.start_services()
        self.timings = {}
        self.services_s = round(time.monotonic() - t0, 1)
        try:
            baseline = rss_of()
            engine = self.make_engine()
            self.engine = engine
            try:
                self.t_start = time.monotonic()
                threads = [threading.Thread(target=self.worker, args=(engine, i), daemon=True) for i in range(self.n_threads)]
                aux = [threading.Thread(target=self.scheduler, daemon=True), threading.Thread(target=self.sampler, daemon=True)]
                for t in threads + aux:
                    t.start()
                for t in threads:
                    t.join(timeout=self.duration_s + 60)
                hung = sum(t.is_alive() for t in threads)
                self.stop.set()
                for t in aux:
                    t.join(timeout=30)
                # Faults healed: one verifying sweep over every document.
                t_end = time.monotonic()
                sweep_t0 = time.monotonic()
                for d in range(len(self.docs)):
                    self._record("retrieve", self.verify(engine, d))
                sweep_s = time.monotonic() - sweep_t0
                stats = engine.stats()
            finally:
                t_close = time.monotonic()
                engine.close()
                self.timings = {"load_s": round(t_end - self.t_start, 1), "close_s": round(time.monotonic() - t_close, 1)}
            return self.report(baseline, stats, hung, sweep_s)
        finally:
            self.node.stop()
            self.proxy.close()
            self.moto.stop()

    def report(self, baseline: int, stats: dict[str, Any], hung: int, sweep_s: float) -> dict[str, Any]:
        everything = [x for v in self.lat.values() for x in v]
        tiers = {t["name"]: {k: t.get(k) for k in ("hits", "misses", "puts", "errors", "skipped")} for t in stats["tiers"]}
        s3 = next(t for t in stats["tiers"] if t["name"] == "s3")
        return {
            "duration_s": self.duration_s,
            "threads": self.n_threads,
            "ops": {**dict(self.ops), "total": sum(self.ops.values())},
            "chunks_verified": self.chunks_verified,
            "wrong": self.wrong,
            "planted_frames": self.planted,
            "frame_key_id": stats.get("frame_key_id"),
            "wrong_detail": self.wrong_detail[:20],
            "bound_s": BOUND_S,
            "overruns": self.overruns,
            "hung_workers": hung,
            "latency_ms": {
                op: {
                    "p50": round(percentile(v, 0.5) * 1000, 2),
                    "p99": round(percentile(v, 0.99) * 1000, 2),
                    "max": round(max(v, default=0) * 1000, 1),
                }
                for op, v in [*self.lat.items(), ("all", everything)]
            },
            "faults": dict(self.faults),
            "faults_total": sum(self.faults.values()),
            "skipped": self.skipped,
            "fault_log": self.fault_log,
            "s3_deadline_overruns_cut": s3["extra"].get("deadline_overruns"),
            "sweep_s": round(sweep_s, 2),
            "timings": {"services_s": self.services_s, **self.timings},
            "rss_mb": {
                "engine_baseline": round(baseline / MiB, 1),
                "engine_peak": round(self.rss_peak / MiB, 1),
                "engine_growth": round((self.rss_peak - baseline) / MiB, 1),
                "engine_pool_budget": self.pool_budget // MiB,
                "node_peak": round(self.node_rss_peak / MiB, 1),
                "node_growth": round(self.node_growth_peak / MiB, 1),
                "node_budget": self.node_budget // MiB,
            },
            "tiers": tiers,
            "engine": {
                k: stats.get(k) for k in ("stored_chunks", "retrieved_chunks", "load_errors", "dropped_writes", "backend_errors")
            },
        }


def launch(
    duration_s: float, workdir: Path, threads: int = 4, timeout_s: float | None = None, *, frame_secret: bool = True
) -> dict[str, Any]:
    """Run the soak in a child process, in a private mount namespace with a tmpfs for
    the disk tier when this machine allows it (else without the disk-full fault).
    Returns the JSON report."""
    out = workdir / "report.json"
    args = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--duration",
        str(duration_s),
        "--threads",
        str(threads),
        "--workdir",
        str(workdir),
        "--out",
        str(out),
        *([] if frame_secret else ["--no-frame-secret"]),
    ]
    timeout = timeout_s if timeout_s is not None else duration_s + 180
    disk = workdir / "disk"
    disk.mkdir(parents=True, exist_ok=True)
    why_not = ""
    if shutil.which("unshare") is not None:
        unshare = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
        script = f'mount -t tmpfs -o size={TMPFS_SIZE} tmpfs "{disk}" || exit 97\nexec "$@"'
        r = subprocess.run(
            [*unshare, "sh", "-ec", script, "soak", *args, "--tmpfs"], capture_output=True, text=True, timeout=timeout
        )
        if r.returncode != 97:
            if r.returncode != 0:
                raise RuntimeError(f"soak failed (rc={r.returncode}): {r.stderr[-4000:]}")
            return json.loads(out.read_text())
        why_not = f"cannot mount a tmpfs (no CAP_SYS_ADMIN / user namespaces): {r.stderr.strip()[-200:]}"
    else:
        why_not = "unshare(1) is not installed"
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"soak failed (rc={r.returncode}): {r.stderr[-4000:]}")
    report = json.loads(out.read_text())
    report["skipped"]["disk_full"] = f"disk-full fault not injected: {why_not}"
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tmpfs", action="store_true", help="the workdir's disk/ is a private tmpfs that may be filled")
    ap.add_argument(
        "--no-frame-secret", action="store_true", help="negative control: no frame_secret, so planted frames can be served"
    )
    a = ap.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.ERROR)  # the faults make the tiers warn a lot; the report says what matters
    workdir = a.workdir or Path(tempfile.mkdtemp(prefix="lmcache-soak-"))
    report = Soak(a.duration, a.threads, workdir, a.tmpfs, frame_secret=not a.no_frame_secret).run()
    a.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("ops", "wrong", "overruns", "faults", "latency_ms", "rss_mb")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
