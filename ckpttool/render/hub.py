"""Human text and --json documents of the Hub round trip: `export`, `push` and `import`
(export's document is consolidate's with the folder's files: `convert` holds the shared part).

Example:
    >>> print(export_text(report))          # an ExportReport
    wrote hub/llama: 2 file(s), 90.8 kB ...
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ckpttool.render.convert import consolidate_document, consolidate_notes, reshard_document, reshard_text
from ckpttool.render.text import human_bytes, human_count, shown, table

# ---------------------------------------------------------------------------------------------
# push

if TYPE_CHECKING:  # huggingface_hub is imported by the push command only
    from ckpttool.commands.push import PushReport

PUSH_SCHEMA = "ckpttool.push/1"


def push_document(report: "PushReport") -> dict[str, Any]:
    """Return the `ckpttool.push/1` JSON document: where the files went (or would go)."""
    return {
        "schema": PUSH_SCHEMA,
        "source": str(report.source),
        "layout": report.layout,
        "exported": report.exported,
        "repo_id": report.repo_id,
        "revision": report.revision,
        "endpoint": report.endpoint,
        "method": report.method,
        "dry_run": report.dry_run,
        "repo_url": report.repo_url,
        "commit_url": report.commit_url,
        "commit_oid": report.commit_oid,
        "files": [{"path": f.path, "bytes": f.size} for f in report.files],
        "total_bytes": report.total_bytes,
        "notes": list(report.notes),
        "seconds": round(report.seconds, 3),
    }


def push_text(report: "PushReport") -> str:
    """Return the human view: the file table for a dry run, else one summary line and the commit."""
    where = f"{report.repo_id}@{report.revision} on {report.endpoint}"
    exported = (", to be exported to a temporary folder" if report.dry_run else ", exported to a temporary folder") \
        if report.exported else ""
    source = f"{report.source} ({report.layout}{exported})"
    if report.dry_run:
        rows = [(f.path, human_bytes(f.size)) for f in report.files]
        return "\n".join([
            f"{source} -> {where}: {len(report.files)} file(s), {human_bytes(report.total_bytes)} with {report.method}",
            *table(rows, ("FILE", "SIZE"), right={1}),
            "dry run: nothing was exported, created or uploaded",
        ])
    return (f"pushed {len(report.files)} file(s), {human_bytes(report.total_bytes)} from {source} to {where} "
            f"in {report.seconds:.2f} s\n  commit {report.commit_oid}: {report.commit_url}")


# ---------------------------------------------------------------------------------------------
# export and import

if TYPE_CHECKING:
    from ckpttool.commands.export import ExportReport
    from ckpttool.commands.import_ import ImportReport
    from ckpttool.commands.import_framework import FrameworkImportReport

EXPORT_SCHEMA = "ckpttool.export/1"
IMPORT_SCHEMA = "ckpttool.import/1"


def export_document(report: "ExportReport") -> dict[str, Any]:
    """Return the `ckpttool.export/1` JSON document: the folder's files and what was checked."""
    weights = consolidate_document(report.weights)
    return {
        "schema": EXPORT_SCHEMA,
        "source": str(report.source),
        "output": str(report.output),
        "layout": weights["layout"],
        "step": report.step,
        "dtype": report.dtype,
        "parameters": report.parameters,
        "config": report.config,
        "left_out": weights["left_out"],  # model tensors the naming table does not write, with its rule
        "checked": report.config_checked,  # false: the keys and shapes were not checked (`check` says why)
        "check": report.checked,
        "assets": list(report.assets),
        "dry_run": report.dry_run,
        "verified": report.weights.verified,
        "files": [{"file": name, "path": str(report.output / name), "bytes": size} for name, size in report.files],
        "tensors": weights["tensors"],
        "ties": weights["ties"],
        "tensor_bytes": weights["tensor_bytes"],
        "output_bytes": report.total_bytes,
        "seconds": round(report.seconds, 3),
        "notes": list(report.notes),
        "problems": weights["problems"],
    }


def export_text(report: "ExportReport") -> str:
    """Return the human view: the file table for a dry run, else one summary line."""
    step = f", step {report.step}" if report.step is not None else ""
    head = (f"{human_count(report.parameters)} parameters ({report.dtype}) from {shown(report.source)}{step}; "
            f"config: {shown(report.config or 'none')}; checked {shown(report.checked)}")
    if not report.dry_run:
        return (f"wrote {len(report.files)} files, {human_bytes(report.total_bytes)} to {shown(report.output)} "
                f"in {report.seconds:.2f} s\n  {head}")
    rows = [(name, human_bytes(size)) for name, size in report.files]
    return "\n".join([f"{shown(report.source)} -> {shown(report.output)}: {head}",
                      *table(rows, ("FILE", "SIZE"), right={1}), "dry run: nothing was written"])


def export_notes(report: "ExportReport") -> list[str]:
    """Return the lines for stderr: consolidate's (gate warnings, ties), then export's notes."""
    weights = consolidate_notes(replace(report.weights, quantization=""))  # export says it in its own words
    return weights + [shown(note) for note in report.notes]


def import_document(report: "ImportReport") -> dict[str, Any]:
    """Return the `ckpttool.import/1` JSON document: reshard's fields plus the layout read and the prefix."""
    return {**reshard_document(report), "schema": IMPORT_SCHEMA, "layout": report.layout, "prefix": report.prefix}


def import_text(report: "ImportReport") -> str:
    """Return the human view: reshard's, with what was read and the prefix."""
    return (reshard_text(report) + f"\n  read {shown(report.layout)}; keys nested under {report.prefix!r}"
            ).replace("reshard to", "import to", 1)


def framework_import_document(report: "FrameworkImportReport") -> dict[str, Any]:
    """Return the `ckpttool.import/1` JSON document of `import --to`: reshard's fields, the
    framework and family table, the tensors made as the framework initialises them, and the
    Hub keys left out."""
    return {**reshard_document(report), "schema": IMPORT_SCHEMA, "layout": report.layout, "framework": report.framework,
            "family": report.family, "architecture": report.architecture,
            "made": [{"key": made.key, "shape": list(made.shape), "dtype": made.dtype, "fill": made.fill,
                      "why": made.why} for made in report.made],
            "left_out": [{"key": key, "why": why} for key, why in report.left_out],
            "extra_files": list(report.extra_files), "run_files": list(report.run_files)}


def framework_import_text(report: "FrameworkImportReport") -> str:
    """Return the human view of `import --to`: reshard's, with the table used and what was made or left out."""
    lines = [reshard_text(report).replace("reshard to", f"import --to {report.framework} to", 1),
             f"  read {shown(report.layout)}; {report.architecture} written by the {report.family} table"]
    for made in report.made:
        lines.append(f"  made {shown(made.key)} {list(made.shape)} {made.dtype} = {made.fill:g} ({shown(made.why)})")
    for key, why in report.left_out:
        lines.append(f"  left out {shown(key)} ({shown(why)})")
    for name in report.run_files:
        lines.append(f"  wrote {shown(name)} (Megatron-LM's run folder: --load {shown(str(report.destination))})")
    for name in report.extra_files:
        lines.append(f"  wrote {shown(name)}")
    return "\n".join(lines)


def push_notes(report: "PushReport") -> list[str]:
    """Return the lines for stderr: what the export of the source said."""
    return [f"export: {shown(note)}" for note in report.notes]
