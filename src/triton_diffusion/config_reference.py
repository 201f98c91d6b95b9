"""The configuration reference's table (docs/reference/config.md, written by scripts/update_reference.py),
made from the parameters' declarations in settings.py."""

from __future__ import annotations

from dataclasses import fields

from triton_diffusion.settings import ALL, IMAGE, IMAGE_SOURCE, LM, RENAMED, ModelConfig


def parameters_markdown() -> str:
    """The configuration reference (docs/reference/config.md), straight from the declarations: a derived
    default's text from its :class:`Derived`, old names from :data:`RENAMED`."""
    names = {IMAGE: "image and video models", IMAGE_SOURCE: "image models", LM: "diffusion_lm"}
    lines = ["| parameter | type | default | read by | meaning |", "|---|---|---|---|---|"]
    for f in fields(ModelConfig):
        kinds = f.metadata["kinds"]
        read_by = (
            "all"
            if set(kinds) == set(ALL)
            else ", ".join(names[k] for k in kinds if k != IMAGE_SOURCE or len(kinds) == 1)
        )
        kind = f.metadata["written"] or str(f.type).replace(" | None", "")
        allowed = f" (one of {', '.join(f.metadata['choices'])})" if f.metadata["choices"] else ""
        if isinstance(f.default, tuple):
            default = (
                f"`{','.join('x'.join(map(str, v)) if isinstance(v, tuple) else str(v) for v in f.default)}`"
            )
            default = default if f.default else "none"
        elif f.default is not None:
            default = f"`{f.default}`"
        elif f.metadata["derived"] is not None or "default:" in f.metadata["doc"]:
            default = "derived"
        else:
            default = "required" if f.name == "model" else "none"
        doc = f.metadata["doc"] + (f"; {f.metadata['derived'].doc()}" if f.metadata["derived"] else "")
        old = [(name, r.unit) for name, r in RENAMED.items() if r.name == f.name]
        if old:
            doc += "; also read as " + ", ".join(
                f"{name} (in {unit})" if unit else name for name, unit in old
            )
        lines.append(f"| `{f.name}` | {kind} | {default} | {read_by} | {doc}{allowed} |")
    return "\n".join(lines)
