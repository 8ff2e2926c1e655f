"""Build script for reclock's C extensions; everything else is in pyproject.toml.

``reclock.sources._kafka_native`` reads Kafka partition ranges into Arrow buffers
below Python (see sources/_kafka_native.c); librdkafka is resolved at run
time from the confluent-kafka wheel. ``reclock._json_native`` parses flat
JSON objects into typed Arrow buffers for the JSON decoder's fast path (see
reclock/_json_native.c). ``reclock.sources.postgres._pgoutput_native``
decodes the Postgres source's replication frames (pgoutput) into Arrow
buffers (see sources/postgres/_pgoutput_native.c). All need only a C
compiler and the Python headers, and all are optional: without a compiler
the install still succeeds, and the Kafka source, the JSON decoder and the
Postgres source use their pure-Python/pyarrow paths.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "reclock.sources._kafka_native",
            ["sources/_kafka_native.c"],
            include_dirs=["reclock"],
            depends=["reclock/_buffers.h"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            libraries=["dl"],
            optional=True,
        ),
        Extension(
            "reclock._json_native",
            ["reclock/_json_native.c"],
            depends=["reclock/_buffers.h"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        ),
        Extension(
            "reclock.sources.postgres._pgoutput_native",
            ["sources/postgres/_pgoutput_native.c"],
            include_dirs=["reclock"],
            depends=["reclock/_buffers.h"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        ),
    ]
)
