"""The built-in remap store: bindings in SQL (:mod:`reclock.remap_store.sql`),
``sqlite:///path/to/remap.db`` (or a bare path; the embedded default) or
``postgresql://user@host:port/db`` (through psycopg 3), declared by its
:class:`~reclock.contracts.remap_store.RemapStorePlugin` (``PLUGIN``) in the
``reclock.remap_stores`` entry point group; :mod:`reclock.remap_store.delta`
is how it stores a binding's frontier. The contract is
:mod:`reclock.contracts.remap_store`; a pipeline opens its store through the
registry (:func:`reclock.registry.open_store`).
"""
