"""A file output on a real, small filesystem (a tmpfs the test mounts) that
fills up and then turns read-only while the pipeline runs: the source stalls
with a clear error naming the output, and once space and write access are
back it carries on; nothing already accepted is lost or doubled."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from reclock.config import load_config
from reclock.verify import verify_pipeline
from tests.running import counter_source, running, wait_for
from tests.tally import count

TOTAL = 150_000


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MB tmpfs (needs root, as the test machine and CI run)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    assert out.returncode == 0, f"mounting a tmpfs needs root: {out.stderr}"
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _remount(mnt: Path, opts: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{opts}", str(mnt)], check=True)


def test_disk_full_and_read_only_file_sink(tmp_path: Path, spark: Any, tiny_fs: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(f"""
state_dir: {tmp_path}/state
timestamp_interval: 200ms
sources:
{counter_source(30000, TOTAL, 101, f"{{type: file, path: {tiny_fs}/value}}")}""")
    cfg = load_config(path)
    with running(cfg, spark) as runners:
        r = runners[0]

        def stalled_with(*words: str) -> bool:
            h = r.health
            return h.status == "stalled" and all(w in f"{h.error} {h.hint}" for w in words)

        wait_for(lambda: stalled_with("counter.value", "disk full"), 120, "the disk to fill")
        _remount(tiny_fs, "ro")
        wait_for(lambda: stalled_with("counter.value", "read-only"), 60, "read-only errors")
        _remount(tiny_fs, "rw,size=256m")
        wait_for(lambda: r.health.status == "finished", 180, "the pipeline to recover")
    [report] = verify_pipeline(cfg)
    assert report.ok, [(o.output, o.breaches, o.samples) for o in report.outputs]
    assert report.complete_checked == TOTAL
    count("file sink faults (disk full, read-only)", faults=2, records_checked=TOTAL)
