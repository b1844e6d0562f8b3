"""``lmcache-core admin``: the node's admin API from the command line, so nobody needs
curl (the API itself: :mod:`.admin`).

    lmcache-core admin --url http://127.0.0.1:9100 --token-file F status
    lmcache-core admin --url ... --token-file F lookup KEY [KEY ...] [--tenant T]
    lmcache-core admin --url ... --token-file F erase (--namespace ID ... | --tenant T | --all) [--dry-run]
    lmcache-core admin --url ... --token-file F retain KEY [KEY ...] --seconds S [--priority P] [--tenant T]
    lmcache-core admin --url ... --token-file F release KEY [KEY ...] [--tenant T]

The token file is checked like the node checks its own (a regular file only its
owner can read: refused otherwise, before anything is sent). HTTPS URLs are verified
against ``--ca-file`` (else the system's trust store). Prints the node's JSON answer;
exits 0 on success, 1 when the node refused or failed the request (its status and
message on stderr), 2 on a usage error or an unreachable node.
"""

from __future__ import annotations

import argparse
import http.client
import json
import ssl
import sys
import urllib.parse
from pathlib import Path
from typing import Any, Callable, Sequence

from lmcache_core.backend import BackendError, EraseMatch

from .admin import read_token
from .limits import MAX_ERASE_NAMESPACES

TIMEOUT_S = 30.0


def setup_command(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    p.add_argument("--url", required=True, help="the node's admin API, as it printed it (http[s]://HOST:PORT)")
    p.add_argument("--token-file", required=True, type=Path, help="the admin token (mode 600, owned by you)")
    p.add_argument("--ca-file", type=Path, default=None, help="the certificate authority of an HTTPS admin API")
    p.add_argument("--timeout-s", type=float, default=TIMEOUT_S, help=f"per request (default {TIMEOUT_S:g})")
    sub = p.add_subparsers(dest="action", required=True)
    sub.add_parser("status", help="the node's store, hits, connections and per-tenant usage")
    lk = sub.add_parser("lookup", help="which of some chunk keys the node holds")
    lk.add_argument("keys", nargs="+", metavar="KEY", help="chunk keys as engines name them (v1-<ns>-<hash>)")
    lk.add_argument("--tenant", default=None, help="as this tenant (default: the shared secret's namespace)")
    er = sub.add_parser("erase", help="drop the chunks of some namespaces, or all")
    which = er.add_mutually_exclusive_group(required=True)
    which.add_argument("--namespace", action="append", metavar="ID", help="a namespace id (32 hex); repeatable")
    which.add_argument("--all", action="store_true", help="every chunk the node holds")
    which.add_argument("--tenant", metavar="T", help="every chunk tenant T wrote (a node with --tenants-file)")
    er.add_argument("--dry-run", action="store_true", help="count what would go, drop nothing")
    rt = sub.add_parser("retain", help="keep some chunks through eviction for a time")
    rt.add_argument("keys", nargs="+", metavar="KEY", help="chunk keys as engines name them (v1-<ns>-<hash>)")
    rt.add_argument("--seconds", type=float, required=True, help="how long (at most 30 days)")
    rt.add_argument("--priority", type=int, default=0, help="0-99, higher kept first past the retained share")
    rt.add_argument("--tenant", default=None, help="the keys as this tenant wrote them")
    rl = sub.add_parser("release", help="end some chunks' retention")
    rl.add_argument("keys", nargs="+", metavar="KEY", help="chunk keys as engines name them (v1-<ns>-<hash>)")
    rl.add_argument("--tenant", default=None, help="the keys as this tenant wrote them")
    return run


class NodeAdmins:
    """The admin APIs of the cache nodes a peer tier writes to (its ``admin_urls``):
    how ``lmcache-core erase`` reaches chunks that live in the nodes' memory."""

    def __init__(self, urls: Sequence[str], token_file: Path, ca_file: Path | None, timeout: float = TIMEOUT_S) -> None:
        self.urls = list(urls)
        self.token_file = token_file
        self.ca_file = ca_file
        self.timeout = timeout

    def erase(self, match: EraseMatch, *, dry_run: bool) -> int:
        """Erase ``match`` on every node (POST /erase); the chunks counted. Raises
        BackendError naming the node when one is unreachable or refuses (the token is
        read, and checked like the node's own, at this call)."""
        try:
            token = read_token(self.token_file)
        except ValueError as err:
            raise BackendError(f"admin_token_file: {err}") from None
        ids = None if match.namespaces is None else sorted(n.hex() for n in match.namespaces)
        step = MAX_ERASE_NAMESPACES
        bodies = [{"all": True}] if ids is None else [{"namespaces": ids[i : i + step]} for i in range(0, len(ids), step)]
        n = 0
        for url in self.urls:
            for body in bodies:
                try:
                    status, answer = request(
                        url, token, "POST", "/erase", {**body, "dry_run": dry_run}, self.timeout, self.ca_file
                    )
                except (OSError, ValueError) as err:
                    raise BackendError(f"node admin API {url}: {type(err).__name__}: {err}") from None
                if status != 200 or not isinstance(answer, dict):
                    why = answer.get("error") if isinstance(answer, dict) else answer
                    raise BackendError(f"node admin API {url} answered {status}: {why}")
                count = answer.get("would_erase" if dry_run else "erased")
                if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                    raise BackendError(f"node admin API {url}: no count in its answer")
                n += count
        return n


def request(url: str, token: bytes, method: str, path: str, body: Any, timeout: float, ca: Path | None) -> tuple[int, Any]:
    """One request to the admin API: (HTTP status, decoded JSON answer). A node that
    does not answer, or answers something that is not HTTP, raises OSError; an answer
    that is not JSON is returned as ``{"error": <its first bytes>}``."""
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname or u.port is None:
        raise ValueError(f"--url: expected http[s]://HOST:PORT, got {url!r}")
    conn: http.client.HTTPConnection
    if u.scheme == "https":
        ctx = ssl.create_default_context(cafile=str(ca) if ca is not None else None)
        conn = http.client.HTTPSConnection(u.hostname, u.port, timeout=timeout, context=ctx)
    else:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    headers = {"Authorization": "Bearer " + token.decode()}
    data = None if body is None else json.dumps(body).encode()
    if data is not None:
        headers["Content-Type"] = "application/json"
    try:
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        payload = resp.read(16 << 20)
    except http.client.HTTPException as err:  # not OSError: a status line, header or body that is not HTTP
        raise OSError(f"not an HTTP answer ({type(err).__name__}: {str(err)[:200]})") from None
    finally:
        conn.close()
    try:
        return resp.status, json.loads(payload) if payload else None
    except (ValueError, RecursionError):  # (RecursionError: JSON nested deeper than Python recurses)
        return resp.status, {"error": payload[:200].decode(errors="replace")}


def plan(args: argparse.Namespace) -> tuple[str, str, Any]:
    """The method, path and body of the action."""
    if args.action == "status":
        return "GET", "/status", None
    if args.action == "lookup":
        query = {"keys": ",".join(args.keys), **({"tenant": args.tenant} if args.tenant else {})}
        return "GET", "/lookup?" + urllib.parse.urlencode(query), None
    if args.action in ("retain", "release"):
        body: dict[str, Any] = {"keys": args.keys, **({"tenant": args.tenant} if args.tenant else {})}
        if args.action == "retain":
            body.update(seconds=args.seconds, priority=args.priority)
        return "POST", "/" + args.action, body
    body = {"all": True} if args.all else {"tenant": args.tenant} if args.tenant else {"namespaces": args.namespace}
    if args.dry_run:
        body["dry_run"] = True
    return "POST", "/erase", body


def run(args: argparse.Namespace) -> int:
    try:
        token = read_token(args.token_file)
        method, path, body = plan(args)
        status, answer = request(args.url, token, method, path, body, args.timeout_s, args.ca_file)
    except (ValueError, OSError) as err:
        sys.stderr.write(f"lmcache-core admin: {err}\n")
        return 2
    if status != 200:
        message = answer.get("error") if isinstance(answer, dict) else answer
        sys.stderr.write(f"lmcache-core admin: the node answered {status}: {message}\n")
        return 1
    sys.stdout.write(json.dumps(answer, indent=1, sort_keys=True) + "\n")
    return 0
