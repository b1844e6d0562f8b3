"""The plugins that ship inside the core, registered through the same hooks as
third-party ones: the CPU tier, the ``raw``/``lz4`` codecs, the lossy opt-in ``fp8`` codec and the
eviction policies."""

from __future__ import annotations

from .hookspecs import RegisterBackend, RegisterCodec, RegisterEvictionPolicy, hookimpl
from .serde import Lz4Codec, RawCodec


@hookimpl
def register_backends(register: RegisterBackend) -> None:
    register(
        "local_cpu",
        "lmcache_core.local_cpu:create_local_cpu",
        pool_bytes="lmcache_core.local_cpu:pool_bytes",
        description="CPU memory tier (byte budget, eviction policy per config)",
    )


@hookimpl
def register_codecs(register: RegisterCodec) -> None:
    register(RawCodec(), description="no compression")
    register(Lz4Codec(), description="LZ4 block compression")
    from .fp8 import Fp8Codec

    register(Fp8Codec(), description="LOSSY: float8 e4m3, a scale per 64 values (0.52x of bf16); per tier, opt-in")


@hookimpl
def register_eviction_policies(register: RegisterEvictionPolicy) -> None:
    from .eviction import BUILTIN_POLICIES

    for name, (factory, description) in BUILTIN_POLICIES.items():
        register(name, factory, description=description)
