"""``ls``, ``verify``, ``show``, ``diff`` and ``prune``: each returns its exit status."""

from __future__ import annotations

import contextlib
import os
import re
import stat
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skipinject.cache_tool import fields
from skipinject.cache_tool.plugins import InstalledRoles
from skipinject.cache_tool.progress import Progress
from skipinject.cache_tool.render import emit_json, human_number, human_size, schema, shorten, table
from skipinject.cache_tool.scan import (
    STEP_RE,
    Item,
    ItemRecord,
    load_meta_json,
    lstat_regular,
    open_step,
    precheck,
    scan,
    step_ranges,
)
from skipinject.errors import CorruptCacheError
from skipinject.store.format import META_NAME, is_ours, is_part_name

OK, FOUND, USAGE = 0, 1, 2


class CommandError(Exception):
    """A one-line error for the user (bad path, bad option); exit status 2."""


def existing_dir(path: Path) -> Path:
    if not path.exists():
        raise CommandError(f"{path}: no such directory")
    if not path.is_dir():
        raise CommandError(f"{path}: not a directory")
    return path


def _writer_text(writer: dict[str, str]) -> str:
    parts = [f"{name} {writer[name]}" for name in ("skipinject", "verl", "torch") if name in writer]
    return ", ".join(parts) or "-"


# ---------------------------------------------------------------- ls


def _scan_any(root: Path | str, problems: list[str]) -> list[Item]:
    """Items of a local directory (which must exist) or of a remote store's URL."""
    if isinstance(root, str):
        from skipinject.cache_tool.remote import scan_remote

        return scan_remote(root, problems)
    existing_dir(root)
    return scan(root, problems)


def cmd_ls(root: Path | str, *, as_json: bool, per_step: bool, default: bool) -> int:
    if default and isinstance(root, Path) and not root.exists():
        if as_json:
            emit_json({"schema": schema("ls"), "dump_dir": str(root), "steps": [], "groups": [], "problems": []})
        else:
            print(f"nothing cached in {root} (it does not exist)")
        return OK
    problems: list[str] = []
    items = _scan_any(root, problems)
    groups = _groups(items)
    if as_json:
        emit_json(
            {
                "schema": schema("ls"),
                "dump_dir": str(root),
                "steps": [item.record() for item in items],
                "groups": groups,
                "problems": problems,
            }
        )
        return OK
    if not items:
        print(f"nothing cached in {root}")
    elif per_step:
        rows = [
            [
                i.project,
                i.layout,
                i.role,
                i.step,
                i.parts,
                i.rows,
                human_size(i.size) + ("" if i.decoded is None else f" ({human_size(i.decoded)} decoded)"),
                _when(i.created, i.mtime),
                _writer_text(i.writer) if i.kind == "skipinject" else i.kind,
                i.state,
            ]
            for i in items
        ]
        heads: tuple[str, ...] = (
            "PROJECT",
            "LAYOUT",
            "ROLE",
            "STEP",
            "PARTS",
            "ROWS",
            "SIZE",
            "CREATED",
            "WRITTEN BY",
            "STATE",
        )
        print(table(heads, rows, right=("STEP", "PARTS", "ROWS", "SIZE")), end="")
    else:
        rows = [
            [
                g["project"],
                g["layout"],
                g["role"],
                g["steps"],
                g["rows"],
                human_size(g["size"]),
                g["created"] or "-",
                g["written_by"],
                g["state"],
            ]
            for g in groups
        ]
        heads = ("PROJECT", "LAYOUT", "ROLE", "STEPS", "ROWS", "SIZE", "CREATED", "WRITTEN BY", "STATE")
        print(table(heads, rows, right=("ROWS", "SIZE")), end="")
        total = sum(i.size for i in items)
        decoded = sum(i.size if i.decoded is None else i.decoded for i in items)
        unpacked = "" if decoded == total else f" ({human_size(decoded)} decoded)"
        print(f"{len(items)} step(s), {human_size(total)}{unpacked} in {root}")
    for item in items:
        if item.state == "damaged":
            for problem in item.problems:
                print(f"damaged: {problem}", file=sys.stderr)
    for problem in problems:
        print(f"unreadable: {problem}", file=sys.stderr)
    return OK


def _when(created: str | None, mtime: float) -> str:
    if created:
        return created[:16].replace("T", " ")
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(mtime)) if mtime else "-"


def _span(first: str, last: str) -> str:
    """``2026-11-30 14:25 .. 14:33`` (the date once when both are on the same day)."""
    if first == last:
        return first
    return f"{first} .. {last[11:]}" if first[:10] == last[:10] else f"{first} .. {last}"


def _groups(items: Sequence[Item]) -> list[dict[str, Any]]:
    """Items of one project, layout, role, state and writer, with their steps as ranges."""
    grouped: dict[tuple[Any, ...], list[Item]] = {}
    for item in items:
        written_by = _writer_text(item.writer) if item.kind == "skipinject" else f"{item.kind} (pickle)"
        key = (item.project, item.layout, item.role, item.state, written_by)
        grouped.setdefault(key, []).append(item)
    out = []
    for (project, layout, role, state, written_by), members in grouped.items():
        whens = sorted(_when(i.created, i.mtime) for i in members)
        rows = [i.rows for i in members]
        out.append(
            {
                "project": project,
                "layout": layout,
                "role": role,
                "state": state,
                "steps": step_ranges([i.step for i in members if i.step is not None]),
                "count": len(members),
                "rows": sum(r for r in rows if r is not None) if any(r is not None for r in rows) else None,
                "size": sum(i.size for i in members),
                "created": _span(whens[0], whens[-1]),
                "written_by": written_by,
            }
        )
    return out


# ---------------------------------------------------------------- verify


class CheckedRecord(ItemRecord):
    status: str
    plugin: str | None
    notes: list[str]


@dataclass
class Checked:
    item: Item
    status: str  # ok | damaged | partial | foreign
    problems: list[str]
    notes: list[str] = field(default_factory=list)
    plugin: str | None = None  # the installed plugin providing the step's role

    def record(self) -> CheckedRecord:
        return {
            **self.item.record(),
            "status": self.status,
            "problems": self.problems,
            "plugin": self.plugin,
            "notes": self.notes,
        }


_PICKLE_MAGIC = (b"\x80", b"PK\x03\x04")  # pickle protocol >= 2; torch.save's zip archive


def verify_item(item: Item, roles: InstalledRoles | None = None) -> Checked:
    """Full check of one item: sizes, checksums, tensor index and JSON tree (skipinject's format);
    presence, size and file magic only for verl's pickles (loading them would run code).

    ``roles``: the installed plugins; a step of a role none of them provides is verified all the
    same, with a note naming the plugin that would show it."""
    checked = _verify_item(item)
    if roles is not None and checked.status == "ok" and item.meta is not None:
        checked.plugin = roles.plugin_of(item.role)
        note = roles.missing(item.role, item.meta)
        if note is not None:
            checked.notes.append(f"{item.path}: {note}")
    return checked


def _verify_item(item: Item) -> Checked:
    if item.state == "damaged":
        return Checked(item, "damaged", list(item.problems))
    if item.state == "partial":
        return Checked(item, "partial", list(item.problems))
    if not isinstance(item.path, Path):  # a step in a remote store
        from skipinject.cache_tool.remote import verify_remote

        problems = verify_remote(item)
        return Checked(item, "damaged" if problems else "ok", problems)
    if item.state == "foreign":
        problems = []
        for path in item.files:
            try:
                head = _head(path)
            except OSError as exc:
                problems.append(f"{path}: cannot read it ({exc})")
                continue
            if not head.startswith(_PICKLE_MAGIC):
                problems.append(f"{path}: not a pickle or torch.save file (damaged?)")
        if item.kind == "verl-v0" and not (item.path / META_NAME).exists():
            problems.append(f"{item.path}: verl's meta.json is missing; verl itself will not load this step")
        return Checked(item, "damaged" if problems else "foreign", problems)
    try:
        store, meta = open_step(item.path)
        precheck(store, int(item.path.name), meta)
        # The store's reader checks sizes, checksums, the tensor index and the JSON tree: what a run
        # checks before it serves a step. No codec is needed, so every role's steps verify alike.
        store.load(store.verified(int(item.path.name)))
    except (CorruptCacheError, OSError) as exc:
        return Checked(item, "damaged", [str(exc)])
    except Exception as exc:
        return Checked(item, "damaged", [f"{item.path}: {type(exc).__name__}: {exc}"])
    return Checked(item, "ok", [])


def _head(path: Path) -> bytes:
    if lstat_regular(path) is None:
        raise OSError("not a regular file")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError("not a regular file")
        return os.read(fd, 8)
    finally:
        os.close(fd)


def cmd_verify(paths: Sequence[Path | str], *, as_json: bool) -> int:
    items: list[Item] = []
    unreadable: list[str] = []
    for path in paths:
        items += _scan_any(path, unreadable)
    total = sum(i.size for i in items if i.state == "complete")
    results = []
    roles = InstalledRoles()
    with Progress(total, "verify") as bar:
        for item in items:
            results.append(verify_item(item, roles))
            bar.update(item.size if item.state == "complete" else 0, f"{item.role} {item.step}")
    damaged = [r for r in results if r.status == "damaged"]
    if as_json:
        emit_json(
            {
                "schema": schema("verify"),
                "ok": not damaged and not unreadable,
                "checked": len(results),
                "bytes": total,
                "steps": [r.record() for r in results],
                "problems": unreadable,
            }
        )
    else:
        for result in results:
            if result.status in ("damaged", "partial"):
                for problem in result.problems or ["(no detail)"]:
                    print(f"{result.status.upper()}: {problem}")
        for problem in unreadable:
            print(f"UNREADABLE: {problem}")
        for result in results:
            for note in result.notes:
                print(f"NOTE: {note}")
        counts = {s: sum(r.status == s for r in results) for s in ("ok", "damaged", "partial", "foreign")}
        foreign = (
            f", {counts['foreign']} foreign (verl's pickles, not loaded: `skipinject cache import --trust` converts)"
            if counts["foreign"]
            else ""
        )
        print(
            f"verified {len(results)} step(s), {human_size(total)}: {counts['ok']} ok, {counts['damaged']} damaged, "
            f"{counts['partial']} partial{foreign}"
        )
    return FOUND if damaged or unreadable else OK


# ---------------------------------------------------------------- show


def load_step(step_dir: Path, roles: InstalledRoles) -> tuple[dict[str, Any], fields.Decoded]:
    """The meta and decoded value of a verified step (by its role's own codec); raises CorruptCacheError."""
    if not STEP_RE.match(step_dir.name):
        raise CommandError(f"{step_dir}: not a step directory (its name is not a step number)")
    ours = (step_dir / META_NAME).exists() and load_meta_json(step_dir / META_NAME) is not None
    if not ours:
        hint = ""
        if (step_dir / "gen_batch.dp").exists() or (step_dir / "0" / "tq_batch.pt").exists():
            hint = " (it holds verl's own pickles: `skipinject cache import --trust` converts them)"
        raise CommandError(f"{step_dir}: no skipinject cache here{hint}")
    store, meta = open_step(step_dir)
    precheck(store, int(step_dir.name), meta)
    entry = store.verified(int(step_dir.name))
    payloads = store.load(entry)
    return dict(entry.meta), fields.decode(payloads, entry.meta, roles)


def cmd_show(step_dir: Path, *, as_json: bool, rows: int, tokenizer: str | None) -> int:
    existing_dir(step_dir)
    roles = InstalledRoles()
    meta, step = load_step(step_dir, roles)
    codec = step.codec
    flat = fields.flatten(step.value)
    infos = [fields.describe(name, v) for name, v in flat.items()]
    texts = {}
    for name, v in flat.items():
        found = fields.text_rows(v, rows)
        if found:
            texts[name] = found
    decoded = _decode_tokens(flat, tokenizer, rows) if tokenizer else {}
    inputs = meta.get("inputs") if isinstance(meta.get("inputs"), list) else None
    summary: dict[str, Any] = {
        "path": str(step_dir),
        "role": meta.get("role"),
        "step": meta.get("step"),
        "rows": meta.get("rows"),
        "parts": [p.get("dir") for p in meta.get("parts", [])],
        "codec": codec,
        "context": meta.get("context"),
        "created": meta.get("created"),
        "writer": meta.get("writer"),
        "inputs": {"rows": len(inputs), "first": inputs[:rows]} if inputs is not None else None,
        "calls": meta.get("calls") if type(meta.get("calls")) is int else None,
        "plugin": roles.plugin_of(str(meta.get("role"))),
        "note": step.note,
    }
    if as_json:
        emit_json(
            {
                "schema": schema("show"),
                **summary,
                "fields": [i.record() for i in infos],
                "text": texts,
                "decoded": decoded,
            }
        )
        return OK
    context = summary["context"] or {}
    print(f"{step_dir}")
    parts = len(summary["parts"])
    print(f"  role {summary['role']}, step {summary['step']}, {summary['rows']} rows in {parts} part(s)")
    print(f"  codec {codec}; created {summary['created']} by {_writer_text(summary['writer'] or {})}")
    if summary["plugin"] is not None:
        print(f"  decoded by plugin {summary['plugin']}")
    if step.note:
        print(f"  note: {step.note}")
    print("  context " + ", ".join(f"{k}={v}" for k, v in sorted(context.items())))
    if inputs is not None:
        print(f"  input fingerprint: {len(inputs)} rows, first {', '.join(map(str, inputs[:rows]))}")
    else:
        print("  input fingerprint: none recorded (prompt mismatches are not detected for this step)")
    print()
    print(table(("FIELD", "KIND", "DTYPE", "SHAPE"), [[i.name, i.kind, i.dtype, i.shape] for i in infos]), end="")
    for name, lines in list(texts.items()) + list(decoded.items()):
        print(f"\n{name}:")
        for index, line in enumerate(lines):
            print(f"  [{index}] {line}")
    return OK


def _decode_tokens(flat: dict[str, Any], tokenizer_path: str, rows: int) -> dict[str, list[str]]:
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    except Exception as exc:
        raise CommandError(f"cannot load a tokenizer from {tokenizer_path} ({type(exc).__name__}: {exc})") from exc
    out = {}
    for name, value in flat.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in ("prompts", "responses", "input_ids") or not hasattr(value, "dtype"):
            continue
        if getattr(value.dtype, "is_floating_point", True):
            continue
        seqs = list(value.unbind(0)) if getattr(value, "is_nested", False) else list(value)
        texts = []
        for seq in seqs[:rows]:
            ids = [int(t) for t in seq.reshape(-1).tolist()]
            texts.append(shorten(tokenizer.decode(ids, skip_special_tokens=True), 200))
        out[f"{name} (decoded)"] = texts
    return out


# ---------------------------------------------------------------- diff


def cmd_diff(a: Path, b: Path, *, as_json: bool) -> int:
    existing_dir(a)
    existing_dir(b)
    if STEP_RE.match(a.name) and STEP_RE.match(b.name) and (a / META_NAME).exists() and (b / META_NAME).exists():
        pairs = [(a, b)]
        only: list[tuple[str, str]] = []
    else:
        pairs, only = _pair_steps(a, b)
    reports = []
    roles = InstalledRoles()
    with Progress(len(pairs), "diff", unit="steps") as bar:
        for x, y in pairs:
            reports.append(_diff_steps(x, y, roles))
            bar.update(1, x.name)
    differ = bool(only) or any(r["differs"] for r in reports)
    if as_json:
        emit_json(
            {
                "schema": schema("diff"),
                "a": str(a),
                "b": str(b),
                "differs": differ,
                "steps": reports,
                "only": [{"side": side, "step": key} for side, key in only],
            }
        )
        return FOUND if differ else OK
    for report in reports:
        _print_step_diff(report)
    for side, key in only:
        print(f"only in {side.upper()}: {key}")
    if not reports and not only:
        print("no cached steps to compare")
    print("differences found" if differ else "no differences")
    return FOUND if differ else OK


def _pair_steps(a: Path, b: Path) -> tuple[list[tuple[Path, Path]], list[tuple[str, str]]]:
    def keyed(root: Path) -> dict[str, Path]:
        out = {}
        for item in scan(root):
            if item.kind == "skipinject" and item.state == "complete":
                out[item.path.relative_to(root).as_posix()] = item.path
        return out

    ka, kb = keyed(a), keyed(b)
    pairs = [(ka[k], kb[k]) for k in sorted(set(ka) & set(kb))]
    only = [("a", k) for k in sorted(set(ka) - set(kb))] + [("b", k) for k in sorted(set(kb) - set(ka))]
    return pairs, only


def _diff_steps(a: Path, b: Path, roles: InstalledRoles) -> dict[str, Any]:
    report: dict[str, Any] = {"a": str(a), "b": str(b), "meta": [], "fields": [], "problems": [], "notes": []}
    try:
        meta_a, decoded_a = load_step(a, roles)
        meta_b, decoded_b = load_step(b, roles)
    except (CorruptCacheError, OSError, CommandError) as exc:
        report["problems"].append(str(exc))
        report["differs"] = True
        return report
    value_a, value_b = decoded_a.value, decoded_b.value
    report["notes"] = sorted({note for note in (decoded_a.note, decoded_b.note) if note})
    for key in ("role", "step", "rows", "context", "writer"):
        if meta_a.get(key) != meta_b.get(key):
            report["meta"].append({"key": key, "a": meta_a.get(key), "b": meta_b.get(key)})
    ia, ib = meta_a.get("inputs"), meta_b.get("inputs")
    if isinstance(ia, list) and isinstance(ib, list):
        changed = sum(1 for x, y in zip(ia, ib, strict=False) if x != y) + abs(len(ia) - len(ib))
        report["inputs_differing"] = changed
    else:
        report["inputs_differing"] = None
    diffs = fields.compare_fields(fields.flatten(value_a), fields.flatten(value_b))
    report["fields"] = [d.record() for d in diffs]
    report["differs"] = bool(
        any(m["key"] != "writer" for m in report["meta"])
        or report["inputs_differing"]
        or any(d.status != "same" for d in diffs)
    )
    return report


def _print_step_diff(report: dict[str, Any]) -> None:
    print(f"A {report['a']}\nB {report['b']}")
    for problem in report["problems"]:
        print(f"  cannot compare: {problem}")
    for note in report.get("notes", []):
        print(f"  note: {note}")
    for item in report["meta"]:
        print(f"  meta {item['key']}: {item['a']!r} vs {item['b']!r}")
    if report.get("inputs_differing"):
        print(f"  inputs: {report['inputs_differing']} row(s) were generated from other prompts")
    rows = [
        [
            f["name"],
            f["status"],
            "-" if f["rows_differing"] is None else f"{f['rows_differing']}/{f['rows']}",
            human_number(f["max_abs_diff"]) if isinstance(f["max_abs_diff"], (int, float)) else f["max_abs_diff"],
            human_number(f["mean_abs_diff"]) if isinstance(f["mean_abs_diff"], (int, float)) else f["mean_abs_diff"],
            f["note"],
        ]
        for f in report["fields"]
        if f["status"] != "same"
    ]
    if rows:
        heads = ("FIELD", "STATUS", "ROWS DIFFERING", "MAX |A-B|", "MEAN |A-B|", "NOTE")
        print(table(heads, rows, right=("ROWS DIFFERING", "MAX |A-B|", "MEAN |A-B|")), end="")
    elif not report["problems"]:
        same = len(report["fields"])
        print(f"  all {same} field(s) identical")
    print()


# ---------------------------------------------------------------- prune

_AGE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)\s*([smhdw]?)$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
#: A data file written this recently may belong to a save still running: never touched.
MIN_AGE = 600.0


def parse_age(text: str) -> float:
    match = _AGE.match(text.strip().lower())
    if not match:
        raise CommandError(f"bad age {text!r}: use a number with s, m, h, d or w (e.g. 7d, 12h)")
    return float(match.group(1)) * _UNITS[match.group(2)]


def _created_ts(item: Item) -> float:
    if item.created:
        with contextlib.suppress(ValueError):
            return time.mktime(time.strptime(item.created[:19], "%Y-%m-%dT%H:%M:%S"))
    return item.mtime


def cmd_prune(
    root: Path,
    *,
    keep_last: int | None,
    older_than: float | None,
    partial: bool,
    damaged: bool,
    dry_run: bool,
    as_json: bool,
    now: float | None = None,
) -> int:
    if keep_last is None and older_than is None and not partial and not damaged:
        raise CommandError("nothing to prune: give --keep-last N, --older-than AGE, --partial or --damaged")
    if keep_last is not None and keep_last < 0:
        raise CommandError("--keep-last must be 0 or more")
    existing_dir(root)
    now = time.time() if now is None else now
    root_real = root.resolve()
    items = scan(root)
    chosen: list[tuple[Item, str]] = []
    by_role: dict[tuple[str, str, str, Path], list[Item]] = {}
    for item in items:
        if item.kind == "skipinject" and item.state == "complete":
            by_role.setdefault((item.project, item.layout, item.role, item.path.parent), []).append(item)
    if keep_last is not None or older_than is not None:
        for members in by_role.values():
            members.sort(key=lambda i: i.step or 0)
            keep = set()
            if keep_last is not None:
                keep = {id(i) for i in members[len(members) - keep_last :]} if keep_last else set()
            for item in members:
                if id(item) in keep:
                    continue
                if older_than is not None and now - _created_ts(item) < older_than:
                    continue
                chosen.append((item, "older than --older-than" if keep_last is None else "beyond --keep-last"))
    for item in items:
        if item.kind != "skipinject":
            continue
        if partial and item.state == "partial":
            chosen.append((item, "interrupted save"))
        if damaged and item.state == "damaged":
            chosen.append((item, "damaged"))
    removed: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    files_total = bytes_total = 0
    garbage_found = _leftovers(items, now) if partial else None
    for item, reason in chosen:
        problem = _unsafe(item, root_real, now)
        abandoned = garbage_found is None or set(item.files) <= garbage_found[1]
        if problem is None and item.state == "partial" and not abandoned:
            problem = "a save may still be writing it (its writer is alive, or it changed in the last 10 minutes)"
        if problem:
            skipped.append({"path": str(item.path), "reason": problem})
            continue
        count, size = (len(_our_files(item)), sum(_sizes(_our_files(item)))) if dry_run else _remove(item)
        files_total += count
        bytes_total += size
        removed.append({"path": str(item.path), "role": item.role, "step": item.step, "reason": reason, "size": size})
    leftovers = None
    if garbage_found is not None:
        from skipinject.store import garbage

        gone = {Path(entry["path"]) for entry in removed}
        rest = [leftover for leftover in garbage_found[0] if not gone & set(leftover.path.parents)]
        counted = (len(rest), sum(leftover.size for leftover in rest))
        leftovers = counted if dry_run else garbage.remove_leftovers(rest)
        files_total += leftovers[0]
        bytes_total += leftovers[1]
    if as_json:
        emit_json(
            {
                "schema": schema("prune"),
                "dump_dir": str(root),
                "dry_run": dry_run,
                "removed": removed,
                "skipped": skipped,
                "leftovers": None if leftovers is None else {"files": leftovers[0], "bytes": leftovers[1]},
                "files": files_total,
                "bytes": bytes_total,
            }
        )
        return OK
    verb = "would remove" if dry_run else "removed"
    for entry in removed:
        print(f"{verb} {entry['path']} ({entry['reason']}, {human_size(entry['size'])})")
    for entry in skipped:
        print(f"kept {entry['path']}: {entry['reason']}")
    if leftovers is not None and leftovers[0]:
        print(f"{verb} {leftovers[0]} leftover file(s) of interrupted saves ({human_size(leftovers[1])})")
    print(f"{verb} {len(removed)} step(s), {files_total} file(s), {human_size(bytes_total)}")
    return OK


def _our_files(item: Item) -> list[Path]:
    """The files of ``item`` to delete: skipinject's only (verl's pickles are never deleted)."""
    if item.state == "partial":
        return list(item.files)
    out = []
    directories = [item.path] + [
        item.path / e.name for e in os.scandir(item.path) if e.is_dir(follow_symlinks=False) and is_part_name(e.name)
    ]
    for directory in directories:
        for entry in os.scandir(directory):
            if is_ours(entry.name) and entry.is_file(follow_symlinks=False):
                out.append(directory / entry.name)
    meta = item.path / META_NAME
    if item.kind == "skipinject" and lstat_regular(meta) is not None:
        out.append(meta)
    return out


def _sizes(paths: list[Path]) -> list[int]:
    return [info.st_size for info in (lstat_regular(p) for p in paths) if info is not None]


def _unsafe(item: Item, root_real: Path, now: float) -> str | None:
    """Why ``item`` must not be touched now, or None."""
    try:
        real = item.path.resolve()
    except OSError as exc:
        return f"cannot resolve it ({exc})"
    if real != root_real and root_real not in real.parents:
        return "it lies outside the dump directory (reached through a link)"
    if item.path.is_symlink():
        return "it is a symbolic link"
    named = set(item.files)
    try:
        ours = _our_files(item)
    except OSError as exc:
        return f"cannot list it ({exc})"
    for path in ours:
        info = lstat_regular(path)
        if info is None:
            continue
        if (path not in named or item.state != "complete") and now - info.st_mtime < MIN_AGE:
            return f"a save may still be writing it ({path.name} changed {now - info.st_mtime:.0f} s ago)"
    return None


def _remove(item: Item) -> tuple[int, int]:
    """Delete ``meta.json`` first (the step becomes absent at once), then its data files and empty dirs."""
    files = _our_files(item)
    files.sort(key=lambda p: p.name != META_NAME)
    count = size = 0
    for path in files:
        info = lstat_regular(path)
        if info is None:
            continue
        try:
            path.unlink()
        except OSError:
            continue
        count += 1
        size += info.st_size
    for directory in sorted({p.parent for p in files}, key=lambda p: len(p.parts), reverse=True):
        if directory != item.path:
            with contextlib.suppress(OSError):
                directory.rmdir()
    with contextlib.suppress(OSError):
        item.path.rmdir()
    return count, size


def _leftovers(items: Sequence[Item], now: float) -> tuple[list[Any], set[Path]] | None:
    """Abandoned files of our saves (the store's rule, :mod:`skipinject.store.garbage`), or None without it."""
    try:
        from skipinject.store import garbage
    except ImportError:
        return None
    found: list[Any] = []
    for store_dir in sorted({item.path.parent for item in items if item.kind == "skipinject"}):
        found += garbage.find_leftovers(store_dir, now=now)
    return found, {leftover.path for leftover in found}
