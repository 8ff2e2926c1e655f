/* A stand-in for a slower disk (mint_bench.py --fsync-ms): fsync and
 * fdatasync wait SLOW_FSYNC_US microseconds before syncing. Preloaded into
 * a benchmark's child processes only (LD_PRELOAD). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <unistd.h>

static void wait_first(void) {
    const char *us = getenv("SLOW_FSYNC_US");
    if (us != NULL) {
        usleep((useconds_t)atoi(us));
    }
}

/* The real call, looked up once into *real, after the wait. */
static int synced(int (**real)(int), const char *name, int fd) {
    if (*real == NULL) {
        *real = (int (*)(int))dlsym(RTLD_NEXT, name);
    }
    wait_first();
    return (*real)(fd);
}

int fsync(int fd) {
    static int (*real)(int) = NULL;
    return synced(&real, "fsync", fd);
}

int fdatasync(int fd) {
    static int (*real)(int) = NULL;
    return synced(&real, "fdatasync", fd);
}
