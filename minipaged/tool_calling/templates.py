"""Which chat template renders a conversation, with or without tools.

``--chat-template`` (and ``LLM.chat(chat_template=...)``) gives a template as
a file or as the template text itself (``load_chat_template``). A request
with tools needs a template that shows them to the model; many models' own
templates never read ``tools`` (SmolLM2's among them), and would drop them
without a word. For those, ``template_for_tools`` puts in the ChatML
template shipped here (``chatml_tools.jinja``), when the model's template is
ChatML too: another model's turn markers would not be the tokens it was
trained on, so there it refuses and asks for ``--chat-template``.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

TOOLS_TEMPLATE_PATH = Path(__file__).with_name("chatml_tools.jinja")
CHATML_TURN = "<|im_start|>"


@cache
def chatml_tools_template() -> str:
    """The shipped tool-aware ChatML template's text."""
    return TOOLS_TEMPLATE_PATH.read_text(encoding="utf-8")


def load_chat_template(value: str) -> str:
    """A template given as a path to a file, or as its text. A value that looks
    like a path (no template tags in it) but names no file is refused."""
    path = Path(value).expanduser()
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError:   # a long literal template is no file name
        pass
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat_template: {value!r} is neither a file nor a Jinja template")


def reads_tools(template: str) -> bool:
    """Whether ``template`` ever reads the ``tools`` variable (parsed with Jinja,
    so a mention in a comment or a string does not count)."""
    import jinja2
    from jinja2 import meta

    try:
        parsed = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return False
    return "tools" in meta.find_undeclared_variables(parsed)


def template_for_tools(template: str | None, explicit: bool) -> str:
    """The template to render a conversation with tools: ``template`` when it
    reads them or was given explicitly (``--chat-template``), else the shipped
    ChatML one for a ChatML model (or one with no template)."""
    if template is not None and (explicit or reads_tools(template)):
        return template
    if template is None or CHATML_TURN in template:
        return chatml_tools_template()
    raise ValueError("tools: this model's chat template does not render tools and is not "
                     "ChatML, so minipaged's tool template would not fit it; start the "
                     "server with --chat-template (or pass chat_template=) naming one that does")
