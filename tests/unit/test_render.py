"""Incremental rendering: environment turns appended as suffixes, model turns never re-tokenised."""

from __future__ import annotations

import pytest

from miles.models.tiny import build_char_tokenizer
from miles.rollout.render import INITIAL_CACHE, Renderer, TemplateError, demonstration_tokens, turn_end_token
from tests.helpers_tokenizers import bpe_chatml_tokenizer

TOKENIZERS = {"char": build_char_tokenizer, "bpe": bpe_chatml_tokenizer}
CONVERSATION = [
    {"role": "user", "content": "add 3 to the number in value.txt"},
    {"role": "assistant", "content": "cat value.txt"},
    {"role": "user", "content": "17"},
    {"role": "assistant", "content": "echo 20 > answer.txt"},
    {"role": "user", "content": ""},
    {"role": "assistant", "content": "done"},
]


@pytest.mark.parametrize("kind", list(TOKENIZERS))
def test_incremental_render_equals_the_full_template(kind: str) -> None:
    """Appending each environment turn as a suffix gives exactly the template's render of the conversation
    (for templates that do not rewrite history), with the model turns' tokens exactly as emitted."""
    tok = TOKENIZERS[kind]()
    renderer = Renderer(tok, "chat")
    stop = turn_end_token(renderer, [tok.eos_token_id])
    ids = renderer.initial(CONVERSATION[:1])
    for i in range(1, len(CONVERSATION) - 1, 2):
        model = tok.encode(CONVERSATION[i]["content"], add_special_tokens=False) + [stop]
        ids = ids + model + renderer.environment_turn(model, [CONVERSATION[i + 1]])
        assert renderer.check_prefix(CONVERSATION[: i + 2], ids)
    full = tok.apply_chat_template(CONVERSATION[:-1], tokenize=False, add_generation_prompt=True)
    assert ids == tok.encode(full, add_special_tokens=False)


@pytest.mark.parametrize("kind", list(TOKENIZERS))
def test_a_turn_cut_off_by_the_budget_gets_the_whole_closing_marker(kind: str) -> None:
    tok = TOKENIZERS[kind]()
    renderer = Renderer(tok, "chat")
    stop = turn_end_token(renderer, [tok.eos_token_id])
    model = tok.encode("cat val", add_special_tokens=False)  # no stop token: the budget ended it
    suffix = renderer.environment_turn(model, [{"role": "user", "content": "x"}])
    assert suffix[0] == stop
    closed = renderer.environment_turn(model + [stop], [{"role": "user", "content": "x"}])
    assert closed == suffix[1:]


def test_raw_mode_is_bos_and_text() -> None:
    tok = build_char_tokenizer()
    renderer = Renderer(tok, "raw")
    assert renderer.initial([{"role": "user", "content": "3+4="}]) == [tok.bos_token_id, *tok.encode("3+4=")]
    assert renderer.check_prefix([], [1, 2, 3])


@pytest.mark.parametrize("mode", ["raw", "chat"])
def test_openings_are_tokenised_once_and_handed_out_as_fresh_lists(mode: str) -> None:
    """A group's episodes share their opening: remembered (up to INITIAL_CACHE), equal to a fresh render, and
    each caller gets its own list (an episode that appends to its prompt must not change the next one's)."""
    tok = TOKENIZERS["char"]()
    renderer = Renderer(tok, mode)
    calls = 0
    encode = renderer._encode

    def counting(text: str) -> list[int]:
        nonlocal calls
        calls += 1
        return encode(text)

    renderer._encode = counting  # type: ignore[method-assign]
    opening = [{"role": "user", "content": "12+30="}]
    first = renderer.initial(opening)
    first.append(99)
    second = renderer.initial([dict(m) for m in opening])
    assert calls == 1 and second == Renderer(tok, mode).initial(opening) and second[-1] != 99
    for i in range(INITIAL_CACHE + 1):  # the oldest opening is forgotten, then rendered again
        renderer.initial([{"role": "user", "content": f"{i}+1="}])
    calls = 0
    assert renderer.initial(opening) == second and calls == 1
    with_tool = [{"role": "user", "content": "x", "tools": [{"name": "sh"}]}]  # unhashable: never cached
    assert renderer.initial(with_tool) == renderer.initial(with_tool) and calls == 3


def test_demonstrations_are_rendered_like_episodes() -> None:
    tok = build_char_tokenizer()
    renderer = Renderer(tok, "chat")
    ids, trained = demonstration_tokens(renderer, CONVERSATION, tok.eos_token_id)
    model_turns = ["cat value.txt", "echo 20 > answer.txt", "done"]
    text_trained = tok.decode([i for i, m in zip(ids, trained, strict=True) if m])
    assert text_trained == "".join(t + "<eos>" for t in model_turns)
    assert sum(trained) == sum(len(t) + 1 for t in model_turns)
    with pytest.raises(ValueError, match="assistant"):
        demonstration_tokens(renderer, CONVERSATION[:1], tok.eos_token_id)


def test_a_template_that_rewrites_history_is_refused() -> None:
    tok = build_char_tokenizer()
    tok.chat_template = "{{ messages | length }}"  # rendering depends on the whole history
    with pytest.raises(TemplateError):
        Renderer(tok, "chat")
    tok.chat_template = None
    with pytest.raises(TemplateError, match="no chat template"):
        Renderer(tok, "chat")
