"""Writes a small byte-level BPE tokenizer.json into HF-conformance fixture folders.

The tiny fixture models have vocabularies of a few hundred tokens; `kiln generate` on them
needs a real `tokenizer.json` of that size. This trains one (the HF `tokenizers` BPE
trainer on kiln's README as it is when run, so the committed files are the artifact; 384 tokens: ids 0 and 1 are the fixtures'
bos/eos specials, then the 256 byte tokens, then merges) and saves it next to each
fixture's config.json.

With `--kimi-chat`, the special tokens are Kimi's chat-format tokens instead (ids 0..12,
in the order of `KIMI_SPECIALS`) and the vocabulary has 512 tokens: this is the tokenizer of
kiln's embedded default model (engine/assets/default-model/tokenizer.json).

Usage: python3 tools/tiny_tokenizer.py [--kimi-chat] tests/fixtures/hf/tiny-kimi [more dirs...]
Made with tokenizers 0.23.3 (Python 3.11).
"""
import pathlib
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB = 384
FIXTURE_SPECIALS = ["<|bos|>", "<|eos|>"]
KIMI_SPECIALS = [
    "[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
    "<|im_middle|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
    "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>", "[PAD]",
]


def build(corpus: str, vocab: int, specials: list) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([corpus], trainer=trainer)
    return tok


def main() -> None:
    root = pathlib.Path(__file__).resolve().parent.parent
    args = sys.argv[1:]
    kimi = "--kimi-chat" in args
    specials, vocab = (KIMI_SPECIALS, 512) if kimi else (FIXTURE_SPECIALS, VOCAB)
    tok = build((root / "README.md").read_text(), vocab, specials)
    assert tok.get_vocab_size() <= vocab, tok.get_vocab_size()
    assert all(tok.token_to_id(s) == i for i, s in enumerate(specials))
    for d in (a for a in args if a != "--kimi-chat"):
        tok.save(str(pathlib.Path(d) / "tokenizer.json"))
        print(f"wrote {d}/tokenizer.json ({tok.get_vocab_size()} tokens)")


if __name__ == "__main__":
    main()
