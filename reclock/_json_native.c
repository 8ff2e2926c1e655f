/*
 * reclock._json_native: flat JSON objects into typed Arrow buffers, in C.
 *
 * The JSON decoder's fast path (reclock/formats/json.py, JsonDecoder._fast) hands a
 * run of records to pyarrow's JSON reader. For the common shape -- one flat
 * object per record whose declared fields hold integers, floats, booleans,
 * strings or null -- this parser does the same work in one pass without
 * building a document: it finds the declared keys, converts their values
 * straight into column buffers and validates (and skips) everything else.
 *
 * It accepts a run only when every record is certain to read the same as
 * with pyarrow, and otherwise answers None, and the caller uses pyarrow for
 * that run (which then names errors exactly as before). So it gives up on:
 * a value of another JSON type than its column's; an integer out of range or
 * written with a fraction or exponent; a number of more than 17 characters
 * (rounding); a string holding an escaped NUL or a lone surrogate; a raw
 * control character in a string; a key written with escapes; a declared key
 * twice; nesting deeper than 64; anything that is not JSON.
 * Records are given as int64 offsets into one data buffer; each record was
 * screened by the caller (non-null, valid UTF-8, '{' first and '}' last).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "_buffers.h"
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { K_INT64 = 0, K_INT32 = 1, K_FLOAT64 = 2, K_BOOL = 3, K_STRING = 4 };

typedef struct {
    const char *name;
    Py_ssize_t name_len;
    int kind;
    buf_t values;   /* int64/int32/float64 values, bool bits, string offsets */
    buf_t data;     /* string bytes */
    uint8_t *valid; /* one bit per row */
    uint8_t *bits;  /* bool values */
    int64_t nulls;
    int seen;       /* set in the current record */
} column_t;

/* Outcomes of the parsing helpers. */
#define OK 0
#define GIVE_UP 1 /* not certain to read as pyarrow does: the caller falls back */
#define NO_MEMORY 2

typedef struct {
    const unsigned char *s, *end;
} cursor_t;

static void
ws(cursor_t *c)
{
    while (c->s < c->end && (*c->s == ' ' || *c->s == '\t' || *c->s == '\n' || *c->s == '\r'))
        c->s++;
}

static int
hex4(const unsigned char *s, unsigned *out)
{
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        unsigned char ch = s[i];
        v <<= 4;
        if (ch >= '0' && ch <= '9')
            v |= ch - '0';
        else if (ch >= 'a' && ch <= 'f')
            v |= ch - 'a' + 10;
        else if (ch >= 'A' && ch <= 'F')
            v |= ch - 'A' + 10;
        else
            return -1;
    }
    *out = v;
    return 0;
}

static int
put_utf8(buf_t *b, unsigned cp)
{
    unsigned char u[4];
    size_t n;
    if (cp < 0x80) {
        u[0] = (unsigned char)cp;
        n = 1;
    }
    else if (cp < 0x800) {
        u[0] = (unsigned char)(0xC0 | (cp >> 6));
        u[1] = (unsigned char)(0x80 | (cp & 0x3F));
        n = 2;
    }
    else if (cp < 0x10000) {
        u[0] = (unsigned char)(0xE0 | (cp >> 12));
        u[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        u[2] = (unsigned char)(0x80 | (cp & 0x3F));
        n = 3;
    }
    else {
        u[0] = (unsigned char)(0xF0 | (cp >> 18));
        u[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
        u[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        u[3] = (unsigned char)(0x80 | (cp & 0x3F));
        n = 4;
    }
    return buf_put(b, u, n) < 0 ? NO_MEMORY : OK;
}

/*
 * A string at c->s (on its opening quote). With out != NULL its decoded bytes
 * are appended to out; *escaped tells whether it held escapes.
 */
static int
string(cursor_t *c, buf_t *out, int *escaped)
{
    const unsigned char *s = c->s + 1;
    *escaped = 0;
    const unsigned char *run = s;
    while (1) {
        if (s >= c->end)
            return GIVE_UP;
        unsigned char ch = *s;
        if (ch == '"')
            break;
        if (ch < 0x20)
            return GIVE_UP;
        if (ch != '\\') {
            s++;
            continue;
        }
        *escaped = 1;
        if (out && s > run && buf_put(out, run, (size_t)(s - run)) < 0)
            return NO_MEMORY;
        if (s + 1 >= c->end)
            return GIVE_UP;
        unsigned char e = s[1];
        const char *simple = NULL;
        switch (e) {
        case '"': simple = "\""; break;
        case '\\': simple = "\\"; break;
        case '/': simple = "/"; break;
        case 'b': simple = "\b"; break;
        case 'f': simple = "\f"; break;
        case 'n': simple = "\n"; break;
        case 'r': simple = "\r"; break;
        case 't': simple = "\t"; break;
        default: break;
        }
        if (simple != NULL) {
            if (out && buf_put(out, simple, 1) < 0)
                return NO_MEMORY;
            s += 2;
        }
        else if (e == 'u') {
            unsigned cp;
            if (s + 6 > c->end || hex4(s + 2, &cp) < 0)
                return GIVE_UP;
            s += 6;
            if (cp == 0 || (cp >= 0xDC00 && cp <= 0xDFFF))
                return GIVE_UP; /* NUL, or a lone low surrogate */
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                unsigned lo;
                if (s + 6 > c->end || s[0] != '\\' || s[1] != 'u' || hex4(s + 2, &lo) < 0
                    || lo < 0xDC00 || lo > 0xDFFF)
                    return GIVE_UP; /* a lone high surrogate */
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                s += 6;
            }
            if (out) {
                int rc = put_utf8(out, cp);
                if (rc != OK)
                    return rc;
            }
        }
        else {
            return GIVE_UP;
        }
        run = s;
    }
    if (out && s > run && buf_put(out, run, (size_t)(s - run)) < 0)
        return NO_MEMORY;
    c->s = s + 1;
    return OK;
}

/* A JSON number at c->s: its extent, and whether it is a plain integer. */
static int
number(cursor_t *c, const unsigned char **start, size_t *len, int *integer)
{
    const unsigned char *s = c->s;
    *start = s;
    *integer = 1;
    if (s < c->end && *s == '-')
        s++;
    if (s >= c->end)
        return GIVE_UP;
    if (*s == '0')
        s++;
    else if (*s >= '1' && *s <= '9')
        while (s < c->end && *s >= '0' && *s <= '9')
            s++;
    else
        return GIVE_UP;
    if (s < c->end && *s == '.') {
        *integer = 0;
        s++;
        if (s >= c->end || *s < '0' || *s > '9')
            return GIVE_UP;
        while (s < c->end && *s >= '0' && *s <= '9')
            s++;
    }
    if (s < c->end && (*s == 'e' || *s == 'E')) {
        *integer = 0;
        s++;
        if (s < c->end && (*s == '+' || *s == '-'))
            s++;
        if (s >= c->end || *s < '0' || *s > '9')
            return GIVE_UP;
        while (s < c->end && *s >= '0' && *s <= '9')
            s++;
    }
    *len = (size_t)(s - *start);
    c->s = s;
    return OK;
}

static int
literal(cursor_t *c, const char *word)
{
    size_t n = strlen(word);
    if ((size_t)(c->end - c->s) < n || memcmp(c->s, word, n) != 0)
        return GIVE_UP;
    c->s += n;
    return OK;
}

/*
 * After an array item or object member: a ',' (*more = 1, the cursor on the
 * next one) or the closing bracket (*more = 0, the cursor past it).
 */
static int
next_item(cursor_t *c, unsigned char close, int *more)
{
    ws(c);
    if (c->s >= c->end)
        return GIVE_UP;
    if (*c->s == ',') {
        c->s++;
        ws(c);
        *more = 1;
        return OK;
    }
    if (*c->s == close) {
        c->s++;
        *more = 0;
        return OK;
    }
    return GIVE_UP;
}

/* Validate and skip any value (for keys that are not declared). */
static int
skip_value(cursor_t *c, int depth)
{
    if (depth > 64 || c->s >= c->end)
        return GIVE_UP;
    unsigned char ch = *c->s;
    int rc, escaped;
    if (ch == '"')
        return string(c, NULL, &escaped);
    if (ch == 't')
        return literal(c, "true");
    if (ch == 'f')
        return literal(c, "false");
    if (ch == 'n')
        return literal(c, "null");
    if (ch == '-' || (ch >= '0' && ch <= '9')) {
        const unsigned char *st;
        size_t len;
        int integer;
        return number(c, &st, &len, &integer);
    }
    if (ch != '{' && ch != '[')
        return GIVE_UP;
    unsigned char close = ch == '{' ? '}' : ']';
    c->s++;
    ws(c);
    if (c->s < c->end && *c->s == close) {
        c->s++;
        return OK;
    }
    while (1) {
        if (close == '}') {
            if (c->s >= c->end || *c->s != '"')
                return GIVE_UP;
            if ((rc = string(c, NULL, &escaped)) != OK)
                return rc;
            ws(c);
            if (c->s >= c->end || *c->s != ':')
                return GIVE_UP;
            c->s++;
            ws(c);
        }
        int more;
        if ((rc = skip_value(c, depth + 1)) != OK || (rc = next_item(c, close, &more)) != OK)
            return rc;
        if (!more)
            return OK;
    }
}

static void
set_valid(column_t *col, int64_t row)
{
    col->valid[row / 8] |= (uint8_t)(1u << (row % 8));
}

/*
 * A JSON number as a double, exactly rounded, when its decimal significand
 * has at most 15 digits and its power of ten is within 22 (Clinger's fast
 * path: both are exact doubles, so one multiplication or division rounds
 * once). GIVE_UP otherwise (the caller uses strtod).
 */
static int
fast_double(const unsigned char *s, size_t len, double *out)
{
    static const double pow10[] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,
                                   1e8,  1e9,  1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
                                   1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};
    const unsigned char *end = s + len;
    int neg = 0, digits = 0, exp10 = 0;
    uint64_t m = 0;
    if (s < end && *s == '-') {
        neg = 1;
        s++;
    }
    for (; s < end && *s >= '0' && *s <= '9'; s++) {
        if (m || *s != '0')
            digits++;
        m = m * 10 + (uint64_t)(*s - '0');
        if (digits > 15)
            return GIVE_UP;
    }
    if (s < end && *s == '.') {
        for (s++; s < end && *s >= '0' && *s <= '9'; s++) {
            if (m || *s != '0')
                digits++;
            m = m * 10 + (uint64_t)(*s - '0');
            exp10--;
            if (digits > 15)
                return GIVE_UP;
        }
    }
    if (s < end && (*s == 'e' || *s == 'E')) {
        int eneg = 0, e = 0;
        s++;
        if (s < end && (*s == '+' || *s == '-'))
            eneg = *s++ == '-';
        for (; s < end && *s >= '0' && *s <= '9'; s++) {
            e = e * 10 + (*s - '0');
            if (e > 400)
                return GIVE_UP;
        }
        exp10 += eneg ? -e : e;
    }
    if (exp10 < -22 || exp10 > 22)
        return GIVE_UP;
    double v = (double)m; /* m < 10^15 < 2^53: exact */
    v = exp10 < 0 ? v / pow10[-exp10] : v * pow10[exp10];
    *out = neg ? -v : v;
    return OK;
}

/* A missing key: null. */
static int
missing(column_t *col)
{
    col->nulls++;
    if (col->kind == K_STRING) {
        int32_t end = (int32_t)col->data.len;
        return buf_put(&col->values, &end, 4) < 0 ? NO_MEMORY : OK;
    }
    if (col->kind == K_BOOL)
        return OK;
    int64_t zero = 0;
    return buf_put(&col->values, &zero, col->kind == K_INT32 ? 4 : 8) < 0 ? NO_MEMORY : OK;
}

/* The value of a declared key into its column at row. */
static int
field_value(cursor_t *c, column_t *col, int64_t row)
{
    if (c->s >= c->end)
        return GIVE_UP;
    if (*c->s == 'n') {
        if (literal(c, "null") != OK)
            return GIVE_UP;
        return missing(col);
    }
    int rc;
    switch (col->kind) {
    case K_STRING: {
        if (*c->s != '"')
            return GIVE_UP;
        int escaped;
        if ((rc = string(c, &col->data, &escaped)) != OK)
            return rc;
        if (col->data.len > INT32_MAX)
            return GIVE_UP;
        int32_t end = (int32_t)col->data.len;
        if (buf_put(&col->values, &end, 4) < 0)
            return NO_MEMORY;
        break;
    }
    case K_BOOL:
        if (*c->s == 't') {
            if (literal(c, "true") != OK)
                return GIVE_UP;
            col->bits[row / 8] |= (uint8_t)(1u << (row % 8));
        }
        else if (literal(c, "false") != OK)
            return GIVE_UP;
        break;
    default: {
        const unsigned char *st;
        size_t len;
        int integer;
        if (*c->s != '-' && (*c->s < '0' || *c->s > '9'))
            return GIVE_UP;
        if ((rc = number(c, &st, &len, &integer)) != OK)
            return rc;
        if (len > 17)
            return GIVE_UP; /* long numbers: leave the rounding and ranges to pyarrow */
        if (col->kind == K_FLOAT64) {
            double v;
            if (fast_double(st, len, &v) != OK) {
                char tmp[24], *e;
                memcpy(tmp, st, len);
                tmp[len] = 0;
                v = strtod(tmp, &e);
                if ((size_t)(e - tmp) != len)
                    return GIVE_UP;
            }
            if (!isfinite(v))
                return GIVE_UP;
            if (buf_put(&col->values, &v, 8) < 0)
                return NO_MEMORY;
        }
        else {
            if (!integer)
                return GIVE_UP;
            /* at most 17 characters: no int64 overflow */
            const unsigned char *d = st;
            int neg = *d == '-';
            int64_t v = 0;
            for (d += neg; d < st + len; d++)
                v = v * 10 + (*d - '0');
            if (neg)
                v = -v;
            if (col->kind == K_INT32) {
                if (v < INT32_MIN || v > INT32_MAX)
                    return GIVE_UP;
                int32_t w = (int32_t)v;
                if (buf_put(&col->values, &w, 4) < 0)
                    return NO_MEMORY;
            }
            else if (buf_put(&col->values, &v, 8) < 0)
                return NO_MEMORY;
        }
        break;
    }
    }
    set_valid(col, row);
    return OK;
}

static int
record(cursor_t *c, column_t *cols, Py_ssize_t ncols, int64_t row)
{
    int rc, escaped;
    for (Py_ssize_t k = 0; k < ncols; k++)
        cols[k].seen = 0;
    ws(c);
    if (c->s >= c->end || *c->s != '{')
        return GIVE_UP;
    c->s++;
    ws(c);
    if (c->s < c->end && *c->s == '}') {
        c->s++;
    }
    else {
        while (1) {
            if (c->s >= c->end || *c->s != '"')
                return GIVE_UP;
            const unsigned char *key = c->s + 1;
            if ((rc = string(c, NULL, &escaped)) != OK)
                return rc;
            size_t klen = (size_t)(c->s - 1 - key);
            ws(c);
            if (c->s >= c->end || *c->s != ':')
                return GIVE_UP;
            c->s++;
            ws(c);
            column_t *col = NULL;
            for (Py_ssize_t k = 0; k < ncols; k++) {
                if ((size_t)cols[k].name_len == klen && memcmp(cols[k].name, key, klen) == 0) {
                    col = &cols[k];
                    break;
                }
            }
            if (escaped) {
                /* a key with escapes might spell a declared name */
                return GIVE_UP;
            }
            if (col != NULL) {
                if (col->seen)
                    return GIVE_UP;
                col->seen = 1;
                rc = field_value(c, col, row);
            }
            else {
                rc = skip_value(c, 0);
            }
            int more;
            if (rc != OK || (rc = next_item(c, '}', &more)) != OK)
                return rc;
            if (!more)
                break;
        }
    }
    ws(c);
    if (c->s != c->end)
        return GIVE_UP;
    for (Py_ssize_t k = 0; k < ncols; k++)
        if (!cols[k].seen && (rc = missing(&cols[k])) != OK)
            return rc;
    return OK;
}

static PyObject *
bytes_of(const void *p, size_t n)
{
    return PyBytes_FromStringAndSize(p ? (const char *)p : "", (Py_ssize_t)n);
}

/*
 * parse(offsets, data, fields) -> list of columns, or None (use pyarrow)
 *   offsets: n + 1 int64 offsets of the records in data (a buffer)
 *   fields:  sequence of (name: bytes, kind: int) -- kinds 0 int64, 1 int32,
 *            2 float64, 3 bool, 4 string
 * Each column: (values, data, validity, null_count); values is the int64,
 * int32 or float64 values, the bool bits, or the int32 string offsets; data
 * is the string bytes (b"" otherwise).
 */
static PyObject *
parse(PyObject *self, PyObject *args)
{
    Py_buffer off_b, data_b;
    PyObject *fields;
    if (!PyArg_ParseTuple(args, "y*y*O", &off_b, &data_b, &fields))
        return NULL;
    PyObject *result = NULL;
    column_t *cols = NULL;
    PyObject *fast = PySequence_Fast(fields, "fields must be a sequence");
    Py_ssize_t ncols = fast ? PySequence_Fast_GET_SIZE(fast) : 0;
    int64_t n = off_b.len / 8 - 1;
    if (fast == NULL)
        goto done;
    if (off_b.len % 8 != 0 || n < 0) {
        PyErr_SetString(PyExc_ValueError, "offsets must hold n + 1 int64 values");
        goto done;
    }
    cols = calloc(ncols > 0 ? (size_t)ncols : 1, sizeof *cols);
    if (cols == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    size_t bitmap = (size_t)(n + 7) / 8 + 1;
    for (Py_ssize_t k = 0; k < ncols; k++) {
        const char *name;
        Py_ssize_t name_len;
        int kind;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, k), "y#i", &name, &name_len, &kind))
            goto done;
        if (kind < K_INT64 || kind > K_STRING) {
            PyErr_Format(PyExc_ValueError, "unknown kind %d", kind);
            goto done;
        }
        cols[k].name = name;
        cols[k].name_len = name_len;
        cols[k].kind = kind;
        cols[k].valid = calloc(bitmap, 1);
        cols[k].bits = calloc(bitmap, 1);
        size_t width = kind == K_INT32 || kind == K_STRING ? 4 : kind == K_BOOL ? 0 : 8;
        if (cols[k].valid == NULL || cols[k].bits == NULL
            || buf_reserve(&cols[k].values, width * (size_t)(n + 1) + 8) < 0) {
            PyErr_NoMemory();
            goto done;
        }
        if (kind == K_STRING) {
            int32_t zero = 0;
            buf_put(&cols[k].values, &zero, 4);
        }
    }
    const int64_t *off = (const int64_t *)off_b.buf;
    const unsigned char *data = (const unsigned char *)data_b.buf;
    int rc = OK;
    for (int64_t i = 0; i < n && rc == OK; i++) {
        if (off[i] < 0 || off[i] > off[i + 1] || off[i + 1] > data_b.len) {
            PyErr_SetString(PyExc_ValueError, "offsets out of the data");
            goto done;
        }
        cursor_t c = {data + off[i], data + off[i + 1]};
        rc = record(&c, cols, ncols, i);
    }
    if (rc == NO_MEMORY) {
        PyErr_NoMemory();
        goto done;
    }
    if (rc == GIVE_UP) {
        result = Py_None;
        Py_INCREF(result);
        goto done;
    }
    result = PyList_New(ncols);
    if (result == NULL)
        goto done;
    for (Py_ssize_t k = 0; k < ncols; k++) {
        column_t *col = &cols[k];
        PyObject *t = Py_BuildValue(
            "(NNNL)",
            col->kind == K_BOOL ? bytes_of(col->bits, (size_t)(n + 7) / 8)
                                : bytes_of(col->values.p, col->values.len),
            bytes_of(col->data.p, col->data.len), bytes_of(col->valid, (size_t)(n + 7) / 8),
            (long long)col->nulls);
        if (t == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, k, t);
    }
done:
    if (cols != NULL) {
        for (Py_ssize_t k = 0; k < ncols; k++) {
            free(cols[k].values.p);
            free(cols[k].data.p);
            free(cols[k].valid);
            free(cols[k].bits);
        }
        free(cols);
    }
    Py_XDECREF(fast);
    PyBuffer_Release(&off_b);
    PyBuffer_Release(&data_b);
    return result;
}

static PyMethodDef methods[] = {
    {"parse", parse, METH_VARARGS,
     "parse(offsets, data, fields) -> [(values, data, validity, nulls), ...] or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_json_native",
    .m_doc = "Flat JSON objects into typed Arrow buffers",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__json_native(void)
{
    return PyModule_Create(&moduledef);
}
