"""Reading configuration YAML: the line-keeping loader (duplicate keys,
bounded depth and size, aliases), ``${VAR}`` substitution, and pydantic errors
mapped back to key paths and lines (:func:`parse_model`, for any model). A
model that validates hands its secrets to the process's scrubber
(:mod:`reclock.core.secrets`)."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, TypeVar, Union, cast, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ValidationError,
)

from reclock.contracts.config import (
    KAFKA_TOPIC_PATTERN,
    NAME_PATTERN,
    SLOT_PATTERN,
    ConfigError,
    ConfigIssue,
    KeyPath,
    config_secrets,
    redact_secrets,
    type_tags,
)
from reclock.core.secrets import register

_M = TypeVar("_M", bound=BaseModel)

# ---------------------------------------------------------------------------
# YAML with positions
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Pos:
    line: int  # 1-based
    column: int  # 1-based

    @classmethod
    def of(cls, mark: yaml.Mark | None) -> _Pos:
        return cls(1, 1) if mark is None else cls(mark.line + 1, mark.column + 1)


_CParser: type[yaml.CSafeLoader] | None = getattr(yaml, "CSafeLoader", None)
_MAP_TAG = "tag:yaml.org,2002:map"
_STR_TAG = "tag:yaml.org,2002:str"
_SEQ_TAG = "tag:yaml.org,2002:seq"
_MERGE_TAG = "tag:yaml.org,2002:merge"


#: Bounds on what a pipeline file may expand to: deeper nesting, or more
#: values (an alias bomb), is a located error found in well under a second.
MAX_YAML_DEPTH = 64
MAX_YAML_VALUES = 100_000
MAX_YAML_BYTES = 4 * 1024 * 1024


class LineLoader(yaml.SafeLoader):
    """A safe loader that remembers where every key and value starts.

    :meth:`load_tracked` returns the plain data of the single document and
    fills ``key_pos`` / ``value_pos`` (key path -> position); duplicate keys,
    non-string keys and unsupported tags become ``problems`` (path, position,
    message) instead of being silently accepted.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._text = stream
        self.key_pos: dict[KeyPath, _Pos] = {}
        self.value_pos: dict[KeyPath, _Pos] = {}
        self.problems: list[tuple[KeyPath, _Pos, str]] = []
        self.broken: set[KeyPath] = set()  # values replaced by None after a problem
        self._active: set[int] = set()
        self._built = 0
        self._too_many = False

    def load_tracked(self) -> Any:
        """Parse the one document (None if the stream is empty)."""
        node = self._compose()
        if node is None:
            return None
        return self._build(node, ())

    def _compose(self) -> yaml.Node | None:
        """The node tree: libyaml's parser when PyYAML has it (the same YAML,
        with the same marks, about ten times faster), else this loader's own."""
        if _CParser is None:
            return self.get_single_node()
        parser = _CParser(self._text)
        try:
            return parser.get_single_node()
        finally:
            parser.dispose()

    def _build(self, node: yaml.Node, path: KeyPath) -> Any:
        self.value_pos[path] = _Pos.of(node.start_mark)
        self._built += 1
        if self._built > MAX_YAML_VALUES:
            if not self._too_many:
                self._too_many = True
                self.problems.append((path, _Pos.of(node.start_mark),
                                      f"the document expands to more than {MAX_YAML_VALUES:,} "
                                      "values (YAML aliases repeating aliases?)"))
            self.broken.add(path)
            return None
        if len(path) > MAX_YAML_DEPTH and isinstance(node, yaml.CollectionNode):
            self.problems.append((path, _Pos.of(node.start_mark),
                                  f"nested deeper than {MAX_YAML_DEPTH} levels"))
            self.broken.add(path)
            return None
        if id(node) in self._active:
            self.problems.append((path, _Pos.of(node.start_mark), "recursive alias"))
            self.broken.add(path)
            return None
        if isinstance(node, yaml.MappingNode):
            self._active.add(id(node))
            try:
                return self._mapping(node, path)
            finally:
                self._active.discard(id(node))
        if isinstance(node, yaml.SequenceNode):
            if node.tag != _SEQ_TAG:
                return self._bad_tag(node, path)
            self._active.add(id(node))
            try:
                return [self._build(item, (*path, i)) for i, item in enumerate(node.value)]
            finally:
                self._active.discard(id(node))
        try:
            return self._scalar(node)
        except yaml.constructor.ConstructorError:
            return self._bad_tag(node, path)

    def _scalar(self, node: yaml.Node) -> Any:
        if node.tag == _STR_TAG:  # the common case, without the constructor's bookkeeping
            return node.value
        return self.construct_object(node, deep=True)

    def _bad_tag(self, node: yaml.Node, path: KeyPath) -> None:
        self.problems.append((path, _Pos.of(node.start_mark), f"unsupported YAML tag {node.tag}"))
        self.broken.add(path)
        return None

    def _mapping(self, node: yaml.MappingNode, path: KeyPath) -> dict[str, Any]:
        if node.tag != _MAP_TAG:
            self._bad_tag(node, path)
            return {}
        first: dict[Any, _Pos] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG or not isinstance(key_node, yaml.ScalarNode):
                continue
            key = self._scalar(key_node)
            pos = _Pos.of(key_node.start_mark)
            if key in first:
                prev = first[key]
                self.problems.append((path, pos, f"duplicate key {key!r} (first at line "
                                                  f"{prev.line}; YAML would keep only the last)"))
            else:
                first[key] = pos
        try:
            self.flatten_mapping(node)  # resolves `<<: *anchor` merge keys
        except yaml.constructor.ConstructorError as exc:
            self.problems.append((path, _Pos.of(exc.problem_mark), str(exc.problem)))
            return {}
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            pos = _Pos.of(key_node.start_mark)
            if not isinstance(key_node, yaml.ScalarNode):
                self.problems.append((path, pos, "a key must be a plain string"))
                continue
            key = self._scalar(key_node)
            if not isinstance(key, str):
                self.problems.append((path, pos, f"key {key!r} must be a string (quote it)"))
                continue
            self.key_pos[(*path, key)] = pos
            out[key] = self._build(value_node, (*path, key))
        return out


# ---------------------------------------------------------------------------
# Environment variables
# ---------------------------------------------------------------------------

_VAR = re.compile(r"\$\$|\$\{([^}]*)\}|\$\{")
_VAR_BODY = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?::-(.*))?", re.DOTALL)


def substitute_env(
    data: Any, env: Mapping[str, str], path: KeyPath = ()
) -> tuple[Any, list[tuple[KeyPath, str]]]:
    """Replace ``${VAR}`` / ``${VAR:-default}`` in every string value of
    ``data`` (keys are left alone); ``$$`` is a literal ``$``. Returns the new
    data and ``(path, message)`` problems (undefined variables, bad syntax);
    messages name the variable, never its value or default."""
    problems: list[tuple[KeyPath, str]] = []
    if isinstance(data, dict):
        out_d: dict[str, Any] = {}
        for k, v in data.items():
            out_d[k], p = substitute_env(v, env, (*path, k))
            problems += p
        return out_d, problems
    if isinstance(data, list):
        out_l: list[Any] = []
        for i, v in enumerate(data):
            new, p = substitute_env(v, env, (*path, i))
            out_l.append(new)
            problems += p
        return out_l, problems
    if not isinstance(data, str) or "$" not in data:
        return data, problems

    def replace(m: re.Match[str]) -> str:
        if m[0] == "$$":
            return "$"
        body = None if m[1] is None else _VAR_BODY.fullmatch(m[1])
        if body is None:
            problems.append((path, "malformed variable reference: use ${NAME} or "
                                   "${NAME:-default} (write $$ for a literal $)"))
            return ""
        name, default = body[1], body[2]
        if name in env:
            return env[name]
        if default is not None:
            return default
        problems.append((path, f"environment variable {name} is not set "
                               f"(set it, or give a default: ${{{name}:-default}})"))
        return ""

    return _VAR.sub(replace, data), problems


# ---------------------------------------------------------------------------
# Mapping pydantic errors back to the YAML
# ---------------------------------------------------------------------------


@dataclass
class _Located:
    path: KeyPath  # the data path (union tags removed)
    parent: type[BaseModel] | None  # the model holding the last key, if any
    union: tuple[type[BaseModel], ...]  # members, if the type at ``path`` is a tagged union


def _unwrap(tp: Any) -> Any:
    """Strip ``Annotated`` and ``Optional``."""
    while True:
        if get_origin(tp) is Annotated:
            tp = get_args(tp)[0]
            continue
        if get_origin(tp) in (Union, UnionType):
            members = [a for a in get_args(tp) if a is not type(None)]
            if len(members) == 1:
                tp = members[0]
                continue
        return tp


def _union_members(tp: Any) -> tuple[type[BaseModel], ...]:
    if get_origin(tp) not in (Union, UnionType):
        return ()
    members = tuple(_unwrap(a) for a in get_args(tp) if a is not type(None))
    if all(isinstance(m, type) and issubclass(m, BaseModel) and "type" in m.model_fields
           for m in members):
        return members
    return ()


def _locate(root: type[BaseModel], loc: tuple[str | int, ...]) -> _Located:
    """Follow a pydantic error ``loc`` through the model types: keep the
    segments that are keys or indexes, drop the tags pydantic inserts for
    discriminated unions (``sink.file.path`` -> ``sink.path``)."""
    tp: Any = root
    path: list[str | int] = []
    parent: type[BaseModel] | None = None
    for seg in loc:
        tp = _unwrap(tp)
        members = _union_members(tp)
        if members:
            chosen = [m for m in members if str(seg) in type_tags([m])]
            tp = chosen[0] if chosen else Any
            continue
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            parent = tp
            field = next((f for n, f in tp.model_fields.items() if (f.alias or n) == seg), None)
            tp = Any if field is None else field.annotation
            path.append(seg)
            continue
        origin = get_origin(tp)
        if origin in (list, tuple) and isinstance(seg, int):
            tp = get_args(tp)[0]
        elif origin is dict:
            if seg == "[key]":
                continue
            tp = get_args(tp)[1]
        else:
            tp = Any
        parent = None
        path.append(seg)
    tp = _unwrap(tp)
    return _Located(tuple(path), parent, _union_members(tp))


def format_path(path: KeyPath) -> str:
    """``("sources", 0, "outputs")`` -> ``sources[0].outputs``; keys that are
    not plain identifiers are quoted: ``conf['spark.executor.memory']``."""
    out = ""
    for seg in path:
        if isinstance(seg, int):
            out += f"[{seg}]"
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", seg):
            out += f".{seg}" if out else seg
        else:
            out += f"[{seg!r}]"
    return out


_EXPECTED = {
    "int_type": "expected an integer",
    "int_parsing": "expected an integer",
    "int_from_float": "expected an integer",
    "float_type": "expected a number",
    "float_parsing": "expected a number",
    "bool_type": "expected true or false",
    "bool_parsing": "expected true or false",
    "string_type": "expected a string",
    "list_type": "expected a list",
    "tuple_type": "expected a list",
    "dict_type": "expected a mapping",
    "model_type": "expected a mapping",
    "model_attributes_type": "expected a mapping",
    "path_type": "expected a path (a string)",
}


def _describe(err: Mapping[str, Any], here: _Located) -> str:
    """A message for one pydantic error, from its type and context only (the
    input value is never echoed)."""
    kind = err["type"]
    ctx = err.get("ctx") or {}
    if kind in _EXPECTED:
        return _EXPECTED[kind]
    if kind == "reclock_config":
        return str(ctx["message"])
    if kind == "value_error":
        return str(ctx.get("error", err["msg"]))
    if kind == "literal_error":
        return f"expected {ctx['expected']}"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        op = {"greater_than": ">", "greater_than_equal": ">=",
              "less_than": "<", "less_than_equal": "<="}[kind]
        bound = next(iter(ctx.values()))
        if isinstance(bound, float) and bound.is_integer():
            bound = int(bound)
        return f"expected a number {op} {bound}"
    if kind == "too_short":
        n = ctx.get("min_length", 1)
        return f"expected at least {n} item{'s' if n != 1 else ''}"
    if kind == "string_too_short":
        return f"expected at least {ctx.get('min_length')} character(s)"
    if kind == "string_too_long":
        return f"expected at most {ctx.get('max_length')} character(s)"
    if kind == "string_pattern_mismatch":
        if ctx.get("pattern") == NAME_PATTERN:
            return ("expected a name: a letter, then letters, digits, '_' or '-' "
                    "(63 characters at most)")
        if ctx.get("pattern") == KAFKA_TOPIC_PATTERN:
            return "expected a Kafka topic name: letters, digits, '.', '_' or '-'"
        if ctx.get("pattern") == SLOT_PATTERN:
            return ("expected a replication slot name: lower-case letters, digits or '_' "
                    "(63 characters at most)")
        return f"expected a string matching {ctx.get('pattern')}"
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        tags = ", ".join(type_tags(here.union))
        if kind == "union_tag_not_found":
            return f"missing required key 'type' (expected one of: {tags})"
        return f"unknown type (expected one of: {tags})"
    return str(err["msg"])


def _lookup(data: Any, path: KeyPath) -> Any:
    """The raw value at ``path`` in ``data``, or None."""
    for seg in path:
        if not isinstance(data, dict | list):
            return None
        try:
            data = data[seg]  # type: ignore[index]
        except (KeyError, IndexError, TypeError):
            return None
    return data


def _issues_from_validation(
    exc: ValidationError,
    root: type[BaseModel],
    data: Any,
    loader: LineLoader,
    filename: str,
) -> list[ConfigIssue]:
    """One :class:`ConfigIssue` per pydantic error, located through ``loader``."""
    issues: list[ConfigIssue] = []

    def pos_of(path: KeyPath, table: Mapping[KeyPath, _Pos]) -> _Pos:
        while path not in table and path:
            path = path[:-1]
            table = loader.value_pos
        return table.get(path, _Pos(1, 1))

    for err in exc.errors(include_url=False, include_input=False):
        here = _locate(root, err["loc"])
        kind = err["type"]
        path = here.path
        if path in loader.broken:
            continue  # already reported by the loader
        if kind == "too_short":
            # pydantic counts only the items that validated: a list whose
            # items have errors of their own is not too short.
            raw = _lookup(data, path)
            if isinstance(raw, list) and len(raw) >= (err.get("ctx") or {}).get("min_length", 1):
                continue
        if kind in ("missing", "extra_forbidden") and path:
            key = path[-1]
            parent_path = path[:-1]
            expected = ", ".join(
                sorted((f.alias or n) for n, f in here.parent.model_fields.items())
            ) if here.parent else ""
            if kind == "missing":
                msg = f"missing required key {key!r}"
                pos = pos_of(parent_path, loader.value_pos)
            else:
                msg = f"unknown key {key!r}" + (f" (expected one of: {expected})"
                                                 if expected else "")
                pos = pos_of(path, loader.key_pos)
            path = parent_path
        else:
            msg = _describe(err, here)
            if kind == "union_tag_invalid" and (*path, "type") in loader.value_pos:
                path = (*path, "type")
            ctx = err.get("ctx") or {}
            if kind == "reclock_config" and "also" in ctx:
                at, also = tuple(ctx["at"]), tuple(ctx["also"])
                prefix = err["loc"][: len(err["loc"]) - len(at)]
                other = _locate(root, (*prefix, *also)).path
                line = loader.value_pos.get(other)
                msg += f" (also at {format_path(other)}" + (
                    f", line {line.line})" if line else ")")
            on_key = kind == "reclock_config" and ctx.get("on_key")
            pos = pos_of(path, loader.key_pos if on_key else loader.value_pos)
        issues.append(ConfigIssue(pos.line, pos.column, format_path(path),
                                  redact_secrets(msg), filename))
    return issues


def parse_model(
    model: type[_M],
    text: str,
    filename: str = "<string>",
    base_dir: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> _M:
    """Validate YAML ``text`` as ``model`` with the same loader, substitution
    and error reporting as :func:`parse_config` (for any configuration model,
    e.g. one connector block in a test)."""
    if len(text) > MAX_YAML_BYTES:
        raise ConfigError([ConfigIssue(1, 1, None, f"the file is larger than "
                                       f"{MAX_YAML_BYTES // (1024 * 1024)} MiB", filename)])
    loader = LineLoader(text)
    try:
        data = loader.load_tracked()
    except RecursionError:
        raise ConfigError([ConfigIssue(1, 1, None, f"invalid YAML: nested deeper than "
                                       f"{MAX_YAML_DEPTH} levels", filename)]) from None
    except yaml.MarkedYAMLError as exc:
        pos = _Pos.of(exc.problem_mark or exc.context_mark)
        what = str(exc.problem or "invalid YAML")
        if exc.context:
            ctx_line = f" at line {exc.context_mark.line + 1}" if exc.context_mark else ""
            what += f" ({exc.context}{ctx_line})"
        if _char_at(text, exc.problem_mark) == "\t":
            what += "; indent with spaces, not tabs"
        issue = ConfigIssue(pos.line, pos.column, None, redact_secrets(f"invalid YAML: {what}"),
                            filename)
        raise ConfigError([issue]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([ConfigIssue(1, 1, None, f"invalid YAML: {type(exc).__name__}",
                                       filename)]) from None
    finally:
        loader.dispose()

    issues = [ConfigIssue(pos.line, pos.column, format_path(path), redact_secrets(msg), filename)
              for path, pos, msg in loader.problems]
    if data is None:
        data = {}
    if not isinstance(data, dict):
        pos = loader.value_pos.get((), _Pos(1, 1))
        issues.append(ConfigIssue(pos.line, pos.column, "", "expected a mapping of settings",
                                  filename))
        raise ConfigError(issues)

    # Top-level keys starting with "x-" are free for YAML anchors (`x-defaults: &d`).
    data, env_problems = _substituted(data, env)
    for path, msg in env_problems:
        pos = loader.value_pos.get(path, _Pos(1, 1))
        issues.append(ConfigIssue(pos.line, pos.column, format_path(path), msg, filename))

    try:
        cfg = model.model_validate(data, context={"base_dir": base_dir or Path.cwd()})
    except ValidationError as exc:
        issues += _issues_from_validation(exc, model, data, loader, filename)
        raise ConfigError(issues) from None
    if issues:
        raise ConfigError(issues)
    # From here on, every text the process lets out is scrubbed of this
    # configuration's secrets (reclock.core.secrets).
    register(config_secrets(cfg))
    if hasattr(cfg, "_fingerprint"):
        object.__setattr__(cfg, "_fingerprint", fingerprint(data, base_dir or Path.cwd()))
    return cfg


def _substituted(data: dict[str, Any], env: Mapping[str, str] | None
                 ) -> tuple[Any, list[tuple[KeyPath, str]]]:
    """The document as validated: without its ``x-`` keys, ``${VAR}`` replaced."""
    data = {k: v for k, v in data.items() if not k.startswith("x-")}
    return substitute_env(data, os.environ if env is None else env)


def fingerprint(data: Any, base_dir: Path) -> str:
    """What identifies a configuration as validated: its document after
    substitution, and the directory its relative paths resolve against. A
    running driver writes it to its status; ``reclock status`` compares it
    with the file's (:func:`quick_view`)."""
    blob = json.dumps({"base_dir": str(base_dir), "data": data}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


#: where reclock keeps its state when the file does not say (relative to the file)
DEFAULT_STATE_DIR = Path("./state")


def absolute_path(path: Path, base: Path) -> Path:
    """``path`` (``~`` expanded) made absolute against ``base``."""
    return Path(os.path.abspath(base / path.expanduser()))


def drop_marker(state_dir: Path, source: str) -> Path:
    """The file ``reclock drop`` makes for ``source``."""
    return state_dir / "dropped" / source


@dataclass(frozen=True)
class QuickView:
    """What :func:`quick_view` reads off a pipeline file."""

    fingerprint: str
    state_dir: Path
    sources: tuple[str, ...]


def _plain_document(path: Path) -> dict[str, Any] | None:
    """The pipeline file at ``path`` as YAML gives it, unvalidated and before
    ``${VAR}`` substitution; None when it does not read plainly (unreadable,
    too large, not YAML, not a mapping, or problems the loader reports)."""
    try:
        text = path.read_text(encoding="utf-8")
        if len(text) > MAX_YAML_BYTES:
            return None
        loader = LineLoader(text)
        try:
            raw = loader.load_tracked()
        finally:
            loader.dispose()
    except (OSError, UnicodeDecodeError, RecursionError, yaml.YAMLError):
        return None
    if loader.problems or not isinstance(raw, dict):
        return None
    return raw


def quick_view(path: str | Path, env: Mapping[str, str] | None = None) -> QuickView | None:
    """The fingerprint, state directory and source names of the pipeline file
    at ``path``, read without validating it (no model is built: ``reclock
    status`` of a running driver needs seconds less at many sources). To be
    trusted only where a driver's status carries the same fingerprint: that
    driver validated this very document. None when the file does not read
    plainly (then validate it)."""
    p = Path(path)
    raw = _plain_document(p)
    if raw is None:
        return None
    data, problems = _substituted(raw, env)
    sd, sources = data.get("state_dir", str(DEFAULT_STATE_DIR)), data.get("sources")
    if problems or not isinstance(sd, str) or "://" in sd or not isinstance(sources, list):
        return None
    names = tuple(s.get("name") if isinstance(s, dict) else None for s in sources)
    if not all(isinstance(n, str) for n in names):
        return None
    base = Path(os.path.abspath(p.parent))
    return QuickView(fingerprint(data, base), absolute_path(Path(sd), base),
                     cast(tuple[str, ...], names))


def spark_view(path: str | Path, env: Mapping[str, str] | None = None
               ) -> tuple[str, str, dict[str, str]] | None:
    """The ``spark`` block's master, application name and settings as the
    pipeline file at ``path`` gives them (the defaults where it is silent),
    read without validating the file, so that ``reclock run`` can start
    Spark's JVM while the rest of the file is checked. Only a hint: the
    session is used if the validated configuration names the same three,
    and made again otherwise. None when the block does not read plainly."""
    raw = _plain_document(Path(path))
    if raw is None:
        return None
    block = raw.get("spark", {})
    if not isinstance(block, dict):
        return None
    data, problems = _substituted({"spark": block}, env)
    block = data["spark"]
    master, app, conf = (block.get("master", "local[*]"), block.get("app_name", "reclock"),
                         block.get("conf", {}))
    if problems or not isinstance(master, str) or not isinstance(app, str) or not isinstance(
            conf, dict):
        return None
    plain: dict[str, str] = {}
    for k, v in conf.items():
        if isinstance(v, bool):
            v = "true" if v else "false"
        elif isinstance(v, int | float):
            v = str(v)
        if not isinstance(k, str) or not isinstance(v, str):
            return None
        plain[k] = v
    return master, app, plain


def _char_at(text: str, mark: yaml.Mark | None) -> str:
    """The character at ``mark`` in ``text`` ("" when out of range)."""
    if mark is None:
        return ""
    lines = text.splitlines()
    line = lines[mark.line] if mark.line < len(lines) else ""
    return line[mark.column : mark.column + 1]
