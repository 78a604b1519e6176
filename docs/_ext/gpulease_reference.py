"""The reference pages that are generated from the package itself, so they follow the code.

Each generator returns the text of a page section (MyST Markdown, with ``{eval-rst}`` blocks
where the source text is reStructuredText, as trait help is):

- :func:`config_reference`: every option of every configurable class of the package, found by
  walking its modules (:func:`configurable_classes`), with help, type and default.
- :func:`rest_api_reference`: the broker's REST API from its OpenAPI document.
- :func:`cli_reference`: ``jupyter gpulease <command> --help`` for every registered command,
  rendered from the command's own argparse parser (or the broker application's help).
- :func:`magics_reference`: the ``%gpu`` subcommands as the kernel's parser declares them.
- :func:`xid_reference`: the XID table of ``core/health.py``.

Nothing here is specific to one class or command: a class, option, path or command added to
the package shows up in the next build.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import json
import os
import pkgutil
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "jupyter_gpulease"
ROOT = Path(__file__).resolve().parents[2]

# where an admin writes the options of the classes of each part of the package, in page order;
# a part not named here still gets its classes documented, under "Other classes"
PARTS = {
    "broker": ("The broker", "gpulease_config.py", "the broker's own config file (`--config`)"),
    "hub": ("The hub", "jupyterhub_config.py", "the hub's config: the spawner"),
    "server": ("Single-user servers", "jupyter_server_config.py", "each single-user server's config: the server extension"),
}
# modules that are not part of the importable API: scripts and the schema migrations
SKIP_MODULES = ("__main__", ".migrations")


# ----------------------------------------------------------------------------- discovery
def package_modules() -> Iterator[object]:
    """Every importable module of the package (scripts and migrations left out)."""
    pkg = importlib.import_module(PACKAGE)
    yield pkg
    for info in pkgutil.walk_packages(pkg.__path__, f"{PACKAGE}."):
        if info.name.endswith(SKIP_MODULES[0]) or SKIP_MODULES[1] in info.name:
            continue
        try:
            yield importlib.import_module(info.name)
        except ImportError as e:  # every class must be documented: a module left out would drop its options
            raise ImportError(f"{info.name} cannot be imported ({e}); pip install -e '.[docs]' brings what every module needs") from e


def package_classes() -> dict[type, str]:
    """Every traitlets class the package defines -> the module that defines it.

    A class counts as the package's when its ``__module__`` is in the package, or when it is
    found in a module of the package and derives from one of the package's classes (a class
    made with ``type()`` may carry another ``__module__``)."""
    from traitlets import HasTraits

    found: dict[type, str] = {}
    later: list[tuple[type, str]] = []
    for mod in package_modules():
        for obj in vars(mod).values():
            if not (inspect.isclass(obj) and issubclass(obj, HasTraits)):
                continue
            if obj.__module__.startswith(PACKAGE):
                found.setdefault(obj, obj.__module__)
            else:
                later.append((obj, mod.__name__))
    for cls, modname in later:
        if cls not in found and any(base in found for base in cls.__mro__[1:]):
            found[cls] = modname
    return found


@dataclass
class ConfigClass:
    """One configurable class and where each of its options is documented."""

    cls: type
    module: str
    own: list[str] = field(default_factory=list)  # documented in this class's section
    inherited: dict[type, list[str]] = field(default_factory=dict)  # a documented base class -> its options
    external: dict[type, list[str]] = field(default_factory=dict)  # a class outside the package -> its options

    @property
    def name(self) -> str:
        return self.cls.__name__

    @property
    def part(self) -> str:
        return self.module.split(".")[1] if self.module.count(".") else ""


def _is_traitlets_base(cls: type) -> bool:
    return cls.__module__.startswith("traitlets") or cls is object


def configurable_classes() -> list[ConfigClass]:
    """The configurable classes of the package with their options, as the reference shows them.

    A configurable class is a ``Configurable`` of the package with at least one config option
    declared by the package. A class that only declares options for its subclasses (its bases
    are the package's and traitlets' own, and another configurable class of the package derives
    from it) gets no section: its options are documented on the topmost class that has them
    (``c.GPULeaseBroker.tiers``, not the settings class the broker inherits it from).
    """
    from traitlets.config import Application, Configurable

    classes = package_classes()
    ours = set(classes)

    def declared_here(trait) -> bool:
        return getattr(trait, "this_class", None) in ours

    configurable = [c for c in classes if issubclass(c, Configurable)
                    and any(declared_here(t) for t in c.class_traits(config=True).values())]

    def folded(c: type) -> bool:
        only_ours = all(b in ours or _is_traitlets_base(b) for b in c.__mro__[1:])
        return only_ours and any(d is not c and issubclass(d, c) for d in configurable)

    documented = [c for c in configurable if not folded(c)]
    out = []
    def order(c: type):
        # by part; within a part the application first, then base classes before those built on them
        part = classes[c].split(".")[1]
        rank = list(PARTS).index(part) if part in PARTS else len(PARTS)
        return rank, not issubclass(c, Application), sum(b in documented for b in c.__mro__), c.__name__

    for c in sorted(documented, key=order):
        entry = ConfigClass(c, classes[c])
        for name, trait in sorted(c.class_traits(config=True).items()):
            if not declared_here(trait):
                entry.external.setdefault(trait.this_class, []).append(name)
                continue
            # the topmost documented class in the MRO that has this very trait documents it
            home = next(b for b in reversed(c.__mro__) if b in documented and b.class_traits(config=True).get(name) is trait)
            if home is c:
                entry.own.append(name)
            else:
                entry.inherited.setdefault(home, []).append(name)
        out.append(entry)
    return out


# ----------------------------------------------------------------------------- the config reference
def _help_rst(text: str) -> str:
    """Trait help as a reStructuredText body (traitlets help is docstring-style reST)."""
    text = inspect.cleandoc(text or "").strip()
    return text or "(no help text)"


def _type_words(trait) -> str:
    name = type(trait).__name__
    values = getattr(trait, "values", None)
    if values and isinstance(values, (list, tuple, set, frozenset)):
        name += ": " + ", ".join(repr(v) for v in values)
    return name


def _default_words(cls: type, name: str, trait) -> str:
    gen = cls._all_trait_default_generators.get(name)
    if gen is not None and getattr(gen, "__self__", None) is not trait:
        return "computed when the object is made (see the help)"
    try:
        value = trait.default_value_repr()
    except Exception:  # a default that cannot be shown is said so, not guessed
        return "(not shown)"
    return value if len(value) <= 400 else value[:400] + " …"


def _literal(text: str) -> str:
    """Inline literal in reST; backquotes in the value cannot be nested, so they are left out."""
    text = " ".join(str(text).split())
    return f"``{text.replace('`', chr(39))}``" if text else "(empty)"


def _external_home(cls: type) -> str:
    top = cls.__module__.split(".")[0]
    return f"{cls.__name__} ({top})"


def config_reference() -> str:
    """Every option of every configurable class of the package, grouped by where it is set."""
    entries = configurable_classes()
    lines: list[str] = []
    by_part: dict[str, list[ConfigClass]] = {}
    for e in entries:
        by_part.setdefault(e.part if e.part in PARTS else "", []).append(e)
    for part in [*PARTS, ""]:
        if part not in by_part:
            continue
        if part:
            title, file, where = PARTS[part]
            lines += [f"## {title}: `{file}`", "", f"Set in {where}.", ""]
        else:
            lines += ["## Other classes", ""]
        for e in by_part[part]:
            lines += _class_section(e)
    return "\n".join(lines) + "\n"


def _class_section(e: ConfigClass) -> list[str]:
    c = e.cls
    doc = inspect.cleandoc(c.__doc__ or "").split("\n\n")[0].replace("\n", " ")
    rst = [doc, ""] if doc else []
    rst += [f"Defined in ``{e.module}``; set as ``c.{e.name}.<option>``.", ""]
    traits = c.class_traits(config=True)
    for name in e.own:
        t = traits[name]
        rst += [f".. confval:: c.{e.name}.{name}",
                f"   :type: {_literal(_type_words(t))}",
                f"   :default: {_literal(_default_words(c, name, t))}",
                "",
                textwrap.indent(_help_rst(t.help), "   "),
                ""]
    for home, names in e.inherited.items():
        refs = ", ".join(f":confval:`{n} <c.{home.__name__}.{n}>`" for n in names)
        rst += [".. container:: gpulease-inherited", "",
                f"   From :ref:`{home.__name__} <config-{home.__name__.lower()}>` (also set as ``c.{e.name}.<option>``): {refs}.", ""]
    for home, names in e.external.items():
        rst += [".. container:: gpulease-inherited gpulease-external", "",
                f"   From {_external_home(home)}, documented there: " + ", ".join(f"``{n}``" for n in names) + ".", ""]
    body = "\n".join(rst)
    return [f"(config-{e.name.lower()})=", f"### {e.name}", "", "```{eval-rst}", body, "```", ""]


# ----------------------------------------------------------------------------- the REST API
OPENAPI = ROOT / PACKAGE / "broker" / "openapi.json"


def _md_cell(text) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _schema_words(schema: dict, doc: dict) -> str:
    """A schema in a few words, with a link for a named one."""
    if not schema:
        return ""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#schema-{name.lower()})"
    t = schema.get("type", "")
    if t == "array":
        return f"array of {_schema_words(schema.get('items', {}), doc)}"
    for key in ("oneOf", "anyOf"):
        if key in schema:
            return " or ".join(_schema_words(s, doc) for s in schema[key])
    words = t or "object"
    if "enum" in schema:
        words += ": " + ", ".join(f"`{v}`" for v in schema["enum"])
    limits = [f"{k} {schema[k]}" for k in ("minimum", "maximum", "maxLength", "maxItems") if k in schema]
    if limits:
        words += f" ({', '.join(limits)})"
    if "default" in schema:
        words += f", default `{json.dumps(schema['default'])}`"
    return words


def _resolve(obj: dict, doc: dict) -> dict:
    while isinstance(obj, dict) and "$ref" in obj and obj["$ref"].startswith("#/components/") and not obj["$ref"].startswith("#/components/schemas/"):
        section, name = obj["$ref"].split("/")[2:4]
        obj = doc["components"][section][name]
    return obj


def _properties_table(schema: dict, doc: dict) -> list[str]:
    props = schema.get("properties") or {}
    if not props:
        return []
    required = set(schema.get("required", []))
    rows = ["| field | type | description |", "|---|---|---|"]
    for name, s in props.items():
        req = " (required)" if name in required else ""
        rows.append(f"| `{name}`{req} | {_md_cell(_schema_words(s, doc))} | {_md_cell(s.get('description', ''))} |")
    return rows + [""]


def _anchor(method: str, path: str) -> str:
    slug = "".join(ch if ch.isalnum() else "-" for ch in path.strip("/")).strip("-") or "root"
    while "--" in slug:
        slug = slug.replace("--", "-")
    return f"api-{method}-{slug}".lower()


def rest_api_reference(path: Path = OPENAPI) -> str:
    """Every path and method of the broker's OpenAPI document, then its schemas."""
    doc = json.loads(path.read_text(encoding="utf-8"))
    lines = [f"Generated from `{path.relative_to(ROOT)}` (OpenAPI {doc['openapi']}, API version {doc['info']['version']}); "
             f"the broker also serves it at `api/openapi.json`.", "", _md_cell(doc["info"].get("description", "")), ""]
    server = (doc.get("servers") or [{}])[0].get("url", "")
    methods = ("get", "put", "post", "delete", "patch")
    lines += ["## Paths", ""]
    for p, item in doc["paths"].items():
        shared = item.get("parameters", [])
        for method in methods:
            if method not in item:
                continue
            op = item[method]
            lines += [f"({_anchor(method, p)})=", f"### {method.upper()} `{p}`", ""]
            if server:
                lines += [f"Full path: `{server.rstrip('/')}{p}`", ""]
            if op.get("summary"):
                lines += [_md_cell(op["summary"]), ""]
            if op.get("description"):
                lines += [_md_cell(op["description"]), ""]
            params = [_resolve(x, doc) for x in [*shared, *op.get("parameters", [])]]
            if params:
                lines += ["| parameter | in | type | description |", "|---|---|---|---|"]
                for prm in params:
                    req = " (required)" if prm.get("required") else ""
                    lines.append(f"| `{prm['name']}`{req} | {prm.get('in', '')} | {_md_cell(_schema_words(prm.get('schema', {}), doc))} | "
                                 f"{_md_cell(prm.get('description', ''))} |")
                lines.append("")
            body = op.get("requestBody")
            if body:
                schema = (body.get("content", {}).get("application/json") or {}).get("schema", {})
                lines += [f"Request body (JSON{', required' if body.get('required') else ''}): {_schema_words(schema, doc)}", ""]
                if "$ref" not in schema:
                    lines += _properties_table(schema, doc)
            lines += ["| status | meaning | body |", "|---|---|---|"]
            for status, ref in sorted(op.get("responses", {}).items()):
                resp = _resolve(ref, doc)
                content = resp.get("content", {})
                kind, media = next(iter(content.items()), ("", {}))
                schema = media.get("schema", {}) if isinstance(media, dict) else {}
                what = _schema_words(schema, doc) if kind == "application/json" else (f"`{kind}`" if kind else "")
                lines.append(f"| {status} | {_md_cell(resp.get('description', ''))} | {_md_cell(what)} |")
            lines.append("")
    lines += ["## Schemas", ""]
    for name, schema in doc["components"].get("schemas", {}).items():
        lines += [f"(schema-{name.lower()})=", f"### {name}", ""]
        if schema.get("description"):
            lines += [_md_cell(schema["description"]), ""]
        table = _properties_table(schema, doc)
        lines += table or [_schema_words(schema, doc) or "object", ""]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- the command line
class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__(parser.prog)
        self.parser = parser


@contextlib.contextmanager
def _columns(n: int):
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(n)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


def command_parser(func: Callable[[list[str]], object]) -> tuple[argparse.ArgumentParser | None, str]:
    """The argparse parser a command's entry point builds, or (None, what its ``--help`` prints).

    The entry point runs with ``--help`` while ``ArgumentParser.parse_args`` is replaced by a
    stand-in that hands the parser back instead of parsing: the command itself builds it, so
    the page shows exactly the parser the command uses."""

    def capture(self, *args, **kwargs):
        raise _Captured(self)

    out = io.StringIO()
    saved = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_args = capture  # type: ignore[method-assign]
    argparse.ArgumentParser.parse_known_args = capture  # type: ignore[method-assign]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            func(["--help"])
    except _Captured as c:
        return c.parser, ""
    except SystemExit:
        pass
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = saved
    return None, out.getvalue()


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:  # argparse keeps its actions here; no public accessor exists
        if isinstance(action, argparse._SubParsersAction):
            found.update(action.choices)
    return found


def cli_reference() -> str:
    """``jupyter gpulease --help`` and every command's help, from the commands' own parsers."""
    from jupyter_gpulease import cli

    lines = ["(cli-overview)=", "## `jupyter gpulease`", "", "```text", cli._usage(), "```", ""]
    with _columns(90):
        for name, (module, func, summary) in cli.SUBCOMMANDS.items():
            parser, printed = command_parser(getattr(importlib.import_module(module), func))
            lines += [f"(cli-{name})=", f"## `jupyter gpulease {name}`", "", summary[:1].upper() + summary[1:] + ".", ""]
            lines += ["```text", (parser.format_help() if parser else printed).rstrip(), "```", ""]
            if parser:
                for sub, sp in _subparsers(parser).items():
                    lines += [f"(cli-{name}-{sub})=", f"### `jupyter gpulease {name} {sub}`", "", "```text", sp.format_help().rstrip(), "```", ""]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- %gpu
def magics_reference() -> str:
    """The ``%gpu`` line and cell magics as the kernel's parser declares them."""
    from jupyter_gpulease.kernel import args

    rows = ["| usage | what it does |", "|---|---|"]
    for name, (_, text) in args.SUBCOMMANDS.items():
        rows.append(f"| `{_md_cell(args.usage(name))}` | {_md_cell(text)} |")
    rows.append(f"| `{_md_cell(args.CELL_USAGE)}` | {_md_cell(args.CELL_HELP)} |")
    return "\n".join([*rows, "", "What `%gpu help` prints in a notebook:", "", "```text", args.help_text(), "```", ""])


# ----------------------------------------------------------------------------- XIDs
def xid_reference() -> str:
    """The one XID table, as ``core/health.py`` declares it."""
    from jupyter_gpulease.core.health import xid_table_markdown

    return xid_table_markdown() + "\n"


GENERATORS: dict[str, Callable[[], str]] = {
    "config": config_reference,
    "rest-api": rest_api_reference,
    "cli": cli_reference,
    "magics": magics_reference,
    "xid": xid_reference,
}
