"""The built-in formats: raw record bytes -> typed rows, bad records kept as data.

One module per format, each declaring itself with one
:class:`~reclock.contracts.decode.FormatPlugin` (its ``PLUGIN``), registered
in the ``reclock.formats`` entry point group: ``bytes``, ``text``, ``json``,
``csv`` and ``avro`` (with its schema registry client). All of them build on
the decode contract and the screening machinery of
:mod:`reclock.contracts.decode`; the pipeline builds a decoder from a format
spec through the registry (:func:`reclock.registry.make_decoder`).
"""
