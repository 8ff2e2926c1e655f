"""Build script for reclock's one C extension; everything else is in pyproject.toml.

``sources._kafka_native`` reads Kafka partition ranges into Arrow buffers
below Python (see sources/_kafka_native.c). It needs only a C compiler and
the Python headers: librdkafka is resolved at run time from the
confluent-kafka wheel. The extension is optional: without a compiler the
install still succeeds and the Kafka source uses its pure-Python reader.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "sources._kafka_native",
            ["sources/_kafka_native.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            libraries=["dl"],
            optional=True,
        )
    ]
)
