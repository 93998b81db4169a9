"""Human text and --json documents of LoRA adapters: `inspect`'s adapter lines and
`export --adapter`'s report (render/inspect.py imports the inspect part).

Example:
    >>> print("\\n".join(adapter_lines(report)))      # an inspect report of a LoRA checkpoint
      adapter 'default': LoRA r=4 on q_proj, v_proj (4 modules); 896 trainable, 23,712 frozen parameters
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckpttool.commands.export_adapter import AdapterReport
    from ckpttool.commands.inspect import AdapterInfo, InspectReport

ADAPTER_SCHEMA = "ckpttool.export-adapter/1"


def adapter_lines(report: "InspectReport") -> list[str]:
    """Return inspect's lines about the model's adapters (none when it holds no LoRA keys)."""
    if report.adapter_problem:
        return [f"  adapter: LoRA keys that do not form an adapter: {report.adapter_problem}"]
    return [f"  adapter {a.name!r}: {_kind(a)} r={_ranks(a.ranks)} on {', '.join(a.targets)} ({len(a.modules)} modules"
            + (f", {len(a.saved)} modules_to_save tensors" if a.saved else "") + f"); {a.trainable:,} "
            f"trainable, {a.frozen:,} frozen parameters" for a in report.adapters]


def adapters_document(report: "InspectReport") -> list[dict[str, Any]]:
    """Return `ckpttool.inspect/1`'s `adapters` list."""
    return [{"name": a.name, "kind": _kind(a), "targets": list(a.targets), "ranks": list(a.ranks),
             "modules": [{"module": path, "rank": rank} for path, rank in a.modules],
             "modules_to_save": list(a.saved), "trainable_parameters": a.trainable, "frozen_parameters": a.frozen}
            for a in report.adapters]


def adapter_document(report: "AdapterReport") -> dict[str, Any]:
    """Return the `ckpttool.export-adapter/1` JSON document of `export --adapter`."""
    return {
        "schema": ADAPTER_SCHEMA, "source": str(report.source), "output": str(report.output),
        "adapter": report.adapter, "targets": list(report.targets), "ranks": list(report.ranks),
        "tensors": report.tensors, "trainable_parameters": report.parameters, "frozen_parameters": report.frozen,
        "config": report.config_from, "dry_run": report.dry_run,
        "files": [{"file": name, "path": str(report.output / name), "bytes": size} for name, size in report.files],
        "seconds": round(report.seconds, 3),
    }


def adapter_text(report: "AdapterReport") -> str:
    """Return the human view of `export --adapter`."""
    what = (f"adapter {report.adapter!r}: LoRA r={_ranks(report.ranks)} on {', '.join(report.targets)}, "
            f"{report.tensors} tensors, {report.parameters:,} parameters; config from {report.config_from}")
    total = sum(size for _, size in report.files)
    if report.dry_run:
        files = ", ".join(f"{name} ({size:,} bytes)" for name, size in report.files)
        return f"{report.source} -> {report.output}: {what}\n  would write {files}\ndry run: nothing was written"
    return (f"wrote {len(report.files)} files, {total:,} bytes to {report.output} in {report.seconds:.2f} s\n"
            f"  {what}")


def _kind(adapter: "AdapterInfo") -> str:
    return "DoRA" if adapter.dora else "LoRA"


def _ranks(ranks: tuple[int, ...]) -> str:
    return "/".join(map(str, ranks)) if ranks else "-"
