"""docs/CONFIG.md, generated from the schema."""

from __future__ import annotations

import yaml

from sft_play.config.schema import SECTIONS

def reference_markdown() -> str:
    """docs/CONFIG.md: every section and key with its default and meaning."""
    lines = [
        "# Config reference",
        "",
        "Generated from `sft_play/config/schema.py` by `python scripts/config_reference.py`; do not edit by hand.",
        "Every key can be set in a run YAML or overridden as `section.key=value` on any script or",
        'make target (`ARGS="section.key=value ..."`).',
    ]
    for section, cls in SECTIONS.items():
        lines += ["", f"## `{section}`", "", (cls.__doc__ or "").strip(), "", "| key | default | meaning |", "|---|---|---|"]
        for key, field in cls.model_fields.items():
            default = field.default_factory() if field.default_factory else field.default
            shown = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...").strip()
            lines.append(f"| `{section}.{key}` | `{shown}` | {field.description or ''} |")
    return "\n".join(lines) + "\n"
