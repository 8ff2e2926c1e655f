/*
 * reclock.sources._kafka_native: a Kafka range reader that fills Arrow buffers in C.
 *
 * The Python reader (sources/kafka.py, KafkaReader._read_ranges) pays for a
 * Python Message object per record and for the lists it builds from their
 * fields. This module does the same job below Python: it consumes batches of
 * messages from librdkafka and appends offsets, timestamps, keys and values
 * straight into growing Arrow-layout buffers (offsets, data, validity
 * bitmaps), which Python turns into a RecordBatch without copying again.
 *
 * It links against nothing at build time. `load(path)` dlopen()s the
 * librdkafka that ships inside the confluent-kafka wheel (the same library
 * the rest of reclock talks to) and resolves the few functions it needs.
 * The declarations below are librdkafka's public, ABI-stable C API
 * (rdkafka.h): the two structs are read through their documented leading
 * fields only.
 *
 * Semantics match the Python reader: the records in [start, end) of each of
 * a task's partition ranges, in offset order within a partition (the
 * partitions are assigned together, so their records interleave); records
 * below a range's position are skipped, the first record at or past its end
 * ends it; _PARTITION_EOF is ignored; any other error is reported to Python,
 * which maps it to reclock's errors.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "_buffers.h"
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

/* ---- librdkafka's public API (rdkafka.h), resolved at run time ---------- */

typedef struct rk_s rk_t;
typedef struct rk_conf_s rk_conf_t;
typedef struct rk_queue_s rk_queue_t;
typedef struct rk_headers_s rk_headers_t;

typedef struct {
    int err;
    void *rkt;
    int32_t partition;
    void *payload;
    size_t len;
    void *key;
    size_t key_len;
    int64_t offset;
    void *_private;
} rk_message_t;

typedef struct {
    char *topic;
    int32_t partition;
    int64_t offset;
    void *metadata;
    size_t metadata_size;
    void *opaque;
    int err;
    void *_private;
} rk_tp_t;

typedef struct {
    int cnt;
    int size;
    rk_tp_t *elems;
} rk_tp_list_t;

#define RK_CONSUMER 1
#define RK_CONF_OK 0
#define RK_ERR_PARTITION_EOF (-191)
#define RK_TIMESTAMP_NOT_AVAILABLE 0

static struct {
    rk_conf_t *(*conf_new)(void);
    int (*conf_set)(rk_conf_t *, const char *, const char *, char *, size_t);
    void (*conf_destroy)(rk_conf_t *);
    rk_t *(*new_)(int, rk_conf_t *, char *, size_t);
    void (*destroy)(rk_t *);
    int (*poll_set_consumer)(rk_t *);
    rk_queue_t *(*queue_get_consumer)(rk_t *);
    void (*queue_destroy)(rk_queue_t *);
    ssize_t (*consume_batch_queue)(rk_queue_t *, int, rk_message_t **, size_t);
    void (*message_destroy)(rk_message_t *);
    int64_t (*message_timestamp)(const rk_message_t *, int *);
    rk_tp_list_t *(*tpl_new)(int);
    rk_tp_t *(*tpl_add)(rk_tp_list_t *, const char *, int32_t);
    void (*tpl_destroy)(rk_tp_list_t *);
    int (*assign)(rk_t *, const rk_tp_list_t *);
    int (*position)(rk_t *, rk_tp_list_t *);
    int (*consumer_close)(rk_t *);
    const char *(*err2str)(int);
    const char *(*topic_name)(const void *);
    int (*message_headers)(const rk_message_t *, rk_headers_t **);
    size_t (*header_cnt)(const rk_headers_t *);
    int (*header_get_all)(const rk_headers_t *, size_t, const char **, const void **, size_t *);
    int (*metadata)(rk_t *, int, void *, const void **, int);
    void (*metadata_destroy)(const void *);
    int loaded;
} rk;

static PyObject *
load(PyObject *self, PyObject *args)
{
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path))
        return NULL;
    if (rk.loaded)
        Py_RETURN_NONE;
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) {
        PyErr_Format(PyExc_ImportError, "cannot load librdkafka from %s: %s", path, dlerror());
        return NULL;
    }
#define SYM(field, name)                                                              \
    do {                                                                              \
        *(void **)(&rk.field) = dlsym(h, name);                                       \
        if (rk.field == NULL) {                                                       \
            PyErr_Format(PyExc_ImportError, "librdkafka at %s lacks %s", path, name); \
            return NULL;                                                              \
        }                                                                             \
    } while (0)
    SYM(conf_new, "rd_kafka_conf_new");
    SYM(conf_set, "rd_kafka_conf_set");
    SYM(conf_destroy, "rd_kafka_conf_destroy");
    SYM(new_, "rd_kafka_new");
    SYM(destroy, "rd_kafka_destroy");
    SYM(poll_set_consumer, "rd_kafka_poll_set_consumer");
    SYM(queue_get_consumer, "rd_kafka_queue_get_consumer");
    SYM(queue_destroy, "rd_kafka_queue_destroy");
    SYM(consume_batch_queue, "rd_kafka_consume_batch_queue");
    SYM(message_destroy, "rd_kafka_message_destroy");
    SYM(message_timestamp, "rd_kafka_message_timestamp");
    SYM(tpl_new, "rd_kafka_topic_partition_list_new");
    SYM(tpl_add, "rd_kafka_topic_partition_list_add");
    SYM(tpl_destroy, "rd_kafka_topic_partition_list_destroy");
    SYM(assign, "rd_kafka_assign");
    SYM(position, "rd_kafka_position");
    SYM(consumer_close, "rd_kafka_consumer_close");
    SYM(topic_name, "rd_kafka_topic_name");
    SYM(err2str, "rd_kafka_err2str");
    SYM(message_headers, "rd_kafka_message_headers");
    SYM(header_cnt, "rd_kafka_header_cnt");
    SYM(header_get_all, "rd_kafka_header_get_all");
    SYM(metadata, "rd_kafka_metadata");
    SYM(metadata_destroy, "rd_kafka_metadata_destroy");
#undef SYM
    rk.loaded = 1;
    Py_RETURN_NONE;
}

/* A binary column: int32 offsets, data, validity bitmap (LSB first). */
typedef struct {
    buf_t offsets, data, valid;
    int64_t nulls;
} bincol_t;

static int
bincol_put(bincol_t *c, int64_t row, const void *src, size_t n)
{
    if (row % 8 == 0) {
        uint8_t zero = 0;
        if (buf_put(&c->valid, &zero, 1) < 0)
            return -1;
    }
    if (src != NULL) {
        if (c->data.len + n > INT32_MAX)
            return -2;
        if (buf_put(&c->data, src, n) < 0)
            return -1;
        ((uint8_t *)c->valid.p)[row / 8] |= (uint8_t)(1u << (row % 8));
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

/* ---- the Reader type -------------------------------------------------------- */

#define MAX_BATCH 10000

/* One partition range [pos, end) of a task; pos advances as records arrive.
 * coord: what the rows' partition column holds (the source's partition id:
 * the Kafka partition itself for a one-topic source). rkt: the topic handle
 * its messages were last matched by (a cache of the name comparison). */
typedef struct {
    char *topic;
    const void *rkt;
    int32_t partition, coord;
    int64_t pos, end;
} range_t;

static void
ranges_free(range_t *ranges, Py_ssize_t n)
{
    if (ranges == NULL)
        return;
    for (Py_ssize_t i = 0; i < n; i++)
        free(ranges[i].topic);
    free(ranges);
}

typedef struct {
    PyObject_HEAD
    rk_t *rk;
    rk_queue_t *queue;
    range_t *ranges;
    Py_ssize_t nranges;
    Py_ssize_t last; /* the range the previous message belonged to */
    int64_t rows;
    buf_t parts, offs, stamps, stamp_valid;
    int64_t stamp_nulls;
    bincol_t keys, values;
    /* with headers: per record the list offsets into the headers' names and values */
    int headers;
    int64_t nheaders;
    buf_t hdr_offs;
    bincol_t hdr_names, hdr_values;
    rk_message_t *msgs[MAX_BATCH];
} Reader;

static void
reader_reset_rows(Reader *r)
{
    r->rows = 0;
    r->parts.len = r->offs.len = r->stamps.len = r->stamp_valid.len = 0;
    r->stamp_nulls = 0;
    bincol_reset(&r->keys);
    bincol_reset(&r->values);
    int32_t zero = 0;
    r->nheaders = 0;
    r->hdr_offs.len = 0;
    buf_put(&r->hdr_offs, &zero, sizeof zero);
    bincol_reset(&r->hdr_names);
    bincol_reset(&r->hdr_values);
}

static void
reader_close_handle(Reader *r)
{
    if (r->queue != NULL) {
        rk.queue_destroy(r->queue);
        r->queue = NULL;
    }
    if (r->rk != NULL) {
        Py_BEGIN_ALLOW_THREADS
        rk.consumer_close(r->rk);
        rk.destroy(r->rk);
        Py_END_ALLOW_THREADS
        r->rk = NULL;
    }
}

static void
Reader_dealloc(Reader *r)
{
    reader_close_handle(r);
    ranges_free(r->ranges, r->nranges);
    free(r->parts.p);
    free(r->offs.p);
    free(r->stamps.p);
    free(r->stamp_valid.p);
    bincol_free(&r->keys);
    bincol_free(&r->values);
    free(r->hdr_offs.p);
    bincol_free(&r->hdr_names);
    bincol_free(&r->hdr_values);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

/* Reader(conf: dict[str, str]) */
static int
Reader_init(Reader *r, PyObject *args, PyObject *kwds)
{
    PyObject *conf_dict;
    static char *kwlist[] = {"conf", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!", kwlist, &PyDict_Type, &conf_dict))
        return -1;
    if (!rk.loaded) {
        PyErr_SetString(PyExc_RuntimeError, "librdkafka is not loaded: call load(path) first");
        return -1;
    }
    if (r->rk != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Reader is already initialised");
        return -1;
    }
    char errstr[512];
    rk_conf_t *conf = rk.conf_new();
    PyObject *k, *v;
    Py_ssize_t i = 0;
    while (PyDict_Next(conf_dict, &i, &k, &v)) {
        const char *ks = PyUnicode_Check(k) ? PyUnicode_AsUTF8(k) : NULL;
        const char *vs = ks && PyUnicode_Check(v) ? PyUnicode_AsUTF8(v) : NULL;
        if (vs == NULL) {
            rk.conf_destroy(conf);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "conf keys and values must be str");
            return -1;
        }
        if (rk.conf_set(conf, ks, vs, errstr, sizeof errstr) != RK_CONF_OK) {
            rk.conf_destroy(conf);
            PyErr_Format(PyExc_ValueError, "%s", errstr);
            return -1;
        }
    }
    rk_t *h = rk.new_(RK_CONSUMER, conf, errstr, sizeof errstr); /* takes conf */
    if (h == NULL) {
        rk.conf_destroy(conf);
        PyErr_Format(PyExc_ValueError, "%s", errstr);
        return -1;
    }
    rk.poll_set_consumer(h);
    r->rk = h;
    r->queue = rk.queue_get_consumer(h);
    reader_reset_rows(r);
    return 0;
}

static int
reader_ready(Reader *r)
{
    if (r->rk == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Reader is closed");
        return 0;
    }
    return 1;
}

/*
 * assign(topic, ranges, headers=False) -> None or (code, text)
 * ranges: a sequence of (partition, start, end) of topic, or of
 * (coord, start, end, topic, partition) for ranges of several topics (the
 * rows of such a range carry coord as their partition); one per partition.
 * All of them are assigned at once, each at its start, so that librdkafka
 * fetches them together; records of every range arrive interleaved.
 * headers: collect each record's headers too (take() returns them).
 */
static PyObject *
Reader_assign(Reader *r, PyObject *args)
{
    const char *topic;
    PyObject *seq;
    int headers = 0;
    if (!PyArg_ParseTuple(args, "sO|p", &topic, &seq, &headers))
        return NULL;
    if (!reader_ready(r))
        return NULL;
    PyObject *fast = PySequence_Fast(seq, "ranges must be a sequence");
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    range_t *ranges = calloc(n > 0 ? (size_t)n : 1, sizeof *ranges);
    if (ranges == NULL) {
        Py_DECREF(fast);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(fast, i);
        int coord, partition;
        long long start, end;
        const char *name = topic;
        int ok = PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 5
                     ? PyArg_ParseTuple(item, "iLLsi", &coord, &start, &end, &name, &partition)
                     : PyArg_ParseTuple(item, "iLL", &partition, &start, &end);
        if (ok && !(PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 5))
            coord = partition;
        char *copy = ok ? strdup(name) : NULL;
        if (ok && copy == NULL)
            PyErr_NoMemory();
        for (Py_ssize_t j = 0; copy != NULL && j < i; j++) {
            if (ranges[j].partition == partition && strcmp(ranges[j].topic, copy) == 0) {
                PyErr_Format(PyExc_ValueError, "partition %d of %s is in two ranges", partition,
                             copy);
                free(copy);
                copy = NULL;
            }
        }
        if (copy == NULL) {
            ranges_free(ranges, i);
            Py_DECREF(fast);
            return NULL;
        }
        ranges[i].topic = copy;
        ranges[i].partition = partition;
        ranges[i].coord = coord;
        ranges[i].pos = start;
        ranges[i].end = end;
    }
    Py_DECREF(fast);
    ranges_free(r->ranges, r->nranges);
    r->ranges = ranges;
    r->nranges = n;
    r->last = 0;
    r->headers = headers;
    reader_reset_rows(r);
    rk_tp_list_t *l = rk.tpl_new((int)(n > 0 ? n : 1));
    for (Py_ssize_t i = 0; i < n; i++)
        rk.tpl_add(l, ranges[i].topic, ranges[i].partition)->offset = ranges[i].pos;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = rk.assign(r->rk, l);
    Py_END_ALLOW_THREADS
    rk.tpl_destroy(l);
    if (err)
        return Py_BuildValue("(is)", err, rk.err2str(err));
    Py_RETURN_NONE;
}

static PyObject *
Reader_unassign(Reader *r, PyObject *Py_UNUSED(ignored))
{
    if (!reader_ready(r))
        return NULL;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = rk.assign(r->rk, NULL);
    Py_END_ALLOW_THREADS
    ranges_free(r->ranges, r->nranges);
    r->ranges = NULL;
    r->nranges = 0;
    if (err)
        return Py_BuildValue("(is)", err, rk.err2str(err));
    Py_RETURN_NONE;
}

/*
 * learn(timeout_ms) -> None or (code, text): fetch every topic's metadata
 * into the consumer's cache. A partition assigned of a topic the consumer has
 * no metadata of waits for librdkafka's periodic topic scan before its first
 * fetch (about 0.8 s measured on a local broker); with the topic in the cache
 * it is fetched at once.
 */
static PyObject *
Reader_learn(Reader *r, PyObject *args)
{
    int timeout_ms;
    if (!PyArg_ParseTuple(args, "i", &timeout_ms))
        return NULL;
    if (!reader_ready(r))
        return NULL;
    const void *md = NULL;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = rk.metadata(r->rk, 1, NULL, &md, timeout_ms);
    Py_END_ALLOW_THREADS
    if (md != NULL)
        rk.metadata_destroy(md);
    if (err)
        return Py_BuildValue("(is)", err, rk.err2str(err));
    Py_RETURN_NONE;
}

/*
 * advance() -> [(coord, pos, end), ...] of the ranges not read to their end.
 * Transaction markers and aborted records are never delivered: the consumer's
 * position (the next offset it will deliver) tells how far each log was read.
 */
static PyObject *
Reader_advance(Reader *r, PyObject *Py_UNUSED(ignored))
{
    if (!reader_ready(r))
        return NULL;
    rk_tp_list_t *l = rk.tpl_new((int)(r->nranges > 0 ? r->nranges : 1));
    for (Py_ssize_t i = 0; i < r->nranges; i++)
        if (r->ranges[i].pos < r->ranges[i].end)
            rk.tpl_add(l, r->ranges[i].topic, r->ranges[i].partition);
    if (l->cnt > 0 && rk.position(r->rk, l) == 0) {
        for (int k = 0; k < l->cnt; k++) {
            for (Py_ssize_t i = 0; i < r->nranges; i++) {
                range_t *g = &r->ranges[i];
                if (g->partition == l->elems[k].partition && l->elems[k].offset >= 0
                    && strcmp(g->topic, l->elems[k].topic) == 0) {
                    int64_t p = l->elems[k].offset < g->end ? l->elems[k].offset : g->end;
                    if (p > g->pos)
                        g->pos = p;
                }
            }
        }
    }
    rk.tpl_destroy(l);
    PyObject *left = PyList_New(0);
    if (left == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < r->nranges; i++) {
        range_t *g = &r->ranges[i];
        if (g->pos >= g->end)
            continue;
        PyObject *t = Py_BuildValue("(iLL)", g->coord, (long long)g->pos, (long long)g->end);
        if (t == NULL || PyList_Append(left, t) < 0) {
            Py_XDECREF(t);
            Py_DECREF(left);
            return NULL;
        }
        Py_DECREF(t);
    }
    return left;
}

static int
same_topic(range_t *g, const void *rkt)
{
    if (g->rkt == rkt)
        return 1;
    if (strcmp(rk.topic_name(rkt), g->topic) != 0)
        return 0;
    g->rkt = rkt; /* the handle stays alive while its partitions are assigned */
    return 1;
}

/* The range of a message's topic and partition, or NULL. */
static range_t *
find_range(Reader *r, const rk_message_t *m)
{
    if (r->nranges == 0 || m->rkt == NULL)
        return NULL;
    range_t *g = &r->ranges[r->last];
    if (g->partition == m->partition && same_topic(g, m->rkt))
        return g;
    for (Py_ssize_t i = 0; i < r->nranges; i++) {
        g = &r->ranges[i];
        if (g->partition == m->partition && same_topic(g, m->rkt)) {
            r->last = i;
            return g;
        }
    }
    return NULL;
}

/* Append one record; 0 ok, -1 out of memory, -2 over the 32-bit offsets. */
static int
append(Reader *r, const rk_message_t *m, int32_t partition)
{
    int64_t row = r->rows;
    int tstype = RK_TIMESTAMP_NOT_AVAILABLE;
    int64_t ts = rk.message_timestamp(m, &tstype);
    if (row % 8 == 0) {
        uint8_t zero = 0;
        if (buf_put(&r->stamp_valid, &zero, 1) < 0)
            return -1;
    }
    if (tstype != RK_TIMESTAMP_NOT_AVAILABLE)
        ((uint8_t *)r->stamp_valid.p)[row / 8] |= (uint8_t)(1u << (row % 8));
    else {
        ts = 0;
        r->stamp_nulls++;
    }
    int rc = bincol_put(&r->keys, row, m->key, m->key_len);
    if (rc == 0)
        rc = bincol_put(&r->values, row, m->payload, m->len);
    if (rc == 0 && r->headers) {
        /* every header in order, duplicates kept; a null value stays null */
        rk_headers_t *hdrs = NULL;
        if (rk.message_headers(m, &hdrs) == 0 && hdrs != NULL) {
            size_t cnt = rk.header_cnt(hdrs);
            for (size_t i = 0; rc == 0 && i < cnt; i++) {
                const char *name;
                const void *value;
                size_t size;
                if (rk.header_get_all(hdrs, i, &name, &value, &size) != 0)
                    break;
                rc = bincol_put(&r->hdr_names, r->nheaders, name, strlen(name));
                if (rc == 0)
                    rc = bincol_put(&r->hdr_values, r->nheaders, value, size);
                if (rc == 0)
                    r->nheaders++;
            }
        }
        if (rc == 0 && r->nheaders > INT32_MAX)
            rc = -2;
        int32_t end = (int32_t)r->nheaders;
        if (rc == 0 && buf_put(&r->hdr_offs, &end, sizeof end) < 0)
            rc = -1;
    }
    if (rc == 0 && (buf_put(&r->parts, &partition, 4) < 0 || buf_put(&r->offs, &m->offset, 8) < 0
                    || buf_put(&r->stamps, &ts, 8) < 0))
        rc = -1;
    if (rc == 0)
        r->rows = row + 1;
    return rc;
}

/*
 * poll(max_messages, timeout_ms) -> (received, error)
 *
 * One rd_kafka_consume_batch_queue call. A record of a range with
 * pos <= offset < end is appended to the pending buffers and advances pos;
 * one at or past end ends its range. received counts the messages delivered
 * (records and errors). error is None or (code, text, partition) for the
 * first error other than _PARTITION_EOF (partition: the coord of its range,
 * -1 when it is not a range's);
 * messages after it are dropped (the task fails and is retried whole).
 */
static PyObject *
Reader_poll(Reader *r, PyObject *args)
{
    Py_ssize_t max_messages;
    int timeout_ms;
    if (!PyArg_ParseTuple(args, "ni", &max_messages, &timeout_ms))
        return NULL;
    if (!reader_ready(r))
        return NULL;
    if (max_messages < 1)
        max_messages = 1;
    if (max_messages > MAX_BATCH)
        max_messages = MAX_BATCH;

    ssize_t n;
    int err_code = 0, failed = 0, err_partition = -1;
    char err_text[512] = "";
    Py_BEGIN_ALLOW_THREADS
    n = rk.consume_batch_queue(r->queue, timeout_ms, r->msgs, (size_t)max_messages);
    for (ssize_t i = 0; i < n; i++) {
        rk_message_t *m = r->msgs[i];
        if (err_code == 0 && failed == 0) {
            if (m->err) {
                if (m->err != RK_ERR_PARTITION_EOF) {
                    err_code = m->err;
                    range_t *g = find_range(r, m);
                    err_partition = g != NULL ? g->coord : -1;
                    if (m->payload != NULL && m->len > 0) {
                        size_t k = m->len < sizeof err_text - 1 ? m->len : sizeof err_text - 1;
                        memcpy(err_text, m->payload, k);
                        err_text[k] = 0;
                    }
                    else {
                        snprintf(err_text, sizeof err_text, "%s", rk.err2str(m->err));
                    }
                }
            }
            else {
                range_t *g = find_range(r, m);
                if (g != NULL && g->pos < g->end) {
                    if (m->offset >= g->end)
                        g->pos = g->end;
                    else if (m->offset >= g->pos) {
                        failed = append(r, m, g->coord);
                        if (failed == 0)
                            g->pos = m->offset + 1;
                    }
                }
            }
        }
        rk.message_destroy(m);
    }
    Py_END_ALLOW_THREADS
    if (failed) {
        /* The pending buffers may hold a half-appended row: drop them all. */
        reader_reset_rows(r);
        if (failed == -2) {
            PyErr_SetString(PyExc_OverflowError,
                            "more than 2 GiB of keys or values pending in one batch");
            return NULL;
        }
        return PyErr_NoMemory();
    }
    if (n < 0)
        n = 0;
    if (err_code)
        return Py_BuildValue("(n(isi))", (Py_ssize_t)n, err_code, err_text, err_partition);
    return Py_BuildValue("(nO)", (Py_ssize_t)n, Py_None);
}

static PyObject *
bytes_of(buf_t *b)
{
    return PyBytes_FromStringAndSize(b->p ? b->p : "", (Py_ssize_t)b->len);
}

/*
 * take() -> (rows, partitions, offsets, stamps, stamp_valid, stamp_nulls,
 *            key_offsets, key_data, key_valid, key_nulls,
 *            value_offsets, value_data, value_valid, value_nulls,
 *            headers, header_list_offsets, name_offsets, name_data,
 *            hvalue_offsets, hvalue_data, hvalue_valid, hvalue_nulls)
 * The pending rows as Arrow buffers (bytes), then clears them. headers: how
 * many headers the rows hold (their buffers are empty unless assign() was
 * asked for headers).
 */
static PyObject *
Reader_take(Reader *r, PyObject *Py_UNUSED(ignored))
{
    PyObject *res = Py_BuildValue(
        "(LNNNNLNNNLNNNLLNNNNNNL)", (long long)r->rows, bytes_of(&r->parts),
        bytes_of(&r->offs), bytes_of(&r->stamps),
        bytes_of(&r->stamp_valid), (long long)r->stamp_nulls, bytes_of(&r->keys.offsets),
        bytes_of(&r->keys.data), bytes_of(&r->keys.valid), (long long)r->keys.nulls,
        bytes_of(&r->values.offsets), bytes_of(&r->values.data), bytes_of(&r->values.valid),
        (long long)r->values.nulls, (long long)r->nheaders, bytes_of(&r->hdr_offs),
        bytes_of(&r->hdr_names.offsets), bytes_of(&r->hdr_names.data),
        bytes_of(&r->hdr_values.offsets), bytes_of(&r->hdr_values.data),
        bytes_of(&r->hdr_values.valid), (long long)r->hdr_values.nulls);
    if (res != NULL)
        reader_reset_rows(r);
    return res;
}

static PyObject *
Reader_close(Reader *r, PyObject *Py_UNUSED(ignored))
{
    reader_close_handle(r);
    Py_RETURN_NONE;
}

static PyObject *
Reader_get_pending(Reader *r, void *Py_UNUSED(closure))
{
    return PyLong_FromLongLong(r->rows);
}

static PyObject *
Reader_get_pending_bytes(Reader *r, void *Py_UNUSED(closure))
{
    return PyLong_FromSize_t(r->keys.data.len + r->values.data.len + r->hdr_names.data.len
                             + r->hdr_values.data.len);
}

static PyMethodDef Reader_methods[] = {
    {"assign", (PyCFunction)Reader_assign, METH_VARARGS,
     "assign(topic, [(partition, start, end) | (coord, start, end, topic, partition), ...], "
     "headers=False) -> None or (code, text)"},
    {"unassign", (PyCFunction)Reader_unassign, METH_NOARGS, "unassign() -> None or (code, text)"},
    {"learn", (PyCFunction)Reader_learn, METH_VARARGS,
     "learn(timeout_ms) -> None or (code, text): every topic's metadata into the cache"},
    {"advance", (PyCFunction)Reader_advance, METH_NOARGS,
     "advance() -> [(coord, pos, end), ...]: the ranges not read to their end"},
    {"poll", (PyCFunction)Reader_poll, METH_VARARGS,
     "poll(max_messages, timeout_ms) -> (received, error)"},
    {"take", (PyCFunction)Reader_take, METH_NOARGS, "take() -> the pending rows' buffers"},
    {"close", (PyCFunction)Reader_close, METH_NOARGS, "close the consumer"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Reader_getset[] = {
    {"pending", (getter)Reader_get_pending, NULL, "rows appended since the last take()", NULL},
    {"pending_bytes", (getter)Reader_get_pending_bytes, NULL, "key, value and header bytes pending",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "reclock.sources._kafka_native.Reader",
    .tp_basicsize = sizeof(Reader),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A librdkafka consumer reading partition ranges into Arrow buffers",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Reader_init,
    .tp_dealloc = (destructor)Reader_dealloc,
    .tp_methods = Reader_methods,
    .tp_getset = Reader_getset,
};

static PyMethodDef module_methods[] = {
    {"load", load, METH_VARARGS, "load(path): resolve librdkafka's API from that library"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_kafka_native",
    .m_doc = "Kafka partition ranges read into Arrow buffers below Python",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__kafka_native(void)
{
    if (PyType_Ready(&ReaderType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL)
        return NULL;
    Py_INCREF(&ReaderType);
    if (PyModule_AddObject(m, "Reader", (PyObject *)&ReaderType) < 0) {
        Py_DECREF(&ReaderType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
