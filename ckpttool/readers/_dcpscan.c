/* Read a DCP `.metadata` pickle as torch writes it straight into columns, at C speed.

   `scan(data, dtypes)` walks the pickle's opcodes as a recursive-descent parser of exactly
   the object graph torch's `Metadata` pickles to (protocol 2 to 5; torch's `FileSystemWriter`
   with MEMOIZE after each object, ckpttool's own writer with no memo): the Metadata record,
   its state_dict_metadata (TensorStorageMetadata with TensorProperties, torch.Size and
   ChunkStorageMetadata; BytesStorageMetadata), planner_data (fqn -> tuple of str/int keys),
   storage_data (MetadataIndex -> _StorageInfo without transforms), storage_meta and version.

   Nothing is built but strings, the planner's tuples and int64 columns; no code runs and no
   class is looked up: a global is only compared with the names below. Anything else, in any
   place (another opcode, class, field, a memo slot fetched that holds no string or class, an
   int past int64, a dtype not in `dtypes`), returns None and the caller reads the file with
   the checking Python loader (safepickle), which explains what is wrong or reads what this
   does not. The work and memory are linear in the input: every read is bounds-checked,
   there is no recursion on the input's nesting, no hashing of values the file controls but
   str (salted), and the columns hold at most one int64 per two input bytes.

   Each storage entry is matched as it is read with the next chunk of its tensor (torch
   writes a tensor's chunks and its entries in the same order, the entries after the chunks):
   a matched entry is kept only as its chunk's columns, so a .metadata of millions of chunks
   is held as those columns, not as a row per entry beside them.

   Returns (version, save_id, tensors, objects, planner, fqns, files, coords, chunks, storage)
   with tensors a list of (fqn, dtype, shape, first coord, chunk count, first chunk, clean)
   in file order, coords the int64 chunk rows (offsets then sizes per chunk), chunks a tuple
   of bytes columns per chunk (file id int32, offset int64, length int64, storage row
   int32; -1, 0, 0, -1 for a chunk no entry matched), and storage the entries no chunk
   matched as bytes columns (fqn id, ndim or -1, coord start, coords, file id, offset,
   length, storage row; int64) in file order. `clean`: every chunk of the tensor matched an
   entry, in strictly ascending offsets, and no other entry names it, so its chunk columns
   say all of it. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define MAX_DIMS 64
#define RECENT 4096  /* a tensor's fqn and the field names are fetched over and over */
#define NAMES (1 << 16)  /* every rank's file name is read once per tensor: 10k+ ranks without collisions */
#define EARLY 1024  /* memo slots below this (the classes and field names, memoized first) are found directly */
#define LITERAL 64  /* strings up to this long are looked up by their bytes before they are decoded */

enum { K_STR = 1, K_GLOBAL, K_LAYOUT, K_MEMFMT, K_PROPS, K_BYTES };  /* what a kept memo slot holds */
enum {
    G_METADATA = 1, G_TSM, G_BSM, G_CHUNK, G_PROPS, G_INDEX, G_STMETA, G_INFO,
    G_SIZE, G_DTYPE, G_GET_LAYOUT, G_MEMFMT, G_PATH
};

enum {
    F_OFFSETS, F_SIZES, F_PROPERTIES, F_SIZE, F_CHUNKS, F_FQN, F_OFFSET, F_INDEX, F_RELATIVE_PATH, F_LENGTH, F_TRANSFORM_DESCRIPTORS, F_CHECKPOINT_ID, F_SAVE_ID, F_LOAD_ID, F_MODULES, F_STATE_DICT_METADATA, F_PLANNER_DATA, F_STORAGE_DATA, F_STORAGE_META, F_VERSION, F_COUNT
};
static const char *const FIELD_NAMES[] = {
    "offsets", "sizes", "properties", "size", "chunks", "fqn", "offset", "index", "relative_path", "length", "transform_descriptors", "checkpoint_id", "save_id", "load_id", "modules", "state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version",
};

typedef struct { uint32_t index; uint8_t kind, gid; PyObject *obj; } Kept;  /* memo slots < 2**31: one per input byte at most */
typedef struct { PyObject *bytes; int64_t *v; Py_ssize_t n, cap; } I64;  /* a bytearray's int64s */
typedef struct { PyObject *bytes; int32_t *v; Py_ssize_t n, cap; } I32;  /* a bytearray's int32s */
typedef struct { PyObject *name; Py_ssize_t id; } Named;  /* a str and the id it was given */

typedef struct {
    const unsigned char *p;
    Py_ssize_t n, i;
    uint64_t memo_count;
    Kept *kept;
    Py_ssize_t nkept, capkept;
    PyObject *strings, *dtypes, *tensors, *objects, *planner, *fqn_ids, *fqns, *file_ids, *files, *seen;
    PyObject *version, *save_id, *last_planner_key;
    I64 coords, st_fqn, st_ndim, st_cstart, st_coords, st_file, st_off, st_len, st_row;
    I32 ch_file, ch_row;  /* per chunk: the matched entry's file id and storage row, or -1 */
    I64 ch_off, ch_len;  /* per chunk: the matched entry's offset and length */
    I64 t_first, t_count, t_ndim, t_chunk0, t_cursor, t_fqn;  /* per tensor: coords, chunks, entries matched */
    I32 fqn_tensor;  /* per fqn id: its tensor's number, or -1 */
    I32 st_log;  /* per storage entry: the tensor it matched a chunk of, or -1 (undone by restore) */
    Py_ssize_t rows;  /* storage entries read */
    Py_ssize_t budget, fail_at;
    int failed;
    Py_ssize_t released, release_every;  /* pages of a mapped input handed back so far; 0: never */
    Py_ssize_t recent[RECENT];  /* kept entry + 1 of recently fetched slots, by slot % RECENT */
    Py_ssize_t early[EARLY];  /* kept entry + 1 of the slots below EARLY */
    PyObject *literals[NAMES];  /* recently read ASCII strings (interned, alive), by a hash of their bytes */
    Named fqn_cache[NAMES], file_cache[NAMES];  /* fqn and file ids by the str's address */
    PyObject *fields[F_COUNT];  /* the field names the records have, interned before the scan */
} P;

typedef struct {
    Py_ssize_t i, nkept, coords, storage, tensors, objects, planner, chunks, rows, st_coords;
    uint64_t memo_count;
} Snapshot;

static const char *METADATA_MODULES[] = {
    "torch.distributed.checkpoint.metadata",
    "torch.distributed._shard.sharded_tensor.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint._fsspec_filesystem",
    NULL,
};

static int fail(P *p) {
    if (!p->failed) p->fail_at = p->i;
    p->failed = 1;
    return -1;
}

static int push64(I64 *a, int64_t v) {
    if (a->n == a->cap) {
        Py_ssize_t cap = a->cap ? a->cap * 2 : 4096;
        if (!a->bytes && !(a->bytes = PyByteArray_FromStringAndSize(NULL, 0))) return -1;
        if (PyByteArray_Resize(a->bytes, cap * (Py_ssize_t)sizeof(int64_t))) return -1;
        a->v = (int64_t *)PyByteArray_AS_STRING(a->bytes);
        a->cap = cap;
    }
    a->v[a->n++] = v;
    return 0;
}

static int push32(I32 *a, int32_t v) {
    if (a->n == a->cap) {
        Py_ssize_t cap = a->cap ? a->cap * 2 : 4096;
        if (!a->bytes && !(a->bytes = PyByteArray_FromStringAndSize(NULL, 0))) return -1;
        if (PyByteArray_Resize(a->bytes, cap * (Py_ssize_t)sizeof(int32_t))) return -1;
        a->v = (int32_t *)PyByteArray_AS_STRING(a->bytes);
        a->cap = cap;
    }
    a->v[a->n++] = v;
    return 0;
}

/* the opcode at the cursor after any FRAMEs (checked as the loader does), or -1 at the end */
static int peek(P *p) {
    while (p->i < p->n && p->p[p->i] == 0x95) {
        if (p->n - p->i < 9) return -1;
        uint64_t count = 0;
        for (int k = 7; k >= 0; k--) count = (count << 8) | p->p[p->i + 1 + k];
        if (count > (uint64_t)(p->n - p->i - 9)) return -1;
        p->i += 9;
    }
    return p->i < p->n ? p->p[p->i] : -1;
}

static int take(P *p, int opcode) {
    if (peek(p) != opcode) return 0;
    p->i++;
    return 1;
}

static int expect(P *p, int opcode) { return take(p, opcode) ? 0 : fail(p); }

static int need(P *p, Py_ssize_t count) { return p->n - p->i >= count ? 0 : fail(p); }

static uint64_t le(const unsigned char *at, int width) {
    uint64_t value = 0;
    for (int k = width - 1; k >= 0; k--) value = (value << 8) | at[k];
    return value;
}

/* memoize what was just built if the next opcode says so: MEMOIZE, or a PUT of the next slot;
   `kind` 0 keeps nothing (fetching that slot later makes the scan give up) */
static int memo(P *p, int kind, int gid, PyObject *obj) {
    int op = peek(p);
    uint64_t slot;
    if (op == 0x94) {
        p->i++;
    } else if (op == 'q' || op == 'r') {
        int width = op == 'q' ? 1 : 4;
        if (need(p, 1 + width)) return -1;
        slot = le(p->p + p->i + 1, width);
        if (slot != p->memo_count) return fail(p);
        p->i += 1 + width;
    } else {
        return 0;
    }
    if (p->memo_count >= UINT32_MAX) return fail(p);
    if (kind) {
        if (p->nkept == p->capkept) {
            Py_ssize_t cap = p->capkept ? p->capkept * 2 : 256;
            Kept *grown = PyMem_Realloc(p->kept, (size_t)cap * sizeof(Kept));
            if (!grown) { PyErr_NoMemory(); return -1; }
            p->kept = grown;
            p->capkept = cap;
        }
        if (p->memo_count < EARLY) p->early[p->memo_count] = p->nkept + 1;
        Kept *k = &p->kept[p->nkept++];
        k->index = (uint32_t)p->memo_count;
        k->kind = kind;
        k->gid = gid;
        k->obj = obj;
        Py_XINCREF(obj);
    }
    p->memo_count++;
    return 0;
}

/* the kept memo entry of `slot` by a search of them all (remembered in `recent`), or NULL */
static Kept *search_slot(P *p, uint64_t slot) {
    Py_ssize_t lo = 0, hi = p->nkept;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (p->kept[mid].index < slot) lo = mid + 1; else hi = mid;
    }
    if (lo == p->nkept || p->kept[lo].index != slot) return NULL;
    p->recent[slot % RECENT] = lo + 1;
    return &p->kept[lo];
}

/* the kept memo entry of `slot`, or NULL */
static inline Kept *lookup_slot(P *p, uint64_t slot) {
    Py_ssize_t hit = slot < EARLY ? p->early[slot] - 1 : p->recent[slot % RECENT] - 1;
    if (hit >= 0 && hit < p->nkept && p->kept[hit].index == slot) return &p->kept[hit];
    if (slot < EARLY) {
        hit = p->recent[slot % RECENT] - 1;
        if (hit >= 0 && hit < p->nkept && p->kept[hit].index == slot) return &p->kept[hit];
    }
    return search_slot(p, slot);
}

/* the kept memo entry a BINGET or LONG_BINGET at the cursor fetches (not consumed), or NULL */
static Kept *lookup(P *p) {
    int op = peek(p);
    int width = op == 'h' ? 1 : op == 'j' ? 4 : 0;
    if (!width || p->n - p->i < 1 + width) return NULL;
    return lookup_slot(p, le(p->p + p->i + 1, width));
}

/* the kept memo entry a BINGET or LONG_BINGET at the cursor fetches (consumed), or NULL */
static Kept *fetched(P *p) {
    Kept *k = lookup(p);
    if (k) p->i += p->p[p->i] == 'h' ? 2 : 5;
    return k;
}

/* consume the GET at the cursor that `lookup` just found */
static void skip_get(P *p) { p->i += p->p[p->i] == 'h' ? 2 : 5; }

static int is_get(P *p) { int op = peek(p); return op == 'h' || op == 'j'; }

/* the kept entry of `kind` a GET at the cursor fetches (consumed), or NULL (nothing consumed) */
static Kept *fetched_kind(P *p, int kind) {
    Kept *k = is_get(p) ? lookup(p) : NULL;
    if (!k || k->kind != kind) return NULL;
    skip_get(p);
    return k;
}

static int is_text(P *p) { int op = peek(p); return op == 0x8c || op == 'X'; }

static int is_int(P *p) { int op = peek(p); return op == 'K' || op == 'M' || op == 'J' || op == 0x8a; }

/* a new reference to the string at the cursor (a literal, memoized as the pickle says, or a
   fetched one), or NULL */
static PyObject *text(P *p) {
    int op = peek(p);
    if (op == 'h' || op == 'j') {
        Kept *k = fetched(p);
        if (!k || k->kind != K_STR) { fail(p); return NULL; }
        Py_INCREF(k->obj);
        return k->obj;
    }
    Py_ssize_t width = op == 0x8c ? 1 : op == 'X' ? 4 : 0;
    if (!width || need(p, 1 + width)) { fail(p); return NULL; }
    uint64_t count = le(p->p + p->i + 1, (int)width);
    if (count > (uint64_t)(p->n - p->i - 1 - width)) { fail(p); return NULL; }
    const char *start = (const char *)p->p + p->i + 1 + width;
    PyObject **literal = NULL;
    if (count <= LITERAL) {  /* a string read before (a rank's file name, say): the same object */
        uint64_t hash = count;
        if (count >= 8) {  /* its first, middle and last 8 bytes: rank numbers are in the first */
            uint64_t first, middle, last;
            memcpy(&first, start, 8);
            memcpy(&middle, start + count / 2 - 4, 8);
            memcpy(&last, start + count - 8, 8);
            hash = (hash ^ first) * 0x9E3779B97F4A7C15u;
            hash = (hash ^ middle) * 0xC2B2AE3D27D4EB4Fu;
            hash = ((hash ^ last) * 0x165667B19E3779F9u) >> 32;
        } else {
            for (uint64_t k = 0; k < count; k++) hash = (hash ^ (unsigned char)start[k]) * 16777619u;
        }
        literal = &p->literals[hash % NAMES];
        PyObject *known = *literal;
        if (known && PyUnicode_GET_LENGTH(known) == (Py_ssize_t)count && !memcmp(PyUnicode_1BYTE_DATA(known), start, count)) {
            Py_INCREF(known);
            p->i += 1 + width + (Py_ssize_t)count;
            if (memo(p, K_STR, 0, known)) { Py_DECREF(known); return NULL; }
            return known;
        }
    }
    PyObject *decoded = PyUnicode_DecodeUTF8(start, (Py_ssize_t)count, "surrogatepass");
    if (!decoded) {
        if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) { PyErr_Clear(); fail(p); }
        return NULL;
    }
    PyObject *interned = PyDict_SetDefault(p->strings, decoded, decoded);
    Py_XINCREF(interned);
    Py_DECREF(decoded);
    if (!interned) return NULL;
    if (literal && PyUnicode_IS_ASCII(interned)) *literal = interned;  /* alive in the intern table */
    p->i += 1 + width + (Py_ssize_t)count;
    if (memo(p, K_STR, 0, interned)) { Py_DECREF(interned); return NULL; }
    return interned;
}

static int integer(P *p, int64_t *out) {
    int op = peek(p);
    const unsigned char *at = p->p + p->i + 1;
    if (op == 'K') {
        if (need(p, 2)) return -1;
        *out = at[0];
        p->i += 2;
    } else if (op == 'M') {
        if (need(p, 3)) return -1;
        *out = (int64_t)le(at, 2);
        p->i += 3;
    } else if (op == 'J') {
        if (need(p, 5)) return -1;
        *out = (int32_t)(uint32_t)le(at, 4);
        p->i += 5;
    } else if (op == 0x8a) {
        if (need(p, 2)) return -1;
        int width = at[0];
        if (width > 8 || need(p, 2 + width)) return fail(p);
        uint64_t value = le(at + 1, width);
        if (width && width < 8 && (at[width] & 0x80)) value |= ~(uint64_t)0 << (8 * width);
        *out = (int64_t)value;
        p->i += 2 + width;
    } else {
        return fail(p);
    }
    return 0;
}

static int named(PyObject *text_object, const char *want) {
    const char *have = PyUnicode_AsUTF8(text_object);
    if (!have) { PyErr_Clear(); return 0; }
    return strcmp(have, want) == 0;
}

/* which of the names this scan knows `module`.`name` is (0: none; then the scan gives up) */
static int classify(P *p, PyObject *module, PyObject *name) {
    const char *m = PyUnicode_AsUTF8(module), *n = PyUnicode_AsUTF8(name);
    if (!m || !n) { PyErr_Clear(); return 0; }
    for (int k = 0; METADATA_MODULES[k]; k++) {
        if (strcmp(m, METADATA_MODULES[k]) != 0) continue;
        if (!strcmp(n, "Metadata")) return G_METADATA;
        if (!strcmp(n, "TensorStorageMetadata")) return G_TSM;
        if (!strcmp(n, "BytesStorageMetadata")) return G_BSM;
        if (!strcmp(n, "ChunkStorageMetadata")) return G_CHUNK;
        if (!strcmp(n, "TensorProperties")) return G_PROPS;
        if (!strcmp(n, "MetadataIndex")) return G_INDEX;
        if (!strcmp(n, "StorageMeta")) return G_STMETA;
        if (!strcmp(n, "_StorageInfo")) return G_INFO;
        if (!strcmp(n, "_MEM_FORMAT_ENCODING")) return G_MEMFMT;
        return 0;
    }
    if (!strcmp(m, "torch")) {
        if (!strcmp(n, "Size")) return G_SIZE;
        int known = PySet_Contains(p->dtypes, name);
        return known == 1 ? G_DTYPE : 0;
    }
    if (!strcmp(m, "torch.serialization") && !strcmp(n, "_get_layout")) return G_GET_LAYOUT;
    /* OLMo-core's writer pickles its own copy of torch's _StorageInfo (safepickle/allowlist.py) */
    if (!strcmp(m, "olmo_core.distributed.checkpoint.filesystem") && !strcmp(n, "_StorageInfo")) return G_INFO;
    if (!strcmp(m, "pathlib") && (!strcmp(n, "PosixPath") || !strcmp(n, "PurePosixPath") || !strcmp(n, "Path") ||
                                  !strcmp(n, "WindowsPath") || !strcmp(n, "PureWindowsPath")))
        return G_PATH;
    return 0;
}

/* a global (GLOBAL, STACK_GLOBAL or fetched): its id; a dtype's name in *dtype (borrowed) */
static int global(P *p, PyObject **dtype) {
    int op = peek(p);
    Kept *k = op == 'h' || op == 'j' ? lookup(p) : NULL;
    if (k && k->kind == K_GLOBAL) {  /* else the module's name, fetched, then STACK_GLOBAL */
        skip_get(p);
        if (dtype) *dtype = k->obj;
        return k->gid;
    }
    PyObject *module = NULL, *name = NULL;
    if (op == 'c') {
        p->i++;
        Py_ssize_t starts[2], ends[2];
        for (int part = 0; part < 2; part++) {
            starts[part] = p->i;
            const unsigned char *line = memchr(p->p + p->i, '\n', (size_t)(p->n - p->i < 256 ? p->n - p->i : 256));
            if (!line) return fail(p);
            ends[part] = line - p->p;
            p->i = ends[part] + 1;
        }
        module = PyUnicode_DecodeASCII((const char *)p->p + starts[0], ends[0] - starts[0], "strict");
        name = module ? PyUnicode_DecodeASCII((const char *)p->p + starts[1], ends[1] - starts[1], "strict") : NULL;
        if (!name) {
            Py_XDECREF(module);
            if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) { PyErr_Clear(); return fail(p); }
            return -1;
        }
    } else {
        module = text(p);
        if (!module) return -1;
        name = text(p);
        if (!name) { Py_DECREF(module); return -1; }
        if (!take(p, 0x93)) { Py_DECREF(module); Py_DECREF(name); return fail(p); }
    }
    int gid = classify(p, module, name);
    Py_DECREF(module);
    if (!gid) { Py_DECREF(name); return fail(p); }
    int status = memo(p, K_GLOBAL, gid, gid == G_DTYPE ? name : NULL);
    if (dtype && gid == G_DTYPE) {
        if (status == 0 && p->nkept && p->kept[p->nkept - 1].obj == name) *dtype = name;  /* kept alive by the memo */
        else *dtype = PyDict_SetDefault(p->strings, name, name);                          /* by the intern table */
    }
    Py_DECREF(name);
    return status ? -1 : gid;
}

/* `cls() ` as copyreg pickles a record: the class, an empty tuple, NEWOBJ; returns its id */
static int new_object(P *p) {
    int gid = global(p, NULL);
    if (gid < 0) return -1;
    if (expect(p, ')') || expect(p, 0x81) || memo(p, 0, 0, NULL)) return -1;
    return gid;
}

/* torch.Size(tuple of ints): its dims into `dims`, their count into *ndim */
static int size(P *p, int64_t *dims, int *ndim) {
    if (global(p, NULL) != G_SIZE) return fail(p);
    int count = 0;
    if (take(p, ')')) {
        count = 0;
    } else {
        int marked = take(p, '(');
        while (is_int(p)) {
            if (count == MAX_DIMS || integer(p, &dims[count])) return fail(p);
            count++;
        }
        if (marked ? !take(p, 't') : (count < 1 || count > 3 || !take(p, 0x84 + count))) return fail(p);
        if (memo(p, 0, 0, NULL)) return -1;
    }
    if (expect(p, 0x85) || memo(p, 0, 0, NULL) || expect(p, 'R') || memo(p, 0, 0, NULL)) return -1;
    *ndim = count;
    return 0;
}

static int boolean(P *p) { return take(p, 0x88) || take(p, 0x89) ? 0 : fail(p); }

/* TensorProperties, or one fetched (a writer may share one between tensors): its dtype's
   name (borrowed) into *dtype */
static int properties(P *p, PyObject **dtype) {
    Kept *shared = fetched_kind(p, K_PROPS);
    if (shared) {
        *dtype = shared->obj;
        return *dtype ? 0 : fail(p);  /* NULL: fetched inside itself */
    }
    if (global(p, NULL) != G_PROPS || expect(p, ')') || expect(p, 0x81)) return fail(p);
    Py_ssize_t kept = p->nkept;
    if (memo(p, K_PROPS, 0, NULL) || expect(p, '(')) return fail(p);
    kept = p->nkept > kept ? kept : -1;  /* its memo entry, named once its dtype is read */
    *dtype = NULL;
    if (global(p, dtype) != G_DTYPE || !*dtype) return fail(p);
    if (!fetched_kind(p, K_LAYOUT)) {  /* `_get_layout("torch.strided")`, its result not fetched */
        if (global(p, NULL) != G_GET_LAYOUT) return fail(p);
        PyObject *layout = text(p);
        if (!layout) return -1;
        int strided = named(layout, "torch.strided");
        Py_DECREF(layout);
        if (!strided || expect(p, 0x85) || memo(p, 0, 0, NULL) || expect(p, 'R') || memo(p, K_LAYOUT, 0, NULL)) return fail(p);
    }
    if (boolean(p)) return -1;
    if (!fetched_kind(p, K_MEMFMT)) {  /* `_MEM_FORMAT_ENCODING(n)`, its result not fetched */
        int64_t format;
        if (global(p, NULL) != G_MEMFMT || integer(p, &format)) return fail(p);
        if (expect(p, 0x85) || memo(p, 0, 0, NULL) || expect(p, 'R') || memo(p, K_MEMFMT, 0, NULL)) return -1;
    }
    if (boolean(p) || expect(p, 't') || memo(p, 0, 0, NULL) || expect(p, 'b')) return fail(p);
    if (kept >= 0) {
        if (kept >= p->nkept || p->kept[kept].kind != K_PROPS) return fail(p);
        Py_INCREF(*dtype);
        p->kept[kept].obj = *dtype;
    }
    return 0;
}

static void snapshot(P *p, Snapshot *s) {
    s->i = p->i;
    s->nkept = p->nkept;
    s->memo_count = p->memo_count;
    s->coords = p->coords.n;
    s->storage = p->st_fqn.n;
    s->st_coords = p->st_coords.n;
    s->chunks = p->ch_file.n;
    s->rows = p->rows;
    s->tensors = PyList_GET_SIZE(p->tensors);
    s->objects = PyList_GET_SIZE(p->objects);
    s->planner = PyDict_GET_SIZE(p->planner);
    p->last_planner_key = NULL;
}

static int restore(P *p, Snapshot *s) {
    p->i = s->i;
    while (p->nkept > s->nkept) Py_XDECREF(p->kept[--p->nkept].obj);
    p->memo_count = s->memo_count;
    while (p->rows > s->rows) {  /* entries read since: their matches undone, latest first */
        int32_t t = p->st_log.v[--p->rows];
        if (t < 0) continue;
        int64_t c = p->t_chunk0.v[t] + --p->t_cursor.v[t];
        p->ch_file.v[c] = p->ch_row.v[c] = -1;
        p->ch_off.v[c] = p->ch_len.v[c] = 0;
    }
    p->st_log.n = s->rows;
    for (Py_ssize_t t = s->tensors; t < p->t_fqn.n; t++) p->fqn_tensor.v[p->t_fqn.v[t]] = -1;
    p->t_first.n = p->t_count.n = p->t_ndim.n = p->t_chunk0.n = p->t_cursor.n = p->t_fqn.n = s->tensors;
    p->ch_file.n = p->ch_row.n = p->ch_off.n = p->ch_len.n = s->chunks;
    p->coords.n = s->coords;
    p->st_coords.n = s->st_coords;
    p->st_fqn.n = p->st_ndim.n = p->st_cstart.n = p->st_file.n = p->st_off.n = p->st_len.n = p->st_row.n = s->storage;
    if (PyList_GET_SIZE(p->tensors) > s->tensors && PyList_SetSlice(p->tensors, s->tensors, PY_SSIZE_T_MAX, NULL)) return -1;
    if (PyList_GET_SIZE(p->objects) > s->objects && PyList_SetSlice(p->objects, s->objects, PY_SSIZE_T_MAX, NULL)) return -1;
    if (PyDict_GET_SIZE(p->planner) > s->planner && p->last_planner_key &&
        PyDict_DelItem(p->planner, p->last_planner_key)) return -1;
    p->failed = 0;
    p->fail_at = 0;
    return 0;
}

typedef int (*Item)(P *p, void *context);

/* a dict's or list's items after EMPTY_DICT / EMPTY_LIST: batches of MARK ... SETITEMS (or
   APPENDS), and a last batch of one item without MARK, told from what follows the container
   by trying it */
/* hand the pages of a mapped input well behind the cursor back to the page cache, so a
   large .metadata is never resident whole (reading them again, after a restore, maps them
   back from the file) */
static void release(P *p) {
    if (!p->release_every || p->i - p->released < 2 * p->release_every) return;
    Py_ssize_t page = sysconf(_SC_PAGESIZE), end = (p->i - p->release_every) / page * page;
    if (end > p->released && madvise((void *)(p->p + p->released), (size_t)(end - p->released), MADV_DONTNEED) == 0)
        p->released = end;
}

static int items(P *p, int batch_op, int single_op, Item item, void *context) {
    if (memo(p, 0, 0, NULL)) return -1;
    for (;;) {
        release(p);
        if (take(p, '(')) {
            while (peek(p) != batch_op) {
                if (peek(p) < 0 || item(p, context)) return fail(p);
            }
            p->i++;
            continue;
        }
        int op = peek(p);
        if (op != 0x8c && op != 'X' && op != 'h' && op != 'j' && op != 'c') return 0;  /* no item starts so */
        Snapshot s;
        snapshot(p, &s);
        if (item(p, context) == 0 && take(p, single_op)) continue;
        if (PyErr_Occurred()) return -1;
        return restore(p, &s);
    }
}

static int dict_items(P *p, Item item, void *context) {
    return expect(p, '}') ? -1 : items(p, 'u', 's', item, context);
}

static int list_items(P *p, Item item, void *context) {
    return expect(p, ']') ? -1 : items(p, 'e', 'a', item, context);
}

/* a record's state: EMPTY_DICT, its fields, BUILD */
static int record_state(P *p, Item field, void *context) {
    return dict_items(p, field, context) || expect(p, 'b') ? -1 : 0;
}

/* the key of a record's field: its position in `names` (field numbers ending with -1), each
   at most once */
static int field_name(P *p, const int *names, unsigned *seen) {
    PyObject *key = text(p);
    if (!key) return -1;
    Py_DECREF(key);  /* alive in the intern table, as every field name is */
    for (int k = 0; names[k] >= 0; k++) {
        if (key == p->fields[names[k]]) {
            if (*seen & (1u << k)) return fail(p);
            *seen |= 1u << k;
            return k;
        }
    }
    return fail(p);
}

typedef struct { unsigned seen; int64_t dims[2][MAX_DIMS]; int ndim[2]; } ChunkFields;

static int chunk_field(P *p, void *context) {
    static const int names[] = {F_OFFSETS, F_SIZES, -1};
    ChunkFields *c = context;
    int which = field_name(p, names, &c->seen);
    return which < 0 ? -1 : size(p, c->dims[which], &c->ndim[which]);
}

/* --- the fast path: a chunk or a storage entry laid out exactly as torch's pickler writes it
   (classes, field names and torch.Size fetched from the memo, MEMOIZE after each object, one
   MARK ... SETITEMS per record), read straight from the bytes at a cursor of its own. It
   accepts only what the parser above reads the same way, with the same memo slots taken;
   anything else (a FRAME, a PUT, another order of opcodes, a literal where a fetch is usual)
   consumes nothing and the parser above reads the record. */

/* the opcode `op` at *at: consumed (1) or not (0) */
static int fast_byte(P *p, Py_ssize_t *at, int op) {
    if (*at >= p->n || p->p[*at] != op) return 0;
    (*at)++;
    return 1;
}

/* the kept entry of `kind` (and `gid`, if not 0) a BINGET or LONG_BINGET at *at fetches, consumed; or NULL */
static Kept *fast_fetch(P *p, Py_ssize_t *at, int kind, int gid) {
    int op = *at < p->n ? p->p[*at] : -1, width = op == 'h' ? 1 : op == 'j' ? 4 : 0;
    if (!width || p->n - *at < 1 + width) return NULL;
    Kept *k = lookup_slot(p, le(p->p + *at + 1, width));
    if (!k || k->kind != kind || (gid && k->gid != gid)) return NULL;
    *at += 1 + width;
    return k;
}

/* an int as `integer` reads it, at *at */
static int fast_int(P *p, Py_ssize_t *at, int64_t *out) {
    int op = *at < p->n ? p->p[*at] : -1;
    Py_ssize_t left = p->n - *at;
    const unsigned char *arg = p->p + *at + 1;
    if (op == 'K' && left >= 2) { *out = arg[0]; *at += 2; return 1; }
    if (op == 'M' && left >= 3) { *out = (int64_t)le(arg, 2); *at += 3; return 1; }
    if (op == 'J' && left >= 5) { *out = (int32_t)(uint32_t)le(arg, 4); *at += 5; return 1; }
    if (op == 0x8a && left >= 2 && arg[0] <= 8 && left >= 2 + arg[0]) {
        int width = arg[0];
        uint64_t value = le(arg + 1, width);
        if (width && width < 8 && (arg[width] & 0x80)) value |= ~(uint64_t)0 << (8 * width);
        *out = (int64_t)value;
        *at += 2 + width;
        return 1;
    }
    return 0;
}

static int fast_is_int(P *p, Py_ssize_t at) {
    int op = at < p->n ? p->p[at] : -1;
    return op == 'K' || op == 'M' || op == 'J' || op == 0x8a;
}

/* `size` at *at; *memos counts the MEMOIZEs read */
static int fast_size(P *p, Py_ssize_t *at, uint64_t *memos, int64_t *dims, int *ndim) {
    if (!fast_fetch(p, at, K_GLOBAL, G_SIZE)) return 0;
    int count = 0;
    if (!fast_byte(p, at, ')')) {
        int marked = fast_byte(p, at, '(');
        while (fast_is_int(p, *at)) {
            if (count == MAX_DIMS || !fast_int(p, at, &dims[count])) return 0;
            count++;
        }
        if (marked ? !fast_byte(p, at, 't') : (count < 1 || count > 3 || !fast_byte(p, at, 0x84 + count))) return 0;
        *memos += fast_byte(p, at, 0x94);
    }
    if (!fast_byte(p, at, 0x85)) return 0;
    *memos += fast_byte(p, at, 0x94);
    if (!fast_byte(p, at, 'R')) return 0;
    *memos += fast_byte(p, at, 0x94);
    *ndim = count;
    return 1;
}

/* `cls()` of a fetched class `gid` and the start of its state: `)`, NEWOBJ, `}`, MARK */
static int fast_record(P *p, Py_ssize_t *at, uint64_t *memos, int gid) {
    if (!fast_fetch(p, at, K_GLOBAL, gid) || !fast_byte(p, at, ')') || !fast_byte(p, at, 0x81)) return 0;
    *memos += fast_byte(p, at, 0x94);
    if (!fast_byte(p, at, '}')) return 0;
    *memos += fast_byte(p, at, 0x94);
    return fast_byte(p, at, '(');
}

/* which of `names` (field numbers ending with -1) the field name fetched at *at is, each at most once; -1: none */
static int fast_field(P *p, Py_ssize_t *at, const int *names, unsigned *seen) {
    Kept *k = fast_fetch(p, at, K_STR, 0);
    for (int n = 0; k && names[n] >= 0; n++) {
        if (k->obj != p->fields[names[n]]) continue;
        if (*seen & (1u << n)) return -1;
        *seen |= 1u << n;
        return n;
    }
    return -1;
}

/* the end of a record's state: SETITEMS, BUILD */
static int fast_end(P *p, Py_ssize_t *at) { return fast_byte(p, at, 'u') && fast_byte(p, at, 'b'); }

/* take the fast path's cursor and memo count (1), or leave the parser's (0: the count would pass its limit) */
static int fast_commit(P *p, Py_ssize_t at, uint64_t memos) {
    if (p->memo_count + memos >= UINT32_MAX) return 0;
    p->memo_count += memos;
    p->i = at;
    return 1;
}

/* a ChunkStorageMetadata into *c: 1, the cursor past it; 0, nothing consumed */
static int fast_chunk(P *p, ChunkFields *c) {
    static const int names[] = {F_OFFSETS, F_SIZES, -1};
    Py_ssize_t at = p->i;
    uint64_t memos = 0;
    if (!fast_record(p, &at, &memos, G_CHUNK)) return 0;
    for (int k = 0; k < 2; k++) {
        int which = fast_field(p, &at, names, &c->seen);
        if (which < 0 || !fast_size(p, &at, &memos, c->dims[which], &c->ndim[which])) { c->seen = 0; return 0; }
    }
    if (!fast_end(p, &at) || !fast_commit(p, at, memos)) { c->seen = 0; return 0; }
    return 1;
}

typedef struct { int ndim; Py_ssize_t count; } ChunkList;

static int chunk(P *p, void *context) {
    ChunkList *list = context;
    ChunkFields c;  /* not zeroed whole: 1 kB a chunk; dims are read only up to ndim */
    c.seen = 0;
    c.ndim[0] = c.ndim[1] = 0;
    if (!fast_chunk(p, &c) && (new_object(p) != G_CHUNK || record_state(p, chunk_field, &c) || c.seen != 3)) return fail(p);
    if (c.ndim[0] != c.ndim[1] || (list->ndim >= 0 && c.ndim[0] != list->ndim)) return fail(p);
    list->ndim = c.ndim[0];
    if (p->coords.n + 2 * c.ndim[0] + 3 * (p->ch_file.n + 1) > p->budget || p->ch_file.n >= INT32_MAX) return fail(p);
    for (int w = 0; w < 2; w++)
        for (int d = 0; d < c.ndim[0]; d++)
            if (push64(&p->coords, c.dims[w][d])) return -1;
    if (push32(&p->ch_file, -1) || push32(&p->ch_row, -1) || push64(&p->ch_off, 0) || push64(&p->ch_len, 0)) return -1;
    list->count++;
    return 0;
}

typedef struct { unsigned seen; PyObject *dtype; int64_t shape[MAX_DIMS]; int ndim; ChunkList chunks; } TensorFields;

static int register_tensor(P *p, PyObject *fqn, Py_ssize_t first, Py_ssize_t count, int ndim, Py_ssize_t chunk0);

static int tensor_field(P *p, void *context) {
    static const int names[] = {F_PROPERTIES, F_SIZE, F_CHUNKS, -1};
    TensorFields *t = context;
    int which = field_name(p, names, &t->seen);
    if (which == 0) return properties(p, &t->dtype);
    if (which == 1) return size(p, t->shape, &t->ndim);
    if (which == 2) return list_items(p, chunk, &t->chunks);
    return -1;
}

/* `cls()` of a state_dict_metadata entry; a BytesStorageMetadata is kept in the memo (it
   has no fields, so a writer may share one) */
static int bytes_or_tensor(P *p) {
    int gid = global(p, NULL);
    if (gid < 0 || expect(p, ')') || expect(p, 0x81)) return -1;
    return memo(p, gid == G_BSM ? K_BYTES : 0, 0, NULL) ? -1 : gid;
}

/* a state_dict_metadata entry: fqn -> TensorStorageMetadata or BytesStorageMetadata */
static int entry(P *p, void *context) {
    (void)context;
    PyObject *fqn = text(p);
    if (!fqn) return -1;
    int seen = PySet_Contains(p->seen, fqn);
    int gid = seen ? -1 : fetched_kind(p, K_BYTES) ? G_BSM : bytes_or_tensor(p);
    if (seen || gid < 0 || PySet_Add(p->seen, fqn)) { Py_DECREF(fqn); return seen < 0 ? -1 : fail(p); }
    if (gid == G_BSM) {
        if (peek(p) == '}' && (expect(p, '}') || memo(p, 0, 0, NULL) || expect(p, 'b'))) { Py_DECREF(fqn); return -1; }
        int status = PyList_Append(p->objects, fqn);
        Py_DECREF(fqn);
        return status;
    }
    if (gid != G_TSM) { Py_DECREF(fqn); return fail(p); }
    TensorFields t = {0};
    t.chunks.ndim = -1;
    Py_ssize_t first = p->coords.n, chunk0 = p->ch_file.n;
    if (record_state(p, tensor_field, &t) || t.seen != 7 || (t.chunks.count && t.chunks.ndim != t.ndim)) {
        Py_DECREF(fqn);
        return fail(p);
    }
    if (register_tensor(p, fqn, first, t.chunks.count, t.ndim, chunk0)) { Py_DECREF(fqn); return -1; }
    PyObject *shape = PyTuple_New(t.ndim);
    for (int d = 0; shape && d < t.ndim; d++) {
        PyObject *dim = PyLong_FromLongLong(t.shape[d]);
        if (!dim) { Py_CLEAR(shape); break; }
        PyTuple_SET_ITEM(shape, d, dim);
    }
    PyObject *row = shape ? Py_BuildValue("(OONnnn)", fqn, t.dtype, shape, first, t.chunks.count, chunk0) : NULL;
    Py_DECREF(fqn);
    int status = row ? PyList_Append(p->tensors, row) : -1;
    Py_XDECREF(row);
    return status;
}

/* a planner_data entry: fqn -> tuple of str and int keys */
static int nesting(P *p, void *context) {
    (void)context;
    PyObject *fqn = text(p);
    if (!fqn) return -1;
    PyObject *keys = PyList_New(0);
    int status = keys ? 0 : -1;
    if (!status && take(p, ')')) {
        /* an empty path */
    } else if (!status) {
        int marked = take(p, '(');
        while (!status && (is_text(p) || is_int(p) || is_get(p))) {
            PyObject *key = NULL;
            if (is_int(p)) {
                int64_t value;
                if (integer(p, &value) == 0) key = PyLong_FromLongLong(value); else status = -1;
            } else {
                key = text(p);
            }
            if (!key) { status = -1; break; }
            status = PyList_Append(keys, key);
            Py_DECREF(key);
        }
        Py_ssize_t count = keys ? PyList_GET_SIZE(keys) : 0;
        if (!status && (marked ? !take(p, 't') : (count < 1 || count > 3 || !take(p, 0x84 + (int)count)))) status = fail(p);
        if (!status) status = memo(p, 0, 0, NULL);
    }
    PyObject *path = status ? NULL : PyList_AsTuple(keys);
    Py_XDECREF(keys);
    if (!path) { Py_DECREF(fqn); return -1; }
    status = PyDict_SetItem(p->planner, fqn, path);
    p->last_planner_key = fqn;  /* alive in the intern table */
    Py_DECREF(fqn);
    Py_DECREF(path);
    return status;
}

static Py_ssize_t number_of(PyObject *ids, PyObject *names, PyObject *name) {
    PyObject *found = PyDict_GetItemWithError(ids, name);
    if (found) return PyLong_AsSsize_t(found);
    if (PyErr_Occurred()) return -1;
    Py_ssize_t id = PyList_GET_SIZE(names);
    PyObject *number = PyLong_FromSsize_t(id);
    if (!number || PyDict_SetItem(ids, name, number) || PyList_Append(names, name)) { Py_XDECREF(number); return -1; }
    Py_DECREF(number);
    return id;
}


/* number_of through a cache by the str's address (every string read is interned and alive) */
static Py_ssize_t id_of(Named *cache, PyObject *ids, PyObject *names, PyObject *name) {
    Named *slot = &cache[((uintptr_t)name >> 4) % NAMES];
    if (slot->name == name) return slot->id;
    Py_ssize_t id = number_of(ids, names, name);
    if (id >= 0) {
        slot->name = name;
        slot->id = id;
    }
    return id;
}

/* a tensor read from state_dict_metadata, whose storage entries `stored` matches with its chunks */
static int register_tensor(P *p, PyObject *fqn, Py_ssize_t first, Py_ssize_t count, int ndim, Py_ssize_t chunk0) {
    Py_ssize_t id = id_of(p->fqn_cache, p->fqn_ids, p->fqns, fqn);
    if (id < 0) return -1;
    while (p->fqn_tensor.n <= id)
        if (push32(&p->fqn_tensor, -1)) return -1;
    p->fqn_tensor.v[id] = (int32_t)p->t_fqn.n;
    return push64(&p->t_first, first) || push64(&p->t_count, count) || push64(&p->t_ndim, ndim) ||
           push64(&p->t_chunk0, chunk0) || push64(&p->t_cursor, 0) || push64(&p->t_fqn, id) ? -1 : 0;
}

/* the tensor whose next unmatched chunk has these offsets, or -1 */
static int32_t matching_tensor(P *p, Py_ssize_t fqn_id, const int64_t *offsets, int ndim) {
    int32_t t = fqn_id < p->fqn_tensor.n ? p->fqn_tensor.v[fqn_id] : -1;
    if (t < 0 || ndim != p->t_ndim.v[t] || p->t_cursor.v[t] >= p->t_count.v[t]) return -1;
    const int64_t *chunk = p->coords.v + p->t_first.v[t] + 2 * ndim * p->t_cursor.v[t];
    for (int d = 0; d < ndim; d++)
        if (chunk[d] != offsets[d]) return -1;
    return t;
}

typedef struct { unsigned seen; PyObject *fqn; int64_t offsets[MAX_DIMS]; int ndim; } IndexFields;

static int index_field(P *p, void *context) {
    static const int names[] = {F_FQN, F_OFFSET, F_INDEX, -1};
    IndexFields *f = context;
    int which = field_name(p, names, &f->seen);
    if (which == 0) {
        Py_XDECREF(f->fqn);
        f->fqn = text(p);
        return f->fqn ? 0 : -1;
    }
    if (which == 1) {
        if (take(p, 'N')) { f->ndim = -1; return 0; }
        return size(p, f->offsets, &f->ndim);
    }
    if (which == 2) {
        int64_t ignored;
        return take(p, 'N') ? 0 : integer(p, &ignored);
    }
    return -1;
}

typedef struct { unsigned seen; PyObject *file; int64_t offset, length; } InfoFields;

static int info_field(P *p, void *context) {
    static const int names[] = {F_RELATIVE_PATH, F_OFFSET, F_LENGTH, F_TRANSFORM_DESCRIPTORS, -1};
    InfoFields *f = context;
    int which = field_name(p, names, &f->seen);
    if (which == 0) {
        Py_XDECREF(f->file);
        f->file = text(p);
        return f->file ? 0 : -1;
    }
    if (which == 1) return integer(p, &f->offset);
    if (which == 2) return integer(p, &f->length);
    if (which == 3) {  /* None or an empty list: no transforms */
        if (take(p, 'N')) return 0;
        return expect(p, ']') || memo(p, 0, 0, NULL) ? -1 : 0;
    }
    return -1;
}

/* a string at *at on the fast path: fetched (*fetched, borrowed) or a SHORT_BINUNICODE whose
   reading `text` does when the record is taken (`fast_taken`): its place in *literal */
typedef struct { Py_ssize_t at; uint64_t memos; } Pending;  /* a literal: where, and the record's MEMOIZEs before it */

static int fast_text(P *p, Py_ssize_t *at, uint64_t *memos, PyObject **fetched, Pending *literal) {
    Kept *k = fast_fetch(p, at, K_STR, 0);
    if (k) {
        *fetched = k->obj;
        literal->at = -1;
        return 1;
    }
    if (*at >= p->n || p->p[*at] != 0x8c || p->n - *at < 2 || p->p[*at + 1] > p->n - *at - 2) return 0;
    literal->at = *at;
    literal->memos = *memos;
    *at += 2 + p->p[*at + 1];
    *memos += fast_byte(p, at, 0x94);
    *fetched = NULL;
    return 1;
}

/* a new reference to a string `fast_text` found, in a record starting at memo slot `base` */
static PyObject *fast_taken(P *p, uint64_t base, PyObject *fetched, const Pending *literal) {
    if (literal->at < 0) {
        Py_INCREF(fetched);
        return fetched;
    }
    p->i = literal->at;
    p->memo_count = base + literal->memos;
    return text(p);
}

/* a storage_data entry into *key (offsets written even when 0) and *info: 1, the cursor past it; 0, nothing consumed; -1, an
   error reading one of its strings (as `stored` would meet it) */
static int fast_stored(P *p, IndexFields *key, InfoFields *info) {
    static const int index_names[] = {F_FQN, F_OFFSET, F_INDEX, -1};
    static const int info_names[] = {F_RELATIVE_PATH, F_OFFSET, F_LENGTH, F_TRANSFORM_DESCRIPTORS, -1};
    Py_ssize_t at = p->i;
    uint64_t memos = 0;
    PyObject *fqn = NULL, *file = NULL;
    Pending fqn_at = {-1, 0}, file_at = {-1, 0};
    unsigned key_seen = 0;
    int ndim = -1;
    InfoFields f = {0};
    int64_t ignored;
    if (!fast_record(p, &at, &memos, G_INDEX)) return 0;
    while (!fast_byte(p, &at, 'u')) {
        int which = fast_field(p, &at, index_names, &key_seen);
        if (which == 0 ? !fast_text(p, &at, &memos, &fqn, &fqn_at) :
            which == 1 ? !fast_byte(p, &at, 'N') && !fast_size(p, &at, &memos, key->offsets, &ndim) :
            which == 2 ? !fast_byte(p, &at, 'N') && !fast_int(p, &at, &ignored) : 1)
            return 0;
    }
    if (!fast_byte(p, &at, 'b') || !(key_seen & 1) || !fast_record(p, &at, &memos, G_INFO)) return 0;
    while (!fast_byte(p, &at, 'u')) {
        int which = fast_field(p, &at, info_names, &f.seen);
        if (which == 0 ? !fast_text(p, &at, &memos, &file, &file_at) :
            which == 1 ? !fast_int(p, &at, &f.offset) :
            which == 2 ? !fast_int(p, &at, &f.length) :
            which == 3 ? !fast_byte(p, &at, 'N') && !(fast_byte(p, &at, ']') && (memos += fast_byte(p, &at, 0x94), 1)) : 1)
            return 0;
    }
    if (!fast_byte(p, &at, 'b') || (f.seen & 7) != 7 || p->memo_count + memos >= UINT32_MAX) return 0;
    uint64_t base = p->memo_count;
    if (!(key->fqn = fast_taken(p, base, fqn, &fqn_at))) return -1;
    if (!(info->file = fast_taken(p, base, file, &file_at))) return -1;  /* stored releases key->fqn */
    p->i = at;
    p->memo_count = base + memos;
    key->seen = key_seen;
    key->ndim = ndim;
    info->seen = f.seen;
    info->offset = f.offset;
    info->length = f.length;
    return 1;
}

/* a storage_data entry: MetadataIndex -> _StorageInfo */
static int stored(P *p, void *context) {
    (void)context;
    IndexFields key;  /* not zeroed whole: offsets are read only up to ndim */
    InfoFields info = {0};
    key.seen = 0;
    key.fqn = NULL;
    key.ndim = -1;
    int fast = fast_stored(p, &key, &info);
    if (fast < 0) { Py_XDECREF(key.fqn); return -1; }
    int status = fast || (new_object(p) == G_INDEX && record_state(p, index_field, &key) == 0 && key.fqn &&
                          new_object(p) == G_INFO && record_state(p, info_field, &info) == 0 && info.file &&
                          (info.seen & 7) == 7) ? 0 : fail(p);
    if (!status && (p->st_coords.n + (key.ndim > 0 ? key.ndim : 0) + 7 > p->budget || p->rows >= INT32_MAX)) status = fail(p);
    Py_ssize_t fqn_id = status ? -1 : id_of(p->fqn_cache, p->fqn_ids, p->fqns, key.fqn);
    Py_ssize_t file_id = fqn_id < 0 ? -1 : id_of(p->file_cache, p->file_ids, p->files, info.file);
    Py_XDECREF(key.fqn);
    Py_XDECREF(info.file);
    if (status || file_id < 0) return -1;
    if (file_id >= INT32_MAX) return fail(p);
    int32_t t = matching_tensor(p, fqn_id, key.offsets, key.ndim);
    if (push32(&p->st_log, t)) return -1;
    Py_ssize_t row = p->rows++;
    if (t >= 0) {
        int64_t c = p->t_chunk0.v[t] + p->t_cursor.v[t]++;
        p->ch_file.v[c] = (int32_t)file_id;
        p->ch_row.v[c] = (int32_t)row;
        p->ch_off.v[c] = info.offset;
        p->ch_len.v[c] = info.length;
        return 0;
    }
    if (push64(&p->st_fqn, fqn_id) || push64(&p->st_ndim, key.ndim) ||
        push64(&p->st_cstart, p->st_coords.n) || push64(&p->st_file, file_id) ||
        push64(&p->st_off, info.offset) || push64(&p->st_len, info.length) || push64(&p->st_row, row))
        return -1;
    for (int d = 0; d < key.ndim; d++)
        if (push64(&p->st_coords, key.offsets[d])) return -1;
    return 0;
}

static int module_name(P *p, void *context) {
    (void)context;
    PyObject *name = text(p);
    Py_XDECREF(name);
    return name ? 0 : -1;
}

/* StorageMeta.checkpoint_id: None, a string, or a pathlib path `cls(*parts)` */
static int path_value(P *p) {
    if (take(p, 'N')) return 0;
    Snapshot s;
    snapshot(p, &s);
    if (global(p, NULL) != G_PATH) {  /* a string (what looked like a global's module name) */
        if (PyErr_Occurred() || restore(p, &s)) return -1;
        return module_name(p, NULL);
    }
    if (!take(p, ')')) {
        int marked = take(p, '('), count = 0;
        while (is_text(p) || is_get(p)) {
            if (module_name(p, NULL)) return -1;
            count++;
        }
        if (marked ? !take(p, 't') : (count < 1 || count > 3 || !take(p, 0x84 + count))) return fail(p);
        if (memo(p, 0, 0, NULL)) return -1;
    }
    return expect(p, 'R') || memo(p, 0, 0, NULL) ? -1 : 0;
}

static int storage_meta_field(P *p, void *context) {
    static const int names[] = {F_CHECKPOINT_ID, F_SAVE_ID, F_LOAD_ID, F_MODULES, -1};
    unsigned *seen = context;
    int which = field_name(p, names, seen);
    if (which == 0) return path_value(p);
    if (which == 1 || which == 2) {
        if (take(p, 'N')) return 0;
        PyObject *value = text(p);
        if (!value) return -1;
        if (which == 1) Py_XSETREF(p->save_id, value); else Py_DECREF(value);
        return 0;
    }
    if (which == 3) return list_items(p, module_name, NULL);
    return -1;
}

static int metadata_field(P *p, void *context) {
    static const int names[] = {F_STATE_DICT_METADATA, F_PLANNER_DATA, F_STORAGE_DATA, F_STORAGE_META, F_VERSION, -1};
    unsigned *seen = context;
    int which = field_name(p, names, seen);
    if (which == 0) return dict_items(p, entry, NULL);
    if (which == 1) return take(p, 'N') ? 0 : dict_items(p, nesting, NULL);
    if (which == 2) return dict_items(p, stored, NULL);
    if (which == 3) {
        if (take(p, 'N')) return 0;
        unsigned fields = 0;
        return new_object(p) == G_STMETA && record_state(p, storage_meta_field, &fields) == 0 ? 0 : fail(p);
    }
    if (which == 4) {
        if (take(p, 'N')) return 0;
        PyObject *version = text(p);
        if (!version) return -1;
        Py_XSETREF(p->version, version);
        return 0;
    }
    return -1;
}

/* the bytearray of a column, cut to its length (a new reference) */
static PyObject *column(I64 *a) {
    if (!a->bytes) return PyByteArray_FromStringAndSize(NULL, 0);
    if (PyByteArray_Resize(a->bytes, a->n * (Py_ssize_t)sizeof(int64_t))) return NULL;
    Py_INCREF(a->bytes);
    return a->bytes;
}

static PyObject *column32(I32 *a) {
    if (!a->bytes) return PyByteArray_FromStringAndSize(NULL, 0);
    if (PyByteArray_Resize(a->bytes, a->n * (Py_ssize_t)sizeof(int32_t))) return NULL;
    Py_INCREF(a->bytes);
    return a->bytes;
}

/* append each tensor's `clean` flag to its row (see the top of the file) */
static int mark_clean(P *p) {
    Py_ssize_t count = p->t_fqn.n;
    if (PyList_GET_SIZE(p->tensors) != count) { PyErr_SetString(PyExc_RuntimeError, "_dcpscan: tensor rows out of step"); return -1; }
    char *dirty = PyMem_Calloc((size_t)count + 1, 1);
    if (!dirty) { PyErr_NoMemory(); return -1; }
    for (Py_ssize_t r = 0; r < p->st_fqn.n; r++) {  /* an entry of the tensor's fqn that matched no chunk */
        int64_t id = p->st_fqn.v[r];
        int32_t t = id < p->fqn_tensor.n ? p->fqn_tensor.v[id] : -1;
        if (t >= 0) dirty[t] = 1;
    }
    int status = 0;
    for (Py_ssize_t t = 0; t < count && !status; t++) {
        int64_t ndim = p->t_ndim.v[t], n = p->t_count.v[t];
        int clean = !dirty[t] && p->t_cursor.v[t] == n;
        const int64_t *at = p->coords.v + p->t_first.v[t];
        for (int64_t k = 1; clean && k < n; k++) {  /* offsets strictly ascending, as tuples compare */
            const int64_t *a = at + 2 * ndim * (k - 1), *b = at + 2 * ndim * k;
            int64_t d = 0;
            while (d < ndim && a[d] == b[d]) d++;
            clean = d < ndim && a[d] < b[d];
        }
        PyObject *row = PyList_GET_ITEM(p->tensors, t);
        PyObject *flagged = PyTuple_New(PyTuple_GET_SIZE(row) + 1);
        if (!flagged) { status = -1; break; }
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(row); k++) {
            PyObject *item = PyTuple_GET_ITEM(row, k);
            Py_INCREF(item);
            PyTuple_SET_ITEM(flagged, k, item);
        }
        PyTuple_SET_ITEM(flagged, PyTuple_GET_SIZE(row), PyBool_FromLong(clean));
        status = PyList_SetItem(p->tensors, t, flagged);
    }
    PyMem_Free(dirty);
    return status;
}

static PyObject *result(P *p) {
    if (mark_clean(p)) return NULL;
    PyObject *chunks = Py_BuildValue("(NNNN)", column32(&p->ch_file), column(&p->ch_off), column(&p->ch_len),
                                     column32(&p->ch_row));
    if (!chunks) return NULL;
    PyObject *storage = Py_BuildValue("(NNNNNNNN)", column(&p->st_fqn), column(&p->st_ndim), column(&p->st_cstart),
                                      column(&p->st_coords), column(&p->st_file), column(&p->st_off), column(&p->st_len),
                                      column(&p->st_row));
    if (!storage) { Py_DECREF(chunks); return NULL; }
    return Py_BuildValue("(OOOOOOONNN)", p->version ? p->version : Py_None, p->save_id ? p->save_id : Py_None,
                         p->tensors, p->objects, p->planner, p->fqns, p->files, column(&p->coords), chunks, storage);
}

static int parse(P *p) {
    if (p->n < 2 || p->p[0] != 0x80 || p->p[1] < 2 || p->p[1] > 5) return fail(p);
    p->i = 2;
    unsigned fields = 0;
    if (new_object(p) != G_METADATA || record_state(p, metadata_field, &fields) || !(fields & 1)) return fail(p);
    if (expect(p, '.') || p->i != p->n) return fail(p);
    return 0;
}

static PyObject *scan(PyObject *module, PyObject *args) {
    (void)module;
    Py_buffer view;
    PyObject *dtypes;
    int where = 0, mapped = 0;
    if (!PyArg_ParseTuple(args, "y*O!|pp", &view, &PyFrozenSet_Type, &dtypes, &where, &mapped)) return NULL;
    P *p = PyMem_Calloc(1, sizeof(P));  /* 2.5 MB of caches: not on the stack */
    if (!p) { PyBuffer_Release(&view); return PyErr_NoMemory(); }
    p->p = view.buf;
    p->n = view.len;
    p->budget = view.len / 2 + 64;
    p->release_every = mapped && (uintptr_t)view.buf % (uintptr_t)sysconf(_SC_PAGESIZE) == 0 ? 32 << 20 : 0;
    p->dtypes = dtypes;
    PyObject *out = NULL;
    p->strings = PyDict_New();
    p->tensors = PyList_New(0);
    p->objects = PyList_New(0);
    p->planner = PyDict_New();
    p->fqn_ids = PyDict_New();
    p->fqns = PyList_New(0);
    p->file_ids = PyDict_New();
    p->files = PyList_New(0);
    p->seen = PySet_New(NULL);
    for (int k = 0; p->strings && k < F_COUNT; k++) {
        p->fields[k] = PyUnicode_InternFromString(FIELD_NAMES[k]);
        if (!p->fields[k] || PyDict_SetItem(p->strings, p->fields[k], p->fields[k])) Py_CLEAR(p->strings);
    }
    if (p->strings && p->tensors && p->objects && p->planner && p->fqn_ids && p->fqns && p->file_ids && p->files && p->seen) {
        int status = parse(p);
        if (status == 0) out = result(p);
        else if (!PyErr_Occurred()) out = where ? PyLong_FromSsize_t(p->fail_at) : Py_NewRef(Py_None);
    }
    while (p->nkept) Py_XDECREF(p->kept[--p->nkept].obj);
    PyMem_Free(p->kept);
    I64 *columns[] = {&p->coords, &p->st_fqn, &p->st_ndim, &p->st_cstart, &p->st_coords, &p->st_file, &p->st_off, &p->st_len,
                      &p->st_row, &p->ch_off, &p->ch_len, &p->t_first, &p->t_count, &p->t_ndim, &p->t_chunk0, &p->t_cursor, &p->t_fqn};
    for (size_t k = 0; k < sizeof columns / sizeof columns[0]; k++) Py_XDECREF(columns[k]->bytes);
    I32 *narrow[] = {&p->ch_file, &p->ch_row, &p->fqn_tensor, &p->st_log};
    for (size_t k = 0; k < sizeof narrow / sizeof narrow[0]; k++) Py_XDECREF(narrow[k]->bytes);
    Py_XDECREF(p->strings); Py_XDECREF(p->tensors); Py_XDECREF(p->objects); Py_XDECREF(p->planner);
    for (int k = 0; k < F_COUNT; k++) Py_XDECREF(p->fields[k]);
    Py_XDECREF(p->fqn_ids); Py_XDECREF(p->fqns); Py_XDECREF(p->file_ids); Py_XDECREF(p->files); Py_XDECREF(p->seen);
    Py_XDECREF(p->version); Py_XDECREF(p->save_id);
    PyMem_Free(p);
    PyBuffer_Release(&view);
    return out;
}

/* `json_rows(rows, ndim, offsets, sizes, file, offset, length, nbytes, files, last=False)`: the JSON
   of a tensor's chunks as inspect writes them, `{"offsets": [...], "sizes": [...], "file": ...,
   "offset": ..., "length": ..., "bytes": ...}` per row, each row followed by ", " but the last
   when `last` (what `json.dumps` writes for the row's dict: ints in decimal, a file id < 0 is no
   entry: `null` file, offset and length). `offsets` and `sizes` are int64 (rows, ndim) arrays,
   the others int64 per row (`file` int32 or int64), in any strides (a table's views of the
   scanned columns are read where they are); `files` a tuple of bytes (each file's name as
   JSON). */
static const char DIGIT_PAIRS[] =
    "00010203040506070809101112131415161718192021222324252627282930313233343536373839"
    "40414243444546474849505152535455565758596061626364656667686970717273747576777879"
    "8081828384858687888990919293949596979899";

/* `value` in decimal at `at`, two digits a step from the end back; past it returned */
static char *put_int(char *at, int64_t value) {
    uint64_t magnitude = value < 0 ? 0 - (uint64_t)value : (uint64_t)value, bound = 10;
    int count = 1;
    if (value < 0) *at++ = '-';
    while (count < 20 && magnitude >= bound) { count++; bound *= 10; }
    char *end = at + count;
    while (magnitude >= 100) {
        unsigned pair = (unsigned)(magnitude % 100);
        magnitude /= 100;
        end -= 2;
        memcpy(end, DIGIT_PAIRS + 2 * pair, 2);
    }
    if (magnitude >= 10) memcpy(end - 2, DIGIT_PAIRS + 2 * magnitude, 2);
    else end[-1] = (char)('0' + magnitude);
    return at + count;
}

static char *put_text(char *at, const char *text, Py_ssize_t length) {
    memcpy(at, text, (size_t)length);
    return at + length;
}

#define PUT(at, literal) put_text(at, literal, (Py_ssize_t)sizeof(literal) - 1)

/* a column read in place: `rows` items (any number for rows < 0) (times `width` for a 2-d one) of 4 or 8 bytes, any strides */
typedef struct { Py_buffer view; const char *buf; Py_ssize_t row_step, item_step; int itemsize; } Column;

static int column_view(PyObject *object, Column *c, Py_ssize_t rows, Py_ssize_t width, int allow32, const char *who) {
    if (PyObject_GetBuffer(object, &c->view, PyBUF_STRIDES | PyBUF_FORMAT)) return -1;
    Py_buffer *v = &c->view;
    const char *format = v->format ? v->format : "B";
    char kind = format[strlen(format) - 1];
    int wide = v->itemsize == 8 && (kind == 'l' || kind == 'q');
    int narrow = allow32 && v->itemsize == 4 && (kind == 'i' || (kind == 'l' && sizeof(long) == 4));
    int shaped = width < 0 ? v->ndim == 1 && (rows < 0 || v->shape[0] == rows)
                           : v->ndim == 2 && v->shape[0] == rows && v->shape[1] == width;
    if (!(wide || narrow) || !shaped || (strlen(format) > 1 && format[0] != '@' && format[0] != '=')) {  /* native order only */
        PyBuffer_Release(v);
        PyErr_Format(PyExc_ValueError, "%s: columns must be int64 arrays of matching rows", who);
        return -1;
    }
    c->buf = v->buf;
    c->itemsize = (int)v->itemsize;
    c->row_step = v->strides ? v->strides[0] : v->itemsize * (width < 0 ? 1 : width);
    c->item_step = width < 0 ? 0 : v->strides ? v->strides[1] : v->itemsize;
    return 0;
}

static inline int64_t column_at(const Column *c, Py_ssize_t row, Py_ssize_t item) {
    const char *at = c->buf + row * c->row_step + item * c->item_step;
    if (c->itemsize == 4) { int32_t v; memcpy(&v, at, 4); return v; }
    int64_t v;
    memcpy(&v, at, 8);
    return v;
}

static PyObject *json_rows(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *objects[6], *files;
    Py_ssize_t rows, ndim;
    int last = 0;
    if (!PyArg_ParseTuple(args, "nnOOOOOOO!|p", &rows, &ndim, &objects[0], &objects[1], &objects[2], &objects[3],
                          &objects[4], &objects[5], &PyTuple_Type, &files, &last))
        return NULL;
    if (rows < 0 || ndim < 0 || ndim > MAX_DIMS) { PyErr_SetString(PyExc_ValueError, "json_rows: bad shape"); return NULL; }
    Py_ssize_t nfiles = PyTuple_GET_SIZE(files), longest = 4;  /* null */
    for (Py_ssize_t k = 0; k < nfiles; k++) {
        PyObject *name = PyTuple_GET_ITEM(files, k);
        if (!PyBytes_Check(name)) { PyErr_SetString(PyExc_TypeError, "json_rows: files must be bytes"); return NULL; }
        if (PyBytes_GET_SIZE(name) > longest) longest = PyBytes_GET_SIZE(name);
    }
    Column columns[6];
    int got = 0;
    for (; got < 6; got++)
        if (column_view(objects[got], &columns[got], rows, got < 2 ? ndim : -1, got == 2, "json_rows")) break;
    PyObject *out = NULL;
    /* a row: its fixed text (80 bytes), 2 * ndim + 3 ints of at most 20 characters and their
       separators, and the longest file text */
    Py_ssize_t per_row = 80 + (2 * ndim + 3) * 20 + 4 * ndim + longest;
    if (got == 6 && rows > (PY_SSIZE_T_MAX - 1) / per_row) PyErr_NoMemory();
    else if (got == 6) out = PyBytes_FromStringAndSize(NULL, rows * per_row);
    if (out) {
        const Column *offsets = &columns[0], *sizes = &columns[1], *file = &columns[2], *offset = &columns[3],
                     *length = &columns[4], *nbytes = &columns[5];
        char *start = PyBytes_AS_STRING(out), *at = start;
        for (Py_ssize_t r = 0; r < rows && out; r++) {
            at = PUT(at, "{\"offsets\": [");
            for (Py_ssize_t d = 0; d < ndim; d++) {
                if (d) at = PUT(at, ", ");
                at = put_int(at, column_at(offsets, r, d));
            }
            at = PUT(at, "], \"sizes\": [");
            for (Py_ssize_t d = 0; d < ndim; d++) {
                if (d) at = PUT(at, ", ");
                at = put_int(at, column_at(sizes, r, d));
            }
            at = PUT(at, "], \"file\": ");
            int64_t id = column_at(file, r, 0);
            if (id >= nfiles) {
                PyErr_SetString(PyExc_IndexError, "json_rows: a file id past the files");
                Py_CLEAR(out);
                break;
            }
            if (id < 0) {
                at = PUT(at, "null, \"offset\": null, \"length\": null");
            } else {
                PyObject *name = PyTuple_GET_ITEM(files, id);
                at = put_text(at, PyBytes_AS_STRING(name), PyBytes_GET_SIZE(name));
                at = put_int(PUT(at, ", \"offset\": "), column_at(offset, r, 0));
                at = put_int(PUT(at, ", \"length\": "), column_at(length, r, 0));
            }
            at = PUT(put_int(PUT(at, ", \"bytes\": "), column_at(nbytes, r, 0)), "}");
            if (!last || r + 1 < rows) at = PUT(at, ", ");
        }
        if (out) _PyBytes_Resize(&out, at - start);
    }
    while (got) PyBuffer_Release(&columns[--got].view);
    return out;
}

/* `file_sums(rows, file, length, nbytes, bins, group, counts, lengths, totals)`: inspect's bytes per
   data file and group, added in place: for each row with a file id >= 0, bin `bins[file] + group`
   gets one count, the row's `length` and its `nbytes` (int64 columns, `file` int32 or int64,
   any strides; `bins` int64 per file id; the three totals writable C-contiguous int64). False,
   with the totals partly added, when a sum would pass int64: the caller adds in Python. */
static PyObject *file_sums(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *objects[7];
    Py_ssize_t rows, group;
    if (!PyArg_ParseTuple(args, "nOOOOnOOO", &rows, &objects[0], &objects[1], &objects[2], &objects[3], &group,
                          &objects[4], &objects[5], &objects[6]))
        return NULL;
    Column columns[4];
    Py_buffer totals[3];
    int got = 0, held = 0;
    for (; got < 4; got++)
        if (column_view(objects[got], &columns[got], got < 3 ? rows : -1, -1, got == 0, "file_sums")) break;
    for (; got == 4 && held < 3; held++) {
        if (PyObject_GetBuffer(objects[4 + held], &totals[held], PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT)) break;
        const char *format = totals[held].format ? totals[held].format : "B";
        if (totals[held].itemsize != 8 || strchr("lq", format[strlen(format) - 1]) == NULL ||
            totals[held].len != totals[0].len) {
            PyBuffer_Release(&totals[held]);
            PyErr_SetString(PyExc_ValueError, "file_sums: totals must be int64 arrays of one length");
            break;
        }
    }
    PyObject *out = NULL;
    if (got == 4 && held == 3) {
        Py_ssize_t nbins = totals[0].len / 8, nfiles = columns[3].view.shape[0];
        int64_t *counts = totals[0].buf, *lengths = totals[1].buf, *sums = totals[2].buf;
        int exact = 1;
        out = Py_True;
        for (Py_ssize_t r = 0; r < rows && out; r++) {
            int64_t id = column_at(&columns[0], r, 0);
            if (id < 0) continue;
            int64_t bin = id < nfiles ? column_at(&columns[3], id, 0) + group : -1;
            if (bin < 0 || bin >= nbins) {
                PyErr_SetString(PyExc_IndexError, "file_sums: a file id past the bins");
                out = NULL;
                break;
            }
            counts[bin] += 1;
            exact &= !__builtin_add_overflow(lengths[bin], column_at(&columns[1], r, 0), &lengths[bin]);
            exact &= !__builtin_add_overflow(sums[bin], column_at(&columns[2], r, 0), &sums[bin]);
        }
        if (out) out = exact ? Py_True : Py_False;
        Py_XINCREF(out);
    }
    while (held) PyBuffer_Release(&totals[--held]);
    while (got) PyBuffer_Release(&columns[--got].view);
    return out;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS,
     "scan(data, dtypes, where=False, mapped=False) -> columns of a DCP .metadata pickle as torch writes it, or None (see the module source)"},
    {"json_rows", json_rows, METH_VARARGS,
     "json_rows(rows, ndim, offsets, sizes, file, offset, length, nbytes, files, last=False) -> the JSON of inspect's chunk rows, each followed by ', ' (but the last, when last)"},
    {"file_sums", file_sums, METH_VARARGS,
     "file_sums(rows, file, length, nbytes, bins, group, counts, lengths, totals) -> True, or False when a sum passed int64 (see the module source)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_dcpscan", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__dcpscan(void) { return PyModule_Create(&module); }
