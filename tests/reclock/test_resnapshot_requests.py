"""The resnapshot request files: a driver notices a new request from the
directory's status alone and lists the files only then."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from reclock.runtime import resnapshot
from reclock.runtime.resnapshot import Requests


def test_requests_are_listed_only_when_the_directory_changed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    r = Requests(tmp_path, "src")
    assert r.changed() and r.pending() == {}  # first look
    assert not r.changed()  # nothing made: no listing needed
    Requests(tmp_path, "src").request("a", 5)  # another process asks
    assert r.changed() and r.pending() == {"a": 5}
    assert not r.changed()
    r.done("a", 4)  # not the request taken up: stays
    assert not r.changed() and r.pending() == {"a": 5}
    r.done("a", 5)
    assert r.changed() and r.pending() == {}
    # a change the directory's time does not show is seen within RELIST_S
    st = r.dir.stat()
    Requests(tmp_path, "src").request("b", 6)
    os.utime(r.dir, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert not r.changed()
    monkeypatch.setattr(resnapshot, "RELIST_S", 0.0)
    assert r.changed() and r.pending() == {"b": 6}
