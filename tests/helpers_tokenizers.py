"""Tokenizers built offline for tests: the tiny model's character tokenizer and a small BPE one with a ChatML
chat template (the format of Qwen-style models), so token-exactness is checked on both kinds."""

from __future__ import annotations

from functools import lru_cache

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CHATML = (
    "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
CORPUS = [
    "cat value.txt",
    "echo 42 > answer.txt",
    "the number in the file is 17",
    "add three to the number and write it to out",
    "12+7=19 3+4=7 100-1=99",
    "ls -la /work && cat a.txt b.txt",
    "done. submit the answer now please",
] * 20


@lru_cache(maxsize=1)
def bpe_chatml_tokenizer() -> PreTrainedTokenizerFast:
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    core.train_from_iterator(CORPUS, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    return tok
