/*
 * reclock.sources.postgres._pgoutput_native: the pgoutput decoder in C.
 *
 * The Python reader (sources/postgres/source.py, PostgresReader) spent most
 * of a replication task parsing CopyData frames into dataclasses and
 * appending their values to lists. This module does the common part below
 * Python: Decoder.feed() takes a batch of frames (bytes of 'w' and 'k'
 * CopyData frames, as the walsender sent them) and, for each
 *
 *   'w' Begin    remembers the transaction (commit LSN, commit time,
 *                position 0), or stops the batch (END) at a transaction
 *                that commits at or after the task's end;
 *   'w' Commit   checks it and goes on;
 *   'w' Insert / Update / Delete of a relation Python registered a layout
 *                for (Decoder.layout) appends the rows the Python path
 *                (PostgresReader._change) would append to the output's
 *                column buffers (text values as Arrow binary columns) with
 *                their metadata (diff, commit LSN, position, commit time,
 *                unchanged TOAST columns); a relation Python said to skip
 *                (Decoder.skip) only advances the position;
 *
 * and hands every other frame back to Python as the dataclass the Python
 * parser (sources/postgres/pgoutput.py) makes of it: keepalives, relation,
 * type, origin, truncate and logical messages, changes of relations without
 * a layout, and changes whose shape the Python path turns into an error
 * (an old row missing from a diff log, an unchanged TOAST value it cannot
 * fill, a tuple shorter than the layout). Python handles those exactly as
 * before and resumes the batch after them, so the decisions (column
 * history, ShapeSeen, truncates, errors) stay in one place.
 *
 * parse_frame() is the Python parser's twin (the same dataclasses, equal
 * field by field; tests/sources/test_pgoutput_native.py fuzzes the two
 * against each other), and every malformed frame raises ProtocolError.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "_buffers.h"
#include <stdint.h>
#include <string.h>

/* the classes of sources/postgres/pgoutput.py (init()) */
static PyObject *ProtocolError, *Unchanged, *cXLogData, *cKeepalive, *cBegin, *cCommit,
    *cRelation, *cColumn, *cTypeInfo, *cOrigin, *cInsert, *cUpdate, *cDelete, *cTruncate,
    *cLogicalMessage;

/* ---- reading big-endian fields ---------------------------------------------- */

typedef struct {
    const uint8_t *p;
    size_t len, pos;
} rd_t;

static int
rd_take(rd_t *r, int64_t n, const uint8_t **out)
{
    if (n < 0) {
        PyErr_Format(ProtocolError, "negative length %lld at %zu", (long long)n, r->pos);
        return -1;
    }
    if ((uint64_t)n > r->len - r->pos) {
        PyErr_Format(ProtocolError, "message truncated: wanted %lld bytes at %zu of %zu",
                     (long long)n, r->pos, r->len);
        return -1;
    }
    *out = r->p + r->pos;
    r->pos += (size_t)n;
    return 0;
}

static uint64_t
be(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = (v << 8) | p[i];
    return v;
}

#define RD_FIELD(fname, ctype, n)                      \
    static int fname(rd_t *r, ctype *out)              \
    {                                                  \
        const uint8_t *p;                              \
        if (rd_take(r, n, &p) < 0)                     \
            return -1;                                 \
        *out = (ctype)be(p, n);                        \
        return 0;                                      \
    }
RD_FIELD(rd_u8, uint8_t, 1)
RD_FIELD(rd_i16, int16_t, 2)
RD_FIELD(rd_i32, int32_t, 4)
RD_FIELD(rd_u32, uint32_t, 4)
RD_FIELD(rd_i64, int64_t, 8)
RD_FIELD(rd_u64, uint64_t, 8)
#undef RD_FIELD

/* A NUL-terminated UTF-8 string as str (new reference), or NULL. */
static PyObject *
rd_string(rd_t *r)
{
    const uint8_t *start = r->p + r->pos;
    const uint8_t *end = memchr(start, 0, r->len - r->pos);
    if (end == NULL) {
        PyErr_SetString(ProtocolError, "unterminated string");
        return NULL;
    }
    PyObject *s = PyUnicode_DecodeUTF8((const char *)start, end - start, "strict");
    if (s == NULL) {
        PyErr_Clear();
        PyErr_Format(ProtocolError, "string at %zu is not UTF-8", r->pos);
        return NULL;
    }
    r->pos = (size_t)(end - r->p) + 1;
    return s;
}

/* ---- tuples ------------------------------------------------------------------ */

enum { V_NULL = 'n', V_UNCHANGED = 'u', V_TEXT = 't' };

typedef struct {
    char kind;
    int32_t len;
    const uint8_t *p;
} val_t;

typedef struct {
    val_t *v;
    int n, cap;
} tup_t;

/* One tuple's columns into t (pointing into the frame); 0 or -1. */
static int
rd_tuple(rd_t *r, tup_t *t)
{
    int16_t n;
    if (rd_i16(r, &n) < 0)
        return -1;
    if (n < 0) {
        PyErr_Format(ProtocolError, "negative column count %d", (int)n);
        return -1;
    }
    if (n > t->cap) {
        val_t *v = realloc(t->v, sizeof(val_t) * (size_t)n);
        if (v == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        t->v = v;
        t->cap = n;
    }
    t->n = n;
    for (int i = 0; i < n; i++) {
        const uint8_t *k;
        if (rd_take(r, 1, &k) < 0)
            return -1;
        val_t *v = &t->v[i];
        if (*k == 'n' || *k == 'u') {
            v->kind = (char)*k;
            v->len = 0;
            v->p = NULL;
        }
        else if (*k == 't' || *k == 'b') {
            int32_t len;
            if (rd_i32(r, &len) < 0 || rd_take(r, len, &v->p) < 0)
                return -1;
            v->kind = V_TEXT;
            v->len = len;
        }
        else {
            PyObject *b = PyBytes_FromStringAndSize((const char *)k, 1);
            if (b != NULL) {
                PyErr_Format(ProtocolError, "unknown tuple column kind %R", b);
                Py_DECREF(b);
            }
            return -1;
        }
    }
    return 0;
}

static PyObject *
tuple_obj(const tup_t *t)
{
    PyObject *out = PyTuple_New(t->n);
    if (out == NULL)
        return NULL;
    for (int i = 0; i < t->n; i++) {
        const val_t *v = &t->v[i];
        PyObject *o;
        if (v->kind == V_NULL) {
            o = Py_None;
            Py_INCREF(o);
        }
        else if (v->kind == V_UNCHANGED) {
            o = Unchanged;
            Py_INCREF(o);
        }
        else {
            o = PyBytes_FromStringAndSize((const char *)v->p, v->len);
            if (o == NULL) {
                Py_DECREF(out);
                return NULL;
            }
        }
        PyTuple_SET_ITEM(out, i, o);
    }
    return out;
}

/* ProtocolError(fmt % repr(tag byte)); NULL. */
static PyObject *
tag_error(const char *fmt, const uint8_t *tag)
{
    PyObject *b = PyBytes_FromStringAndSize((const char *)tag, 1);
    if (b != NULL) {
        PyErr_Format(ProtocolError, fmt, b);
        Py_DECREF(b);
    }
    return NULL;
}

/* ---- messages as pgoutput.py's dataclasses -------------------------------------- */

static tup_t scratch_a, scratch_b; /* parse_message's tuples (it holds the GIL) */

static PyObject *
parse_message(const uint8_t *p, size_t len)
{
    rd_t r = {p, len, 0};
    const uint8_t *tag;
    if (rd_take(&r, 1, &tag) < 0)
        return NULL;
    switch (*tag) {
    case 'B': {
        uint64_t lsn;
        int64_t ts;
        uint32_t xid;
        if (rd_u64(&r, &lsn) < 0 || rd_i64(&r, &ts) < 0 || rd_u32(&r, &xid) < 0)
            return NULL;
        return PyObject_CallFunction(cBegin, "KLk", (unsigned long long)lsn, (long long)ts,
                                     (unsigned long)xid);
    }
    case 'C': {
        uint8_t flags;
        uint64_t lsn, end;
        int64_t ts;
        if (rd_u8(&r, &flags) < 0 || rd_u64(&r, &lsn) < 0 || rd_u64(&r, &end) < 0 ||
            rd_i64(&r, &ts) < 0)
            return NULL;
        return PyObject_CallFunction(cCommit, "iKKL", (int)flags, (unsigned long long)lsn,
                                     (unsigned long long)end, (long long)ts);
    }
    case 'R': {
        uint32_t relid;
        uint8_t ident;
        int16_t n;
        PyObject *ns = NULL, *name = NULL, *cols = NULL, *out = NULL;
        if (rd_u32(&r, &relid) < 0 || (ns = rd_string(&r)) == NULL ||
            (name = rd_string(&r)) == NULL || rd_u8(&r, &ident) < 0 || rd_i16(&r, &n) < 0)
            goto rel_done;
        if (n < 0) {
            PyErr_Format(ProtocolError, "negative column count %d", (int)n);
            goto rel_done;
        }
        if ((cols = PyTuple_New(n)) == NULL)
            goto rel_done;
        for (int i = 0; i < n; i++) {
            uint8_t flags;
            uint32_t oid;
            int32_t typmod;
            PyObject *cname;
            if (rd_u8(&r, &flags) < 0 || (cname = rd_string(&r)) == NULL)
                goto rel_done;
            if (rd_u32(&r, &oid) < 0 || rd_i32(&r, &typmod) < 0) {
                Py_DECREF(cname);
                goto rel_done;
            }
            PyObject *c = PyObject_CallFunction(cColumn, "NkiN", cname, (unsigned long)oid,
                                                (int)typmod, PyBool_FromLong(flags & 1));
            if (c == NULL)
                goto rel_done;
            PyTuple_SET_ITEM(cols, i, c);
        }
        out = PyObject_CallFunction(cRelation, "kOONO", (unsigned long)relid, ns, name,
                                    PyUnicode_FromOrdinal(ident), cols);
    rel_done:
        Py_XDECREF(ns);
        Py_XDECREF(name);
        Py_XDECREF(cols);
        return out;
    }
    case 'Y': {
        uint32_t oid;
        PyObject *ns, *name;
        if (rd_u32(&r, &oid) < 0 || (ns = rd_string(&r)) == NULL)
            return NULL;
        if ((name = rd_string(&r)) == NULL) {
            Py_DECREF(ns);
            return NULL;
        }
        return PyObject_CallFunction(cTypeInfo, "kNN", (unsigned long)oid, ns, name);
    }
    case 'O': {
        uint64_t lsn;
        PyObject *name;
        if (rd_u64(&r, &lsn) < 0 || (name = rd_string(&r)) == NULL)
            return NULL;
        return PyObject_CallFunction(cOrigin, "KN", (unsigned long long)lsn, name);
    }
    case 'I': {
        uint32_t relid;
        const uint8_t *k;
        if (rd_u32(&r, &relid) < 0 || rd_take(&r, 1, &k) < 0)
            return NULL;
        if (*k != 'N') {
            PyErr_SetString(ProtocolError, "insert without a new tuple");
            return NULL;
        }
        if (rd_tuple(&r, &scratch_a) < 0)
            return NULL;
        return PyObject_CallFunction(cInsert, "kN", (unsigned long)relid,
                                     tuple_obj(&scratch_a));
    }
    case 'U': {
        uint32_t relid;
        const uint8_t *k;
        int has_old = 0, old_is_key = 0;
        if (rd_u32(&r, &relid) < 0 || rd_take(&r, 1, &k) < 0)
            return NULL;
        if (*k == 'K' || *k == 'O') {
            has_old = 1;
            old_is_key = *k == 'K';
            if (rd_tuple(&r, &scratch_a) < 0 || rd_take(&r, 1, &k) < 0)
                return NULL;
        }
        if (*k != 'N')
            return tag_error("update without a new tuple (got %R)", k);
        if (rd_tuple(&r, &scratch_b) < 0)
            return NULL;
        PyObject *old = has_old ? tuple_obj(&scratch_a) : (Py_INCREF(Py_None), Py_None);
        if (old == NULL)
            return NULL;
        return PyObject_CallFunction(cUpdate, "kNNN", (unsigned long)relid, old,
                                     PyBool_FromLong(old_is_key), tuple_obj(&scratch_b));
    }
    case 'D': {
        uint32_t relid;
        const uint8_t *k;
        if (rd_u32(&r, &relid) < 0 || rd_take(&r, 1, &k) < 0)
            return NULL;
        if (*k != 'K' && *k != 'O')
            return tag_error("delete without an old tuple (got %R)", k);
        if (rd_tuple(&r, &scratch_a) < 0)
            return NULL;
        return PyObject_CallFunction(cDelete, "kNN", (unsigned long)relid,
                                     tuple_obj(&scratch_a), PyBool_FromLong(*k == 'K'));
    }
    case 'T': {
        int32_t n;
        uint8_t opts;
        if (rd_i32(&r, &n) < 0 || rd_u8(&r, &opts) < 0)
            return NULL;
        if (n < 0) {
            PyErr_Format(ProtocolError, "negative relation count %d", (int)n);
            return NULL;
        }
        if ((uint64_t)n * 4 > r.len - r.pos) {
            const uint8_t *skip;
            rd_take(&r, (int64_t)n * 4, &skip); /* the truncation error */
            return NULL;
        }
        PyObject *ids = PyTuple_New(n);
        if (ids == NULL)
            return NULL;
        for (int32_t i = 0; i < n; i++) {
            uint32_t id;
            rd_u32(&r, &id);
            PyObject *o = PyLong_FromUnsignedLong(id);
            if (o == NULL) {
                Py_DECREF(ids);
                return NULL;
            }
            PyTuple_SET_ITEM(ids, i, o);
        }
        return PyObject_CallFunction(cTruncate, "NNN", ids, PyBool_FromLong(opts & 1),
                                     PyBool_FromLong(opts & 2));
    }
    case 'M': {
        uint8_t flags;
        uint64_t lsn;
        int32_t n;
        const uint8_t *content;
        PyObject *prefix;
        if (rd_u8(&r, &flags) < 0 || rd_u64(&r, &lsn) < 0 || (prefix = rd_string(&r)) == NULL)
            return NULL;
        if (rd_i32(&r, &n) < 0 || rd_take(&r, n, &content) < 0) {
            Py_DECREF(prefix);
            return NULL;
        }
        return PyObject_CallFunction(cLogicalMessage, "NKNy#", PyBool_FromLong(flags & 1),
                                     (unsigned long long)lsn, prefix, (const char *)content,
                                     (Py_ssize_t)n);
    }
    default:
        return tag_error("unknown pgoutput message %R", tag);
    }
}

static PyObject *
parse_frame_raw(const uint8_t *p, size_t len)
{
    rd_t r = {p, len, 0};
    const uint8_t *tag;
    if (rd_take(&r, 1, &tag) < 0)
        return NULL;
    if (*tag == 'w') {
        uint64_t start, end;
        int64_t ts;
        if (rd_u64(&r, &start) < 0 || rd_u64(&r, &end) < 0 || rd_i64(&r, &ts) < 0)
            return NULL;
        PyObject *m = parse_message(p + r.pos, len - r.pos);
        if (m == NULL)
            return NULL;
        return PyObject_CallFunction(cXLogData, "KKLN", (unsigned long long)start,
                                     (unsigned long long)end, (long long)ts, m);
    }
    if (*tag == 'k') {
        uint64_t end;
        int64_t ts;
        uint8_t reply;
        if (rd_u64(&r, &end) < 0 || rd_i64(&r, &ts) < 0 || rd_u8(&r, &reply) < 0)
            return NULL;
        return PyObject_CallFunction(cKeepalive, "KLN", (unsigned long long)end, (long long)ts,
                                     PyBool_FromLong(reply));
    }
    return tag_error("unknown replication frame %R", tag);
}

static int
ready(void)
{
    if (ProtocolError == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_pgoutput_native.init() was not called");
        return 0;
    }
    return 1;
}

static PyObject *
parse_frame(PyObject *self, PyObject *arg)
{
    Py_buffer b;
    if (!ready() || PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *out = parse_frame_raw(b.buf, (size_t)b.len);
    PyBuffer_Release(&b);
    return out;
}

static PyObject *
init(PyObject *self, PyObject *args)
{
    PyObject *error, *unchanged, *classes;
    if (!PyArg_ParseTuple(args, "OOO!", &error, &unchanged, &PyDict_Type, &classes))
        return NULL;
    struct {
        PyObject **slot;
        const char *name;
    } want[] = {
        {&cXLogData, "XLogData"}, {&cKeepalive, "Keepalive"}, {&cBegin, "Begin"},
        {&cCommit, "Commit"}, {&cRelation, "Relation"}, {&cColumn, "Column"},
        {&cTypeInfo, "TypeInfo"}, {&cOrigin, "Origin"}, {&cInsert, "Insert"},
        {&cUpdate, "Update"}, {&cDelete, "Delete"}, {&cTruncate, "Truncate"},
        {&cLogicalMessage, "LogicalMessage"},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        PyObject *c = PyDict_GetItemString(classes, want[i].name);
        if (c == NULL) {
            PyErr_Format(PyExc_KeyError, "init() needs the class %s", want[i].name);
            return NULL;
        }
        Py_INCREF(c);
        Py_XSETREF(*want[i].slot, c);
    }
    Py_INCREF(error);
    Py_XSETREF(ProtocolError, error);
    Py_INCREF(unchanged);
    Py_XSETREF(Unchanged, unchanged);
    Py_RETURN_NONE;
}

/* ---- column buffers --------------------------------------------------------------- */

/* A binary column: int32 offsets, data, validity bitmap (LSB first). */
typedef struct {
    buf_t offsets, data, valid;
    int64_t nulls;
} bincol_t;

static int
bit_put(buf_t *valid, int64_t row, int set)
{
    if (row % 8 == 0) {
        uint8_t zero = 0;
        if (buf_put(valid, &zero, 1) < 0)
            return -1;
    }
    if (set)
        ((uint8_t *)valid->p)[row / 8] |= (uint8_t)(1u << (row % 8));
    return 0;
}

static int
bincol_put(bincol_t *c, int64_t row, const void *src, size_t n)
{
    if (bit_put(&c->valid, row, src != NULL) < 0)
        return -1;
    if (src != NULL) {
        if (buf_put(&c->data, src, n) < 0)
            return -1;
    }
    else {
        c->nulls++;
    }
    int32_t end = (int32_t)c->data.len;
    return buf_put(&c->offsets, &end, sizeof end);
}

static void
bincol_reset(bincol_t *c)
{
    int32_t zero = 0;
    c->offsets.len = c->data.len = c->valid.len = 0;
    c->nulls = 0;
    buf_put(&c->offsets, &zero, sizeof zero); /* 4 bytes: the first cap is larger */
}

static void
bincol_free(bincol_t *c)
{
    free(c->offsets.p);
    free(c->data.p);
    free(c->valid.p);
    memset(c, 0, sizeof *c);
}

/* The rows of one output collected since its last take(). */
typedef struct {
    int set;   /* set up (its columns known) */
    int ncols;
    int64_t rows;
    bincol_t *cols;
    buf_t diff, off, seq, ts, ts_valid;
    int64_t ts_nulls;
    /* unchanged TOAST columns per row: list<int32> (offsets, values, validity) */
    buf_t u_offs, u_vals, u_valid;
    int64_t u_nulls;
    size_t maxdata; /* the largest column's data bytes */
} out_t;

static void
out_reset(out_t *o)
{
    for (int k = 0; k < o->ncols; k++)
        bincol_reset(&o->cols[k]);
    o->rows = 0;
    o->diff.len = o->off.len = o->seq.len = o->ts.len = o->ts_valid.len = 0;
    o->u_offs.len = o->u_vals.len = o->u_valid.len = 0;
    o->ts_nulls = o->u_nulls = 0;
    o->maxdata = 0;
    int32_t zero = 0;
    buf_put(&o->u_offs, &zero, sizeof zero);
}

static void
out_free(out_t *o)
{
    for (int k = 0; k < o->ncols; k++)
        bincol_free(&o->cols[k]);
    free(o->cols);
    free(o->diff.p);
    free(o->off.p);
    free(o->seq.p);
    free(o->ts.p);
    free(o->ts_valid.p);
    free(o->u_offs.p);
    free(o->u_vals.p);
    free(o->u_valid.p);
    memset(o, 0, sizeof *o);
}

/* How a relation's tuples map onto its output (PostgresReader._layout). */
typedef struct {
    uint32_t relid;
    int output;   /* -1: skip its changes while the commit LSN is below `until` */
    uint64_t until;
    int full;     /* a diff log (REPLICA IDENTITY FULL / no key): old rows retract */
    int npos;     /* the output's columns: pos[k] = tuple index or -1 */
    int *pos;
    int nkey;     /* tuple indexes of the key columns */
    int *key;
} layout_t;

typedef struct {
    PyObject_HEAD
    uint64_t end;
    int64_t batch_rows;
    uint64_t commit_lsn;
    int64_t ts;
    int ts_valid;
    int64_t seq;
    layout_t *lays;
    int nlays;
    out_t *outs;
    int nouts;
    tup_t a, b;
    int *unch; /* scratch: output columns left unchanged */
    int unch_cap;
} Decoder;

static layout_t *
find_layout(Decoder *d, uint32_t relid)
{
    for (int i = 0; i < d->nlays; i++)
        if (d->lays[i].relid == relid)
            return &d->lays[i];
    return NULL;
}

static void
forget_layout(Decoder *d, uint32_t relid)
{
    layout_t *l = find_layout(d, relid);
    if (l == NULL)
        return;
    free(l->pos);
    free(l->key);
    *l = d->lays[--d->nlays];
}

static layout_t *
new_layout(Decoder *d, uint32_t relid)
{
    forget_layout(d, relid);
    layout_t *lays = realloc(d->lays, sizeof(layout_t) * (size_t)(d->nlays + 1));
    if (lays == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    d->lays = lays;
    layout_t *l = &lays[d->nlays++];
    memset(l, 0, sizeof *l);
    l->relid = relid;
    return l;
}

static out_t *
get_output(Decoder *d, int i, int ncols)
{
    if (i < 0) {
        PyErr_SetString(PyExc_ValueError, "negative output index");
        return NULL;
    }
    if (i >= d->nouts) {
        out_t *outs = realloc(d->outs, sizeof(out_t) * (size_t)(i + 1));
        if (outs == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        memset(outs + d->nouts, 0, sizeof(out_t) * (size_t)(i + 1 - d->nouts));
        d->outs = outs;
        d->nouts = i + 1;
    }
    out_t *o = &d->outs[i];
    if (ncols < 0)
        return o;
    if (!o->set) {
        o->cols = calloc((size_t)(ncols ? ncols : 1), sizeof(bincol_t));
        if (o->cols == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        o->ncols = ncols;
        o->set = 1;
        out_reset(o);
    }
    else if (o->ncols != ncols) {
        PyErr_Format(PyExc_ValueError, "output %d has %d columns, not %d", i, o->ncols, ncols);
        return NULL;
    }
    return o;
}

/* One row's metadata (diff, commit LSN, position, commit time, unchanged). */
static int
out_meta(Decoder *d, out_t *o, int64_t diff, int32_t seq, const int *unch, int nunch,
         int64_t off, int ts_valid, int64_t ts)
{
    if (buf_put(&o->diff, &diff, 8) < 0 || buf_put(&o->off, &off, 8) < 0 ||
        buf_put(&o->seq, &seq, 4) < 0 || buf_put(&o->ts, &ts, 8) < 0 ||
        bit_put(&o->ts_valid, o->rows, ts_valid) < 0 ||
        bit_put(&o->u_valid, o->rows, nunch > 0) < 0)
        return -1;
    if (!ts_valid)
        o->ts_nulls++;
    if (nunch > 0) {
        for (int i = 0; i < nunch; i++) {
            int32_t v = unch[i];
            if (buf_put(&o->u_vals, &v, 4) < 0)
                return -1;
        }
    }
    else {
        o->u_nulls++;
    }
    int32_t end = (int32_t)(o->u_vals.len / 4);
    if (buf_put(&o->u_offs, &end, 4) < 0)
        return -1;
    o->rows++;
    for (int k = 0; k < o->ncols; k++)
        if (o->cols[k].data.len > o->maxdata)
            o->maxdata = o->cols[k].data.len;
    return 0;
}

/* Row kinds of add_tuple: the whole row, or only its key columns. */
enum { ROW_ALL, ROW_KEY };

static int
in_key(const layout_t *l, int j)
{
    for (int i = 0; i < l->nkey; i++)
        if (l->key[i] == j)
            return 1;
    return 0;
}

/* Append one row of tuple t through layout l (checked by the caller: every
 * index in range, no unchanged TOAST value among those taken, except where
 * `toast_null` says to take them as NULL). */
static int
add_tuple(Decoder *d, out_t *o, const layout_t *l, const tup_t *t, int which, int toast_null,
          int64_t diff, int32_t seq, const int *unch, int nunch)
{
    for (int k = 0; k < l->npos; k++) {
        int j = l->pos[k];
        const val_t *v = NULL;
        if (j >= 0 && (which == ROW_ALL || in_key(l, j)))
            v = &t->v[j];
        int r;
        if (v == NULL || v->kind == V_NULL || (toast_null && v->kind == V_UNCHANGED))
            r = bincol_put(&o->cols[k], o->rows, NULL, 0);
        else
            r = bincol_put(&o->cols[k], o->rows, v->p, (size_t)v->len);
        if (r < 0)
            return -1;
    }
    return out_meta(d, o, diff, seq, unch, nunch, (int64_t)d->commit_lsn, d->ts_valid, d->ts);
}

/* Whether every index the layout takes (all, or the key's) is in t. */
static int
covers(const layout_t *l, const tup_t *t, int which)
{
    if (which == ROW_KEY) {
        for (int i = 0; i < l->nkey; i++)
            if (l->key[i] >= t->n)
                return 0;
        return 1;
    }
    for (int k = 0; k < l->npos; k++)
        if (l->pos[k] >= t->n)
            return 0;
    return 1;
}

/* Whether a value the layout takes (all, or the key's) is unchanged TOAST. */
static int
toasted(const layout_t *l, const tup_t *t, int which)
{
    if (which == ROW_KEY) {
        for (int i = 0; i < l->nkey; i++)
            if (t->v[l->key[i]].kind == V_UNCHANGED)
                return 1;
        return 0;
    }
    for (int k = 0; k < l->npos; k++)
        if (l->pos[k] >= 0 && t->v[l->pos[k]].kind == V_UNCHANGED)
            return 1;
    return 0;
}

static int
same_value(const val_t *x, const val_t *y)
{
    if (x->kind != y->kind)
        return 0;
    return x->kind != V_TEXT || (x->len == y->len && memcmp(x->p, y->p, (size_t)x->len) == 0);
}

enum { DONE = 0, END = 1, FULL = 2, MESSAGE = 3 };
enum { TAKEN = 0, DEFER = 1 };

/*
 * One change (I/U/D, after the relid) through layout l, as
 * PostgresReader._change does it; TAKEN, DEFER (Python decides: an error
 * there, or a shape this path does not take), or -1 with an exception.
 */
static int
change(Decoder *d, rd_t *r, char tag, const layout_t *l)
{
    const uint8_t *k;
    int has_old = 0, old_is_key = 0;
    tup_t *old = &d->a, *new = &d->b;
    if (rd_take(r, 1, &k) < 0)
        return -1;
    if (tag == 'I') {
        if (*k != 'N') {
            PyErr_SetString(ProtocolError, "insert without a new tuple");
            return -1;
        }
        if (rd_tuple(r, new) < 0)
            return -1;
    }
    else if (tag == 'U') {
        if (*k == 'K' || *k == 'O') {
            has_old = 1;
            old_is_key = *k == 'K';
            if (rd_tuple(r, old) < 0 || rd_take(r, 1, &k) < 0)
                return -1;
        }
        if (*k != 'N') {
            tag_error("update without a new tuple (got %R)", k);
            return -1;
        }
        if (rd_tuple(r, new) < 0)
            return -1;
    }
    else {
        if (*k != 'K' && *k != 'O') {
            tag_error("delete without an old tuple (got %R)", k);
            return -1;
        }
        has_old = 1;
        old_is_key = *k == 'K';
        if (rd_tuple(r, old) < 0)
            return -1;
    }
    if (l->output < 0)
        return TAKEN; /* (skipped: the caller advances the position) */
    out_t *o = &d->outs[l->output];
    int32_t s = (int32_t)d->seq;
    if (tag == 'I') {
        if (!covers(l, new, ROW_ALL) || toasted(l, new, ROW_ALL))
            return DEFER;
        return add_tuple(d, o, l, new, ROW_ALL, 0, 1, 2 * s + 1, NULL, 0) < 0 ? -1 : TAKEN;
    }
    if (tag == 'D') {
        if (l->full) {
            if (old_is_key || !covers(l, old, ROW_ALL) || toasted(l, old, ROW_ALL))
                return DEFER;
            return add_tuple(d, o, l, old, ROW_ALL, 0, -1, 2 * s, NULL, 0) < 0 ? -1 : TAKEN;
        }
        if (!covers(l, old, ROW_KEY) || toasted(l, old, ROW_KEY))
            return DEFER;
        return add_tuple(d, o, l, old, ROW_KEY, 0, 0, 2 * s, NULL, 0) < 0 ? -1 : TAKEN;
    }
    if (l->full) {
        /* an unchanged TOAST value in the new row is the old row's */
        if (!has_old || old_is_key || !covers(l, old, ROW_ALL) || !covers(l, new, ROW_ALL) ||
            toasted(l, old, ROW_ALL))
            return DEFER;
        int fill = 0;
        for (int j = 0; j < new->n; j++)
            if (new->v[j].kind == V_UNCHANGED)
                fill = 1;
        if (fill) {
            if (old->n != new->n)
                return DEFER;
            for (int j = 0; j < new->n; j++)
                if (new->v[j].kind == V_UNCHANGED)
                    new->v[j] = old->v[j];
        }
        if (add_tuple(d, o, l, old, ROW_ALL, 0, -1, 2 * s, NULL, 0) < 0 ||
            add_tuple(d, o, l, new, ROW_ALL, 0, 1, 2 * s + 1, NULL, 0) < 0)
            return -1;
        return TAKEN;
    }
    /* keyed: an unchanged TOAST value is marked; the driver's key state fills it */
    if (!covers(l, new, ROW_ALL) || !covers(l, new, ROW_KEY) || toasted(l, new, ROW_KEY))
        return DEFER;
    if (has_old && (!covers(l, old, ROW_KEY) || toasted(l, old, ROW_KEY)))
        return DEFER;
    if (l->npos > d->unch_cap) {
        int *u = realloc(d->unch, sizeof(int) * (size_t)l->npos);
        if (u == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        d->unch = u;
        d->unch_cap = l->npos;
    }
    int nunch = 0;
    for (int c = 0; c < l->npos; c++)
        if (l->pos[c] >= 0 && new->v[l->pos[c]].kind == V_UNCHANGED)
            d->unch[nunch++] = c;
    if (has_old) {
        int moved = 0;
        for (int i = 0; i < l->nkey; i++)
            if (!same_value(&old->v[l->key[i]], &new->v[l->key[i]]))
                moved = 1;
        if (moved && add_tuple(d, o, l, old, ROW_KEY, 0, 0, 2 * s, NULL, 0) < 0)
            return -1;
    }
    return add_tuple(d, o, l, new, ROW_ALL, 1, 1, 2 * s + 1, d->unch, nunch) < 0 ? -1 : TAKEN;
}

/* Room in every column of output o for `more` bytes (offsets are 32-bit). */
static int
fits(const out_t *o, size_t more)
{
    return o->maxdata + 2 * more < (size_t)INT32_MAX;
}

#define SOFT_BYTES ((size_t)256 << 20) /* a batch's largest column, at most about */

static PyObject *
event(Py_ssize_t i, int kind, PyObject *obj)
{
    if (obj == NULL)
        return NULL;
    return Py_BuildValue("niN", i, kind, obj);
}

/*
 * feed(frames, start) -> (index, kind, obj): decode frames[start:] until
 *   DONE     all taken (index = len(frames), obj None)
 *   END      frames[index] begins a transaction committing at or after `end`
 *   FULL     output obj holds batch_rows rows (or its bytes are many); resume at index
 *   MESSAGE  frames[index] is for Python: obj is its XLogData or Keepalive
 */
static PyObject *
Decoder_feed(Decoder *d, PyObject *args)
{
    PyObject *frames;
    Py_ssize_t start;
    if (!PyArg_ParseTuple(args, "O!n", &PyList_Type, &frames, &start))
        return NULL;
    if (!ready())
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(frames);
    for (Py_ssize_t i = start < 0 ? 0 : start; i < n; i++) {
        PyObject *f = PyList_GET_ITEM(frames, i);
        if (!PyBytes_Check(f)) {
            PyErr_SetString(PyExc_TypeError, "frames must be bytes");
            return NULL;
        }
        const uint8_t *p = (const uint8_t *)PyBytes_AS_STRING(f);
        size_t len = (size_t)PyBytes_GET_SIZE(f);
        if (len < 26 || p[0] != 'w') /* keepalives, short and unknown frames: Python */
            return event(i, MESSAGE, parse_frame_raw(p, len));
        rd_t r = {p + 25, len - 25, 0};
        char tag = (char)r.p[0];
        r.pos = 1;
        if (tag == 'B') {
            uint64_t lsn;
            int64_t ts;
            uint32_t xid;
            if (rd_u64(&r, &lsn) < 0 || rd_i64(&r, &ts) < 0 || rd_u32(&r, &xid) < 0)
                return NULL;
            if (lsn >= d->end)
                return event(i, END, (Py_INCREF(Py_None), Py_None));
            /* (ts + PG_EPOCH_US) // 1000, floored as Python does */
            int64_t us;
            if (__builtin_add_overflow(ts, INT64_C(946684800000000), &us)) {
                PyErr_Format(ProtocolError, "commit time %lld is out of range", (long long)ts);
                return NULL;
            }
            d->commit_lsn = lsn;
            d->ts = us / 1000 - (us % 1000 < 0);
            d->ts_valid = 1;
            d->seq = 0;
            continue;
        }
        if (tag == 'C') {
            const uint8_t *rest;
            if (rd_take(&r, 1 + 8 + 8 + 8, &rest) < 0)
                return NULL;
            continue;
        }
        if (tag != 'I' && tag != 'U' && tag != 'D')
            return event(i, MESSAGE, parse_frame_raw(p, len));
        uint32_t relid;
        if (rd_u32(&r, &relid) < 0)
            return NULL;
        layout_t *l = find_layout(d, relid);
        if (l == NULL || (l->output < 0 && d->commit_lsn >= l->until))
            return event(i, MESSAGE, parse_frame_raw(p, len));
        if (l->output >= 0) {
            const out_t *o = &d->outs[l->output];
            if (o->rows > 0 && !fits(o, len))
                return event(i, FULL, PyLong_FromLong(l->output));
        }
        int got = change(d, &r, tag, l);
        if (got < 0)
            return NULL;
        if (got == DEFER)
            return event(i, MESSAGE, parse_frame_raw(p, len));
        d->seq++;
        if (l->output >= 0) {
            const out_t *o = &d->outs[l->output];
            if (o->rows >= d->batch_rows || o->maxdata >= SOFT_BYTES)
                return event(i + 1, FULL, PyLong_FromLong(l->output));
        }
    }
    return event(n, DONE, (Py_INCREF(Py_None), Py_None));
}

static int
int_list(PyObject *seq, int **out, int *n)
{
    PyObject *fast = PySequence_Fast(seq, "expected a sequence of ints");
    if (fast == NULL)
        return -1;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(fast);
    int *v = malloc(sizeof(int) * (size_t)(len ? len : 1));
    if (v == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        long x = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
        if (x == -1 && PyErr_Occurred()) {
            free(v);
            Py_DECREF(fast);
            return -1;
        }
        v[i] = (int)x;
    }
    Py_DECREF(fast);
    *out = v;
    *n = (int)len;
    return 0;
}

/* layout(relid, output, ncols, pos, key_pos, full): changes of relid go to output. */
static PyObject *
Decoder_layout(Decoder *d, PyObject *args)
{
    unsigned long relid;
    int output, ncols, full;
    PyObject *pos, *key;
    if (!PyArg_ParseTuple(args, "kiiOOp", &relid, &output, &ncols, &pos, &key, &full))
        return NULL;
    if (get_output(d, output, ncols) == NULL)
        return NULL;
    int *p, *k, np, nk;
    if (int_list(pos, &p, &np) < 0)
        return NULL;
    if (int_list(key, &k, &nk) < 0) {
        free(p);
        return NULL;
    }
    if (np != ncols) {
        free(p);
        free(k);
        PyErr_SetString(PyExc_ValueError, "pos must name a tuple index per output column");
        return NULL;
    }
    layout_t *l = new_layout(d, (uint32_t)relid);
    if (l == NULL) {
        free(p);
        free(k);
        return NULL;
    }
    l->output = output;
    l->full = full;
    l->pos = p;
    l->npos = np;
    l->key = k;
    l->nkey = nk;
    Py_RETURN_NONE;
}

/* skip(relid, until): take changes of relid as no output's while the commit LSN < until. */
static PyObject *
Decoder_skip(Decoder *d, PyObject *args)
{
    unsigned long relid;
    unsigned long long until;
    if (!PyArg_ParseTuple(args, "kK", &relid, &until))
        return NULL;
    layout_t *l = new_layout(d, (uint32_t)relid);
    if (l == NULL)
        return NULL;
    l->output = -1;
    l->until = until;
    Py_RETURN_NONE;
}

static PyObject *
Decoder_forget(Decoder *d, PyObject *args)
{
    unsigned long relid;
    if (!PyArg_ParseTuple(args, "k", &relid))
        return NULL;
    forget_layout(d, (uint32_t)relid);
    Py_RETURN_NONE;
}

/* add_row(output, ncols, values, diff, off, seq, ts, unchanged): one row from Python. */
static PyObject *
Decoder_add_row(Decoder *d, PyObject *args)
{
    int output, ncols;
    PyObject *values, *tso, *unch;
    long long diff;
    unsigned long long off;
    long seq;
    if (!PyArg_ParseTuple(args, "iiOLKlOO", &output, &ncols, &values, &diff, &off, &seq, &tso,
                          &unch))
        return NULL;
    out_t *o = get_output(d, output, ncols);
    if (o == NULL)
        return NULL;
    PyObject *fast = PySequence_Fast(values, "values must be a sequence");
    if (fast == NULL)
        return NULL;
    if (PySequence_Fast_GET_SIZE(fast) != o->ncols) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "a row of output %d has %d values", output, o->ncols);
        return NULL;
    }
    for (int k = 0; k < o->ncols; k++) {
        PyObject *v = PySequence_Fast_GET_ITEM(fast, k);
        if (v != Py_None && !PyBytes_Check(v)) {
            Py_DECREF(fast);
            PyErr_Format(PyExc_TypeError, "a value of output %d is %R, not bytes", output, v);
            return NULL;
        }
    }
    for (int k = 0; k < o->ncols; k++) {
        PyObject *v = PySequence_Fast_GET_ITEM(fast, k);
        int r = v == Py_None ? bincol_put(&o->cols[k], o->rows, NULL, 0)
                             : bincol_put(&o->cols[k], o->rows, PyBytes_AS_STRING(v),
                                          (size_t)PyBytes_GET_SIZE(v));
        if (r < 0) {
            Py_DECREF(fast);
            return PyErr_NoMemory();
        }
    }
    Py_DECREF(fast);
    int64_t ts = 0;
    if (tso != Py_None) {
        ts = PyLong_AsLongLong(tso);
        if (ts == -1 && PyErr_Occurred())
            return NULL;
    }
    int *u = NULL, nu = 0;
    if (unch != Py_None && int_list(unch, &u, &nu) < 0)
        return NULL;
    int r = out_meta(d, o, diff, (int32_t)seq, u, nu, (int64_t)off, tso != Py_None, ts);
    free(u);
    if (r < 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *
bytes_of(const buf_t *b)
{
    return PyBytes_FromStringAndSize(b->p ? b->p : "", (Py_ssize_t)b->len);
}

/*
 * take(output) -> (rows, columns, diff, off, seq, ts, ts_valid, ts_nulls,
 *                  u_offsets, u_values, u_valid, u_nulls)
 * columns: per output column (offsets, data, valid, nulls) of a binary
 * column; diff int64, off int64, seq int32, ts int64 (validity ts_valid);
 * the unchanged columns a list<int32> column. The output's buffers restart.
 */
static PyObject *
Decoder_take(Decoder *d, PyObject *args)
{
    int output;
    if (!PyArg_ParseTuple(args, "i", &output))
        return NULL;
    if (output < 0 || output >= d->nouts || !d->outs[output].set)
        return Py_BuildValue("(n[]yyyyyiyyyi)", (Py_ssize_t)0, "", "", "", "", "", 0, "", "",
                             "", 0);
    out_t *o = &d->outs[output];
    PyObject *cols = PyList_New(o->ncols);
    if (cols == NULL)
        return NULL;
    for (int k = 0; k < o->ncols; k++) {
        bincol_t *c = &o->cols[k];
        PyObject *t = Py_BuildValue("(NNNL)", bytes_of(&c->offsets), bytes_of(&c->data),
                                    bytes_of(&c->valid), (long long)c->nulls);
        if (t == NULL) {
            Py_DECREF(cols);
            return NULL;
        }
        PyList_SET_ITEM(cols, k, t);
    }
    PyObject *out = Py_BuildValue("(LNNNNNNLNNNL)", (long long)o->rows, cols, bytes_of(&o->diff),
                                  bytes_of(&o->off), bytes_of(&o->seq), bytes_of(&o->ts),
                                  bytes_of(&o->ts_valid), (long long)o->ts_nulls,
                                  bytes_of(&o->u_offs), bytes_of(&o->u_vals),
                                  bytes_of(&o->u_valid), (long long)o->u_nulls);
    out_reset(o);
    return out;
}

static PyObject *
Decoder_pending(Decoder *d, PyObject *args)
{
    int output;
    if (!PyArg_ParseTuple(args, "i", &output))
        return NULL;
    if (output < 0 || output >= d->nouts)
        return PyLong_FromLong(0);
    return PyLong_FromLongLong(d->outs[output].rows);
}

static int
Decoder_init(Decoder *d, PyObject *args, PyObject *kw)
{
    unsigned long long end;
    long long batch_rows;
    if (!PyArg_ParseTuple(args, "KL", &end, &batch_rows))
        return -1;
    d->end = end;
    d->batch_rows = batch_rows > 0 ? batch_rows : 1;
    return 0;
}

static void
Decoder_dealloc(Decoder *d)
{
    for (int i = 0; i < d->nlays; i++) {
        free(d->lays[i].pos);
        free(d->lays[i].key);
    }
    free(d->lays);
    for (int i = 0; i < d->nouts; i++)
        out_free(&d->outs[i]);
    free(d->outs);
    free(d->a.v);
    free(d->b.v);
    free(d->unch);
    Py_TYPE(d)->tp_free((PyObject *)d);
}

static PyObject *
Decoder_get_commit_lsn(Decoder *d, void *c)
{
    return PyLong_FromUnsignedLongLong(d->commit_lsn);
}

static PyObject *
Decoder_get_ts(Decoder *d, void *c)
{
    if (!d->ts_valid)
        Py_RETURN_NONE;
    return PyLong_FromLongLong(d->ts);
}

static PyObject *
Decoder_get_seq(Decoder *d, void *c)
{
    return PyLong_FromLongLong(d->seq);
}

static int
Decoder_set_seq(Decoder *d, PyObject *v, void *c)
{
    long long s = v == NULL ? -1 : PyLong_AsLongLong(v);
    if (s == -1 && (v == NULL || PyErr_Occurred())) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "seq cannot be deleted");
        return -1;
    }
    d->seq = s;
    return 0;
}

static PyMethodDef Decoder_methods[] = {
    {"feed", (PyCFunction)Decoder_feed, METH_VARARGS,
     "feed(frames, start) -> (index, kind, obj): decode frames until Python is needed"},
    {"layout", (PyCFunction)Decoder_layout, METH_VARARGS,
     "layout(relid, output, ncols, pos, key_pos, full): how relid's changes map"},
    {"skip", (PyCFunction)Decoder_skip, METH_VARARGS,
     "skip(relid, until): relid's changes feed no output while the commit LSN < until"},
    {"forget", (PyCFunction)Decoder_forget, METH_VARARGS, "forget(relid): its layout is gone"},
    {"add_row", (PyCFunction)Decoder_add_row, METH_VARARGS,
     "add_row(output, ncols, values, diff, off, seq, ts, unchanged): one row from Python"},
    {"take", (PyCFunction)Decoder_take, METH_VARARGS, "take(output) -> its rows' buffers"},
    {"pending", (PyCFunction)Decoder_pending, METH_VARARGS, "pending(output) -> rows held"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Decoder_getset[] = {
    {"commit_lsn", (getter)Decoder_get_commit_lsn, NULL, "the transaction's commit LSN", NULL},
    {"ts", (getter)Decoder_get_ts, NULL, "its commit time (ms since the epoch), or None", NULL},
    {"seq", (getter)Decoder_get_seq, (setter)Decoder_set_seq,
     "the next change's position in the transaction", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject DecoderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "reclock.sources.postgres._pgoutput_native.Decoder",
    .tp_basicsize = sizeof(Decoder),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Decodes batches of replication frames into per-output column buffers",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Decoder_init,
    .tp_dealloc = (destructor)Decoder_dealloc,
    .tp_methods = Decoder_methods,
    .tp_getset = Decoder_getset,
};

static PyMethodDef module_methods[] = {
    {"init", init, METH_VARARGS,
     "init(ProtocolError, UNCHANGED_TOAST, classes): pgoutput.py's error and dataclasses"},
    {"parse_frame", parse_frame, METH_O, "parse_frame(data) -> XLogData | Keepalive"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_pgoutput_native",
    .m_doc = "pgoutput replication frames decoded into Arrow buffers below Python",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__pgoutput_native(void)
{
    if (PyType_Ready(&DecoderType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL)
        return NULL;
    Py_INCREF(&DecoderType);
    if (PyModule_AddObject(m, "Decoder", (PyObject *)&DecoderType) < 0) {
        Py_DECREF(&DecoderType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "DONE", DONE);
    PyModule_AddIntConstant(m, "END", END);
    PyModule_AddIntConstant(m, "FULL", FULL);
    PyModule_AddIntConstant(m, "MESSAGE", MESSAGE);
    return m;
}
