"""The ``csv`` format: typed columns from CSV lines, bad lines isolated."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
from pydantic import Field
from pydantic_core import InitErrorDetails

from reclock.contracts.config import ColumnType, ConfigModel, problem
from reclock.contracts.decode import (
    STRING_CONVERTERS,
    Bad,
    Collector,
    ColumnField,
    DecodeResult,
    DecoderOptions,
    Fail,
    FormatError,
    FormatPlugin,
    Joined,
    Ok,
    SlowOut,
    arrow_schema,
    as_binary,
    convert_isolating,
    count_newlines,
    declared_fields,
    decode_screened,
    offsets,
    read_options_block,
    screen,
    show,
)

I64 = npt.NDArray[np.int64]

# csv

_CSV_ROW_RE = re.compile(r"In CSV column #(\d+): Row #(\d+): (.*)", re.S)
_CSV_FIELDS_RE = re.compile(r"CSV parse error: (Row #(\d+)): Expected (\d+) columns, got (\d+)")
_CSV_CONV_RE = re.compile(r"CSV conversion error to [^:]+: invalid value (.*)", re.S)
_CSV_DEC_RE = re.compile(r"The string (.*) is not a valid decimal\d* number", re.S)


def _csv_converter(f: ColumnField) -> Callable[[pa.Array], pa.Array]:
    """Text -> ``f.type``: Arrow's cast (ints in decimal or ``0x`` hex, floats
    incl. ``nan``/``inf``, bools ``true``/``false``/``1``/``0`` in any case,
    decimals without precision loss), ISO-8601 for dates and timestamps."""
    conv = STRING_CONVERTERS.get(f.kind)
    if conv is not None:
        return conv
    return _Cast(f.type)


@dataclass(frozen=True)
class _Cast:
    type: pa.DataType

    def __call__(self, arr: pa.Array) -> pa.Array:
        return arr.cast(self.type)


class CsvDecoder:
    """``{"type": "csv", "columns": [...], "types": {...}, "delimiter": ",",
    "quote": "\\""}``: each record is one CSV line (a quoted field may hold a
    newline). Columns default to ``string``; an empty field is null in a
    non-string column and ``""`` in a string column. A record with the wrong
    number of fields, or a field that does not convert, is an error row that
    names the column.

    Fields are read as text and converted column by column (see
    :func:`_csv_converter`). There is no header: a Kafka value is one line, so
    ``header: true`` is rejected when the decoder is built.
    """

    def __init__(
        self,
        columns: Sequence[str],
        types: Mapping[str, str] | Sequence[str] | None = None,
        delimiter: str = ",",
        quote: str = '"',
        header: bool = False,
        allow_null: bool = False,
    ) -> None:
        if header:
            raise FormatError(
                "csv format: header: true is not supported: each record is one CSV line "
                "(a Kafka value), so there is no header line to skip; list the columns "
                "under 'columns' instead"
            )
        if isinstance(columns, str) or not columns or not all(
            isinstance(c, str) and c for c in columns
        ):
            raise FormatError("csv format: 'columns' must be a non-empty list of column names")
        if len(set(columns)) != len(columns):
            raise FormatError(f"csv format: duplicate names in 'columns': {list(columns)}")
        if not (isinstance(delimiter, str) and len(delimiter) == 1 and delimiter not in "\r\n"):
            raise FormatError(f"csv format: 'delimiter' must be one character, got {delimiter!r}")
        if not (isinstance(quote, str) and len(quote) == 1 and quote != delimiter):
            raise FormatError(f"csv format: 'quote' must be one character, got {quote!r}")
        if types is None:
            labels = dict.fromkeys(columns, "string")
        elif isinstance(types, Mapping):
            unknown = [k for k in types if k not in columns]
            if unknown:
                raise FormatError(f"csv format: 'types' names columns not in 'columns': {unknown}")
            labels = {c: types.get(c, "string") for c in columns}
        else:
            if len(types) != len(columns):
                raise FormatError(
                    f"csv format: 'types' has {len(types)} entries for {len(columns)} columns"
                )
            labels = dict(zip(columns, types, strict=True))
        self.fields = declared_fields(labels, "csv format")
        for f in self.fields:
            if f.kind == "json":
                raise FormatError(
                    f"csv format: column {f.name!r}: type json is not supported in csv; "
                    "use string"
                )
        self.delimiter = delimiter
        self.quote = quote
        self.allow_null = allow_null
        self.schema = arrow_schema(self.fields)

    def decode(self, data: pa.Array) -> DecodeResult:
        data = as_binary(data)
        c = Collector(self.schema, "csv")
        # not UTF-8: judged alone (also keeps non-text rows from pyarrow's row handler)
        _, cand = screen(data, None, None, utf8=True)
        off, values = offsets(data)
        if len(self.fields) > 1:
            cand &= off[1:] > off[:-1]  # empty records: see _slow
        if count_newlines(values) and len(data):
            # A record holding a line break would read as two lines: judge it alone.
            nl = pc.match_substring_regex(data, "[\r\n]").fill_null(False)
            cand &= ~np.asarray(nl.to_numpy(zero_copy_only=False), dtype=bool)
        return decode_screened(
            c, data, cand, self._slow, self.allow_null,
            lambda joined, lo, hi: self._fast(joined.lines(lo, hi), hi - lo, False),
            lambda joined, lo, hi, msg: self._suspects(joined, lo, hi),
        )

    def _suspects(self, joined: Joined, lo: int, hi: int) -> list[int]:
        """A run that read as fewer lines than records holds a quoted field
        that is not closed: it swallowed the next records. Such a record has an
        odd number of quote characters."""
        quotes = pc.count_substring(joined.records.slice(lo, hi - lo), self.quote)
        odd = pc.bit_wise_and(quotes, 1).to_numpy(zero_copy_only=False)
        return np.flatnonzero(odd).tolist()

    def _read(self, buf: pa.Buffer | bytes, multiline: bool, handler: bool = True
              ) -> tuple[pa.Table, list[tuple[int | None, str]]]:
        """Read ``buf``; rows with the wrong number of fields are skipped and
        listed (1-based row number, reason) if ``handler``, else they raise.
        (pyarrow hands the handler the row as text: only use it on UTF-8.)"""
        invalid: list[tuple[int | None, str]] = []

        def on_invalid(row: Any) -> str:
            invalid.append((
                row.number,
                f"csv: expected {row.expected_columns} columns, got {row.actual_columns}",
            ))
            return "skip"

        size = buf.size if isinstance(buf, pa.Buffer) else len(buf)
        table = pcsv.read_csv(
            pa.BufferReader(buf),
            read_options=pcsv.ReadOptions(
                column_names=[f.name for f in self.fields], use_threads=False,
                block_size=read_options_block(size),
            ),
            parse_options=pcsv.ParseOptions(
                delimiter=self.delimiter, quote_char=self.quote, double_quote=True,
                escape_char=False, newlines_in_values=multiline, ignore_empty_lines=False,
                invalid_row_handler=on_invalid if handler else None,
            ),
            convert_options=pcsv.ConvertOptions(
                # text only: typed columns are converted afterwards, column by
                # column, so that a bad value rejects its record, not the run
                column_types={
                    f.name: pa.binary() if f.kind == "binary" else pa.string()
                    for f in self.fields
                },
                null_values=[], strings_can_be_null=False, quoted_strings_can_be_null=False,
                check_utf8=True,
            ),
        )
        return table, invalid

    def _fast(self, buf: pa.Buffer | bytes, n: int, multiline: bool, handler: bool = True,
              run: bool = True) -> Ok | Fail:
        """Parse ``n`` records of ``buf``, each ending with a line break; see
        :class:`Ok`. In a ``run`` no record holds a line break, so a line break
        in a value means that a quote was left open: the record is judged alone."""
        try:
            parsed, invalid = self._read(buf, multiline, handler)
        except pa.ArrowException as exc:
            m = _CSV_ROW_RE.match(str(exc)) or _CSV_FIELDS_RE.match(str(exc))
            return Fail(int(m.group(2)) - 1 if m else None, self._reason(str(exc)))
        lines = parsed.num_rows + len(invalid)
        if lines != n:
            return Fail(None, f"csv: {lines} lines for {n} records")
        rejected: dict[int, str] = {}
        for number, reason in invalid:
            if number is None or not 1 <= number <= n:
                return Fail(None, reason)
            rejected[number - 1] = reason
        # positions (in the range) of the parsed rows
        rows = np.array([p for p in range(n) if p not in rejected], dtype=np.int64) \
            if rejected else np.arange(n, dtype=np.int64)
        if run and len(rows) and rows[-1] == n - 1:
            # An open quote in an earlier record swallows the next records (the
            # line count shows it); in the last one it swallows only the break.
            last = parsed.slice(parsed.num_rows - 1, 1)
            for column in last.columns:
                text = column[0].as_py()
                raw = text.encode() if isinstance(text, str) else text
                if isinstance(raw, bytes) and (b"\n" in raw or b"\r" in raw):
                    return Fail(n - 1, "csv: a quoted field is not closed")
        cols = []
        unparsed: set[int] = set()  # parsed-row indices whose text did not convert
        for f in self.fields:
            col = parsed.column(f.name).combine_chunks()
            if f.kind not in ("string", "binary"):
                # an empty field is null in a typed column
                strings = pc.if_else(pc.equal(col, ""), pa.scalar(None, pa.string()), col)
                col, bad = convert_isolating(strings, _csv_converter(f))
                for b in bad:
                    unparsed.add(b)
                    rejected.setdefault(
                        int(rows[b]), f"csv: column {f.name!r}: cannot convert "
                        f"{show(strings[b].as_py())} to {f.label}"
                    )
            cols.append(col)
        table = pa.Table.from_arrays(cols, schema=self.schema)
        if unparsed:
            keep = np.ones(len(rows), dtype=bool)
            keep[sorted(unparsed)] = False
            table = table.filter(pa.array(keep))
        return Ok(table, sorted(rejected.items()))

    def _slow(self, raw: bytes) -> SlowOut:
        """One record alone; a quoted field may span lines here."""
        if not raw and len(self.fields) > 1:
            # Arrow reads an empty line as a row of empty fields; it holds one field.
            return Bad(f"csv: expected {len(self.fields)} columns, got 1")
        try:
            raw.decode("utf-8")
            utf8 = True
        except UnicodeDecodeError:
            utf8 = False
        out = self._fast(raw + b"\n", 1, True, handler=utf8, run=False)
        if isinstance(out, Ok):
            if out.rejected:
                return Bad(out.rejected[0][1])
            # A quote left open runs to the end of the input, taking the line
            # break after the record with it: end the record differently and see.
            alt = self._fast(raw + b"\r\n", 1, True, handler=utf8, run=False)
            if not (isinstance(alt, Ok) and alt.table.equals(out.table)):
                return Bad("csv: a quoted field is not closed")
            return out.table
        if out.message.startswith("csv: ") and " lines for 1 records" in out.message:
            lines = out.message.split()[1]
            return Bad(f"csv: the record holds {lines} lines; a record is one CSV line")
        return Bad(out.message)

    def _reason(self, message: str) -> str:
        if fm := _CSV_FIELDS_RE.match(message):
            return f"csv: expected {fm.group(3)} columns, got {fm.group(4)}"
        m = _CSV_ROW_RE.match(message)
        if not m:
            return message if message.startswith("csv: ") else f"csv: {message}"
        k = int(m.group(1))
        f = self.fields[k] if k < len(self.fields) else None
        name = f.name if f else f"#{k}"
        detail = m.group(3)
        label = f.label if f else "?"
        if (v := _CSV_CONV_RE.match(detail)) or (v := _CSV_DEC_RE.match(detail)):
            return f"csv: column {name!r}: cannot convert {v.group(1)} to {label}"
        if "invalid UTF8" in detail:
            return f"csv: column {name!r}: invalid utf-8"
        return f"csv: column {name!r}: {detail}"


class CsvFormat(ConfigModel):
    """Each record is one line of delimited text (no header line: every record
    is data; a stray header record becomes an error row if it does not convert)."""

    type: Literal["csv"] = "csv"
    """``csv``."""
    columns: tuple[str, ...] = Field(min_length=1)
    """Column names, in order (required)."""
    types: dict[str, ColumnType] = Field(default_factory=dict)
    """Types of some columns, ``column: type``; the others are ``string``."""
    delimiter: str = Field(default=",", min_length=1, max_length=1)
    """The field separator, one character."""

    @classmethod
    def check_raw(cls, data: Mapping[str, Any]) -> list[InitErrorDetails]:
        columns, types = data.get("columns"), data.get("types")
        if not isinstance(columns, Sequence) or not isinstance(types, Mapping):
            return []
        out = [
            problem(("types", k), f"column {k!r} is not in 'columns'", on_key=True)
            for k in types if k not in columns
        ]
        seen: set[Any] = set()
        for i, c in enumerate(columns):
            if c in seen:
                out.append(problem(("columns", i), f"duplicate column {c!r}"))
            seen.add(c)
        return out


def _decoder(spec: Mapping[str, Any], options: DecoderOptions) -> CsvDecoder:
    if "columns" not in spec:
        raise FormatError("csv format: 'columns' is required")
    return CsvDecoder(
        spec["columns"], spec.get("types"), delimiter=spec.get("delimiter", ","),
        quote=spec.get("quote", '"'), header=bool(spec.get("header", False)),
        allow_null=options.allow_null,
    )


#: (``quote`` and ``header`` are for specs written in code: ``reclock load``'s files)
PLUGIN = FormatPlugin(name="csv", config=CsvFormat, decoder=_decoder,
                      extra_keys=("quote", "header"))
