"""The engine round trip: chunks saved from the device's KV into the engine's CPU tier,
read back and loaded into other blocks, with and without the completion wait."""

from __future__ import annotations

from typing import Any

import torch
from lmcache_connector.layouts.kv_adapters import BlockLayout, TokenLayout
from lmcache_cuda.paged_layout import int_view
from lmcache_cuda.testing import poison_like

from .common import RESULTS, TABLE, _llama, log, section


@section("engine round trip")
def engine_round_trip(quick: bool) -> None:
    """Save chunks from CUDA KV into the engine's pool (CPU tier), read them back, load
    them into other blocks: every byte must land. Then the same with the host-side
    completion wait removed, to show the check can see the race it guards against."""
    from lmcache_core.config import load_config
    from lmcache_core.engine import CacheEngine
    from lmcache_core.keys import KeyNamespace
    from lmcache_core.plugins import PluginManager

    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = {}
    n_chunks = 6 if quick else 12
    rounds = 2 if quick else 4
    for kind in ("token", "block"):
        for wait in (True, False):
            if not wait and device == "cpu":
                continue
            src = _llama(256 * n_chunks, device, seed=1)
            dst = poison_like(src, 2)

            def make(kv: dict) -> Any:
                return TokenLayout(kv, 16, allow_cpu=True) if kind == "token" else BlockLayout(kv, 16)

            a, b, ref = make(src), make(dst), make(src)
            loaded = load_config(env={}, overrides={"chunk_size": 256, "backends": [{"name": "local_cpu", "max_size": "2GiB"}]})
            eng = CacheEngine(
                loaded, namespace=KeyNamespace(model=f"gpu-check-{kind}-{wait}"), plugins=PluginManager(load_entry_points=False)
            )
            g = torch.Generator().manual_seed(3)
            nb = next(iter(src.values())).shape[0]
            shape = a.chunk_shape(256)
            stored_bad = loaded_bad = total = 0
            for r in range(rounds):
                table_s = torch.randperm(nb, generator=g)[: 16 * n_chunks].tolist()
                table_d = torch.randperm(nb, generator=g)[: 16 * n_chunks].tolist()
                hashes = [bytes([r, i, int(wait)]) * 5 + b"x" for i in range(n_chunks)]
                expected = []
                for i, h in enumerate(hashes):
                    ids = table_s[i * 16 : (i + 1) * 16]
                    on_dev = torch.empty(shape, dtype=a.dtype, device=device)
                    ref.save_chunk(ids, 0, 256, on_dev)  # the truth, gathered on the device
                    expected.append(int_view(on_dev).cpu())
                    buf = eng.allocate(shape, a.dtype)
                    assert buf is not None, "pool exhausted"
                    a.save_chunk(ids, 0, 256, buf.tensor, wait=wait)
                    # what the CPU tier, the canary or a write-behind reads at once:
                    stored_bad += int(not torch.equal(int_view(buf.tensor), expected[i]))
                    eng.store_hashes([h], [buf], n_tokens=256)
                    buf.release()
                    if device == "cuda":
                        torch.cuda.synchronize()
                for i, h in enumerate(hashes):
                    got = eng.retrieve_buffer(h, shape, a.dtype)
                    assert got is not None, "chunk missing from the CPU tier"
                    # a chunk read from a remote tier lands in a temporary pool buffer,
                    # which goes back to the pool right after the load
                    tmp = eng.allocate(shape, a.dtype)
                    tmp.tensor.copy_(got.tensor)
                    got.release()
                    b.load_chunk(tmp.tensor, table_d[i * 16 : (i + 1) * 16], 0, 256, 0, wait=wait)
                    tmp.tensor.view(torch.uint8).fill_(0xA5)  # ...and is reused at once
                    tmp.release()
                if device == "cuda":
                    torch.cuda.synchronize()
                for i in range(n_chunks):
                    back = torch.empty(shape, dtype=a.dtype, device=device)
                    make(dst).save_chunk(table_d[i * 16 : (i + 1) * 16], 0, 256, back)
                    total += 1
                    loaded_bad += int(not torch.equal(int_view(back).cpu(), expected[i]))
            eng.close()
            results[f"{kind}/{'wait' if wait else 'no-wait'}"] = {
                "chunks": total,
                "stored_wrong": stored_bad,
                "loaded_wrong": loaded_bad,
            }
            log(
                f"  {kind:5} {'with' if wait else 'WITHOUT (control)'} the completion wait: "
                f"{stored_bad} of {total} saved chunks wrong when read at once, {loaded_bad} of {total} loaded chunks wrong"
            )
            bad = stored_bad + loaded_bad
            if wait:
                TABLE.append(
                    (
                        f"engine round trip ({kind})",
                        f"{bad} of {2 * total} saved+loaded chunks wrong",
                        "PASS" if bad == 0 else "FAIL",
                    )
                )
            else:
                TABLE.append((f"  control: no wait ({kind})", f"{bad} of {2 * total} wrong (should be > 0)", "info"))
    RESULTS["engine"] = results
