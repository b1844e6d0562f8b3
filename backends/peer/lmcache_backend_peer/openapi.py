"""The admin API described in OpenAPI 3.1: served at ``GET /openapi.json`` (behind the
token, like every endpoint) and kept in ``docs/backends/admin-openapi.json``
(``python -m lmcache_backend_peer.openapi > docs/backends/admin-openapi.json``; a test
fails when the file and this description differ, or when the node routes a path
this description lacks)."""

from __future__ import annotations

import json
from typing import Any

from lmcache_core.retention import MAX_PRIORITY, MAX_SECONDS

from .limits import MAX_BODY, MAX_ERASE_NAMESPACES, MAX_REQUEST_KEYS
from .store import RETAIN_SHARE

_ERROR = {"type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]}
_NS_ID = {"type": "string", "pattern": "^[0-9a-f]{32}$", "description": "a key namespace id (32 lowercase hex digits)"}


def _refusals(*codes: int) -> dict[str, Any]:
    why = {
        400: "a malformed request (the error says what)",
        401: "no or wrong bearer token (answered before the body is read)",
        404: "no such tenant on this node",
        411: "a chunked body (send a Content-Length)",
        413: f"a body over {MAX_BODY} bytes (never read)",
        429: "over the node's admin request rate for this client address (--admin-rate); Retry-After says when to retry",
    }
    ref = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    return {str(c): {"description": why[c], "content": ref} for c in codes}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_USAGE_ROW = {
    "type": "object",
    "properties": {
        "chunks": {"type": "integer"},
        "bytes": {"type": "integer"},
        "quota": {"type": ["integer", "null"], "description": "bytes at most (null: no quota)"},
        "refused": {"type": "integer", "description": "puts refused over the quota (private memory)"},
        "self_evictions": {"type": "integer", "description": "own chunks evicted to stay within the quota"},
    },
}

_STATUS = {
    "type": "object",
    "properties": {
        "node": {"type": "object", "description": "listen address, unix socket, writable, uptime_s, tenants"},
        "tiers": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    k: {"type": t}
                    for k, t in [
                        ("name", "string"),
                        ("kind", "string"),
                        ("max_bytes", "integer"),
                        ("bytes", "integer"),
                        ("chunks", "integer"),
                        ("evictions", "integer"),
                        ("retained", "integer"),
                        ("retained_bytes", "integer"),
                    ]
                },
            },
        },
        "hits": {"type": "object", "description": "per kind (lookup, get, locate): keys, hits, hit_rate"},
        "connections": {"type": "object", "description": "the node's connection counters"},
        "tenants": {
            "type": ["object", "null"],
            "additionalProperties": _USAGE_ROW,
            "description": "per tenant (and '(shared secret)') on a node with tenants, else null",
        },
        "quarantine": {"type": "null", "description": "always null: a node has no quarantine"},
        "admin": {"type": "object", "description": "the API's own counters"},
    },
    "required": ["node", "tiers", "hits", "connections", "tenants", "admin"],
}

_ERASE_BODY = {
    "type": "object",
    "description": "exactly one of namespaces, tenant and all",
    "properties": {
        "namespaces": {"type": "array", "items": _NS_ID, "minItems": 1, "maxItems": MAX_ERASE_NAMESPACES},
        "tenant": {"type": "string", "description": "every chunk this tenant wrote (a node with --tenants-file)"},
        "all": {"type": "boolean", "const": True},
        "dry_run": {"type": "boolean", "default": False},
    },
    "additionalProperties": False,
}

_ERASE_REPLY = {
    "type": "object",
    "properties": {
        "erased": {"type": "integer"},
        "would_erase": {"type": "integer", "description": "instead of erased, on a dry run"},
        "dry_run": {"type": "boolean"},
        "tier": {"type": "string", "const": "node"},
    },
}

_LOOKUP_REPLY = {
    "type": "object",
    "properties": {
        "keys": {"type": "integer"},
        "held": {"type": "array", "items": {"type": "boolean"}},
        "prefix_held": {"type": "integer", "description": "how many keys, from the first, are held"},
        "tenant": {"type": ["string", "null"]},
    },
}

_KEYS = {
    "type": "array",
    "items": {"type": "string", "pattern": "^v1-[0-9a-f]{32}-[0-9a-f]{32}$"},
    "minItems": 1,
    "maxItems": MAX_REQUEST_KEYS,
    "description": "chunk keys as engines name them (v1-<namespace>-<hash>)",
}
_TENANT = {"type": "string", "description": "the keys as this tenant wrote them (default: the shared secret's principal)"}

_RETAIN_BODY = {
    "type": "object",
    "properties": {
        "keys": _KEYS,
        "seconds": {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_SECONDS, "description": "how long"},
        "priority": {
            "type": "integer",
            "minimum": 0,
            "maximum": MAX_PRIORITY,
            "default": 0,
            "description": "higher kept first when retained chunks pass their share",
        },
        "tenant": _TENANT,
    },
    "required": ["keys", "seconds"],
    "additionalProperties": False,
}

_RETAIN_REPLY = {
    "type": "object",
    "properties": {
        "keys": {"type": "integer"},
        "retained": {"type": "integer", "description": "keys held now and retained"},
        "pending": {"type": "integer", "description": "keys not held yet: retained when they arrive"},
        "seconds": {"type": "number"},
        "tenant": {"type": ["string", "null"]},
    },
}

_RELEASE_BODY = {
    "type": "object",
    "properties": {"keys": _KEYS, "tenant": _TENANT},
    "required": ["keys"],
    "additionalProperties": False,
}

_RELEASE_REPLY = {
    "type": "object",
    "properties": {
        "keys": {"type": "integer"},
        "released": {"type": "integer", "description": "keys that had a retention"},
        "tenant": {"type": ["string", "null"]},
    },
}


def _post(summary: str, body: dict[str, Any], reply: dict[str, Any], what: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {"200": _json(reply, what), **_refusals(400, 401, 404, 411, 413, 429)},
        }
    }


SPEC: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {
        "title": "lmcache-core cache node admin API",
        "version": "1",
        "description": "JSON over HTTP/1.1 (HTTPS with --admin-cert), one request per connection. Every request "
        "needs the bearer token of --admin-token-file. See docs/deployment.md#admin-api.",
    },
    "security": [{"bearer": []}],
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        "schemas": {"Error": _ERROR},
    },
    "paths": {
        "/status": {
            "get": {
                "summary": "the node's store, hits, connections and per-tenant usage",
                "responses": {"200": _json(_STATUS, "the node's status"), **_refusals(401, 429)},
            }
        },
        "/erase": _post("drop chunks by namespace, by tenant, or all", _ERASE_BODY, _ERASE_REPLY, "how many went"),
        "/retain": _post(
            "keep some chunks through eviction for a time (a key not held yet: from when it arrives); retained "
            f"chunks hold at most {RETAIN_SHARE:.0%} of the node (of a tenant's arena), the weakest released past it",
            _RETAIN_BODY,
            _RETAIN_REPLY,
            "how many are retained",
        ),
        "/release": _post("end some chunks' retention", _RELEASE_BODY, _RELEASE_REPLY, "how many had one"),
        "/lookup": {
            "get": {
                "summary": "which of some chunk keys the node holds (read-only: no hit counted, nothing moved)",
                "parameters": [
                    {
                        "name": "keys",
                        "in": "query",
                        "required": True,
                        "description": f"up to {MAX_REQUEST_KEYS} chunk keys v1-<namespace>-<hash>, comma-separated",
                        "schema": {"type": "string"},
                    },
                    {
                        "name": "tenant",
                        "in": "query",
                        "required": False,
                        "description": "as this tenant sees the node (default: the shared secret's principal)",
                        "schema": {"type": "string"},
                    },
                ],
                "responses": {"200": _json(_LOOKUP_REPLY, "held per key"), **_refusals(400, 401, 404, 429)},
            }
        },
        "/metrics": {
            "get": {
                "summary": "the status in Prometheus' text format 0.0.4 (store, hits, connections, per tenant, admin)",
                "responses": {
                    "200": {"description": "the exposition", "content": {"text/plain": {"schema": {"type": "string"}}}},
                    **_refusals(401, 429),
                },
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "this description",
                "responses": {"200": _json({"type": "object"}, "the OpenAPI document"), **_refusals(401, 429)},
            }
        },
    },
}


def text() -> str:
    return json.dumps(SPEC, indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    print(text(), end="")
