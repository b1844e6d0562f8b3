"""``lmcache-peer-serve``: a standalone cache node.

Holds chunks in memory (LRU within ``--max-size``) and accepts LOOKUP, GET, PUT and
REMOVE from clients that know the shared secret, so instances with ``push: true`` can
share one cache. The secret comes from ``--secret-file`` or the environment variable
``LMCACHE_PEER_SECRET`` (never the command line, where ``ps`` would show it). With
``--tenants-file`` each tenant authenticates with its own secret and sees only its
own chunks (see :mod:`.tenants`). Prints
``listening on HOST:PORT`` once ready (with port 0 the chosen port), runs until
SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

from lmcache_core.config import HOUR, ConfigError, CoreConfig, check_seconds, ms_to_seconds, parse_size, read_frame_secret
from lmcache_core.frames import FrameSeal

from .admin import DEFAULT_RATE as DEFAULT_ADMIN_RATE
from .admin import DEFAULT_TIMEOUT_S as ADMIN_TIMEOUT_S
from .admin import AdminConfigError, AdminServer, check_listen, is_loopback, read_token, tls_context
from .client import format_address
from .config import check_secret, parse_address
from .evictions import DEFAULT_CAPACITY, MAX_CAPACITY, EvictionLog
from .server import PeerServer, SocketPathError
from .shm import ArenaStore, ShmUnavailable
from .store import FrameStore
from .tenants import load_tenants_file

SECRET_ENV = "LMCACHE_PEER_SECRET"
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_HANDSHAKE_TIMEOUT_S = 1.0


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _address(text: str) -> tuple[str, int]:
    try:
        return parse_address(text, allow_port_zero=True)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", type=_address, required=True, help="host:port to listen on (port 0: pick one)")
    p.add_argument("--secret-file", type=Path, help=f"file with the shared secret (else ${SECRET_ENV})")
    p.add_argument(
        "--tenants-file",
        type=Path,
        help="file of 'NAME SECRET' lines: each tenant sees only its own chunks (the shared secret becomes optional)",
    )
    p.add_argument("--max-size", type=_size, default=parse_size("1GiB"), help="memory budget, e.g. 2GiB (default 1GiB)")
    p.add_argument(
        "--tenant-quota",
        type=_size,
        default=None,
        help="bytes the node holds for each tenant at most (a tenants-file line's quota=SIZE overrides it); a tenant "
        "at its quota evicts its own chunks, never another's (default: no quota, one LRU over --max-size)",
    )
    p.add_argument("--max-frame-size", type=_size, default=parse_size("256MiB"), help="largest message (default 256MiB)")
    p.add_argument(
        "--timeout-s",
        type=float,
        default=None,
        help="per-request deadline in seconds: once a request's first byte is in, the rest of its header must come "
        f"within this, and its body within this of the header (default {DEFAULT_TIMEOUT_S:g}; idle connections "
        "between requests stay 300 s)",
    )
    p.add_argument("--timeout-ms", type=float, default=None, help="deprecated: --timeout-s in milliseconds")
    p.add_argument("--max-connections", type=int, default=256, help="concurrent authenticated connections (default 256)")
    p.add_argument(
        "--max-unauthenticated",
        type=int,
        default=32,
        help="connections still authenticating, apart from --max-connections, per transport (TCP, --unix-socket) (default 32)",
    )
    p.add_argument("--max-unauthenticated-per-address", type=int, default=4, help="of those, from one client address (default 4)")
    p.add_argument(
        "--max-unauthenticated-per-subnet",
        type=int,
        default=None,
        help="of those, from one IPv4 /24, IPv6 /64 or local user (default: half of --max-unauthenticated)",
    )
    p.add_argument(
        "--handshake-timeout-s",
        type=float,
        default=None,
        help=f"a new connection must authenticate within this many seconds (default {DEFAULT_HANDSHAKE_TIMEOUT_S:g})",
    )
    p.add_argument("--handshake-timeout-ms", type=float, default=None, help="deprecated: --handshake-timeout-s in milliseconds")
    p.add_argument(
        "--max-inflight",
        type=_size,
        default=None,
        help="request bytes held at once across connections (default 2 x --max-frame-size)",
    )
    p.add_argument("--read-only", action="store_true", help="refuse PUT and REMOVE")
    p.add_argument(
        "--unix-socket",
        type=Path,
        default=None,
        help="also listen on this Unix socket (mode 0600) for engines on this host: same secrets, shared memory. "
        "A stale socket of this user there is replaced; anything else (a live socket, a file, a link, another "
        "user's socket, a directory writable by all without the sticky bit) stops the node with an error",
    )
    p.add_argument(
        "--eviction-log",
        type=int,
        default=DEFAULT_CAPACITY,
        metavar="N",
        help=f"remember the last N dropped keys per tenant for engines' KV events (32 B each; 0: off; default {DEFAULT_CAPACITY})",
    )
    p.add_argument(
        "--frame-secret-file",
        type=Path,
        default=None,
        help="the engines' frame_secret_file: pushed frames must be sealed with it (without it the node keeps "
        "sealed frames unchecked and the engines check them)",
    )
    p.add_argument(
        "--admin",
        type=_address,
        default=None,
        metavar="HOST:PORT",
        help="serve the admin HTTP API (status, erase, lookup) here, e.g. 127.0.0.1:9001; needs --admin-token-file",
    )
    p.add_argument(
        "--admin-token-file",
        type=Path,
        default=None,
        help="file with the admin API's bearer token: owned by this user, mode 0600 or stricter (else the node refuses to start)",
    )
    p.add_argument("--admin-cert", type=Path, default=None, help="serve the admin API over TLS with this certificate (PEM)")
    p.add_argument("--admin-key", type=Path, default=None, help="the private key of --admin-cert (PEM)")
    p.add_argument(
        "--admin-timeout-s",
        type=float,
        default=ADMIN_TIMEOUT_S,
        help=f"an admin request, TLS handshake included, must arrive within this (default {ADMIN_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--admin-rate",
        type=float,
        default=DEFAULT_ADMIN_RATE,
        help=f"admin requests a second per client address, bursts of twice that; past it 429 (default {DEFAULT_ADMIN_RATE:g}; 0: no limit)",
    )
    p.add_argument(
        "--no-shm",
        action="store_true",
        help="keep frames in private memory: engines on --unix-socket get them over the socket",
    )


def _frame_seal(args: argparse.Namespace, parser: argparse.ArgumentParser) -> FrameSeal | None:
    if args.frame_secret_file is None:
        return None
    try:
        secret = read_frame_secret(CoreConfig(frame_secret_file=str(args.frame_secret_file)))
    except ConfigError as err:
        parser.error(str(err))
    return FrameSeal(secret) if secret is not None else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lmcache-peer-serve", description="Run a standalone lmcache peer cache node.")
    _add_arguments(p)
    return p


def setup_command(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """``lmcache-core serve`` (registered in :mod:`.plugin`): the same node as
    ``lmcache-peer-serve``, on the parser lmcache-core made for the command."""
    _add_arguments(p)
    return lambda args: _serve(args, p)


def _secret(args: argparse.Namespace, parser: argparse.ArgumentParser) -> bytes:
    if args.secret_file is not None:
        try:
            data = args.secret_file.read_bytes().rstrip(b"\r\n")
        except OSError as err:
            parser.error(f"--secret-file: cannot read {args.secret_file}: {err.strerror or err}")
        if not data:
            parser.error(f"--secret-file: {args.secret_file} is empty")
    else:
        data = os.environ.get(SECRET_ENV, "").encode()
        if not data:
            parser.error(f"give --secret-file or set {SECRET_ENV}")
    try:
        check_secret(data)
    except ValueError as err:
        parser.error(f"{'--secret-file' if args.secret_file is not None else SECRET_ENV}: {err}")
    return data


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    return _serve(parser.parse_args(argv), parser)


#: the most each duration flag takes: the same bounds as the engines' peer tier keys
FLAG_MAX_S = {"timeout": HOUR, "handshake-timeout": 600.0}


def seconds_flag(args: argparse.Namespace, parser: argparse.ArgumentParser, name: str, default: float) -> float:
    """The value of ``--<name>-s``, or of the deprecated ``--<name>-ms`` (accepted for
    one release, converted to seconds with a warning by the config's own rule,
    :func:`lmcache_core.config.ms_to_seconds`), or ``default``. It must meet the
    config's rule for durations (:func:`lmcache_core.config.check_seconds`: from
    1 ms to :data:`FLAG_MAX_S`); both flags at once are an error."""
    attr = name.replace("-", "_")
    seconds, millis = getattr(args, f"{attr}_s"), getattr(args, f"{attr}_ms")
    if millis is not None:
        try:
            seconds = ms_to_seconds(
                millis,
                f"--{name}-ms",
                f"--{name}-s",
                both=seconds is not None,
                sep=" ",
                say=lambda msg: print(f"{parser.prog}: {msg}", file=sys.stderr),
            )
        except ConfigError as err:
            parser.error(str(err))
    if seconds is None:
        seconds = default
    try:
        return check_seconds(seconds, max_s=FLAG_MAX_S.get(name, HOUR))
    except ValueError as err:
        parser.error(f"--{name}-s: {err}")


def _admin_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[bytes | None, Any]:
    """The admin token and TLS context, checked before the node starts (None, None
    without ``--admin``); every problem is a usage error that names the flag."""
    if args.admin is None:
        if args.admin_token_file or args.admin_cert or args.admin_key:
            parser.error("--admin-token-file, --admin-cert and --admin-key need --admin HOST:PORT")
        return None, None
    try:
        check_seconds(args.admin_timeout_s, max_s=600.0)
    except ValueError as err:
        parser.error(f"--admin-timeout-s: {err}")
    if not 0 <= args.admin_rate <= 100_000 or args.admin_rate != args.admin_rate:
        parser.error(f"--admin-rate: requests a second from 0 (no limit) to 100000, got {args.admin_rate:g}")
    try:
        check_listen(args.admin[0], args.admin_token_file)
    except AdminConfigError as err:
        parser.error(str(err))
    try:
        token = read_token(args.admin_token_file)
    except AdminConfigError as err:
        parser.error(f"--admin-token-file: {err}")
    try:
        tls = tls_context(args.admin_cert, args.admin_key)
    except AdminConfigError as err:
        parser.error(str(err))
    if tls is None and not is_loopback(args.admin[0]):
        print(
            f"{parser.prog}: warning: the admin API on {format_address(args.admin)} is not loopback and has no TLS: "
            "the token crosses the network in clear (give --admin-cert and --admin-key)",
            file=sys.stderr,
        )
    return token, tls


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    timeout = seconds_flag(args, parser, "timeout", DEFAULT_TIMEOUT_S)
    handshake_timeout = seconds_flag(args, parser, "handshake-timeout", DEFAULT_HANDSHAKE_TIMEOUT_S)
    for flag in ("max_connections", "max_unauthenticated", "max_unauthenticated_per_address", "max_unauthenticated_per_subnet"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if not 0 <= args.eviction_log <= MAX_CAPACITY:
        parser.error(f"--eviction-log must be 0..{MAX_CAPACITY}")
    admin_token, admin_tls = _admin_options(args, parser)
    tenants = None
    quotas: dict[str | None, int] = {}
    if args.tenants_file is not None:
        try:
            tenants, file_quotas = load_tenants_file(args.tenants_file)
            quotas.update(file_quotas)
        except ValueError as err:
            parser.error(f"--tenants-file: {err}")
    if args.tenant_quota is not None:
        if tenants is None:
            parser.error("--tenant-quota needs --tenants-file (quotas are per tenant)")
        quotas = {t: quotas.get(t, args.tenant_quota) for t in tenants}
    secret = _secret(args, parser) if tenants is None or args.secret_file or os.environ.get(SECRET_ENV) else None
    store: FrameStore | ArenaStore
    if args.unix_socket is not None and not args.no_shm:
        principals: list[str | None] = ([None] if secret else []) + list(tenants or {})
        try:
            store = ArenaStore(args.max_size, principals, quotas)
        except (OSError, ShmUnavailable) as err:
            print(f"{parser.prog}: no shared memory ({err}); serving frames over the socket", file=sys.stderr)
            store = FrameStore(args.max_size, quotas)
    else:
        store = FrameStore(args.max_size, quotas)
    evictions = None
    if args.eviction_log and not args.read_only:
        evictions = EvictionLog(args.eviction_log)
        evictions.watch(store, tenants or ())
    try:
        server = PeerServer(
            store,
            args.listen,
            secret,
            tenants=tenants,
            writable=not args.read_only,
            max_frame_size=args.max_frame_size,
            timeout=timeout,
            max_connections=args.max_connections,
            handshake_timeout=handshake_timeout,
            max_unauthenticated=args.max_unauthenticated,
            max_unauthenticated_per_address=args.max_unauthenticated_per_address,
            max_unauthenticated_per_subnet=args.max_unauthenticated_per_subnet,
            max_inflight_bytes=args.max_inflight,
            unix_socket=None if args.unix_socket is None else str(args.unix_socket),
            eviction_log=evictions,
            seal=_frame_seal(args, parser),
        )
    except ValueError as err:
        parser.error(str(err))
    except SocketPathError as err:  # names the path and what is there
        print(f"{parser.prog}: --unix-socket: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        where = format_address(args.listen) + (f" and {args.unix_socket}" if args.unix_socket is not None else "")
        print(f"{parser.prog}: cannot listen on {where}: {err.strerror or err}", file=sys.stderr)
        return 2
    admin = None
    if args.admin is not None and admin_token is not None:
        try:
            admin = AdminServer(
                server,
                store,
                args.admin,
                admin_token,
                tenants=tenants,
                timeout=args.admin_timeout_s,
                tls=admin_tls,
                rate=args.admin_rate,
            )
        except OSError as err:
            server.close()
            print(
                f"{parser.prog}: --admin: cannot listen on {format_address(args.admin)}: {err.strerror or err}", file=sys.stderr
            )
            return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if args.unix_socket is not None:
        shm = "shared memory" if isinstance(store, ArenaStore) else "no shared memory"
        print(f"local socket {args.unix_socket} ({shm})", flush=True)
    print(f"listening on {format_address(server.address)}", flush=True)
    if admin is not None:
        print(f"admin API on {admin.url}", flush=True)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        if admin is not None:
            admin.close()
        server.close()
        if isinstance(store, ArenaStore):
            store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
