"""A tiny byte-level BPE tokenizer per family, trained offline, carrying the family's chat template.

Why BPE and not the char tokenizer of :mod:`miles.models.tiny`: the things that break with real
tokenizers (multi-character tokens, special tokens inside text, a chat template whose rendered ids must
round-trip, stop tokens that are single ids) only show up with a real subword vocabulary. Byte-level,
so every string encodes without an unknown token; digits are split one per token (as Qwen and
DeepSeek do), so arithmetic answers tokenize the same way at every length. The corpus is built in
code: arithmetic, shell commands, a little prose and conversations rendered with the family template.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.models.families.base import ModelFamily

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# Bump when the corpus or the tokenizer pipeline changes (it is part of the twin's cache key).
CORPUS_VERSION = 1
DEFAULT_VOCAB_SIZE = 512

_SHELL: tuple[str, ...] = (
    "ls -la",
    "ls /tmp",
    "cd /tmp && ls",
    "cat README.md",
    "cat /etc/os-release",
    "pwd",
    "echo hello world",
    "echo $HOME",
    "mkdir -p build/out",
    "rm -rf build",
    "cp a.txt b.txt",
    "mv old.py new.py",
    "grep -rn TODO src/",
    "grep -c error log.txt",
    "find . -name '*.py' | head",
    "wc -l data.csv",
    "head -n 5 file.txt",
    "tail -f server.log",
    "sort names.txt | uniq -c",
    "python3 -c 'print(1+2)'",
    "python3 main.py --help",
    "pip install -e .",
    "git status",
    "git diff HEAD~1",
    "git log --oneline | head -3",
    "chmod +x run.sh && ./run.sh",
    "tar -xzf archive.tar.gz",
    "curl -s http://localhost:8080/health",
    "sed -n 1,20p config.yaml",
    "awk '{print $1}' access.log",
    "export PATH=$PATH:/usr/local/bin",
    "make test",
    "du -sh .",
    "ps aux | grep python",
    "touch notes.txt",
)

_PROSE: tuple[str, ...] = (
    "You are a helpful assistant.",
    "The answer is",
    "Let me think about this step by step.",
    "First, list the files in the current directory.",
    "Run the tests and report the result.",
    "What is the sum of the two numbers?",
    "The command printed the following output:",
    "The file does not exist.",
    "Done. All tests passed.",
    "Compute the result and reply with the number only.",
)


def _arithmetic() -> list[str]:
    """Problems in the quickstart task's format (``a+b=c``), all three operators, a spread of operands."""
    lines = []
    for a in range(0, 100, 7):
        for b in range(0, 100, 11):
            lines.append(f"{a}+{b}={a + b}")
            lines.append(f"{a}-{b}={a - b}")
            lines.append(f"{a}*{b}={a * b}")
    return lines


def _conversations() -> list[list[dict[str, str]]]:
    """Short chats over the same material, rendered with the family template so role words merge."""
    chats = []
    for i, command in enumerate(_SHELL[:12]):
        a, b = 3 * i + 4, 5 * i + 2
        chats.append(
            [
                {"role": "system", "content": _PROSE[0]},
                {"role": "user", "content": f"What is {a}+{b}?"},
                {"role": "assistant", "content": str(a + b)},
                {"role": "user", "content": f"Run: {command}"},
                {"role": "assistant", "content": command},
            ]
        )
    return chats


def _render(template: str, messages: list[dict[str, str]], family: ModelFamily) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    chat = family.chat
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=False, bos_token=chat.bos or "", eos_token=chat.eos
    )


def training_corpus(family: ModelFamily) -> list[str]:
    """The lines the BPE merges are learned from; the family's special tokens are cut out of them."""
    texts = [*_arithmetic(), *_SHELL, *_PROSE]
    texts += [_render(family.chat.template, chat, family) for chat in _conversations()]
    for token in sorted(family.chat.all_tokens(), key=len, reverse=True):
        texts = [t.replace(token, "\n") for t in texts]
    return texts


def build_tokenizer(family: ModelFamily, vocab_size: int = DEFAULT_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train the family's tiny tokenizer (deterministic) and wrap it with its chat template and special tokens.

    Control tokens (``chat.special_tokens``, bos/eos/pad, stop tokens) get the lowest ids and are
    special (dropped by ``skip_special_tokens``); ``chat.added_tokens`` (think and tool tags) are single
    ids that decode as text, as in the real tokenizers. Left padding, as batched generation needs.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    chat = family.chat
    specials = [t for t in chat.all_tokens() if t not in chat.added_tokens]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(training_corpus(family), trainer=trainer)
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in chat.added_tokens])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=chat.bos,
        eos_token=chat.eos,
        pad_token=chat.pad,
        chat_template=chat.template,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
