"""Turning conversations into token ids without ever re-tokenising what the model sampled.

The first render of an episode uses the tokenizer's chat template (``chat`` mode) or is BOS + the prompt
text (``raw`` mode, for single-turn text tasks and tokenizers without a template). After that, the
accumulated sequence only grows by appending:

* the model's turn: the token ids the engine sampled, as they are;
* the environment's turn: what the chat template puts after an assistant message that the model did not
  emit itself (e.g. a newline after the end-of-turn token; the whole closing marker when the turn was cut
  off by the token budget), then the new messages and the generation prompt. This suffix is found by
  rendering a fixed probe conversation with and without the new messages and taking the difference, so
  only the new text is tokenised, once.

:meth:`Renderer.check_prefix` compares the accumulated ids with a fresh render of the whole conversation
(decoded model turns included). A mismatch is counted, never corrected: the trainer trains on exactly the
sampled ids. Templates that rewrite history (dropping earlier reasoning, for example) mismatch by design,
which is precisely why re-tokenising histories trains on tokens the model never produced.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Literal

from miles.rollout.env import ChatMessage

RenderMode = Literal["raw", "chat"]
_PROBE_USER = "MILESPROBEUSER"
_PROBE_ASSISTANT = "MILESPROBEASSISTANT"
INITIAL_CACHE = 1024  # episode openings remembered per renderer (a group's episodes share one)


class TemplateError(ValueError):
    """The chat template cannot be appended to incrementally (its rendering of a conversation is not a
    prefix of its rendering of a longer one)."""


class Renderer:
    """Incremental tokenisation for one tokenizer (shared by all episodes of a worker; stateless per call)."""

    def __init__(self, tokenizer: Any, mode: RenderMode) -> None:
        if mode == "chat" and not getattr(tokenizer, "chat_template", None):
            raise TemplateError("the tokenizer has no chat template; use a raw-prompt task or add one")
        self.tokenizer = tokenizer
        self.mode = mode
        self._initial_ids: OrderedDict[tuple[Any, ...], list[int]] = OrderedDict()
        if mode == "chat":
            self._closing = self._assistant_closing()

    # ------------------------------------------------------------------ rendering

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _template(self, messages: Sequence[ChatMessage], *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=generation_prompt
        )

    def initial(self, messages: Sequence[ChatMessage]) -> list[int]:
        """The prompt ids of an episode's opening messages (a fresh list each call).

        Remembered for the last :data:`INITIAL_CACHE` openings: every episode of a group opens with the same
        messages, and tokenising them was 5% of a quickstart worker's CPU (py-spy)."""
        if not messages:
            raise ValueError("an episode needs at least one opening message")
        try:
            key = tuple(tuple(sorted(m.items())) for m in messages)
            hash(key)
        except TypeError:  # a message with unhashable parts (a tool call's arguments): render it every time
            return self._initial(messages)
        ids = self._initial_ids.get(key)
        if ids is None:
            ids = self._initial_ids[key] = self._initial(messages)
            if len(self._initial_ids) > INITIAL_CACHE:
                self._initial_ids.popitem(last=False)
        else:
            self._initial_ids.move_to_end(key)
        return list(ids)

    def _initial(self, messages: Sequence[ChatMessage]) -> list[int]:
        if self.mode == "chat":
            return self._encode(self._template(messages, generation_prompt=True))
        ids = self._encode("".join(m["content"] for m in messages))
        bos = self.tokenizer.bos_token_id
        if bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def _assistant_closing(self) -> str:
        """What the template writes after an assistant message's content (e.g. ``<|im_end|>\\n``)."""
        probe = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ASSISTANT}]
        text = self._template(probe, generation_prompt=False)
        at = text.rfind(_PROBE_ASSISTANT)
        if at < 0:
            raise TemplateError("the chat template drops the assistant's content")
        return text[at + len(_PROBE_ASSISTANT) :]

    def environment_turn(self, model_ids: Sequence[int], messages: Sequence[ChatMessage]) -> list[int]:
        """Ids to append after a model turn ``model_ids`` so that the conversation continues with ``messages``
        and ends in the generation prompt of the next model turn."""
        if self.mode == "raw":
            return self._encode("".join(m["content"] for m in messages))
        closing = self._encode(self._closing)
        if closing and model_ids and model_ids[-1] == closing[0]:
            closing = closing[1:]  # the model closed its turn itself (its stop token is the template's)
        probe = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ASSISTANT}]
        before = self._template(probe, generation_prompt=False)
        after = self._template([*probe, *messages], generation_prompt=True)
        if not after.startswith(before):
            raise TemplateError("the chat template rewrites earlier messages when one is appended")
        return closing + self._encode(after[len(before) :])

    def decode(self, model_ids: Sequence[int]) -> str:
        """The text of a model turn, as the environment sees it (special tokens removed)."""
        return self.tokenizer.decode(list(model_ids), skip_special_tokens=True)

    def check_prefix(self, messages: Sequence[ChatMessage], ids: Sequence[int]) -> bool:
        """Whether a fresh render of ``messages`` (ending in a generation prompt) tokenises to exactly ``ids``."""
        if self.mode == "raw":
            return True
        return self._encode(self._template(messages, generation_prompt=True)) == list(ids)


def turn_end_token(renderer: Renderer, stop_ids: Sequence[int]) -> int:
    """The stop token a model turn ends with: the template's own end-of-turn token when it closes assistant
    messages with one of the stop tokens (``<|im_end|>``, ``<end_of_turn>``), else the first stop token."""
    if not stop_ids:
        raise ValueError("the tokenizer defines no stop token")
    if renderer.mode == "chat":
        closing = renderer._encode(renderer._closing)
        if closing and closing[0] in stop_ids:
            return closing[0]
    return stop_ids[0]


def demonstration_tokens(
    renderer: Renderer, messages: Sequence[ChatMessage], stop_id: int
) -> tuple[list[int], list[int]]:
    """A demonstration conversation as the episode runner would build it: ``(ids, trained)`` where model
    turns (each assistant message's tokens, then ``stop_id``) are 1 and everything else 0."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None or first == 0:
        raise ValueError("a demonstration needs opening messages followed by an assistant turn")
    ids = renderer.initial(messages[:first])
    trained = [0] * len(ids)
    pending: list[ChatMessage] = []
    last_turn: list[int] = []
    for message in messages[first:]:
        if message["role"] != "assistant":
            pending.append(message)
            continue
        if pending:
            env = renderer.environment_turn(last_turn, pending)
            ids += env
            trained += [0] * len(env)
            pending = []
        last_turn = renderer._encode(message["content"]) + [stop_id]
        ids += last_turn
        trained += [1] * len(last_turn)
    return ids, trained
