"""``python -m lmcache_cuda``: resolve the backend now (JIT-compiling the kernels if
needed, e.g. ahead of starting vLLM) and print which one is in use and why."""

from lmcache_cuda.dispatch import status


def main() -> int:
    st = status()
    print(f"backend: {st.name}\nreason: {st.reason}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
