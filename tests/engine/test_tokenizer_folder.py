"""A checkpoint folder's tokenizer and chat template, in either transformers generation's layout."""

from __future__ import annotations

import json
import shutil

from splitserve.engine.checkpoints.tiny_model import tiny_model_folder
from splitserve.engine.checkpoints.tokenizer import TextTokenizer


def test_a_folder_s_chat_template_may_live_in_chat_template_jinja(tmp_path) -> None:
    """transformers 5 saves the template beside tokenizer_config.json instead of inside it."""
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_model_folder(0), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    template = config.pop("chat_template")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert TextTokenizer(folder).chat_template is None
    (folder / "chat_template.jinja").write_text(template)
    tokenizer = TextTokenizer(folder)
    assert tokenizer.chat_template == template
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
