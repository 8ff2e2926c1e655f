"""MariaDB change data capture: the binary log in ROW format, read with
python-mysql-replication.

* :mod:`reclock.sources.mysql.config` -- the connector's configuration model;
* :mod:`reclock.sources.mysql.source` -- the source (driver side) and its reader
  (executor side): server checks, GTID positions, snapshot hand-off;
* :mod:`reclock.sources.mysql.gtid` -- GTID positions as partitioned frontiers;
* :mod:`reclock.sources.mysql.types` -- column types as Arrow types, values as arrays.
"""
