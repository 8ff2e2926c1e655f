"""The monitoring that ships with reclock (examples/monitoring/, and
compose.yaml's prometheus and grafana services):

* the alert rules pass ``promtool check rules`` and their unit tests
  (``promtool test rules``: fixture series in which a source stalls, an
  output never commits, error rows land, the driver stops answering);
* Prometheus' configuration passes ``promtool check config``;
* every metric the rules and the dashboard query is one reclock exports;
* compose mounts these files where the configurations expect them.

``promtool`` comes from Debian's ``prometheus`` package (tests/setup.sh).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from reclock.metrics import make_registry, render
from tests.reclock.test_http import fake_doc

REPO = Path(__file__).resolve().parents[1]
MON = REPO / "examples" / "monitoring"
RULES = MON / "reclock-alerts.yml"
#: Metric names in PromQL: reclock's own and the process collector's.
_METRIC = re.compile(r"\b(?:reclock|process)_[a-z_]+\b")


def promtool(*args: str, cwd: Path = MON) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("promtool")
    assert tool, "promtool is missing: tests/setup.sh installs Debian's prometheus package"
    return subprocess.run([tool, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def exported_names() -> set[str]:
    """Every sample name /metrics renders for a document with every kind of
    source, plus the family names (``_total`` counters are queried by them)."""
    text = render(make_registry(fake_doc)).decode()
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def rule_exprs() -> list[str]:
    doc = yaml.safe_load(RULES.read_text())
    return [r["expr"] for g in doc["groups"] for r in g["rules"]]


def dashboard() -> dict[str, Any]:
    return dict(json.loads((MON / "grafana" / "dashboards" / "reclock.json").read_text()))


def test_alert_rules_check_and_pass_their_unit_tests() -> None:
    out = promtool("check", "rules", RULES.name)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 4 rules found" in out.stdout + out.stderr
    out = promtool("test", "rules", "reclock-alerts.test.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr


def test_a_broken_rule_expectation_fails_the_unit_tests(tmp_path: Path) -> None:
    """The rule tests can fail: the stalled source's alert expected a minute
    early is reported."""
    shutil.copy(RULES, tmp_path / RULES.name)
    text = (MON / "reclock-alerts.test.yml").read_text()
    assert "      - eval_time: 6m\n        alertname: ReclockSourceStalled" in text
    (tmp_path / "t.yml").write_text(text.replace(
        "      - eval_time: 6m\n        alertname: ReclockSourceStalled",
        "      - eval_time: 4m45s\n        alertname: ReclockSourceStalled"))
    out = promtool("test", "rules", "t.yml", cwd=tmp_path)
    assert out.returncode != 0 and "ReclockSourceStalled" in out.stdout + out.stderr


def test_prometheus_config_checks_with_the_rules_where_compose_mounts_them(
        tmp_path: Path) -> None:
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    mounts = {v.split(":")[1]: (REPO / v.split(":")[0]).resolve()
              for v in compose["services"]["prometheus"]["volumes"] if v.startswith("./")}
    config = yaml.safe_load((MON / "prometheus.yml").read_text())
    # Every rule file and the configuration itself are mounted from the repository.
    assert mounts["/etc/prometheus/prometheus.yml"] == (MON / "prometheus.yml").resolve()
    for rule_file in config["rule_files"]:
        assert mounts[rule_file] == RULES.resolve()
    # The scrape target is the pipeline service's HTTP port.
    [job] = config["scrape_configs"]
    assert job["job_name"] == "reclock"
    assert job["static_configs"][0]["targets"] == ["pipeline:9464"]
    # promtool reads rule files by path: check a copy pointing at the repository's.
    config["rule_files"] = [str(RULES)]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    out = promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr


def test_rules_and_dashboard_query_only_metrics_reclock_exports() -> None:
    exported = exported_names()
    assert "reclock_output_lag_seconds" in exported and "process_cpu_seconds_total" in exported
    exprs = rule_exprs() + [t["expr"] for p in dashboard()["panels"] for t in p["targets"]]
    queried = {m for e in exprs for m in _METRIC.findall(e)}
    assert queried, exprs
    assert queried <= exported, sorted(queried - exported)


def test_grafana_provisioning_matches_the_dashboard_and_compose() -> None:
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    mounts = {v.split(":")[1]: (REPO / v.split(":")[0]).resolve()
              for v in compose["services"]["grafana"]["volumes"]}
    sources = yaml.safe_load((MON / "grafana" / "provisioning" / "datasources.yml").read_text())
    [ds] = sources["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((MON / "grafana" / "provisioning" / "dashboards.yml").read_text())
    [prov] = providers["providers"]
    assert mounts[prov["options"]["path"]] == (MON / "grafana" / "dashboards").resolve()
    for path in ("/etc/grafana/provisioning/datasources/reclock.yml",
                 "/etc/grafana/provisioning/dashboards/reclock.yml"):
        assert path in mounts
    env = compose["services"]["grafana"]["environment"]
    home = env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(prov["options"]["path"] + "/")
    assert (MON / "grafana" / "dashboards" / Path(home).name).is_file()
    dash = dashboard()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] == "reclock"
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == ds["uid"], p["title"]
        assert p["targets"] and all(t["datasource"]["uid"] == ds["uid"] for t in p["targets"])
        assert p.get("description"), f"panel {p['title']!r} explains nothing"


@pytest.mark.parametrize("service", ["prometheus", "grafana"])
def test_monitoring_images_are_pinned(service: str) -> None:
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    image = compose["services"][service]["image"]
    assert re.fullmatch(r"[a-z/]+:v?\d+\.\d+\.\d+", image), image
    if service == "prometheus":  # the same release as the promtool the tests run
        out = promtool("--version")
        version = re.search(r"version (\d+\.\d+\.\d+)", out.stdout + out.stderr)
        assert version and image.endswith(version.group(1)), (image, out.stdout)
