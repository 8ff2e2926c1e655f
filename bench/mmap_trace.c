/* Who maps the anonymous memory (soak.py --mmap-trace): every anonymous
 * mmap and every munmap a library makes through libc's symbols is written,
 * with the library that called it, to $MMAP_TRACE_DIR/mmap.<pid>. glibc's
 * own malloc maps its arenas and large chunks through internal calls, so
 * those never appear here: what is left unlogged is glibc's (and thread
 * stacks). Only the process it is preloaded into logs: LD_PRELOAD is taken
 * out of the environment at load, so Spark's JVM and workers run without it.
 *
 *   gcc -O2 -shared -fPIC -o /tmp/mmap_trace.so bench/mmap_trace.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

static int log_fd = -1;

__attribute__((constructor)) static void trace_open(void) {
    const char *dir = getenv("MMAP_TRACE_DIR");
    unsetenv("LD_PRELOAD");
    if (dir == NULL) {
        return;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/mmap.%d", dir, (int)getpid());
    log_fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
}

/* One line per call, written whole: "m <addr> <len> <library>" or "u ...". */
static void trace(char op, void *addr, size_t len, void *caller) {
    if (log_fd < 0) {
        return;
    }
    Dl_info info;
    const char *lib = "?";
    if (dladdr(caller, &info) != 0 && info.dli_fname != NULL && info.dli_fname[0] != '\0') {
        lib = info.dli_fname;
    }
    char line[600];
    int n = snprintf(line, sizeof line, "%c %lx %lx %s\n", op, (unsigned long)addr,
                     (unsigned long)len, lib);
    if (n > 0) {
        int saved = errno;
        ssize_t w = write(log_fd, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1);
        (void)w;
        errno = saved;
    }
}

void *mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
    void *r = (void *)syscall(SYS_mmap, addr, len, prot, flags, fd, off);
    if (r != MAP_FAILED && (flags & MAP_ANONYMOUS)) {
        trace('m', r, len, __builtin_return_address(0));
    }
    return r;
}

void *mmap64(void *addr, size_t len, int prot, int flags, int fd, off_t off)
    __attribute__((alias("mmap")));

int munmap(void *addr, size_t len) {
    int r = (int)syscall(SYS_munmap, addr, len);
    if (r == 0) {
        trace('u', addr, len, __builtin_return_address(0));
    }
    return r;
}
