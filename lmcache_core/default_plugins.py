"""The plugins that ship inside the core, registered through the same hooks as
third-party ones: the CPU tier and the ``raw``/``lz4`` codecs."""

from __future__ import annotations

from .hookspecs import RegisterBackend, RegisterCodec, hookimpl
from .serde import Lz4Codec, RawCodec


@hookimpl
def register_backends(register: RegisterBackend) -> None:
    from .local_cpu import create_local_cpu

    register("local_cpu", create_local_cpu, description="CPU memory tier (LRU, byte budget)")


@hookimpl
def register_codecs(register: RegisterCodec) -> None:
    register(RawCodec(), description="no compression")
    register(Lz4Codec(), description="LZ4 block compression")
