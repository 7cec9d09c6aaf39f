"""The chat template: the variables a client may add (:func:`check_template_kwargs`) and the
prompt ids of a chat (:func:`chat_ids`), as the gateway's tokenizer renders and encodes them."""

from __future__ import annotations

from jinja2 import TemplateError

from dflash.core.sampling import InvalidParam
from gateway.inputs import short

# chat_template_kwargs the gateway sets itself (or that would change what it encodes)
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "sanitize_control_tokens"})
MAX_TEMPLATE_KWARGS = 32


def check_template_kwargs(kwargs: dict) -> None:
    """Extra variables for the chat template (``enable_thinking``...): at most
    MAX_TEMPLATE_KWARGS, none that the gateway sets itself. Raises InvalidParam naming
    ``chat_template_kwargs.<key>``."""
    if not isinstance(kwargs, dict):
        raise InvalidParam("chat_template_kwargs", "must be an object")
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise InvalidParam("chat_template_kwargs", f"{len(kwargs)} entries, more than "
                           f"{MAX_TEMPLATE_KWARGS}")
    for k in kwargs:
        if not isinstance(k, str) or not k.isidentifier():
            raise InvalidParam("chat_template_kwargs", f"key {short(str(k))} is not a name")
        if k in RESERVED_TEMPLATE_KWARGS:
            raise InvalidParam(f"chat_template_kwargs.{k}", "is set by the gateway")


def chat_ids(tokenizer, msgs: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """Render the chat template and encode it; special tokens typed in a content stay text.

    transformers' ``sanitize_control_tokens``: control tokens in the messages are marked
    before rendering and encoded as ordinary text, so only the template's own become control
    tokens (without any typed, the ids equal encoding the rendered text). Raises
    InvalidParam("chat.messages") when the template refuses the chat or the tokenizer cannot
    keep a typed control token as text, InvalidParam("chat_template_kwargs...") for a variable
    :func:`check_template_kwargs` refuses.
    """
    kwargs = template_kwargs or {}
    check_template_kwargs(kwargs)
    try:
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                            return_dict=False, sanitize_control_tokens=True,
                                            **kwargs)
    except (ValueError, TypeError, TemplateError) as e:
        raise InvalidParam("chat.messages", f"cannot be rendered: {str(e)[:120]}") from e
    return list(ids)
