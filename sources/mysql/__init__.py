"""MariaDB change data capture: the binary log in ROW format, read with
python-mysql-replication.

* :mod:`sources.mysql.config` -- the connector's configuration model;
* :mod:`sources.mysql.source` -- the source (driver side) and its reader
  (executor side): server checks, GTID positions, snapshot hand-off;
* :mod:`sources.mysql.gtid` -- GTID positions as partitioned frontiers;
* :mod:`sources.mysql.types` -- column types as Arrow types, values as arrays.
"""
