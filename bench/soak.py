"""Long-uptime soak of one driver: a counter generator (2,000 records/s by
default) and an order stream with keyed (upsert) outputs, to file (Delta)
outputs at a 1 s interval on ``local[2]`` with the SQLite remap store and the
HTTP status endpoint on, all in this process (the pipeline runs in a thread,
exactly as ``reclock run`` runs it). Every ``--every`` seconds it samples the
process and prints one row; at the end, the first sample after the warm-up
against the last, and the slope over the run.

    python bench/soak.py --minutes 60
    python bench/soak.py --minutes 10 --tracemalloc       # Python allocations too
    python bench/soak.py --minutes 10 --jemalloc-conf ''  # delta-rs's jemalloc defaults

Columns: ``rss`` the driver's resident set (MiB) and ``anon`` its anonymous
part; ``py`` the bytes Python allocated (``tracemalloc``'s current size, with
``--tracemalloc``); ``heap`` glibc malloc's in-use bytes and ``free`` its
free-but-held bytes (``mallinfo2``); ``sqlite`` what SQLite allocated (through
glibc's malloc: the page caches of the remap store's connections and of each
keyed output's key state); ``glibc`` / ``mimal`` / ``other`` /
``stacks`` the anonymous memory by who mapped it (:func:`native_breakdown`);
``rel`` the RSS after :func:`release_native` (``--probe-release``);
``arrow`` Arrow's pool (``pyarrow.total_allocated_bytes``); ``thr`` threads
(``tokio`` of them delta-rs's runtime threads); ``fds`` open file
descriptors; ``jvm`` the Spark driver JVM's RSS and ``wrk`` the Python
workers' total RSS (MiB); ``tick50`` / ``tickmx`` the median and largest
source tick in the window (ms); ``objs`` gc-tracked objects; ``rows``
records read so far; ``pya`` Python's object arenas (1 MiB each), ``pyblk``
its live blocks, ``pyfree`` free blocks in its pools in use, ``pypool`` its
empty pools (MiB, from ``sys._debugmallocstats``).
"""

from __future__ import annotations

import argparse
import bisect
import ctypes
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

MIB = 1 << 20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]


def _libc() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        return libc
    except (OSError, AttributeError):
        return None


LIBC = _libc()


def _sqlite() -> Any:
    """The libsqlite3 Python's sqlite3 module is linked to (its memory
    counters are process-wide), or None (a statically linked one)."""
    try:
        lib = ctypes.CDLL("libsqlite3.so.0")
        lib.sqlite3_status64.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int64),
                                         ctypes.POINTER(ctypes.c_int64), ctypes.c_int]
        return lib
    except (OSError, AttributeError):
        return None


SQLITE = _sqlite()


def sqlite_memory() -> float | None:
    """MiB SQLite has allocated in this process (page caches of every
    connection: the remap store's pool, each keyed output's key state)."""
    if SQLITE is None:
        return None
    cur, hi = ctypes.c_int64(), ctypes.c_int64()
    if SQLITE.sqlite3_status64(0, ctypes.byref(cur), ctypes.byref(hi), 0) != 0:  # MEMORY_USED
        return None
    return cur.value / MIB


def proc_status(pid: int | str = "self") -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "RssAnon", "RssFile", "Threads", "PPid"):
                    out[k] = int(v.split()[0])
    except OSError:
        pass
    return out


def descendants(root: int) -> list[tuple[int, str]]:
    """(pid, comm) of every process below ``root``."""
    children: dict[int, list[int]] = defaultdict(list)
    comm: dict[int, str] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        st = proc_status(d)
        if "PPid" in st:
            children[st["PPid"]].append(int(d))
            try:
                with open(f"/proc/{d}/comm") as f:
                    comm[int(d)] = f.read().strip()
            except OSError:
                comm[int(d)] = "?"
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append((c, comm.get(c, "?")))
            todo.append(c)
    return out


def thread_names() -> dict[str, int]:
    names: dict[str, int] = defaultdict(int)
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names[f.read().strip()] += 1
        except OSError:
            pass
    return dict(names)


def _thread_kind(name: str) -> str:
    """A Python thread's name without its number (``jobs-counter``, ``Thread``)."""
    return re.sub(r"[-_ ]?\d+.*$", "", name) or name


class _PthreadAttr(ctypes.Structure):
    _fields_ = [("opaque", ctypes.c_char * 64)]  # pthread_attr_t: 56 bytes on x86-64


def python_thread_stacks() -> list[tuple[int, int, str]]:
    """(low, high, name) of each live Python thread's stack, from glibc's
    ``pthread_getattr_np`` (a Thread's ``ident`` is its ``pthread_t``)."""
    out: list[tuple[int, int, str]] = []
    if LIBC is None:
        return out
    for t in threading.enumerate():
        if t.ident is None or not t.is_alive():
            continue
        attr = _PthreadAttr()
        if LIBC.pthread_getattr_np(ctypes.c_ulong(t.ident), ctypes.byref(attr)) != 0:
            continue
        addr, size = ctypes.c_void_p(), ctypes.c_size_t()
        if LIBC.pthread_attr_getstack(ctypes.byref(attr), ctypes.byref(addr),
                                      ctypes.byref(size)) == 0 and addr.value:
            out.append((addr.value, addr.value + size.value, _thread_kind(t.name)))
        LIBC.pthread_attr_destroy(ctypes.byref(attr))
    return out


def native_stack_pointers() -> list[tuple[int, str]]:
    """(stack pointer, name) of each thread blocked in a system call, from
    /proc/self/task/*/syscall (its next-to-last field), for the threads
    Python did not start (Arrow's, delta-rs's tokio and jemalloc threads)."""
    out: list[tuple[int, str]] = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/syscall") as f:
                fields = f.read().split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        if len(fields) >= 3 and fields[-2].startswith("0x"):
            out.append((int(fields[-2], 16), re.sub(r"[-_ ]?\d+$", "", comm) or comm))
    return out


def native_breakdown() -> dict[str, Any]:
    """The process's anonymous memory (MiB) by who most likely mapped it, from
    /proc/self/smaps: ``glibc`` the main heap and the 64 MiB-aligned thread
    arenas; ``mimalloc`` Arrow's pool (its 1 GiB arenas); ``stacks`` thread
    stacks (2 and 8 MiB mappings right above a guard page: two of the
    interpreter's 1 MiB arenas side by side merge into one 2 MiB mapping,
    which is not a stack); ``other`` the rest (delta-rs's jemalloc,
    the interpreter's own mmaps, ...). ``stack_by``: the stacks' resident
    MiB by Python thread name (``main``), else by the name of the thread
    whose stack pointer is in it (:func:`native_stack_pointers`);
    ``unmatched``: a thread running at the time, or a stack no live thread
    uses (glibc caches exited threads' stacks, resident pages and all)."""
    out: dict[str, Any] = dict.fromkeys(("glibc", "mimalloc", "stacks", "other"), 0.0)
    ranges = python_thread_stacks()
    sps = native_stack_pointers()
    by: dict[str, float] = defaultdict(float)
    start = size = 0
    name = ""
    guarded = False  # the mapping right below is a one-page guard (no access)
    below = (0, "")  # the end and permissions of the mapping before
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                if "-" in line[:20] and not line[0].isupper():
                    rng, _, rest = line.partition(" ")
                    a, _, b = rng.partition("-")
                    start, size = int(a, 16), (int(b, 16) - int(a, 16)) >> 10
                    parts = rest.split(None, 4)
                    name = parts[4].strip() if len(parts) > 4 else ""
                    guarded = below == (start, "---p")
                    below = (int(b, 16), parts[0] if size == 4 else "")
                elif line.startswith("Anonymous:"):
                    kb = int(line.split()[1])
                    if not kb:
                        continue
                    if name == "[heap]" or (not name and start % (64 << 20) == 0
                                            and size <= 65536):
                        k = "glibc"
                    elif not name and size >= 1 << 20:
                        k = "mimalloc"
                    elif name == "[stack]" or (not name and size in (2048, 8192) and guarded):
                        k = "stacks"
                        end = start + (size << 10)
                        who = "main" if name == "[stack]" else next(
                            (n for lo, hi, n in ranges if lo <= start < hi), None) or next(
                            (n for sp, n in sps if start <= sp < end), "unmatched")
                        by[who] += kb / 1024
                    else:
                        k = "other"
                    out[k] += kb / 1024
    except OSError:
        pass
    out["stack_by"] = {k: round(v, 2) for k, v in sorted(by.items())}
    return out


class MmapOwners:
    """The driver's resident anonymous memory by the library that mapped it
    (``--mmap-trace``): bench/mmap_trace.c, preloaded, logs every anonymous
    mmap and munmap made through libc's symbols with its caller's library;
    this replays the log into the live mappings and counts their resident
    pages from /proc/self/pagemap. glibc's malloc maps its arenas, its large
    chunks and thread stacks through internal calls, so what no logged
    mapping holds is theirs (``unlogged``)."""

    SHIM = Path(__file__).with_name("mmap_trace.c")

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pos = 0
        self.starts: list[int] = []          # sorted starts of live mappings
        self.spans: dict[int, tuple[int, str]] = {}  # start -> (end, library)

    @classmethod
    def preload(cls, out_dir: Path) -> dict[str, str]:
        """The environment that preloads the shim (compiled into out_dir)."""
        so = out_dir / "mmap_trace.so"
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(so), str(cls.SHIM), "-ldl"],
                       check=True)
        return {"LD_PRELOAD": str(so), "MMAP_TRACE_DIR": str(out_dir)}

    def _cut(self, a: int, b: int) -> None:
        i = max(bisect.bisect_right(self.starts, a) - 1, 0)
        hit = []
        while i < len(self.starts) and self.starts[i] < b:
            s = self.starts[i]
            if self.spans[s][0] > a:
                hit.append(s)
            i += 1
        for s in hit:
            e, lib = self.spans.pop(s)
            self.starts.remove(s)
            if s < a:
                self._add(s, a, lib)
            if e > b:
                self._add(b, e, lib)

    def _add(self, a: int, b: int, lib: str) -> None:
        bisect.insort(self.starts, a)
        self.spans[a] = (b, lib)

    def _replay(self) -> None:
        with open(self.path, "rb") as f:
            f.seek(self.pos)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.pos += end
        for line in data[:end].decode(errors="replace").splitlines():
            op, a_hex, n_hex, lib = line.split(" ", 3)
            a = int(a_hex, 16)
            b = a + ((int(n_hex, 16) + 4095) & ~4095)
            self._cut(a, b)
            if op == "m":
                self._add(a, b, os.path.basename(lib))

    def resident(self) -> dict[str, float]:
        """MiB resident per library, and ``unlogged`` (the process's anonymous
        resident memory no logged mapping holds)."""
        import numpy as np

        self._replay()
        out: dict[str, float] = defaultdict(float)
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
        try:
            for s in list(self.starts):
                e, lib = self.spans[s]
                pages = (e - s) >> 12
                raw = os.pread(fd, pages * 8, (s >> 12) * 8)
                present = (np.frombuffer(raw, dtype=np.uint64) >> np.uint64(63)).sum()
                out[lib] += int(present) * 4096 / MIB
        finally:
            os.close(fd)
        anon = 0
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Anonymous:"):
                    anon = int(line.split()[1])
        out["unlogged"] = anon / 1024 - sum(out.values())
        return dict(out)


_PYMALLOC_KEYS = {
    "# arenas allocated current": "pya",
    "# bytes in allocated blocks": "pyblk",
    "# bytes in available blocks": "pyfree",
}


def pymalloc_stats() -> dict[str, float]:
    """Python's small-object allocator, from ``sys._debugmallocstats`` (which
    writes to the C stderr; it is pointed at a file for the call): ``pya``
    the object arenas held (MiB, 1 MiB each on 3.10+), ``pyblk`` the bytes
    in live blocks, ``pyfree`` free blocks inside pools in use, ``pypools``
    pools empty but kept in an arena. Arenas growing while live blocks stay
    flat is fragmentation, not a leak."""
    import tempfile

    with tempfile.TemporaryFile("w+") as f:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(f.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(0)
        text = f.read()
    out: dict[str, float] = {}
    for line in text.splitlines():
        head, _, val = line.partition("=")
        head = head.strip()
        num = val.strip().replace(",", "")
        if not num.isdigit():
            continue
        if head in _PYMALLOC_KEYS:
            key = _PYMALLOC_KEYS[head]
            out[key] = int(num) if key == "pya" else int(num) / MIB
        elif "unused pools *" in head:
            out["pypools"] = int(num) / MIB
    return out


def release_native() -> None:
    """Hand back what the allocators hold free: Arrow's pool (mimalloc) and
    glibc's malloc (``malloc_trim``). delta-rs's jemalloc has no handle here."""
    import pyarrow as pa

    pa.default_memory_pool().release_unused()
    if LIBC is not None:
        LIBC.malloc_trim(0)


class Ticks:
    """Durations of SourceRunner.tick, per source, since the last take()."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.window: list[float] = []

    def install(self) -> None:
        from reclock.runtime.driver import SourceRunner

        orig = SourceRunner.tick
        ticks = self

        def tick(runner: Any) -> bool:
            t0 = time.perf_counter()
            try:
                return orig(runner)
            finally:
                with ticks.lock:
                    ticks.window.append((time.perf_counter() - t0) * 1000)

        SourceRunner.tick = tick  # type: ignore[method-assign,assignment]

    def take(self) -> list[float]:
        with self.lock:
            w, self.window = self.window, []
        return w


def sample(t0: float, ticks: Ticks, runners: list[Any], traced: bool,
           owners: MmapOwners | None = None) -> dict[str, Any]:
    import pyarrow as pa

    st = proc_status()
    s: dict[str, Any] = {
        "min": (time.monotonic() - t0) / 60,
        "rss": st.get("VmRSS", 0) / 1024, "anon": st.get("RssAnon", 0) / 1024,
        "thr": st.get("Threads", 0),
        "fds": len(os.listdir("/proc/self/fd")),
        "arrow": pa.total_allocated_bytes() / MIB,
    }
    names = thread_names()
    s["tokio"] = sum(n for k, n in names.items() if k.startswith("tokio"))
    s["threads_by_name"] = names
    py: dict[str, int] = defaultdict(int)
    for t in threading.enumerate():
        py[_thread_kind(t.name)] += 1
    s["python_threads"] = dict(py)
    s.update(native_breakdown())
    if LIBC is not None:
        mi = LIBC.mallinfo2()
        s["heap"] = (mi.uordblks + mi.hblkhd) / MIB
        s["free"] = mi.fordblks / MIB
        s["arena"] = mi.arena / MIB
    s["sqlite"] = sqlite_memory()
    if traced:
        import tracemalloc

        s["py"] = tracemalloc.get_traced_memory()[0] / MIB
    jvm = wrk = 0.0
    for pid, comm in descendants(os.getpid()):
        rss = proc_status(pid).get("VmRSS", 0) / 1024
        if comm == "java":
            jvm += rss
        elif comm.startswith("python") or comm.startswith("pyspark"):
            wrk += rss
    s["jvm"], s["wrk"] = jvm, wrk
    w = ticks.take()
    s["tick50"] = statistics.median(w) if w else 0.0
    s["tickmax"] = max(w) if w else 0.0
    s["ticks"] = len(w)
    s["rows"] = sum(r.records for r in runners)
    s["objs"] = len(gc.get_objects())
    s.update(pymalloc_stats())
    if owners is not None:
        s["owners"] = owners.resident()
    return s


COLS = [("min", "min", "{:6.1f}"), ("rss", "rss", "{:6.0f}"), ("anon", "anon", "{:6.0f}"),
        ("py", "py", "{:6.1f}"), ("heap", "heap", "{:6.1f}"), ("free", "free", "{:6.1f}"),
        ("sqlite", "sqlite", "{:6.1f}"),
        ("glibc", "glibc", "{:6.1f}"), ("mimalloc", "mimal", "{:6.1f}"),
        ("other", "other", "{:6.1f}"), ("stacks", "stacks", "{:6.1f}"),
        ("rss_released", "rel", "{:6.0f}"), ("arrow", "arrow", "{:6.1f}"),
        ("thr", "thr", "{:4d}"), ("tokio", "tokio", "{:5d}"),
        ("fds", "fds", "{:4d}"), ("jvm", "jvm", "{:6.0f}"), ("wrk", "wrk", "{:6.0f}"),
        ("tick50", "tick50", "{:6.0f}"), ("tickmax", "tickmx", "{:6.0f}"),
        ("objs", "objs", "{:7d}"), ("pya", "pya", "{:4d}"), ("pyblk", "pyblk", "{:6.1f}"),
        ("pyfree", "pyfree", "{:6.1f}"), ("pypools", "pypool", "{:6.1f}"),
        ("rows", "rows", "{:10,d}")]


def row(s: dict[str, Any]) -> str:
    out = []
    for key, head, fmt in COLS:
        w = len(fmt.format(0) if "d" in fmt else fmt.format(0.0))
        w = max(w, len(head))
        v = s.get(key)
        out.append("-".rjust(w) if v is None else fmt.format(v).rjust(w))
    return " ".join(out)


def header() -> str:
    out = []
    for _key, head, fmt in COLS:
        w = max(len(fmt.format(0) if "d" in fmt else fmt.format(0.0)), len(head))
        out.append(head.rjust(w))
    return " ".join(out)


def slope_per_hour(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (minutes), per hour."""
    if len(xs) < 3:
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    num = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    return 0.0 if den == 0 else 60 * num / den


def config_text(state: Path, rate: int, orders_rate: int, interval: str, master: str,
                release_memory: bool = True, key_cache: str | None = None,
                vacuum_every: str | None = None) -> str:
    src = [
        "  - name: counter",
        f"    generator: {{kind: counter, rate: {rate}, value_format: json, bad_every: 1000}}",
        "    outputs:",
        "      - name: counter",
        "        format: {type: json, schema: {n: int64, payload: string, even: bool}}",
        "        sink: file",
    ]
    if orders_rate:
        src += [
            "  - name: shop",
            f"    generator: {{kind: orders, rate: {orders_rate}}}",
            "    outputs:",
            "      - name: customers",
            "        envelope: {type: upsert, key: [customer_id]}",
            "        sink: file",
            "      - name: orders",
            "        sink: file",
        ]
    return "\n".join([
        f"state_dir: {json.dumps(str(state))}",
        f"timestamp_interval: {interval}",
        "http: {host: 127.0.0.1, port: 0}",
        f"housekeeping: {{release_memory: {json.dumps(release_memory)}"
        + (f", key_state_cache: {json.dumps(key_cache)}" if key_cache else "")
        + (f", vacuum_every: {vacuum_every}" if vacuum_every else "") + "}",
        "spark:",
        f"  master: {json.dumps(master)}",
        "  conf: {spark.sql.shuffle.partitions: '2'}",
        "sources:",
        *src,
    ]) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--every", type=float, default=60.0, help="seconds between samples")
    ap.add_argument("--warmup", type=float, default=2.0,
                    help="minutes before the 'start' sample of the summary")
    ap.add_argument("--rate", type=int, default=2000, help="counter records/s")
    ap.add_argument("--orders-rate", type=int, default=200,
                    help="order stream records/s (keyed outputs; 0: none)")
    ap.add_argument("--interval", default="1s")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--tracemalloc", action="store_true",
                    help="trace Python allocations (slower); the py column")
    ap.add_argument("--trace-frames", type=int, default=1, metavar="N",
                    help="with --tracemalloc: frames kept per allocation; over 1, the "
                         "growth is shown by call stack rather than by line")
    ap.add_argument("--jemalloc-conf", metavar="CONF",
                    help="delta-rs's jemalloc settings (_RJEM_MALLOC_CONF; '' for the "
                         "library's defaults; default: the one the sinks package sets)")
    ap.add_argument("--probe-release", action="store_true",
                    help="after each sample, release what the allocators hold free "
                         "(Arrow's pool, malloc_trim) and show the RSS after (rel)")
    ap.add_argument("--no-release-memory", action="store_true",
                    help="housekeeping release_memory: false (the driver keeps what the "
                         "allocators hold free after a compaction pass)")
    ap.add_argument("--key-cache", metavar="SIZE",
                    help="housekeeping key_state_cache (the keyed outputs' SQLite page "
                         "cache, all together; default: the pipeline's default)")
    ap.add_argument("--vacuum-every", metavar="DURATION",
                    help="housekeeping vacuum_every (default 1m; every 60th pass reads "
                         "the whole table in a child: 5s brings the hour's one forward)")
    ap.add_argument("--arrow-pool", choices=["mimalloc", "jemalloc", "system"],
                    help="Arrow's default memory pool (ARROW_DEFAULT_MEMORY_POOL; default: "
                         "Arrow's own choice, mimalloc on Linux wheels)")
    ap.add_argument("--state", type=Path, help="state directory (default: a temporary one)")
    ap.add_argument("--json", type=Path, help="also write every sample here (JSON lines)")
    ap.add_argument("--mmap-trace", type=Path, metavar="DIR",
                    help="preload bench/mmap_trace.c (gcc) and show the anonymous resident "
                         "memory by the library that mapped it; its log goes to DIR")
    ap.add_argument("--summarize", type=Path, metavar="JSON",
                    help="run nothing: print the summary and verdict of the samples a "
                         "--json run wrote")
    args = ap.parse_args()
    if args.summarize is not None:
        samples = [json.loads(line) for line in args.summarize.read_text().splitlines()
                   if line.strip()]
        summary(samples, args.warmup)
        owners_summary(samples, args.warmup)
        return 0 if verdicts(samples, args.warmup, _key_budget(args.key_cache)) else 1
    if args.mmap_trace is not None and "MMAP_TRACE_DIR" not in os.environ:
        args.mmap_trace.mkdir(parents=True, exist_ok=True)  # preloaded from the start
        os.environ.update(MmapOwners.preload(args.mmap_trace.resolve()))
        os.execv(sys.executable, [sys.executable, *sys.argv])
    owners = (MmapOwners(Path(os.environ["MMAP_TRACE_DIR"]) / f"mmap.{os.getpid()}")
              if args.mmap_trace is not None else None)

    if args.jemalloc_conf is not None:
        os.environ["_RJEM_MALLOC_CONF"] = args.jemalloc_conf
    if args.arrow_pool is not None:  # read when pyarrow is first imported
        os.environ["ARROW_DEFAULT_MEMORY_POOL"] = args.arrow_pool
    if args.tracemalloc:
        import tracemalloc

        tracemalloc.start(max(1, args.trace_frames))
    from reclock import _allocator
    from reclock.config import parse_config
    from reclock.pipeline import run

    tmp = None
    if args.state is None:
        tmp = tempfile.TemporaryDirectory(prefix="reclock-soak-")
        state = Path(tmp.name) / "state"
    else:
        state = args.state
    text = config_text(state, args.rate, args.orders_rate, args.interval, args.master,
                       release_memory=not args.no_release_memory,
                       key_cache=args.key_cache, vacuum_every=args.vacuum_every)
    cfg = parse_config(text, "soak.yaml", base_dir=state.parent)
    ticks = Ticks()
    ticks.install()
    stop = threading.Event()
    ready = threading.Event()
    runners: list[Any] = []
    result: dict[str, Any] = {}

    def on_ready(rs: list[Any]) -> None:
        runners.extend(rs)
        ready.set()

    def target() -> None:
        try:
            result["runners"] = run(cfg, stop=stop, out=None, on_ready=on_ready,
                                    install_signals=False)
        except BaseException as exc:  # reported below
            result["error"] = exc
            ready.set()

    th = threading.Thread(target=target, name="soak-pipeline", daemon=True)
    th.start()
    ready.wait()
    if "error" in result:
        raise result["error"]
    t0 = time.monotonic()
    print(f"soak: {args.minutes:g} min, counter {args.rate}/s, orders {args.orders_rate}/s, "
          f"interval {args.interval}, {args.master}, arrow pool "
          f"{__import__('pyarrow').default_memory_pool().backend_name}, "
          f"driver's mimalloc options {_allocator.APPLIED or 'defaults'}, "
          f"_RJEM_MALLOC_CONF {os.environ.get('_RJEM_MALLOC_CONF')!r}, "
          f"release_memory {not args.no_release_memory}, state {state}", flush=True)
    print(header(), flush=True)
    samples: list[dict[str, Any]] = []
    jf = args.json.open("w") if args.json else None
    snap0 = None
    try:
        deadline = t0 + args.minutes * 60
        nxt = t0
        while True:
            s = sample(t0, ticks, runners, args.tracemalloc, owners)
            if args.probe_release:
                release_native()
                s["rss_released"] = proc_status().get("VmRSS", 0) / 1024
            samples.append(s)
            print(row(s), flush=True)
            if owners is not None:
                print("  by mapper (MiB): " + ", ".join(
                    f"{k} {v:.1f}" for k, v in sorted(s["owners"].items(), key=lambda kv: -kv[1])
                    if abs(v) >= 0.05), flush=True)
            print("  stacks by thread (MiB): " + ", ".join(
                f"{k} {v:.2f}" for k, v in s["stack_by"].items()), flush=True)
            if jf is not None:
                jf.write(json.dumps(s) + "\n")
                jf.flush()
            if args.tracemalloc and snap0 is None and s["min"] >= args.warmup:
                import tracemalloc

                snap0 = tracemalloc.take_snapshot()
            for r in runners:
                if r.health.status not in ("running", "starting"):
                    print(f"  source {r.name}: {r.health.as_dict()}", flush=True)
            if time.monotonic() >= deadline or not th.is_alive():
                break
            nxt += args.every
            time.sleep(max(0.0, min(nxt, deadline) - time.monotonic()))
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
        th.join(timeout=120)
        if jf is not None:
            jf.close()
    if "error" in result:
        raise result["error"]
    summary(samples, args.warmup)
    owners_summary(samples, args.warmup)
    verdicts(samples, args.warmup, _key_budget(args.key_cache))
    if snap0 is not None:
        import tracemalloc

        by = "traceback" if args.trace_frames > 1 else "lineno"
        top = tracemalloc.take_snapshot().compare_to(snap0, by)[:10]
        print(f"\nPython allocations grown since the start sample (tracemalloc, top 10 by {by}):")
        for stat in top:
            print(f"  {stat}")
            if by == "traceback":
                for line in stat.traceback.format()[-2 * args.trace_frames:]:
                    print(f"      {line}")
    if tmp is not None:
        tmp.cleanup()
    return 0


def _key_budget(key_cache: str | None) -> int:
    """The keyed outputs' SQLite page cache, all together (bytes)."""
    from reclock.config.schema import HousekeepingConfig
    from reclock.contracts.config import parse_size

    if key_cache:
        return parse_size(key_cache)
    return int(HousekeepingConfig.model_fields["key_state_cache"].default)


#: RSS noise allowed between the first and the last quarter of a soak:
#: Arrow's pool and the threads' stacks swing a few MiB from sample to sample
RSS_NOISE_MIB = 4.0


def _quarter(samples: list[dict[str, Any]], key: str, last: bool) -> float:
    """The median of ``key`` over the first (or last) quarter of ``samples``."""
    n = max(1, len(samples) // 4)
    part = samples[-n:] if last else samples[:n]
    return float(statistics.median(float(s[key]) for s in part))


def verdicts(samples: list[dict[str, Any]], warmup: float, key_budget: int) -> bool:
    """Print :func:`verdict_rows`; True if all pass."""
    rows = verdict_rows(samples, warmup, key_budget)
    if not rows:
        print("\n(too few samples after the warm-up for a verdict)")
        return False
    after = [s for s in samples if s["min"] >= warmup]
    span = f"minutes {after[0]['min']:.0f}-{after[-1]['min']:.0f}"
    print(f"\nverdict ({span}: median of the last quarter against the first)")
    for label, got, goal, ok in rows:
        print(f"{label:>18}  {got:<52} {goal:<32} {'PASS' if ok else 'FAIL'}")
    return all(ok for *_, ok in rows)


def verdict_rows(samples: list[dict[str, Any]], warmup: float,
                 key_budget: int) -> list[tuple[str, str, str, bool]]:
    """The issue's target -- driver RSS, threads, file descriptors and tick
    time flat -- judged on the samples after the warm-up: the median of the
    last quarter against that of the first (medians: single samples swing).

    RSS may grow by what SQLite allocated more (its page caches: the key
    state's, which fills as keys arrive, up to ``housekeeping.key_state_cache``
    over all keyed outputs, a bounded cache and not a leak), plus
    :data:`RSS_NOISE_MIB`, and RSS less SQLite's may grow at most that much
    an hour (least squares over every sample); SQLite's own must stay
    within that budget (and 2 MiB for the remap store's). Threads and file
    descriptors: the last quarter's median no higher than the first
    quarter's (a sample taken while a maintenance child runs counts its
    pipes). Tick: the median
    no more than 20% (and 20 ms) slower. One row each: (what, measured,
    goal, passed); none with too few samples."""
    after = [s for s in samples if s["min"] >= warmup]
    if len(after) < 8:
        return []
    rows: list[tuple[str, str, str, bool]] = []
    rss = _quarter(after, "rss", True) - _quarter(after, "rss", False)
    sq = (_quarter(after, "sqlite", True) - _quarter(after, "sqlite", False)
          if after[0].get("sqlite") is not None else 0.0)
    sq_end = float(after[-1].get("sqlite") or 0.0)
    rows.append(("driver RSS", f"{rss:+.1f} MiB ({sq:+.1f} of it SQLite's caches)",
                 f"<= SQLite's {sq:+.1f} + {RSS_NOISE_MIB:.0f} MiB", rss - sq <= RSS_NOISE_MIB))
    xs = [s["min"] for s in after]
    slope = slope_per_hour(xs, [s["rss"] - (s.get("sqlite") or 0.0) for s in after])
    rows.append(("RSS without SQLite", f"{slope:+.1f} MiB/h (least squares)",
                 f"<= {RSS_NOISE_MIB:.0f} MiB/h", slope <= RSS_NOISE_MIB))
    rows.append(("SQLite caches", f"{sq_end:.1f} MiB at the end",
                 f"<= key_state_cache {key_budget / MIB:.0f} MiB + 2",
                 sq_end <= key_budget / MIB + 2))
    for key, label in (("thr", "threads"), ("fds", "file descriptors")):
        a, b = _quarter(after, key, False), _quarter(after, key, True)
        top = max(s[key] for s in after)
        rows.append((label, f"median {a:.0f} in the first quarter, {b:.0f} in the last "
                     f"(most {top:.0f})", "last <= first", b <= a))
    ticks = [s for s in after if s.get("tick50")]
    if len(ticks) >= 8:
        a, b = _quarter(ticks, "tick50", False), _quarter(ticks, "tick50", True)
        rows.append(("tick median", f"{a:.0f} -> {b:.0f} ms", "<= x1.2 + 20 ms",
                     b <= 1.2 * a + 20))
    return rows


def summary(samples: list[dict[str, Any]], warmup: float) -> None:
    if len(samples) < 2:
        return
    after = [s for s in samples if s["min"] >= warmup] or samples
    first, last = after[0], samples[-1]
    print(f"\nstart (minute {first['min']:.1f}) vs end (minute {last['min']:.1f}); "
          "slope: least squares over the samples from the start, per hour")
    xs = [s["min"] for s in after]
    print(f"{'':>22} {'start':>9} {'end':>9} {'change':>9} {'slope/h':>9}")
    for key, label in (("rss", "driver RSS MiB"), ("anon", "driver anon MiB"),
                       ("py", "Python heap MiB"), ("heap", "malloc in use MiB"),
                       ("free", "malloc free MiB"),
                       ("sqlite", "SQLite MiB"), ("glibc", "glibc anon MiB"),
                       ("mimalloc", "mimalloc anon MiB"), ("other", "other anon MiB"),
                       ("stacks", "stacks MiB"), ("rss_released", "RSS released MiB"),
                       ("arrow", "Arrow pool MiB"),
                       ("thr", "threads"), ("tokio", "tokio threads"), ("fds", "fds"),
                       ("jvm", "JVM RSS MiB"), ("wrk", "workers RSS MiB"),
                       ("tick50", "tick median ms"), ("tickmax", "tick max ms"),
                       ("objs", "gc objects"), ("pya", "pymalloc arenas"),
                       ("pyblk", "pymalloc live MiB"), ("pyfree", "pymalloc free blk MiB"),
                       ("pypools", "pymalloc free pools")):
        if first.get(key) is None or last.get(key) is None:
            continue
        ys = [float(s[key]) for s in after]
        a, b = float(first[key]), float(last[key])
        print(f"{label:>22} {a:9.1f} {b:9.1f} {b - a:+9.1f} {slope_per_hour(xs, ys):+9.1f}")
    secs = (last["min"] - first["min"]) * 60
    if secs > 0:
        print(f"{'records/s':>22} {(last['rows'] - first['rows']) / secs:9.0f}")


def owners_summary(samples: list[dict[str, Any]], warmup: float) -> None:
    """Start against end of the thread stacks' resident memory by thread, and
    of the resident memory by mapper (``--mmap-trace``)."""
    stacked = [s for s in samples if s["min"] >= warmup and "stack_by" in s]
    if len(stacked) >= 2:
        a0, b0 = stacked[0]["stack_by"], stacked[-1]["stack_by"]
        print("\nthread stacks resident, by thread (MiB)")
        print(f"{'':>30} {'start':>9} {'end':>9} {'change':>9}")
        for name in sorted(set(a0) | set(b0)):
            a, b = a0.get(name, 0.0), b0.get(name, 0.0)
            print(f"{name[:30]:>30} {a:9.2f} {b:9.2f} {b - a:+9.2f}")
    after = [s for s in samples if s["min"] >= warmup and "owners" in s]
    if len(after) < 2:
        return
    first, last = after[0]["owners"], after[-1]["owners"]
    print("\nanonymous resident memory by the library that mapped it (MiB)")
    print(f"{'':>30} {'start':>9} {'end':>9} {'change':>9}")
    for lib in sorted(set(first) | set(last), key=lambda k: -abs(last.get(k, 0) - first.get(k, 0))):
        a, b = first.get(lib, 0.0), last.get(lib, 0.0)
        if max(abs(a), abs(b)) >= 0.05:
            print(f"{lib[:30]:>30} {a:9.1f} {b:9.1f} {b - a:+9.1f}")


if __name__ == "__main__":
    sys.exit(main())
