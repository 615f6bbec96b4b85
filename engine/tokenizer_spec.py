"""Prompt encoding from a `TokenizerSpec` with tokenizers and jinja2 alone, so the process
that tokenizes (a disaggregated cluster's router) needs no transformers or torch. The chat
template renders as transformers renders it (sandboxed, trim_blocks, lstrip_blocks, loop
controls, `raise_exception`, `strftime_now`, non-HTML-escaping `tojson`, `{% generation %}`
as its content, None-valued message keys left out)."""

from __future__ import annotations

import json
from datetime import datetime

from engine.tokenizer import ChatEncoding, TokenizerSpec


class SpecTokenizer(ChatEncoding):
    """Encodes text and chat prompts into the ids the `Tokenizer` that exported `spec` gives
    (shielded chat content included); it does not decode."""

    def __init__(self, spec: TokenizerSpec):
        self.spec = spec
        self.eos_token_id = spec.eos_token_id
        # One backend reads special-token strings as the tokens, the other as plain text (the
        # shield's pieces): a flag flipped per call on one would race between threads.
        self._plain, self._split = (_backend(spec.backend, split) for split in (False, True))
        self._template = _compile(spec.chat_template) if spec.chat_template else None

    def encode(self, text: str) -> list[int]:
        return self._plain.encode(text, add_special_tokens=True).ids

    def _encode(self, text: str, split_special: bool = False) -> list[int]:
        backend = self._split if split_special else self._plain
        return backend.encode(text, add_special_tokens=False).ids

    def _specials(self) -> list[str]:
        return list(self.spec.specials)

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        if self._template is None:
            raise ValueError("this model's tokenizer has no chat template: send text or ids")
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        return self._template.render(messages=messages, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt,
                                     **self.spec.template_tokens)


def _backend(state: str, split_special: bool):
    """A fast tokenizer from its JSON, encoding whole texts: truncation and padding saved with
    it are off, as transformers turns them off for a plain encode."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(state)
    tok.no_truncation()
    tok.no_padding()
    tok.encode_special_tokens = split_special
    return tok


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None,
            sort_keys: bool = False) -> str:
    """JSON text unescaped for HTML (jinja2's own filter escapes it), as templates expect."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _compile(source: str):
    """The chat template, compiled in a sandbox: templates come with checkpoints, untrusted."""
    from jinja2 import nodes
    from jinja2.exceptions import TemplateError
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` marks the assistant's text for training
        masks; rendering a prompt keeps its content, in a scope of its own."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, Generation])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
