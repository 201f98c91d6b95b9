"""Rewrite README's request-field tables from the field declarations (tests/unit/test_readme.py checks)."""

import re
from pathlib import Path

from triton_diffusion.text_to_image import TEXT_TO_IMAGE_FIELDS

TABLES = {"text_to_image": TEXT_TO_IMAGE_FIELDS}
README = Path(__file__).resolve().parents[1] / "README.md"


def main() -> None:
    text = README.read_text()
    for name, fields in TABLES.items():
        pattern = rf"(<!-- fields:{name} -->\n).*?(\n<!-- /fields:{name} -->)"
        text = re.sub(
            pattern, lambda m, f=fields: m.group(1) + f.markdown_table() + m.group(2), text, flags=re.S
        )
    README.write_text(text)


if __name__ == "__main__":
    main()
