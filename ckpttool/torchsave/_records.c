/* Build torch.save records of one tensor each, end to end, at C speed (reshard's Records).

   `assemble(out, source, kinds, positions, layouts, first, limit)` writes records `first`,
   `first + 1`, ... into the writable buffer `out` until at least `limit` bytes are written
   or the records end, and returns (next record, bytes written). Record i is
   `layouts[kinds[i]]`'s head, the data (its `data_length` bytes at `positions[i]` of
   `source`) and the tail for the data's CRC-32, exactly as `torchsave.record.RecordLayout`
   builds them in Python:

   layouts[k] = (head, data_length, segments, fields, crcs_before, crcs_after), where
   segments are the tail template's 6 pieces between its 5 CRC-dependent fields and fields
   says which value goes after each segment: 0 the data's CRC-32 (little-endian uint32),
   1 the serialization id (40 decimal digits of the little-endian 128-bit blake2b digest of
   crcs_before + the data's CRC + crcs_after), 2 the CRC-32 of that id.

   Every position and length is checked against the buffers before anything is written; the
   records are built without the GIL. BLAKE2b is RFC 7693's (digest 16 bytes, no key).

   `spans(files, offsets, kinds, lengths, read_gap, read_span, gap_budget)` is
   `record_writes.source_spans_in_python` over the columns of a Records operation: which
   coalesced spans of the source files hold the records' data, and where each record's is
   (a record whose file is "" reads nothing: span 0, start 0).

   `match(block, starts, runs)` compares the words of many records in a block with those of
   a parsed layout (`record.ParsedRecords.match_block`).

   `encode_rows(spec, rows, starts)` encodes `.metadata`'s chunk and storage rows straight from
   their int64 columns: pickle ints, torch.Size tuples, memo fetches (`dcp.writer`). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <zlib.h>

/* ---- BLAKE2b (RFC 7693) ---- */

static const uint64_t blake2b_iv[8] = {
    0x6A09E667F3BCC908ULL, 0xBB67AE8584CAA73BULL, 0x3C6EF372FE94F82BULL, 0xA54FF53A5F1D36F1ULL,
    0x510E527FADE682D1ULL, 0x9B05688C2B3E6C1FULL, 0x1F83D9ABFB41BD6BULL, 0x5BE0CD19137E2179ULL};

static const uint8_t blake2b_sigma[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

#define ROTR64(x, n) (((x) >> (n)) | ((x) << (64 - (n))))
#define MIX(a, b, c, d, x, y)              \
    do {                                   \
        v[a] = v[a] + v[b] + (x);          \
        v[d] = ROTR64(v[d] ^ v[a], 32);    \
        v[c] = v[c] + v[d];                \
        v[b] = ROTR64(v[b] ^ v[c], 24);    \
        v[a] = v[a] + v[b] + (y);          \
        v[d] = ROTR64(v[d] ^ v[a], 16);    \
        v[c] = v[c] + v[d];                \
        v[b] = ROTR64(v[b] ^ v[c], 63);    \
    } while (0)

static uint64_t load64(const uint8_t *p) {
    uint64_t x;
    memcpy(&x, p, 8);  /* little-endian hosts only: record_layout refuses big-endian ones */
    return x;
}

static void blake2b_compress(uint64_t h[8], const uint8_t block[128], uint64_t counted, int last) {
    uint64_t v[16], m[16];
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = blake2b_iv[i];
    }
    v[12] ^= counted;  /* the high word of the 128-bit counter stays 0: inputs are short */
    if (last)
        v[14] = ~v[14];
    for (int i = 0; i < 16; i++)
        m[i] = load64(block + 8 * i);
    for (int r = 0; r < 12; r++) {
        const uint8_t *s = blake2b_sigma[r];
        MIX(0, 4, 8, 12, m[s[0]], m[s[1]]);
        MIX(1, 5, 9, 13, m[s[2]], m[s[3]]);
        MIX(2, 6, 10, 14, m[s[4]], m[s[5]]);
        MIX(3, 7, 11, 15, m[s[6]], m[s[7]]);
        MIX(0, 5, 10, 15, m[s[8]], m[s[9]]);
        MIX(1, 6, 11, 12, m[s[10]], m[s[11]]);
        MIX(2, 7, 8, 13, m[s[12]], m[s[13]]);
        MIX(3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; i++)
        h[i] ^= v[i] ^ v[i + 8];
}

/* the 16-byte unkeyed BLAKE2b digest of `data` */
static void blake2b_16(const uint8_t *data, size_t length, uint8_t out[16]) {
    uint64_t h[8];
    uint8_t block[128];
    memcpy(h, blake2b_iv, sizeof h);
    h[0] ^= 0x01010000ULL ^ 16;
    size_t at = 0;
    while (length - at > 128) {
        blake2b_compress(h, data + at, (uint64_t)(at + 128), 0);
        at += 128;
    }
    memset(block, 0, sizeof block);
    memcpy(block, data + at, length - at);
    blake2b_compress(h, block, (uint64_t)length, 1);
    memcpy(out, h, 16);
}

/* `archive.serialization_id_from`: b"%040d" % int.from_bytes(digest, "little") */
static void serialization_id(const uint8_t digest[16], char out[40]) {
    unsigned __int128 value = 0;
    for (int i = 15; i >= 0; i--)
        value = (value << 8) | digest[i];
    for (int i = 39; i >= 0; i--) {
        out[i] = (char)('0' + (int)(value % 10));
        value /= 10;
    }
}

/* ---- records ---- */

#define SEGMENTS 6
#define FIELDS 5
#define MAX_CRCS 1024  /* bytes of the other entries' packed CRC-32s (a tensor record has 4 or 5) */

typedef struct {
    const char *head;
    Py_ssize_t head_length;
    Py_ssize_t data_length;
    const char *segment[SEGMENTS];
    Py_ssize_t segment_length[SEGMENTS];
    int field[FIELDS];
    uint8_t crcs[MAX_CRCS + 4];  /* crcs_before, 4 bytes for the data's CRC, crcs_after */
    Py_ssize_t crcs_before, crcs_length;
    Py_ssize_t length;  /* the whole record */
} Kind;

static int bytes_of(PyObject *object, const char **data, Py_ssize_t *length) {
    if (!PyBytes_Check(object)) {
        PyErr_SetString(PyExc_TypeError, "a record layout's parts are bytes");
        return -1;
    }
    *data = PyBytes_AS_STRING(object);
    *length = PyBytes_GET_SIZE(object);
    return 0;
}

static int read_kind(PyObject *layout, Kind *kind) {
    PyObject *head, *segments, *fields, *before, *after;
    Py_ssize_t data_length;
    if (!PyArg_ParseTuple(layout, "SnO!O!SS", &head, &data_length, &PyTuple_Type, &segments, &PyTuple_Type, &fields,
                          &before, &after))
        return -1;
    if (PyTuple_GET_SIZE(segments) != SEGMENTS || PyTuple_GET_SIZE(fields) != FIELDS || data_length < 0) {
        PyErr_SetString(PyExc_ValueError, "a record layout has 6 tail segments and 5 fields");
        return -1;
    }
    kind->head = PyBytes_AS_STRING(head);
    kind->head_length = PyBytes_GET_SIZE(head);
    kind->data_length = data_length;
    Py_ssize_t length = kind->head_length + data_length;
    for (int i = 0; i < SEGMENTS; i++) {
        if (bytes_of(PyTuple_GET_ITEM(segments, i), &kind->segment[i], &kind->segment_length[i]) < 0)
            return -1;
        length += kind->segment_length[i];
    }
    for (int i = 0; i < FIELDS; i++) {
        long field = PyLong_AsLong(PyTuple_GET_ITEM(fields, i));
        if (field == -1 && PyErr_Occurred())
            return -1;
        if (field < 0 || field > 2) {
            PyErr_SetString(PyExc_ValueError, "a tail field is 0, 1 or 2");
            return -1;
        }
        kind->field[i] = (int)field;
        length += field == 1 ? 40 : 4;
    }
    Py_ssize_t nbefore = PyBytes_GET_SIZE(before), nafter = PyBytes_GET_SIZE(after);
    if (nbefore + nafter > MAX_CRCS) {
        PyErr_SetString(PyExc_ValueError, "too many entries in a record layout");
        return -1;
    }
    memcpy(kind->crcs, PyBytes_AS_STRING(before), nbefore);
    memcpy(kind->crcs + nbefore + 4, PyBytes_AS_STRING(after), nafter);
    kind->crcs_before = nbefore;
    kind->crcs_length = nbefore + 4 + nafter;
    kind->length = length;
    return 0;
}

/* the values of a sequence of ints as a new int64 array (NULL and an exception if not) */
static int64_t *int_array(PyObject *sequence, Py_ssize_t *count) {
    PyObject *fast = PySequence_Fast(sequence, "a sequence of ints");
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    int64_t *values = PyMem_Malloc(sizeof(int64_t) * (size_t)(n ? n : 1));
    if (values == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        values[i] = PyLong_AsLongLong(items[i]);
        if (values[i] == -1 && PyErr_Occurred()) {
            PyMem_Free(values);
            Py_DECREF(fast);
            return NULL;
        }
    }
    Py_DECREF(fast);
    *count = n;
    return values;
}

static char *put_record(char *at, const Kind *kind, const uint8_t *data) {
    uint8_t crcs[MAX_CRCS + 4], digest[16];
    char identity[40];
    uint32_t crc = (uint32_t)crc32_z(0L, data, (z_size_t)kind->data_length);
    memcpy(crcs, kind->crcs, (size_t)kind->crcs_length);
    memcpy(crcs + kind->crcs_before, &crc, 4);
    blake2b_16(crcs, (size_t)kind->crcs_length, digest);
    serialization_id(digest, identity);
    uint32_t identity_crc = (uint32_t)crc32(0L, (const Bytef *)identity, 40);
    memcpy(at, kind->head, (size_t)kind->head_length);
    at += kind->head_length;
    memcpy(at, data, (size_t)kind->data_length);
    at += kind->data_length;
    for (int i = 0; i < FIELDS; i++) {
        memcpy(at, kind->segment[i], (size_t)kind->segment_length[i]);
        at += kind->segment_length[i];
        switch (kind->field[i]) {
        case 0: memcpy(at, &crc, 4); at += 4; break;
        case 1: memcpy(at, identity, 40); at += 40; break;
        default: memcpy(at, &identity_crc, 4); at += 4; break;
        }
    }
    memcpy(at, kind->segment[FIELDS], (size_t)kind->segment_length[FIELDS]);
    return at + kind->segment_length[FIELDS];
}

static PyObject *assemble(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer out, source;
    PyObject *kinds_given, *positions_given, *layouts, *result = NULL;
    Py_ssize_t first, limit, count = 0, counted = 0;
    int64_t *kinds = NULL, *positions = NULL;
    Kind *table = NULL;
    if (!PyArg_ParseTuple(args, "w*y*OOO!nn", &out, &source, &kinds_given, &positions_given, &PyTuple_Type, &layouts,
                          &first, &limit))
        return NULL;
    Py_ssize_t nkinds = PyTuple_GET_SIZE(layouts);
    table = PyMem_Malloc(sizeof(Kind) * (size_t)(nkinds ? nkinds : 1));
    if (table == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < nkinds; k++)
        if (read_kind(PyTuple_GET_ITEM(layouts, k), &table[k]) < 0)
            goto done;
    if ((kinds = int_array(kinds_given, &count)) == NULL || (positions = int_array(positions_given, &counted)) == NULL)
        goto done;
    if (counted != count || first < 0 || first > count) {
        PyErr_SetString(PyExc_ValueError, "kinds and positions differ in length, or first is out of range");
        goto done;
    }
    /* check every record this call may write before writing any */
    Py_ssize_t stop = first, planned = 0;
    while (stop < count && planned < limit) {
        int64_t k = kinds[stop], at = positions[stop];
        if (k < 0 || k >= nkinds) {
            PyErr_Format(PyExc_ValueError, "record %zd: kind %lld of %zd", stop, (long long)k, nkinds);
            goto done;
        }
        if (at < 0 || at > source.len || table[k].data_length > source.len - at) {
            PyErr_Format(PyExc_ValueError, "record %zd: data at %lld runs past the source buffer", stop, (long long)at);
            goto done;
        }
        planned += table[k].length;
        stop++;
    }
    if (planned > out.len) {
        PyErr_Format(PyExc_ValueError, "%zd bytes of records do not fit the %zd-byte output buffer", planned, out.len);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    char *at = out.buf;
    for (Py_ssize_t i = first; i < stop; i++)
        at = put_record(at, &table[kinds[i]], (const uint8_t *)source.buf + positions[i]);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("nn", stop, planned);
done:
    PyMem_Free(kinds);
    PyMem_Free(positions);
    PyMem_Free(table);
    PyBuffer_Release(&out);
    PyBuffer_Release(&source);
    return result;
}

/* ---- source spans ---- */

typedef struct {
    Py_ssize_t file;  /* rank of the file's name among the distinct names */
    int64_t offset;
    Py_ssize_t index;
} Run;

/* firsts[i] = first and seconds[i] = second, as new ints (-1 and an exception if one cannot be made) */
static int set_pair(PyObject *firsts, PyObject *seconds, Py_ssize_t i, long long first, long long second) {
    PyObject *a = PyLong_FromLongLong(first), *b = PyLong_FromLongLong(second);
    if (a == NULL || b == NULL) {
        Py_XDECREF(a);
        Py_XDECREF(b);
        return -1;
    }
    PyList_SET_ITEM(firsts, i, a);
    PyList_SET_ITEM(seconds, i, b);
    return 0;
}

/* append (file, start, end) to spans (-1 and an exception if it cannot) */
static int append_span(PyObject *spans, PyObject *file, int64_t start, int64_t end) {
    PyObject *span = Py_BuildValue("(OLL)", file, (long long)start, (long long)end);
    if (span == NULL || PyList_Append(spans, span) < 0) {
        Py_XDECREF(span);
        return -1;
    }
    Py_DECREF(span);
    return 0;
}

static int run_order(const void *a, const void *b) {
    const Run *x = a, *y = b;
    if (x->file != y->file)
        return x->file < y->file ? -1 : 1;
    if (x->offset != y->offset)
        return x->offset < y->offset ? -1 : 1;
    return x->index < y->index ? -1 : (x->index > y->index);
}

/* spans(files, offsets, kinds, lengths, read_gap, read_span, gap_budget) ->
   (spans, span_of, start_in): record_writes.source_spans for columns (see there) */
static PyObject *spans(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *files_given, *offsets_given, *kinds_given, *lengths_given, *result = NULL;
    long long read_gap, read_span, budget;
    int64_t *offsets = NULL, *kinds = NULL, *lengths = NULL;
    Run *runs = NULL;
    PyObject *names = NULL, *files = NULL, *found = NULL, *span_of = NULL, *start_in = NULL;
    Py_ssize_t count = 0, counted = 0, nkinds = 0;
    if (!PyArg_ParseTuple(args, "OOOOLLL", &files_given, &offsets_given, &kinds_given, &lengths_given, &read_gap,
                          &read_span, &budget))
        return NULL;
    if ((files = PySequence_Fast(files_given, "a sequence of file names")) == NULL)
        goto done;
    if ((offsets = int_array(offsets_given, &count)) == NULL || (kinds = int_array(kinds_given, &counted)) == NULL ||
        (lengths = int_array(lengths_given, &nkinds)) == NULL)
        goto done;
    if (counted != count || PySequence_Fast_GET_SIZE(files) != count) {
        PyErr_SetString(PyExc_ValueError, "the columns differ in length");
        goto done;
    }
    /* the distinct names, sorted: a record's file is its name's rank among them */
    if ((names = PyDict_New()) == NULL)
        goto done;
    PyObject **file = PySequence_Fast_ITEMS(files);
    for (Py_ssize_t i = 0; i < count; i++)
        if (PyDict_SetDefault(names, file[i], Py_None) == NULL)
            goto done;
    PyObject *sorted = PyDict_Keys(names);
    if (sorted == NULL || PyList_Sort(sorted) < 0) {
        Py_XDECREF(sorted);
        goto done;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(sorted); i++) {
        PyObject *rank = PyLong_FromSsize_t(i);
        if (rank == NULL || PyDict_SetItem(names, PyList_GET_ITEM(sorted, i), rank) < 0) {
            Py_XDECREF(rank);
            Py_DECREF(sorted);
            goto done;
        }
        Py_DECREF(rank);
    }
    Py_DECREF(sorted);
    runs = PyMem_Malloc(sizeof(Run) * (size_t)(count ? count : 1));
    if (runs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (kinds[i] < 0 || kinds[i] >= nkinds) {
            PyErr_Format(PyExc_ValueError, "record %zd: kind %lld of %zd", i, (long long)kinds[i], nkinds);
            goto done;
        }
        runs[i].file = PyLong_AsSsize_t(PyDict_GetItem(names, file[i]));
        runs[i].offset = offsets[i];
        runs[i].index = i;
    }
    qsort(runs, (size_t)count, sizeof(Run), run_order);
    if ((found = PyList_New(0)) == NULL || (span_of = PyList_New(count)) == NULL || (start_in = PyList_New(count)) == NULL)
        goto done;
    Py_ssize_t current = -1;  /* the index of the record whose file the open span reads */
    int64_t start = 0, end = 0;
    for (Py_ssize_t n = 0; n < count; n++) {
        Py_ssize_t i = runs[n].index;
        if (PyUnicode_Check(file[i]) && PyUnicode_GET_LENGTH(file[i]) == 0) {  /* an empty chunk: no data */
            if (set_pair(span_of, start_in, i, 0, 0) < 0)
                goto done;
            continue;
        }
        int64_t at = offsets[i], stop = at + lengths[kinds[i]];
        int64_t gap = at > end ? at - end : 0;  /* runs that overlap (a run read twice) join at no cost */
        if (current >= 0 && runs[n].file == runs[current].file && gap <= read_gap &&
            (stop > end ? stop : end) - start <= read_span && gap <= budget) {
            budget -= gap;
            if (stop > end)
                end = stop;
        } else {
            if (current >= 0 && append_span(found, file[runs[current].index], start, end) < 0)
                goto done;
            current = n;
            start = at;
            end = stop;
        }
        if (set_pair(span_of, start_in, i, (long long)PyList_GET_SIZE(found), (long long)(at - start)) < 0)
            goto done;
    }
    if (current >= 0 && append_span(found, file[runs[current].index], start, end) < 0)
        goto done;
    result = PyTuple_Pack(3, found, span_of, start_in);
done:
    Py_XDECREF(files);
    Py_XDECREF(names);
    Py_XDECREF(found);
    Py_XDECREF(span_of);
    Py_XDECREF(start_in);
    PyMem_Free(offsets);
    PyMem_Free(kinds);
    PyMem_Free(lengths);
    PyMem_Free(runs);
    return result;
}

/* ---- record headers compared ---- */

/* match(block, starts, runs) -> bytes: per start, 1 when the record there holds the words
   `ParsedRecords.match_block` compares: for each run (first word, end word, expected words,
   mask words or None), the little-endian uint64 words first..end-1 from the start, under
   the mask, equal the expected ones; else 0. Raises IndexError for a word past the block. */
static PyObject *match(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer block, starts_given;
    PyObject *runs, *result = NULL;
    if (!PyArg_ParseTuple(args, "y*y*O!", &block, &starts_given, &PyList_Type, &runs))
        return NULL;
    Py_ssize_t nruns = PyList_GET_SIZE(runs), count = starts_given.len / 8;
    Py_buffer *expected = PyMem_Calloc((size_t)(nruns ? nruns : 1), sizeof(Py_buffer));
    Py_buffer *masks = PyMem_Calloc((size_t)(nruns ? nruns : 1), sizeof(Py_buffer));
    Py_ssize_t *first = PyMem_Calloc((size_t)(nruns ? nruns : 1), sizeof(Py_ssize_t));
    Py_ssize_t *end = PyMem_Calloc((size_t)(nruns ? nruns : 1), sizeof(Py_ssize_t));
    int *masked = PyMem_Calloc((size_t)(nruns ? nruns : 1), sizeof(int));
    Py_ssize_t got = 0, reach = 0;
    if (expected == NULL || masks == NULL || first == NULL || end == NULL || masked == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (starts_given.len % 8) {
        PyErr_SetString(PyExc_ValueError, "starts are int64");
        goto done;
    }
    for (; got < nruns; got++) {
        PyObject *run = PyList_GET_ITEM(runs, got), *mask;
        if (!PyArg_ParseTuple(run, "nny*O", &first[got], &end[got], &expected[got], &mask))
            goto done;
        masked[got] = mask != Py_None;
        if (masked[got] && PyObject_GetBuffer(mask, &masks[got], PyBUF_SIMPLE) < 0) {
            PyBuffer_Release(&expected[got]);
            goto done;
        }
        Py_ssize_t words = end[got] - first[got];
        if (first[got] < 0 || words < 0 || expected[got].len != words * 8 || (masked[got] && masks[got].len != words * 8)) {
            PyErr_SetString(PyExc_ValueError, "a run's expected and mask words are end - first words");
            PyBuffer_Release(&expected[got]);
            if (masked[got])
                PyBuffer_Release(&masks[got]);
            goto done;
        }
        if (end[got] * 8 > reach)
            reach = end[got] * 8;
    }
    const int64_t *starts = starts_given.buf;
    for (Py_ssize_t n = 0; n < count; n++)
        if (starts[n] < 0 || starts[n] > block.len - reach) {
            PyErr_Format(PyExc_IndexError, "a record at %lld: its words run past the block", (long long)starts[n]);
            goto done;
        }
    result = PyBytes_FromStringAndSize(NULL, count);
    if (result == NULL)
        goto done;
    uint8_t *same = (uint8_t *)PyBytes_AS_STRING(result);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t n = 0; n < count; n++) {
        const uint8_t *record = (const uint8_t *)block.buf + starts[n];
        int equal = 1;
        for (Py_ssize_t r = 0; r < nruns && equal; r++) {
            const uint8_t *want = expected[r].buf, *bits = masked[r] ? masks[r].buf : NULL;
            for (Py_ssize_t w = first[r]; w < end[r]; w++) {
                uint64_t word = load64(record + 8 * w), wanted = load64(want + 8 * (w - first[r]));
                if (bits != NULL)
                    word &= load64(bits + 8 * (w - first[r]));
                if (word != wanted) {
                    equal = 0;
                    break;
                }
            }
        }
        same[n] = (uint8_t)equal;
    }
    Py_END_ALLOW_THREADS
done:
    for (Py_ssize_t r = 0; r < got; r++) {
        PyBuffer_Release(&expected[r]);
        if (masked[r])
            PyBuffer_Release(&masks[r]);
    }
    PyMem_Free(expected);
    PyMem_Free(masks);
    PyMem_Free(first);
    PyMem_Free(end);
    PyMem_Free(masked);
    PyBuffer_Release(&block);
    PyBuffer_Release(&starts_given);
    return result;
}

/* ---- .metadata rows encoded from int64 columns ---- */

/* pickle opcodes (Lib/pickle.py) */
#define OP_MARK '('
#define OP_BININT 'J'
#define OP_BININT1 'K'
#define OP_BININT2 'M'
#define OP_LONG1 '\x8a'
#define OP_TUPLE 't'
#define OP_EMPTY_TUPLE ')'
#define OP_TUPLE1 '\x85'
#define OP_TUPLE2 '\x86'
#define OP_TUPLE3 '\x87'

enum { PART_FIXED = -1, PART_INT = 0, PART_SIZE = 1, PART_FETCH = 2 };

typedef struct {
    int tag;
    const char *fixed;  /* PART_FIXED */
    Py_ssize_t fixed_length;
    Py_buffer values;  /* PART_INT (rows,); PART_SIZE (rows, width); PART_FETCH: which entry (rows,) */
    Py_buffer ndim;  /* PART_SIZE: how many of a row's values its tuple holds (rows,) */
    int held;  /* 1: values held, 2: ndim too */
    Py_ssize_t width;  /* PART_SIZE: values per row */
    Py_ssize_t entries;  /* PART_FETCH */
    const char **entry;  /* PART_FETCH: the table's bytes (borrowed from the spec) */
    Py_ssize_t *entry_length;
} Part;

/* the bytes of `int_bytes(value)` (torchsave.pickle): BININT1, BININT2, BININT or LONG1 */
static Py_ssize_t int_length(int64_t value) {
    if (value >= 0 && value <= 0xFF)
        return 2;
    if (value >= 0 && value <= 0xFFFF)
        return 3;
    if (value >= -0x80000000LL && value <= 0x7FFFFFFFLL)
        return 5;
    Py_ssize_t n = 1;  /* encode_long: the fewest two's-complement bytes */
    while (n < 8 && (value >= ((int64_t)1 << (8 * n - 1)) || value < -((int64_t)1 << (8 * n - 1))))
        n++;
    return 2 + n;
}

static char *put_int(char *at, int64_t value) {
    Py_ssize_t length = int_length(value), n;
    uint64_t bits = (uint64_t)value;
    switch (length) {
    case 2: *at++ = OP_BININT1; n = 1; break;
    case 3: *at++ = OP_BININT2; n = 2; break;
    case 5: *at++ = OP_BININT; n = 4; break;
    default: *at++ = OP_LONG1; n = length - 2; *at++ = (char)n; break;
    }
    for (Py_ssize_t i = 0; i < n; i++, bits >>= 8)
        *at++ = (char)(bits & 0xFF);
    return at;
}

static const char tuple_opcode[4] = {OP_EMPTY_TUPLE, OP_TUPLE1, OP_TUPLE2, OP_TUPLE3};

/* an int64 column of `rows` values (ndim 1) or rows of `width` values (ndim 2, width -1: any) */
static int int64_buffer(PyObject *object, Py_buffer *view, Py_ssize_t rows, int ndim, const char *what) {
    if (PyObject_GetBuffer(object, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s is not a C-contiguous int64 array", what);
        return -1;
    }
    const char *format = view->format ? view->format : "B";
    if (*format == '<' || *format == '=' || *format == '@')
        format++;
    if (view->itemsize != 8 || (strcmp(format, "l") && strcmp(format, "q")) || view->ndim != ndim ||
        view->shape[0] != rows) {
        PyErr_Format(PyExc_ValueError, "%s is not an int64 array of %zd rows (ndim %d)", what, rows, ndim);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static void release_parts(Part *parts, Py_ssize_t count) {
    for (Py_ssize_t i = 0; i < count; i++) {
        if (parts[i].held & 1)
            PyBuffer_Release(&parts[i].values);
        if (parts[i].held & 2)
            PyBuffer_Release(&parts[i].ndim);
        PyMem_Free(parts[i].entry);
        PyMem_Free(parts[i].entry_length);
    }
    PyMem_Free(parts);
}

/* one part of the spec, checked: its buffers are held (part->held) even when it fails */
static int read_part(PyObject *item, Py_ssize_t rows, Part *part) {
    if (PyBytes_Check(item)) {
        part->tag = PART_FIXED;
        part->fixed = PyBytes_AS_STRING(item);
        part->fixed_length = PyBytes_GET_SIZE(item);
        return 0;
    }
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) < 2) {
        PyErr_SetString(PyExc_ValueError, "a row part is bytes or a (kind, ...) tuple");
        return -1;
    }
    if (!PyLong_Check(PyTuple_GET_ITEM(item, 0))) {
        PyErr_SetString(PyExc_ValueError, "a row part's kind is an int");
        return -1;
    }
    long tag = PyLong_AsLong(PyTuple_GET_ITEM(item, 0));
    if (tag == -1 && PyErr_Occurred())
        return -1;
    Py_ssize_t size = PyTuple_GET_SIZE(item);
    part->tag = (int)tag;
    if (tag == PART_INT && size == 2) {
        if (int64_buffer(PyTuple_GET_ITEM(item, 1), &part->values, rows, 1, "an int column") < 0)
            return -1;
        part->held = 1;
        return 0;
    }
    if (tag == PART_SIZE && size == 3) {
        if (int64_buffer(PyTuple_GET_ITEM(item, 1), &part->values, rows, 2, "a size column") < 0)
            return -1;
        part->held = 1;
        if (int64_buffer(PyTuple_GET_ITEM(item, 2), &part->ndim, rows, 1, "an ndim column") < 0)
            return -1;
        part->held = 3;
        part->width = part->values.shape[1];
        const int64_t *ndim = part->ndim.buf;
        for (Py_ssize_t r = 0; r < rows; r++)
            if (ndim[r] < 0 || ndim[r] > part->width) {
                PyErr_Format(PyExc_ValueError, "row %zd: ndim %lld of %zd values", r, (long long)ndim[r], part->width);
                return -1;
            }
        return 0;
    }
    if (tag == PART_FETCH && size == 3) {
        PyObject *table = PyTuple_GET_ITEM(item, 1);
        if (!PyTuple_Check(table)) {
            PyErr_SetString(PyExc_ValueError, "a fetch table is a tuple of bytes");
            return -1;
        }
        Py_ssize_t entries = PyTuple_GET_SIZE(table);
        part->entries = entries;
        part->entry = PyMem_Malloc(sizeof(char *) * (size_t)(entries ? entries : 1));
        part->entry_length = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(entries ? entries : 1));
        if (part->entry == NULL || part->entry_length == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t e = 0; e < entries; e++) {
            PyObject *entry = PyTuple_GET_ITEM(table, e);
            if (!PyBytes_Check(entry)) {
                PyErr_SetString(PyExc_ValueError, "a fetch table is a tuple of bytes");
                return -1;
            }
            part->entry[e] = PyBytes_AS_STRING(entry);
            part->entry_length[e] = PyBytes_GET_SIZE(entry);
        }
        if (int64_buffer(PyTuple_GET_ITEM(item, 2), &part->values, rows, 1, "a fetch column") < 0)
            return -1;
        part->held = 1;
        const int64_t *which = part->values.buf;
        for (Py_ssize_t r = 0; r < rows; r++)
            if (which[r] < 0 || which[r] >= entries) {
                PyErr_Format(PyExc_ValueError, "row %zd: fetch %lld of a table of %zd", r, (long long)which[r], entries);
                return -1;
            }
        return 0;
    }
    PyErr_Format(PyExc_ValueError, "unknown row part kind %ld (or wrong length %zd)", tag, size);
    return -1;
}

/* the bytes of one part for row r */
static Py_ssize_t part_length(const Part *part, Py_ssize_t r) {
    switch (part->tag) {
    case PART_FIXED:
        return part->fixed_length;
    case PART_INT:
        return int_length(((const int64_t *)part->values.buf)[r]);
    case PART_SIZE: {
        int64_t ndim = ((const int64_t *)part->ndim.buf)[r];
        const int64_t *value = (const int64_t *)part->values.buf + r * part->width;
        Py_ssize_t length = ndim > 3 ? 2 : 1;  /* MARK ... TUPLE, or TUPLE1/2/3 (EMPTY_TUPLE) */
        for (int64_t d = 0; d < ndim; d++)
            length += int_length(value[d]);
        return length;
    }
    default:
        return part->entry_length[((const int64_t *)part->values.buf)[r]];
    }
}

static char *put_part(char *at, const Part *part, Py_ssize_t r) {
    switch (part->tag) {
    case PART_FIXED:
        if (part->fixed_length <= 16) {  /* most are a few bytes: a call to memcpy is most of the time */
            for (Py_ssize_t k = 0; k < part->fixed_length; k++)
                at[k] = part->fixed[k];
        } else {
            memcpy(at, part->fixed, (size_t)part->fixed_length);
        }
        return at + part->fixed_length;
    case PART_INT:
        return put_int(at, ((const int64_t *)part->values.buf)[r]);
    case PART_SIZE: {
        int64_t ndim = ((const int64_t *)part->ndim.buf)[r];
        const int64_t *value = (const int64_t *)part->values.buf + r * part->width;
        if (ndim > 3)
            *at++ = OP_MARK;
        for (int64_t d = 0; d < ndim; d++)
            at = put_int(at, value[d]);
        *at++ = ndim > 3 ? OP_TUPLE : tuple_opcode[ndim];
        return at;
    }
    default: {
        int64_t e = ((const int64_t *)part->values.buf)[r];
        memcpy(at, part->entry[e], (size_t)part->entry_length[e]);
        return at + part->entry_length[e];
    }
    }
}

/* encode_rows(spec, rows, starts) -> bytes: for each row r in turn, each part of `spec` for
   it: bytes as they are; (0, values): int_bytes(values[r]); (1, values, ndim): the tuple of
   values[r, :ndim[r]] as `Writer._tuple` writes it (MARK ... TUPLE past 3 items); (2, table,
   which): table[which[r]]. Columns are C-contiguous int64 of `rows` rows, every ndim and
   index in range (ValueError otherwise, before anything is written). `starts`, when not None,
   is a writable int64 buffer of rows + 1 values: it gets where each row starts, then the end.
   `dcp.writer`'s .metadata chunk and storage rows. */
static PyObject *encode_rows(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *given, *spec, *starts_given, *result = NULL;
    Py_ssize_t rows, count, made = 0;
    Py_buffer starts = {0};
    int have_starts = 0;
    int64_t *row_start = NULL;
    if (!PyArg_ParseTuple(args, "O!nO", &PyList_Type, &given, &rows, &starts_given))
        return NULL;
    if (rows < 0) {
        PyErr_SetString(PyExc_ValueError, "rows is negative");
        return NULL;
    }
    /* a tuple of the parts: it holds every part (and so every byte string the parts point
       into) until the end, whatever happens to the list */
    if ((spec = PyList_AsTuple(given)) == NULL)
        return NULL;
    count = PyTuple_GET_SIZE(spec);
    Part *parts = PyMem_Calloc((size_t)(count ? count : 1), sizeof(Part));
    if (parts == NULL) {
        Py_DECREF(spec);
        return PyErr_NoMemory();
    }
    for (; made < count; made++)
        if (read_part(PyTuple_GET_ITEM(spec, made), rows, &parts[made]) < 0) {
            made++;
            goto done;
        }
    if (starts_given != Py_None) {
        if (PyObject_GetBuffer(starts_given, &starts, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0)
            goto done;
        have_starts = 1;
        const char *format = starts.format ? starts.format : "B";
        if (*format == '<' || *format == '=' || *format == '@')
            format++;
        if (starts.itemsize != 8 || (strcmp(format, "l") && strcmp(format, "q")) || starts.ndim != 1 ||
            starts.shape[0] != rows + 1) {
            PyErr_Format(PyExc_ValueError, "starts is not a writable int64 array of %zd values", rows + 1);
            goto done;
        }
    }
    /* the rows' bytes, counted before writing: the fixed parts' once */
    Py_ssize_t total = 0, fixed = 0;
    for (Py_ssize_t i = 0; i < count; i++)
        if (parts[i].tag == PART_FIXED) {
            if (parts[i].fixed_length > PY_SSIZE_T_MAX - fixed)
                goto too_long;
            fixed += parts[i].fixed_length;
        }
    if (rows && fixed > PY_SSIZE_T_MAX / rows)
        goto too_long;
    total = fixed * rows;
    for (Py_ssize_t i = 0; i < count; i++)
        if (parts[i].tag != PART_FIXED)
            for (Py_ssize_t r = 0; r < rows; r++) {
                Py_ssize_t length = part_length(&parts[i], r);
                if (length > PY_SSIZE_T_MAX - total)
                    goto too_long;
                total += length;
            }
    result = PyBytes_FromStringAndSize(NULL, total);
    if (result == NULL)
        goto done;
    if (have_starts && (row_start = PyMem_Malloc(sizeof(int64_t) * (size_t)(rows + 1))) == NULL) {
        Py_CLEAR(result);
        PyErr_NoMemory();
        goto done;
    }
    /* with the GIL held: no other thread can change a column between counting and writing */
    char *out = PyBytes_AS_STRING(result), *at = out;
    for (Py_ssize_t r = 0; r < rows; r++) {
        if (row_start != NULL)
            row_start[r] = (int64_t)(at - out);
        for (Py_ssize_t i = 0; i < count; i++)
            at = put_part(at, &parts[i], r);
    }
    if (row_start != NULL) {  /* only now: `starts` may share memory with a column */
        row_start[rows] = (int64_t)(at - out);
        memcpy(starts.buf, row_start, sizeof(int64_t) * (size_t)(rows + 1));
    }
    goto done;
too_long:
    PyErr_SetString(PyExc_OverflowError, "the rows are too long");
done:
    if (have_starts)
        PyBuffer_Release(&starts);
    PyMem_Free(row_start);
    release_parts(parts, made);
    Py_DECREF(spec);
    return result;
}

static PyObject *serialization_id_of(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer packed;
    uint8_t digest[16];
    char identity[40];
    if (!PyArg_ParseTuple(args, "y*", &packed))
        return NULL;
    blake2b_16(packed.buf, (size_t)packed.len, digest);
    PyBuffer_Release(&packed);
    serialization_id(digest, identity);
    return PyBytes_FromStringAndSize(identity, 40);
}

static PyMethodDef methods[] = {
    {"assemble", assemble, METH_VARARGS,
     "assemble(out, source, kinds, positions, layouts, first, limit) -> (next, written): torch.save records end to end"},
    {"spans", spans, METH_VARARGS,
     "spans(files, offsets, kinds, lengths, read_gap, read_span, gap_budget) -> (spans, span_of, start_in)"},
    {"match", match, METH_VARARGS, "match(block, starts, runs) -> bytes: which records hold a layout's words"},
    {"encode_rows", encode_rows, METH_VARARGS,
     "encode_rows(spec, rows, starts) -> bytes: dcp.writer's .metadata rows from int64 columns"},
    {"serialization_id_of", serialization_id_of, METH_VARARGS,
     "serialization_id_of(packed_crcs) -> bytes: archive.serialization_id_of in C (for tests)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_records", "torch.save records built in C", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__records(void) { return PyModule_Create(&module); }
