"""``--config FILE``: a run's settings read from a YAML (``.yaml``, ``.yml``) or JSON (``.json``) file, a
mapping of option names to values, such as the ``config.json`` every run writes into its job folder.

A key is an option's field name (``input_size``) or its flag (``input-size``, ``--input-size``); a value is
what ``config.json`` holds (a list for a list option, true or false for a switch, null for "not set") and
is parsed by the option's own flag, so a bad one gets the flag's message. What a run's ``config.json``
holds that is no setting of the next run is ignored, and named in the run's log
(:meth:`FileSettings.note`): where that run sat (the placement flags: the command line's and the
launcher's alone, so that a file never outranks torchrun or SLURM), what its resumes kept
(``global_batch``), its own ``config_file``, and, in a run's record, the other script's options at their
defaults. :func:`fixres_dist.entry.cli.build_parser`'s parser merges the result under the flags given.
Imports nothing heavy (PyYAML only when a YAML file is read).
"""
from __future__ import annotations

import argparse
import difflib
import json
from pathlib import Path

import attrs

from fixres_dist.config import TrainerConfig, resolved_path
from fixres_dist.errors import FixresError

SUFFIXES = {".yaml": "YAML", ".yml": "YAML", ".json": "JSON"}
NOTE = "config_note"  # the parsed namespace's attribute holding the log's line (FileSettings.note), if any


@attrs.frozen
class FileSettings:
    """What a ``--config`` file sets. ``path``: the file, absolute; ``values``: option (the parser's
    ``dest``) -> value, as its flag parses it; ``ignored``: the keys read and not applied, in the file's order;
    ``ranks``: the file's ``num_tasks`` (the world size of the run whose ``config.json`` it is), or None."""

    path: str
    values: dict
    ignored: tuple[str, ...] = ()
    ranks: int | None = None

    def note(self, overridden: list[str], ranks: int | None = None) -> str:
        """The log's line: the file read, the flags of ``overridden`` (the command line's instead), what was
        ignored, and, where the file's run had another number of ranks than ``--num-tasks`` (``ranks``, None:
        not given), how to give it the same global batch."""
        line = f"settings read from --config {self.path}"
        if overridden:
            line += f"; the command line's {', '.join(overridden)} instead of the file's"
        if self.ignored:
            line += (f"; ignored, as no setting of this run (where its run sat, its record, the other script's "
                     f"options): {', '.join(self.ignored)}")
        if self.ranks is not None and (ranks or 1) != self.ranks:
            line += (f"; its run had {self.ranks} rank(s), and --batch is per rank: run on {self.ranks} (--num-tasks "
                     f"{self.ranks}, or its launcher's) for its global batch and learning rate")
        return line


def read_mapping(path: str) -> dict:
    """The mapping in ``path`` (YAML by PyYAML's ``safe_load``, or JSON, by its suffix). Raises
    :class:`~fixres_dist.errors.FixresError` (one line, naming ``--config path``) for another suffix, a
    file that is missing or unreadable, text that is not valid YAML or JSON, or a top-level value that
    is not a mapping."""
    where = f"--config {path}"
    kind = SUFFIXES.get(Path(path).suffix.lower())
    if kind is None:
        raise FixresError(f"{where}: give a YAML (.yaml, .yml) or JSON (.json) file")
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FixresError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise FixresError(f"{where}: is a folder, not a file") from None
    except UnicodeDecodeError:
        raise FixresError(f"{where}: is not UTF-8 text") from None
    except OSError as exc:
        raise FixresError(f"{where}: cannot be read ({exc.strerror or exc})") from None
    data = _parsed(text, kind, where)
    if not isinstance(data, dict):
        raise FixresError(f"{where}: holds {_kind_of(data)}, not a mapping of option names to values "
                          "(e.g. input_size: 64)")
    return data


class DuplicateKey(ValueError):
    """A mapping of the file that gives one key twice (JSON and YAML parsers keep the last, silently)."""


def _unique(pairs) -> dict:
    """A JSON object's ``(key, value)`` pairs as a dict; :class:`DuplicateKey` for a key given twice."""
    found = {}
    for key, value in pairs:
        if key in found:
            raise DuplicateKey(key)
        found[key] = value
    return found


def _yaml_loader():
    """PyYAML's safe loader, refusing a mapping that gives one key twice (:class:`DuplicateKey`)."""
    import yaml

    class UniqueKeys(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            keys = [self.construct_object(key, deep=deep) for key, _ in node.value]
            twice = next((key for i, key in enumerate(keys) if key in keys[:i]), None)
            if twice is not None:
                raise DuplicateKey(twice)
            return super().construct_mapping(node, deep=deep)
    return UniqueKeys


def _parsed(text: str, kind: str, where: str):
    """``text`` parsed as ``kind`` (``YAML`` or ``JSON``); FixresError saying where it is malformed, or
    which key it gives twice."""
    try:
        if kind == "JSON":
            try:
                return json.loads(text, object_pairs_hook=_unique)
            except json.JSONDecodeError as exc:
                raise FixresError(f"{where}: not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") \
                    from None
        return _yaml(text, where)
    except DuplicateKey as exc:
        raise FixresError(f"{where}: {exc.args[0]!r} is given twice (which one is meant?)") from None


def _yaml(text: str, where: str):
    import yaml

    try:
        return yaml.load(text, Loader=_yaml_loader())
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc)
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise FixresError(f"{where}: not valid YAML: {' '.join(problem.split())}{at}") from None


def _kind_of(data) -> str:
    if data is None:
        return "nothing"
    if isinstance(data, list):
        return "a list"
    return "text" if isinstance(data, str) else f"a single value ({data!r})"


def read_settings(path: str, parser: argparse.ArgumentParser, mode: str, placement: tuple[str, ...]) -> FileSettings:
    """The settings of ``--config path`` for ``parser`` (``main_<mode>.py``'s; ``placement``: the
    ``dest`` of its placement flags, never read from a file). Raises
    :class:`~fixres_dist.errors.FixresError` (one line) for what :func:`read_mapping` refuses, a key that
    is no option (naming the nearest), two keys of one option, a value its flag refuses (the flag's
    message), a file naming another ``--config``, an option of the other script (but, in a run's own
    ``config.json``, at its default) and a run's ``config.json`` of the other script."""
    data, where = read_mapping(path), f"--config {path}"
    record = "mode" in data  # a run's config.json: every field, the other script's at their defaults
    if record and data["mode"] != mode:
        what = f"the configuration of a main_{data['mode']}.py run" if data["mode"] in ("scratch", "finetune") \
            else f"of mode {data['mode']!r}"
        raise FixresError(f"{where}: is {what}, not of main_{mode}.py")
    options, fields = _options(parser), attrs.fields_dict(TrainerConfig)
    values, ignored, seen = {}, [], {}
    for key, value in data.items():
        action = options.get(key) if isinstance(key, str) else None
        if key == "mode" or (action is None and key in fields):  # the record of a run: no option sets it
            ignored += [key] if key != "mode" else []
            continue
        if action is None:
            raise FixresError(f"{where}: unknown option {key!r}; did you mean {_nearest(key, options)}?")
        if action.dest in seen:
            raise FixresError(f"{where}: {seen[action.dest]} and {key} are one option, {action.option_strings[0]}")
        seen[action.dest] = key
        if action.dest == "config_file" and key != "config_file":  # config_file: the record of that run's --config
            raise FixresError(f"{where}: a --config file cannot name another ({key}: {value})")
        if action.dest in placement or action.dest == "config_file" or (
                getattr(action, "belongs_to", None) and record and value == fields[action.dest].default):
            ignored.append(key)  # where that run sat; the other script's options, unset
        elif getattr(action, "belongs_to", None):
            raise FixresError(f"{where}: {action.option_strings[0]} only applies to {action.belongs_to}")
        elif (parsed := _value(parser, action, value, where)) is not None:
            values[action.dest] = parsed
    ranks = data.get("num_tasks")
    return FileSettings(resolved_path(path), values, tuple(ignored),
                        ranks if isinstance(ranks, int) and not isinstance(ranks, bool) and ranks > 0 else None)


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every key that names an option of ``parser``: its ``dest``, and each flag with and without ``--``
    (not ``--no-x``, the negative of a switch ``--x``)."""
    options = {}
    for action in parser._actions:
        if action.dest == "help":
            continue
        options[action.dest] = action
        for flag in action.option_strings:
            if not (isinstance(action, argparse.BooleanOptionalAction) and flag.startswith("--no-")):
                options[flag] = options[flag.lstrip("-")] = action
    return options


def _nearest(key, options: dict) -> str:
    """The valid key nearest to ``key``, spelt as it is (``input_size``, ``input-size`` or ``--input-size``)."""
    key = str(key)

    def style(name: str) -> tuple[bool, bool]:
        return name.startswith("--"), "-" in name.lstrip("-")
    names = [name for name, action in options.items() if style(name) == style(key)
             and not getattr(action, "belongs_to", None) and action.dest != "config_file"]
    return difflib.get_close_matches(key, names, n=1, cutoff=0.0)[0]


def _value(parser: argparse.ArgumentParser, action: argparse.Action, value, where: str):
    """``value`` of option ``action`` as its flag gives it; None: not set (null, or ``false`` of ``--compile``).
    FixresError with the flag's message."""
    flag = action.option_strings[0]
    if value is None:
        return "none" if "none" in (action.choices or ()) else None  # --auto-augment none: no policy
    if action.nargs == 0:  # a switch: --x (and --no-x)
        if not isinstance(value, bool):
            raise FixresError(f"{where}: argument {flag}: expected true or false, got {value!r}")
        return value
    if isinstance(value, bool):
        if action.nargs == "?" and action.const is not None:  # --compile: true is its default backend
            return action.const if value else None
        try:  # YAML 1.1 reads off, no, on, yes as booleans: --amp off, --stall-timeout off
            if action.type is not None or action.choices:
                return parser._get_values(action, ["on" if value else "off"])
        except argparse.ArgumentError:
            pass
        raise FixresError(f"{where}: argument {flag}: expected a value, got {str(value).lower()}")
    if isinstance(value, dict) or (isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value)):
        raise FixresError(f"{where}: argument {flag}: expected a value or a list of values, got {value!r}")
    text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
    try:
        return parser._get_values(action, [text])  # the flag's own conversion and choices, and its messages
    except argparse.ArgumentError as exc:
        raise FixresError(f"{where}: {exc}") from None
