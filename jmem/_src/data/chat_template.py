"""Chat templates: render a conversation as transformers does and find the assistant turns.

Rendering follows transformers' ``apply_chat_template`` (``utils/chat_template_utils.py``):
a jinja2 ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension, a ``tojson`` filter that does not escape HTML,
``raise_exception`` and ``strftime_now`` globals, and the variables ``messages``,
``add_generation_prompt``, ``tools``/``documents`` (None), ``bos_token`` and ``eos_token``.
The ``{% generation %}`` tag of assistant-mask templates renders its body.

The assistant spans: for assistant turn ``i``, the text from the end of
``render(messages[:i], add_generation_prompt=True)`` (the prompt a model would be given) to
the end of ``render(messages[:i + 1])`` (its answer and the template's end-of-turn text).
This needs a template that renders a conversation's prefixes as prefixes of its rendering;
one that does not (e.g. it drops the reasoning of earlier turns) is refused.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime

#: The documented plain template, used when the tokenizer has no chat template: turns are
#: ``"### {Role}:\n{content}"`` (role capitalized) separated by a blank line, assistant turns
#: end with ``eos_token`` (when the tokenizer has one), the whole starts with ``bos_token``,
#: and the generation prompt is ``"### Assistant:\n"``. The trainable text of an assistant
#: turn is exactly its content followed by ``eos_token``.
PLAIN_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if not loop.first %}{{ '\\n\\n' }}{% endif %}"
    "{{ '### ' + message['role'] | capitalize + ':\\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{% if messages %}{{ '\\n\\n' }}{% endif %}{{ '### Assistant:\\n' }}"
    "{% endif %}"
)


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    import jinja2  # noqa: PLC0415
    from jinja2 import nodes  # noqa: PLC0415
    from jinja2.ext import Extension  # noqa: PLC0415
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(
    messages: list[dict],
    template: str,
    *,
    bos_token: str | None = None,
    eos_token: str | None = None,
    add_generation_prompt: bool = False,
) -> str:
    """Renders ``messages`` (``[{"role", "content"}, ...]``) with a jinja chat template.

    Args:
      messages: the conversation.
      template: a chat template (e.g. ``HFTokenizer.chat_template``, ``PLAIN_CHAT_TEMPLATE``).
      bos_token, eos_token: the special tokens' text (undefined in the template when None).
      add_generation_prompt: append the text that opens an assistant turn.

    Returns:
      The rendered text, as ``transformers``' ``apply_chat_template(..., tokenize=False)``.

    Raises:
      ValueError: if the template fails to compile or raises (``raise_exception``).
    """
    try:
        import jinja2  # noqa: PLC0415
    except ImportError as e:
        raise ImportError(
            "chat and instruction examples are rendered with jinja2 (as transformers does); "
            'install it with `pip install jinja2` or `pip install "jmem[examples]"`.'
        ) from e

    special = {k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v}
    try:
        return _compile(template).render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **special,
        )
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"The chat template failed on this conversation: {e}") from None


def assistant_spans(
    messages: list[dict],
    template: str,
    *,
    bos_token: str | None = None,
    eos_token: str | None = None,
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the ``[start, end)`` character spans of its assistant
    turns (every one of them, see the module docstring).

    Raises:
      ValueError: if the template raises, or does not render the conversation's prefixes as
        prefixes of its rendering (the assistant text cannot then be located).
    """
    kw = dict(bos_token=bos_token, eos_token=eos_token)
    full = render_chat(messages, template, **kw)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render_chat(messages[:i], template, add_generation_prompt=True, **kw)
        through = render_chat(messages[: i + 1], template, **kw)
        if not (through.startswith(prompt) and full.startswith(through)):
            raise ValueError(
                f"The chat template does not render the conversation up to assistant turn "
                f"{i} as a prefix of the whole conversation (e.g. it rewrites earlier turns), "
                "so its answer cannot be located for the loss mask. Use the plain template "
                "(a tokenizer without chat_template) or a prompt/completion example."
            )
        spans.append((len(prompt), len(through)))
    return full, spans
