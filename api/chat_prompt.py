"""A chat request's prompt text and token ids, as the engine's API and the router both make them: the tool
definitions rendered the way the model's template expects, the template applied, the text tokenized
without adding special tokens (the template spells them out). Imports no torch."""

from __future__ import annotations

from typing import Any

from splitserve.api.openai_protocol import ApiError
from splitserve.api.tools.formats import messages_for_template, template_renders_tools
from splitserve.api.tools.request import ToolRequest
from splitserve.engine.checkpoints.tokenizer import ChatTemplateError, TextTokenizer


def chat_prompt_text(tokenizer: TextTokenizer, messages: list[dict[str, Any]], tools: ToolRequest | None,
                     tool_format: str) -> str:
    """The chat template applied to `messages` (and the tools), or a 400 naming `messages`."""
    renders_tools = template_renders_tools(tokenizer.chat_template)
    openai_tools = [f.as_openai() for f in tools.tools] if tools is not None and renders_tools else None
    try:
        templated = messages_for_template(messages, tools, tool_format, renders_tools)
        return tokenizer.apply_chat_template(templated, tools=openai_tools)
    except ChatTemplateError as exc:
        raise ApiError(str(exc), "messages") from None
    except Exception as exc:  # a template that breaks on these messages (a type it does not expect)
        raise ApiError(f"the chat template cannot render these messages: {exc!r}", "messages") from None
