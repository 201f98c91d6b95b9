from pathlib import Path

from triton_diffusion.text_to_image import TEXT_TO_IMAGE_FIELDS

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_field_table_is_the_generated_one():
    text = README.read_text()
    start = text.index("<!-- fields:text_to_image -->") + len("<!-- fields:text_to_image -->")
    end = text.index("<!-- /fields:text_to_image -->")
    assert text[start:end].strip() == TEXT_TO_IMAGE_FIELDS.markdown_table()
