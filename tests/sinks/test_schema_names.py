"""Field names a sink cannot hold as columns are a definite error that names
them, never a retry loop: names that differ only in case, and names that
clash with reclock's own columns in any case."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest

from reclock.contracts.rows import output_schema
from reclock.core.columns import META_NAMES
from reclock.core.errors import DefiniteError


@pytest.mark.parametrize("names, named", [
    (["a", "A"], "'a' and 'A'"),
    (["id", "Id", "ID"], "'id' and 'Id', 'id' and 'ID'"),
    (["x", "x"], "'x' and 'x'"),
])
def test_names_that_differ_only_in_case(names: list[str], named: str) -> None:
    schema = pa.schema([(n, pa.int64()) for n in names])
    with pytest.raises(DefiniteError, match="differ only in case") as err:
        output_schema(schema)
    assert named in str(err.value) and err.value.hint


@pytest.mark.parametrize("name", ["_into_time", "_Into_Time", "_DIFF", "_error"])
def test_names_that_clash_with_reclocks_columns_in_any_case(name: str) -> None:
    with pytest.raises(DefiniteError, match="clash with reclock's own columns") as err:
        output_schema(pa.schema([("v", pa.string()), (name, pa.int64())]))
    assert name in str(err.value)


def test_distinct_names_pass() -> None:
    out = output_schema(pa.schema([("a", pa.int64()), ("b_", pa.string())]))
    assert out.names[:2] == ["a", "b_"] and out.names[2:] == list(META_NAMES)


def test_the_hint_names_the_rename_mapping() -> None:
    with pytest.raises(DefiniteError) as err:
        output_schema(pa.schema([("a", pa.int64()), ("A", pa.int64())]))
    assert "rename" in (err.value.hint or "")


def _pipeline(tmp_path: Any, bootstrap: str, topic: str, rename: str) -> Any:
    from reclock.config import load_config

    path = tmp_path / "p.yaml"
    path.write_text(f"""
state_dir: {tmp_path}/state
timestamp_interval: 200ms
sources:
  - name: s
    kafka: {{bootstrap_servers: "{bootstrap}", topic: {topic}, timeout: 5s}}
    outputs:
      - name: o
        format: {{type: json, schema: {{a: string, A: string, _into_time: int64}}}}
        key_format: {{type: json, schema: {{Id: int64}}}}
        envelope: {{type: upsert, key: [Id]}}
        sink: file
{rename}
""")
    return load_config(path)


def test_a_rename_mapping_lands_fields_that_clash(tmp_path: Any, spark: Any, kafka: Any) -> None:
    """Issue: upstream fields `a` and `A`, or `_into_time` beside reclock's own
    column, stalled the source for good. Without a mapping the pipeline
    refuses to start with a definite error naming them and the mapping; with
    ``rename`` the fields land under their new names, the upsert key (named
    by its upstream name) too, and a restart rebuilds the key state."""
    import json
    import uuid

    from confluent_kafka import Producer

    from reclock.contracts.consolidate import consolidate
    from reclock.pipeline import Pipeline
    from tests.running import running, wait_for

    topic = f"rn-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, 1)
    p = Producer({"bootstrap.servers": kafka.bootstrap})
    for k, a in [(1, "x"), (2, "y"), (1, "x2")]:
        p.produce(topic, key=json.dumps({"Id": k}).encode(), partition=0,
                  value=json.dumps({"a": a, "A": a.upper(), "_into_time": k * 10}).encode())
    assert p.flush(30) == 0

    with pytest.raises(DefiniteError) as err:
        Pipeline(_pipeline(tmp_path, kafka.bootstrap, topic, "")).build_source(
            _pipeline(tmp_path, kafka.bootstrap, topic, "").sources[0])
    assert "rename" in str(err.value) + (err.value.hint or "")

    bad = "        rename: {nope: x}"
    with pytest.raises(DefiniteError, match=r"rename names fields \['nope'\]"):
        cfg = _pipeline(tmp_path, kafka.bootstrap, topic, bad)
        Pipeline(cfg).build_source(cfg.sources[0])

    rename = "        rename: {A: a_upper, _into_time: upstream_time, Id: key_id}"
    cfg = _pipeline(tmp_path, kafka.bootstrap, topic, rename)

    def held() -> list[tuple[Any, ...]]:
        pipe = Pipeline(cfg)
        try:
            t = pipe.sink(cfg.sources[0], cfg.sources[0].outputs[0]).read_updates()
        finally:
            pipe.close()
        cols = ["key_id", "a", "a_upper", "upstream_time"]
        return sorted(tuple(r[c] for c in [*cols, "_count"])
                      for r in consolidate(t, None, cols).to_pylist())

    with running(cfg, spark) as runners:
        wait_for(lambda: runners[0].outputs[0].rows == 3, 60, lambda: str(runners[0].health))
    assert held() == [(1, "x2", "X2", 10, 1), (2, "y", "Y", 20, 1)]
    p.produce(topic, key=json.dumps({"Id": 2}).encode(), value=None, partition=0)
    assert p.flush(30) == 0
    with running(cfg, spark) as runners:  # a restart: the key state rebuilds by output names
        wait_for(lambda: runners[0].outputs[0].rows == 1, 60, lambda: str(runners[0].health))
    assert held() == [(1, "x2", "X2", 10, 1)]
