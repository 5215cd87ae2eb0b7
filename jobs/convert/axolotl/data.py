"""axolotl's ``datasets`` (or ``pretraining_dataset``) as Ferry's ``data`` section.

Each entry becomes a source with its own settings (format, field names, chat template, file type) and its paths
(``path``, or ``path`` joined with each of ``data_files``). A Ferry job reads every source of ``data.mix`` with
one section's fields, so an entry joins the mix only when its settings equal the first entry's; any other entry
is listed as not converted, never read with the first one's fields.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import Any

from jobs.convert.axolotl.conversion import AxolotlConversion
from jobs.convert.axolotl.reader import AxolotlConfig, shown
from jobs.data.formats.rendering import REASONING_KEYS
from jobs.data.formats.sharegpt import ROLES as SHAREGPT_ROLES

_BUILDERS = {"json", "csv", "parquet", "text", "arrow"}  # ``path: json`` + ``data_files``: a loader, not a path
_FILE_TYPES = {"json": "jsonl", "csv": "csv", "parquet": "parquet", "text": "txt"}
_DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".txt", ".arrow", ".zst", ".gz")
_ENTRY_REASONS = {
    "drop_system_message": "Ferry's chat format trains on the messages as given; remove the system turns from the data",
    "name": "Ferry reads local files, not a Hub dataset's configurations; point path at that configuration's files",
    "revision": "Ferry reads local files; download that revision",
    "shards": "Ferry reads every file whole",
    "shards_idx": "Ferry reads every file whole",
    "preprocess_shards": "Ferry reads every file whole",
    "trust_remote_code": "Ferry never runs a dataset's own code",
}


@dataclass
class _Source:
    """One entry: the data settings it needs, its paths, and what of it is not converted."""

    where: str
    settings: dict[str, Any]
    paths: list[str]
    not_converted: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def data_section(config: AxolotlConfig, conversion: AxolotlConversion, *, preference: bool) -> dict[str, Any]:
    """The ``data`` section; raises ``ValueError`` for data that cannot be read as given (with the fix)."""
    key, entries = _entries(config, conversion)
    template = _chat_template(config.text("chat_template", example="chatml"), config, conversion)
    sources = []
    for index, entry in enumerate(entries):
        reader = AxolotlConfig(entry, f"{key}[{index}].")
        source = _source(reader, preference=preference, pretraining=key == "pretraining_dataset", template=template)
        if source is None and index == 0:
            raise ValueError(
                f"{key}[0].type: {shown(reader.raw('type'))} is not a format Ferry reads (chat_template, sharegpt, "
                "alpaca, completion, pretrain; with rl: dpo or orpo, preference pairs); convert the data to one of them"
            )
        sources.append((reader, source))
    first = sources[0][1]
    assert first is not None  # refused above
    paths: list[str] = []
    for index, (_reader, source) in enumerate(sources):
        if source is None or source.settings != first.settings:
            why = "its type is not a format Ferry reads" if source is None else _difference(source, first)
            conversion.not_converted.append(
                (
                    f"{key}[{index}]",
                    f"{why}; a Ferry job reads every source with one data section's fields, so it "
                    "would be read wrongly: convert it to the first entry's layout, or train it in a job of its own",
                )
            )
            continue
        paths += [p for p in source.paths if p not in paths]
        conversion.notes += source.notes
        conversion.not_converted += source.not_converted
    data: dict[str, Any] = {"kind": "text", **first.settings}
    if len(paths) == 1:
        data["path"] = paths[0]
    else:
        data["mix"] = [{"path": p} for p in paths]
        conversion.notes.append(
            f"{key}: {len(paths)} files become data.mix with equal weights, so each fills an equal share of an "
            "epoch (axolotl reads each record once); set each entry's weight to its record count to match"
        )
    return data


def _entries(config: AxolotlConfig, conversion: AxolotlConversion) -> tuple[str, list[dict[str, Any]]]:
    """Which key holds the data, and its entries as mappings."""
    key = "datasets" if "datasets" in config else "pretraining_dataset"
    if key == "datasets" and "pretraining_dataset" in config:
        config.raw("pretraining_dataset")
        conversion.not_converted.append(
            ("pretraining_dataset", "datasets is converted; a Ferry job reads one data section")
        )
    value = config.raw(key)
    example = f"{key}: [{{path: data.jsonl, type: {'pretrain' if key == 'pretraining_dataset' else 'chat_template'}}}]"
    entries = value if isinstance(value, list) else [value]
    if isinstance(value, (str, dict)):
        entries = [value]
    elif not isinstance(value, list) or not value:
        raise ValueError(f"{key}: must be a list of {{path, type}} entries, e.g. {example}; got {shown(value)}")
    checked = []
    for index, entry in enumerate(entries):
        if isinstance(entry, str) and entry:
            entry = {"path": entry}
        if not isinstance(entry, dict):
            raise ValueError(f"{key}[{index}]: must be a {{path, type}} entry, e.g. {example}; got {shown(entry)}")
        checked.append(entry)
    return key, checked


def _source(reader: AxolotlConfig, *, preference: bool, pretraining: bool, template: str | None) -> _Source | None:
    """The source an entry describes, or ``None`` for a type Ferry does not read."""
    kind = reader.text("type", example="chat_template") or ("pretrain" if pretraining else "alpaca")
    source = _Source(reader.where, {}, _paths(reader))
    if preference:
        source.settings = _preference(reader, kind, source)
    elif kind in ("chat_template", "sharegpt") or kind.startswith("chat_template."):
        source.settings = _chat(reader, kind, source)
    elif kind == "alpaca" or kind.startswith("alpaca:"):
        source.settings = {"format": "instruction"}
        if kind != "alpaca":
            source.not_converted.append(
                (reader.name("type"), f"{kind!r}'s prompt style is not Ferry's; alpaca's is used")
            )
    elif kind in ("completion", "pretrain"):
        field_name = reader.text("field") or reader.text("text_column") or "text"
        source.settings = {"format": "text"} | ({"text_field": field_name} if field_name != "text" else {})
    else:
        return None
    own_template = reader.text("chat_template", example="chatml")
    chosen = _chat_template(own_template, reader, source) if own_template else template
    if chosen and source.settings["format"] in ("chat", "preference"):
        source.settings["chat_template"] = chosen
    ds_type = reader.text("ds_type", example="json")
    if ds_type in _FILE_TYPES:
        source.settings["file_type"] = _FILE_TYPES[ds_type]
    elif ds_type is not None:
        source.not_converted.append(
            (reader.name("ds_type"), f"{ds_type!r} is not a file type Ferry reads (json, csv, parquet, text)")
        )
    split = reader.text("split", example="train")
    if split not in (None, "train"):
        source.not_converted.append(
            (reader.name("split"), "Ferry reads local files whole; point path at the split's file")
        )
    source.notes += _hub_notes(reader, source.paths)
    for key in reader.unread():
        why = _ENTRY_REASONS.get(key, "it is not a dataset setting Ferry has")
        if not (key == "drop_system_message" and reader.raw(key) is False):
            source.not_converted.append((reader.name(key), why))
    return source


def _paths(reader: AxolotlConfig) -> list[str]:
    """``path``, or ``path`` joined with each of ``data_files`` (a Hub repository's files, or a loader's)."""
    path = reader.text("path", example="data.jsonl")
    if not path:
        raise ValueError(f"{reader.name('path')}: every dataset needs a path, e.g. path: data.jsonl")
    raw = reader.raw("data_files")
    if raw is None:
        return [path]
    if isinstance(raw, dict):  # {train: [...]}: the training split's files
        raw = raw.get("train")
    files = [raw] if isinstance(raw, str) else raw
    if not isinstance(files, list) or not files or not all(isinstance(f, str) and f for f in files):
        raise ValueError(
            f"{reader.name('data_files')}: must be a file or a list of files, e.g. data_files: [train.jsonl]; "
            f"got {shown(raw)}"
        )
    base = "" if path in _BUILDERS else path
    return [posixpath.join(base, f) if base else f for f in files]


def _chat(reader: AxolotlConfig, kind: str, source: _Source) -> dict[str, Any]:
    chat: dict[str, Any] = {"format": "chat"}
    field_name = reader.text("field_messages", example="messages") or (
        "conversations" if kind == "sharegpt" else "messages"
    )
    if field_name != "messages":
        chat["messages_field"] = field_name
    _message_fields(reader, source)
    _roles(reader, source)
    _thinking(reader, source)
    roles = reader.names("roles_to_train", example="[assistant]")
    if roles not in (None, ["assistant"], ["gpt"]):
        source.not_converted.append(
            (reader.name("roles_to_train"), "Ferry trains on assistant turns (train_on_inputs: true, on every turn)")
        )
    eos = reader.text("train_on_eos", example="turn")
    if eos not in (None, "turn"):
        source.not_converted.append(
            (reader.name("train_on_eos"), "Ferry trains each assistant turn's end-of-turn token")
        )
    if kind not in ("chat_template", "sharegpt"):
        source.notes.append(f"{reader.name('type')}: {kind!r} is read as chat messages through the chat template")
    return chat


def _preference(reader: AxolotlConfig, kind: str, source: _Source) -> dict[str, Any]:
    """Pairs for dpo/orpo: Ferry reads TRL's layout (prompt, chosen, rejected) or OpenAI's, by those names."""
    for key, ferry, default in (
        ("field_messages", "prompt", "messages"),
        ("field_chosen", "chosen", "chosen"),
        ("field_rejected", "rejected", "rejected"),
    ):
        name = reader.text(key, example=ferry)
        if (name or default) != ferry:
            where = reader.name(key) if name else reader.name("type")
            source.not_converted.append(
                (
                    where,
                    f"Ferry's preference format reads the {ferry} from {ferry!r} (TRL's layout; or OpenAI's "
                    f"input.messages, preferred_output, non_preferred_output); rename {(name or default)!r} to {ferry!r} "
                    "in the data",
                )
            )
    _message_fields(reader, source)
    _roles(reader, source)
    _thinking(reader, source)
    if kind not in ("chat_template", "chat_template.default"):
        source.notes.append(
            f"{reader.name('type')}: {kind!r} is read as preference pairs in TRL's layout, through the chat template; "
            "chosen and rejected must hold the completions only"
        )
    return {"format": "preference"}


def _message_fields(reader: AxolotlConfig, source: _Source) -> None:
    """Role and content field names: Ferry reads ``role``/``content`` and ShareGPT's ``from``/``value``."""
    mappings = reader.mapping("message_property_mappings") or {}
    for key, name in (("message_field_role", "role"), ("message_field_content", "content")):
        legacy = reader.text(key, example=name)
        if legacy is not None:
            mappings.setdefault(name, legacy)
    pair = (mappings.get("role", "role"), mappings.get("content", "content"))
    extra = {k: v for k, v in mappings.items() if k not in ("role", "content") and v != k}
    if pair in (("role", "content"), ("from", "value")) and not extra:
        return
    keys = [k for k in ("message_property_mappings", "message_field_role", "message_field_content") if k in reader]
    for key in keys:
        source.not_converted.append(
            (
                reader.name(key),
                "Ferry reads a message's role and content from 'role' and 'content' (or ShareGPT's "
                "'from' and 'value'); rename the fields in the data",
            )
        )


def _thinking(reader: AxolotlConfig, source: _Source) -> None:
    """``field_thinking`` (the data's reasoning key) and ``template_thinking_key`` (the one the template reads)
    map when each is a key Ferry knows: it reads a message's reasoning under any of them and gives it to the
    template under the one the template renders (jobs/data/formats/rendering.py)."""
    known = ", ".join(REASONING_KEYS)
    for key, fix in (
        ("field_thinking", f"rename that key in the data's messages to one of {known}"),
        (
            "template_thinking_key",
            f"Ferry gives the template a message's reasoning as one of {known}, whichever it renders",
        ),
    ):
        name = reader.text(key, example="reasoning_content")
        if name is not None and name not in REASONING_KEYS:
            source.not_converted.append((reader.name(key), f"Ferry reads reasoning under {known}, not {name!r}; {fix}"))


def _roles(reader: AxolotlConfig, source: _Source) -> None:
    """``roles`` (role: [names in the data]) maps when every name is one Ferry reads as that role already."""
    roles = reader.mapping("roles", example="{user: [human], assistant: [gpt]}")
    if roles is None:
        return
    for role, names in roles.items():
        names = [names] if isinstance(names, str) else names
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError(
                f"{reader.name('roles')}.{role}: must be a list of names, e.g. [human]; got {shown(names)}"
            )
        if any(SHAREGPT_ROLES.get(n, n) != role for n in names):
            source.not_converted.append(
                (
                    reader.name("roles"),
                    f"Ferry reads the roles {', '.join(SHAREGPT_ROLES)} (human as user, gpt as "
                    "assistant); rename the data's other roles",
                )
            )
            return


def _chat_template(name: str | None, reader: AxolotlConfig, sink: Any) -> str | None:
    """Ferry's ``chat_template``: ``chatml``, a Jinja text, or ``None`` for the tokenizer's own."""
    if name in (None, "tokenizer_default"):
        return None
    if name == "chatml":
        return "chatml"
    jinja = reader.text("chat_template_jinja", example="'{% for m in messages %}...'")
    if name == "jinja" and jinja:
        return jinja
    sink.not_converted.append(
        (
            reader.name("chat_template"),
            f"{name!r} is not built into Ferry (chatml is); the tokenizer's own template is "
            "used (or give chat_template: jinja with chat_template_jinja)",
        )
    )
    return None


_DEFAULTS = {"text_field": "text", "messages_field": "messages", "file_type": "auto"}  # Ferry's, left unwritten


def _difference(source: _Source, first: _Source) -> str:
    def value(settings: dict[str, Any], key: str) -> Any:
        return settings.get(key, _DEFAULTS.get(key))

    keys = sorted(set(source.settings) | set(first.settings))
    changed = [k for k in keys if value(source.settings, k) != value(first.settings, k)]
    shown_changes = ", ".join(f"{k}: {shown(value(source.settings, k), 30)}" for k in changed)
    return f"its settings ({shown_changes}) differ from the first entry's"


def _hub_notes(reader: AxolotlConfig, paths: list[str]) -> list[str]:
    path = reader.text("path") or ""
    if looks_local(path) or path in _BUILDERS:
        return []
    return [
        f"{reader.name('path')}: {shown(path)} looks like a Hugging Face Hub dataset; Ferry reads local paths "
        f"only, so {', '.join(shown(p) for p in paths)} must exist under a data root. Fetch it first: "
        f"huggingface-cli download --repo-type dataset {shown(path)[1:-1]} --local-dir <data root>/{shown(path)[1:-1]}"
    ]


def looks_local(path: str) -> bool:
    """Whether ``path`` reads as a file or directory rather than a Hub id (``org/name``)."""
    return (
        path.startswith(("/", "./", "../", "~")) or path.lower().endswith(_DATA_SUFFIXES) or "/" not in path.strip("/")
    )
