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

int fsync(int fd) {
    static int (*real)(int) = NULL;
    if (real == NULL) {
        real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    }
    wait_first();
    return real(fd);
}

int fdatasync(int fd) {
    static int (*real)(int) = NULL;
    if (real == NULL) {
        real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    }
    wait_first();
    return real(fd);
}
