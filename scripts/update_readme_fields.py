"""Rewrite README's request-field tables and its config-parameter table from their declarations
(fields.py, settings.py; tests/unit/test_readme.py checks)."""

import re
from pathlib import Path

from triton_diffusion.models.diffusion_lm import DIFFUSION_LM_FIELDS
from triton_diffusion.models.image_to_image import IMAGE_TO_IMAGE_FIELDS
from triton_diffusion.models.text_to_image import TEXT_TO_IMAGE_FIELDS
from triton_diffusion.models.text_to_video import TEXT_TO_VIDEO_FIELDS
from triton_diffusion.settings import parameters_markdown

TABLES = {
    "text_to_image": TEXT_TO_IMAGE_FIELDS,
    "image_to_image": IMAGE_TO_IMAGE_FIELDS,
    "text_to_video": TEXT_TO_VIDEO_FIELDS,
    "diffusion_lm": DIFFUSION_LM_FIELDS,
}
README = Path(__file__).resolve().parents[1] / "README.md"


def main() -> None:
    text = README.read_text()
    for name, fields in TABLES.items():
        pattern = rf"(<!-- fields:{name} -->).*?(<!-- /fields:{name} -->)"
        text = re.sub(
            pattern, lambda m, f=fields: f"{m.group(1)}\n{f.markdown_table()}\n{m.group(2)}", text, flags=re.S
        )
    pattern = r"(<!-- config -->).*?(<!-- /config -->)"
    text = re.sub(pattern, lambda m: f"{m.group(1)}\n{parameters_markdown()}\n{m.group(2)}", text, flags=re.S)
    README.write_text(text)


if __name__ == "__main__":
    main()
