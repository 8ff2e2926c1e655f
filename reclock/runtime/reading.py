"""Reading an output as of an IntoTime: what ``reclock read`` shows and what
``reclock verify`` audits.

An output's sink keeps its update log ``(row, _into_time, _diff)`` and its
state (its upper: every update below it is durable). As of ``t`` the output
means the consolidation of the updates at or before ``t``
(:mod:`reclock.contracts.consolidate`); that is complete only for ``t``
below the upper, so :func:`choose_as_of` refuses a later ``t`` and, when none
is asked for, picks the latest complete one of all the outputs read
together (their least upper, less one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from reclock.contracts.consolidate import consolidate, errors
from reclock.core.errors import ReclockError

if TYPE_CHECKING:
    import pyarrow as pa

    from reclock.contracts.sink import SinkState
    from reclock.runtime.site import OutputRuntime

#: what :func:`read_output` returns: the raw update log, the collection it
#: means, or its error rows
View = Literal["log", "collection", "errors"]


def choose_as_of(outputs: Sequence[tuple[str, SinkState]], as_of: int | None) -> int | None:
    """The IntoTime to read the named outputs (``(label, state)``) as of:
    ``as_of`` when every output is complete at it (else a
    :class:`ReclockError` names the first that is not), or, when ``as_of``
    is ``None``, the latest time complete in all of them (their least upper
    less one, -1 when one has committed nothing; ``None``: all are closed,
    so everything is complete)."""
    if as_of is not None:
        for label, st in outputs:
            if st.upper is not None and as_of >= st.upper:
                raise ReclockError(
                    f"output {label} is durable only below {st.upper}; "
                    f"as of {as_of} is not complete yet"
                )
        return as_of
    finite = [st.upper for _, st in outputs if st.upper is not None]
    if not finite:
        return None
    return max(min(finite) - 1, -1)


def read_output(output: OutputRuntime, as_of: int | None = None,
                view: View = "log") -> pa.Table:
    """The output's updates at or before ``as_of`` (all of them: ``None``),
    as ``view``: the raw ``log`` (every column), the ``collection`` they
    mean (the user columns and ``_count``) or their ``errors``. Reading the
    sink's state before its log is the caller's part (the log may grow
    meanwhile; rows past the state's upper are not complete)."""
    updates = output.sink.read_updates(as_of)
    if view == "log":
        return updates
    if view == "errors":
        return errors(updates, as_of)
    return consolidate(updates, as_of, [f.name for f in output.user_schema])
