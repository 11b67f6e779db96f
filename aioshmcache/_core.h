/* The compiled core's shared header: the segment layout constants and what every section of
 * the extension module ``aioshmcache._core`` shares.
 *
 * The constants mirror ``aioshmcache/_layout.py`` (the reference: its docstring lays out every
 * byte); the module exports them as ``LAYOUT`` and a test checks them against the Python
 * ones, so the two cannot drift apart silently.
 *
 * The module is built from every ``aioshmcache/_core*.c`` (``hatch_build.py``); ``_core.c``
 * holds the module definition, the tag and the copy; ``_core_put.c`` the put of a plain item. A further section (e.g. the read path) adds its own functions
 * by defining ``aioshm_read_methods`` (a NULL-terminated ``PyMethodDef`` table) and may define
 * ``aioshm_read_init``: both are weak here, so the module builds with or without that file.
 */
#ifndef AIOSHM_CORE_H
#define AIOSHM_CORE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* --- segment header words (H_*) --- */
#define AIOSHM_MAGIC UINT64_C(0x31434d48534f4941) /* "AIOSHMC1" little-endian */
#define AIOSHM_LAYOUT_VERSION 4
#define AIOSHM_HEADER_SIZE 4096
#define H_MAGIC 0
#define H_VERSION 1
#define H_CAPACITY 3
#define H_RING_OFF 8
#define H_NONCE 9
#define H_EPOCH 11
#define H_NEXT_ID 14
#define H_WAITING 15
#define H_HITS 20
#define H_MISSES 21
#define H_BYTES_USED 25
#define H_ITEMS 26
#define H_SECRET 28
#define H_HEAD_POS 29

/* --- reader slots --- */
#define SLOT_HEADER 128
#define RS_SESSION 0
#define RS_HEAD 2
#define WS_CONSUMED 8
#define WS_OWED 10
#define LOG_ENTRY_BYTES 16

/* --- chunk header (C_*) --- */
#define CHUNK_HEADER 64
#define CHUNK_MAGIC UINT64_C(0x9E3779B97F4A7C15)
#define C_ID 0
#define C_LENGTH 1
#define C_STATE 2
#define C_CHECK 3
#define CHUNK_WRITING 1
#define CHUNK_COMMITTED 2
#define CHUNK_FREED 3
#define CHUNK_DEAD 4

/* --- the reference tag's multipliers (``_types``) --- */
#define TAG_M1 UINT64_C(0x9E3779B97F4A7C15)
#define TAG_M2 UINT64_C(0xC2B2AE3D27D4EB4F)
#define TAG_M3 UINT64_C(0x165667B19E3779F9)
#define TAG_M4 UINT64_C(0xD6E8FEB86659FD93)

/* --- the payload prefix (``_serde_encode``) --- */
#define PAYLOAD_PREFIX_SIZE 20
#define PAYLOAD_ALIGN 64

/* Shared by the sections: the reference tag (``_types``), the copy into the ring. */
uint64_t aioshm_tag_base(uint64_t secret, uint64_t epoch, uint64_t address, uint64_t cid,
                         uint64_t length, uint64_t position);
uint64_t aioshm_finish_tag(uint64_t base, uint64_t seq);
/* ``memcpy``, or streaming stores and an ``sfence`` from the copy threshold (``copy_info``) */
void aioshm_copy_bytes(char *dst, const char *src, size_t n);

/* The write core's put of a plain item (``_core_put.c``). */
extern PyMethodDef aioshm_put_methods[];

/* The compiled plan of the usual items (``_core_plan.c``): ``StoreWriter.plan`` of ``value``
 * with ``store.serde`` (a ``MsgpackSerde``), or None (declined: the reference plans it). */
extern PyMethodDef aioshm_plan_methods[];
PyObject *aioshm_plan_store(PyObject *store, PyObject *serde, PyObject *value);
/* The bytes of ``obj`` read from its fields, without a buffer export (``_core_plan.c``): 1 if
 * it is an exact numpy array, C-contiguous, of a dtype the plan has met (its item size known),
 * with its data pointer and size; else 0 (take its buffer). The pointer is good while nothing
 * can run Python code that resizes the array: a caller uses it at once, holding the GIL. */
int aioshm_array_bytes(PyObject *obj, const char **data, Py_ssize_t *nbytes);
/* The offset of ``t``'s object slot ``name`` (a member descriptor), or -1: not such a slot. */
Py_ssize_t aioshm_member_offset(PyTypeObject *t, const char *name);

/* The writer's counters as C integers (``_core_state.c``; reference: ``_core_py.RingState`` /
 * ``MapState``): the bases of ``ShmRingBuffer`` and ``ShardedMap``, whose fields the put reads
 * and writes here instead of Python ints in slots. */
typedef struct {
    PyObject_HEAD
    int64_t tail, limit, end, head, mask, at_mask, lap, used, capacity;
} AioshmRingState;
typedef struct {
    PyObject_HEAD
    int64_t mask, n;
} AioshmMapState;
extern PyTypeObject AioshmRingState_Type, AioshmMapState_Type;
int aioshm_state_init(PyObject *module);

/* The layout constants as a dict (for the test that compares them with ``_layout``). */
PyObject *aioshm_layout_dict(void);

/* Optional further sections of the module (weak: absent unless their file is compiled in). */
extern PyMethodDef aioshm_read_methods[] __attribute__((weak));
extern int aioshm_read_init(PyObject *module) __attribute__((weak));
/* The specs of a sender's request over features (``_core_spec.c``). */
extern PyMethodDef aioshm_spec_methods[] __attribute__((weak));
/* The channel's per-call steps (``_core_chan.c``). */
extern PyMethodDef aioshm_chan_methods[] __attribute__((weak));
/* The sender's kept prompt updates (``_core_kept.c``). */
extern PyMethodDef aioshm_kept_methods[] __attribute__((weak));
extern int aioshm_kept_init(PyObject *module) __attribute__((weak));

#endif
