#!/usr/bin/env bash
# Prepares this machine for the test suite; the README's test command runs it
# first. Idempotent: a second run checks, finds everything in place, and
# touches neither the network nor the package manager.
#
# The tests need
#   * PostgreSQL's server binaries (initdb, pg_ctl, postgres). The tests start
#     their own private cluster from them (wal_level=logical, trust auth on
#     127.0.0.1, a free port; tests/pgcluster.py), so no server has to be
#     running. RECLOCK_TEST_PG=postgresql://... points the non-CDC tests at an
#     existing server instead.
#   * MariaDB's server (Debian's mariadb-server): the mysql source's tests
#     start a private server with a ROW-format binary log (tests/mariadb.py).
#   * Chromium, which the status-page test drives headless.
#   * Java 17+ and Maven: Apache Kafka's broker jars are resolved once from
#     tests/broker/pom.xml into $RECLOCK_CACHE/kafka-broker (default
#     ~/.cache/reclock), and the tests start real KRaft brokers from them
#     (tests/kafkabroker.py); Apache Iceberg's REST catalog server likewise,
#     from tests/iceberg-rest/pom.xml into $RECLOCK_CACHE/iceberg-rest
#     (tests/icebergrest.py).
#   * promtool (Debian's prometheus package), which checks and unit-tests
#     the alert rules in examples/monitoring/ (tests/test_monitoring.py).
#   * A second Spark (PySpark 4.1.4 in $RECLOCK_CACHE/spark-peer) with
#     delta-spark and Iceberg's Spark runtime, which read reclock's Delta and
#     Iceberg outputs in the interoperability tests (about 450 MB from PyPI and
#     some 35 jars from Maven Central, once).
#
# Missing system packages are installed from Debian's packages when this runs
# as root on a machine with apt-get; elsewhere it says what to install.
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE="${RECLOCK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/reclock}"
APT_UPDATED=""

say() { printf 'setup: %s\n' "$*"; }

apt_install() {  # apt_install PACKAGE... ; fails with a hint when it cannot
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        say "missing: $* -- install it with your package manager and run again" >&2
        exit 1
    fi
    if [ -z "$APT_UPDATED" ]; then
        apt-get update -q >/dev/null
        APT_UPDATED=1
    fi
    say "installing $* from Debian's packages"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" >/dev/null
}

pg_initdb() {  # prints the path of initdb, the same search as tests/pgcluster.py
    if [ -n "${RECLOCK_PG_BINDIR:-}" ] && [ -x "$RECLOCK_PG_BINDIR/initdb" ]; then
        echo "$RECLOCK_PG_BINDIR/initdb"; return
    fi
    local found
    found=$(ls -d /usr/lib/postgresql/*/bin/initdb 2>/dev/null | sort -V | tail -n 1 || true)
    if [ -n "$found" ]; then echo "$found"; return; fi
    command -v initdb || true
}

# 1. PostgreSQL server binaries (and the postgres user that runs them as root)
if [ -z "$(pg_initdb)" ]; then
    apt_install postgresql
fi
if [ -z "$(pg_initdb)" ]; then
    say "PostgreSQL's initdb not found; set RECLOCK_PG_BINDIR to its directory" >&2
    exit 1
fi
if [ "$(id -u)" = 0 ] && ! id postgres >/dev/null 2>&1; then
    say "running as root needs a 'postgres' user for initdb (Debian's package creates it)" >&2
    exit 1
fi
say "PostgreSQL: $("$(pg_initdb)" --version)"

# 1b. MariaDB's server and client (mariadbd, mariadb-install-db) for the mysql
#     source's tests, which start a private server from them (tests/mariadb.py)
if ! command -v mariadb-install-db >/dev/null || [ ! -x /usr/sbin/mariadbd ]; then
    apt_install mariadb-server mariadb-client
fi
if [ "$(id -u)" = 0 ] && ! id mysql >/dev/null 2>&1; then
    say "running as root needs a 'mysql' user for mariadbd (Debian's package creates it)" >&2
    exit 1
fi
say "MariaDB: $(/usr/sbin/mariadbd --version 2>/dev/null | head -n 1)"

# 2. Chromium for the status-page test
if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null; then
    apt_install chromium
fi
say "Chromium: $( (chromium --version || chromium-browser --version) 2>/dev/null | head -n 1)"

# 2b. promtool for the alert rules' tests. The package's own Prometheus
#     server is not needed: stop it if the package's scripts started one.
if ! command -v promtool >/dev/null; then
    apt_install prometheus
    if command -v service >/dev/null; then service prometheus stop >/dev/null 2>&1 || true; fi
fi
say "promtool: $(promtool --version 2>&1 | head -n 1)"

# 3. Java and Maven, then the Kafka broker's jars
if ! command -v java >/dev/null; then apt_install openjdk-17-jre-headless; fi
if ! command -v mvn >/dev/null; then apt_install maven; fi
java_major=$(java -XshowSettings:properties -version 2>&1 | sed -n 's/^ *java.specification.version = //p')
if [ "${java_major%%.*}" -lt 17 ] 2>/dev/null; then
    say "Java $java_major found; the Kafka broker and Spark need Java 17 or newer" >&2
    exit 1
fi

resolve_jars() {  # resolve_jars POM NAME WHAT: POM's dependencies into $CACHE/NAME/libs
    local pom="$1" dest="$CACHE/$2" what="$3" want tmp
    want=$(sha256sum "$pom" | cut -d' ' -f1)
    if [ -f "$dest/pom.sha256" ] && [ "$(cat "$dest/pom.sha256")" = "$want" ] \
            && [ -d "$dest/libs" ]; then
        say "$what jars: cached in $dest/libs ($(ls "$dest/libs" | wc -l) jars)"
        return
    fi
    say "$what jars: resolving $pom with Maven into $dest/libs"
    mkdir -p "$CACHE"
    tmp=$(mktemp -d "$CACHE/$2.XXXXXX")
    if ! mvn -B -Dstyle.color=never -f "$pom" dependency:copy-dependencies \
            -DoutputDirectory="$tmp/libs" -Dmdep.useBaseVersion=true > "$tmp/mvn.log" 2>&1; then
        tail -n 40 "$tmp/mvn.log" >&2
        say "Maven could not resolve $pom (is Maven Central reachable?)" >&2
        exit 1
    fi
    echo "$want" > "$tmp/pom.sha256"
    rm -rf "$dest"
    mv "$tmp" "$dest"
    say "$what jars: $(ls "$dest/libs" | wc -l) jars"
}

resolve_jars tests/broker/pom.xml kafka-broker "Kafka broker"

# 3b. Apache Iceberg's own REST catalog server (the apache/iceberg-rest-fixture
#     image's server, over a JDBC catalog on SQLite), which the Iceberg sink's
#     REST catalog tests run against (tests/icebergrest.py)
resolve_jars tests/iceberg-rest/pom.xml iceberg-rest "Iceberg REST catalog server"

# 4. A second Spark, with delta-spark and Iceberg's Spark runtime, for the
#    interoperability tests (tests/sinks/test_delta_interop.py and the Iceberg
#    ones: Spark reads reclock's outputs in a JVM of its own). The newest
#    Spark both are released for is 4.1 (delta-spark 4.3.1, Iceberg 1.12.0),
#    not the PySpark reclock installs, so this Spark lives in its own
#    virtualenv; its jars are resolved once from Maven Central by Spark itself
#    (Ivy).
PEER="$CACHE/spark-peer"
PEER_SPARK=4.1.4
PEER_STAMP="$PEER/ready"
peer_want="pyspark==$PEER_SPARK $(sha256sum tests/spark_peer.py | cut -d' ' -f1)"
if [ -f "$PEER_STAMP" ] && [ "$(cat "$PEER_STAMP")" = "$peer_want" ]; then
    say "Spark peer: cached in $PEER (PySpark $PEER_SPARK, $(ls "$PEER/ivy/jars" | wc -l) jars)"
else
    say "Spark peer: installing PySpark $PEER_SPARK into $PEER and resolving delta-spark and Iceberg"
    mkdir -p "$CACHE"
    if [ ! -x "$PEER/bin/python" ] || ! "$PEER/bin/python" -c \
            "import importlib.metadata as m, sys; sys.exit(m.version('pyspark') != '$PEER_SPARK')" \
            2>/dev/null; then
        rm -rf "$PEER"
        python3 -m venv "$PEER"
        "$PEER/bin/pip" install -q --disable-pip-version-check "pyspark==$PEER_SPARK"
    fi
    rm -rf "$PEER/ivy/jars"  # only the jars this reader asks for, no older versions
    if ! PYSPARK_PYTHON="$PEER/bin/python" "$PEER/bin/python" tests/spark_peer.py \
            --resolve --ivy "$PEER/ivy" > "$PEER/resolve.log" 2>&1; then
        tail -n 30 "$PEER/resolve.log" >&2
        say "Spark could not resolve delta-spark and Iceberg (is Maven Central reachable?)" >&2
        exit 1
    fi
    echo "$peer_want" > "$PEER_STAMP"
    say "Spark peer: ready ($(ls "$PEER/ivy/jars" | wc -l) jars)"
fi
