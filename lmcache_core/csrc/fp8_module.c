/* lmcache_core._fp8: the compiled fp8 kernel, built with the package (setup.py).
 *
 * It holds the kernel once per instruction set (fp8_generic.c, fp8_avx2.c,
 * fp8_avx512.c) and tells Python which of them this CPU runs, best first, with the
 * addresses of their two functions; lmcache_core/fp8_native.py calls them through
 * ctypes (which releases the GIL for the call). Loaded by Python's import system from
 * the installed package like any other module of it: nothing is compiled or looked
 * up in a cache directory at run time. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define DECLARE(v, ...)                                                                                    \
    __VA_ARGS__ int lmc_fp8_encode_##v(const void *, int, int64_t, float, float, float, uint8_t *);        \
    __VA_ARGS__ int lmc_fp8_decode_##v(const uint8_t *, int64_t, int, float, void *);

DECLARE(generic)
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define X86_VARIANTS 1
/* weak: a variant the compiler could not target is absent (NULL), not a load error */
DECLARE(avx2, __attribute__((weak)))
DECLARE(avx512, __attribute__((weak)))
#endif

static int append(PyObject *list, const char *name, void *encode, void *decode) {
    PyObject *item = Py_BuildValue("(sNN)", name, PyLong_FromVoidPtr(encode), PyLong_FromVoidPtr(decode));
    if (item == NULL) return -1;
    int rc = PyList_Append(list, item);
    Py_DECREF(item);
    return rc;
}

static PyObject *variants(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    PyObject *list = PyList_New(0);
    if (list == NULL) return NULL;
#ifdef X86_VARIANTS
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi") &&
               __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt");
    int avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                 __builtin_cpu_supports("avx512cd");
    if (avx512 && lmc_fp8_encode_avx512 != NULL &&
        append(list, "avx512", (void *)lmc_fp8_encode_avx512, (void *)lmc_fp8_decode_avx512) < 0)
        goto fail;
    if (avx2 && lmc_fp8_encode_avx2 != NULL &&
        append(list, "avx2", (void *)lmc_fp8_encode_avx2, (void *)lmc_fp8_decode_avx2) < 0)
        goto fail;
#endif
    if (append(list, "generic", (void *)lmc_fp8_encode_generic, (void *)lmc_fp8_decode_generic) < 0) goto fail;
    return list;
fail:
    Py_DECREF(list);
    return NULL;
}

static PyMethodDef methods[] = {
    {"variants", variants, METH_NOARGS,
     "The kernel's variants this CPU runs, best first: (name, encode address, decode address)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fp8", "The fp8 codec's compiled kernel.", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fp8(void) { return PyModule_Create(&module); }
