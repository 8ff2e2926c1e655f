/*
 * Growing byte buffers, shared by reclock's C extensions
 * (reclock/_json_native.c, sources/_kafka_native.c): each collects Arrow
 * buffers (values, offsets, bitmaps) of unknown final size.
 */
#ifndef RECLOCK_BUFFERS_H
#define RECLOCK_BUFFERS_H

#include <stdlib.h>
#include <string.h>

typedef struct {
    char *p;
    size_t len, cap;
} buf_t;

/* Room for `more` bytes after len; 0, or -1 when out of memory. */
static int
buf_reserve(buf_t *b, size_t more)
{
    if (b->len + more <= b->cap)
        return 0;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + more)
        cap *= 2;
    char *p = realloc(b->p, cap);
    if (p == NULL)
        return -1;
    b->p = p;
    b->cap = cap;
    return 0;
}

/* Append n bytes from src; 0, or -1 when out of memory. */
static int
buf_put(buf_t *b, const void *src, size_t n)
{
    if (buf_reserve(b, n) < 0)
        return -1;
    if (n)
        memcpy(b->p + b->len, src, n);
    b->len += n;
    return 0;
}

#endif
