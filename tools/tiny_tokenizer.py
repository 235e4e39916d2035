"""Writes a small byte-level BPE tokenizer.json into HF-conformance fixture folders.

The tiny fixture models have vocabularies of a few hundred tokens; `kiln generate` on them
needs a real `tokenizer.json` of that size. This trains one (the HF `tokenizers` BPE
trainer on kiln's README as it is when run, so the committed files are the artifact; 384 tokens: ids 0 and 1 are the fixtures'
bos/eos specials, then the 256 byte tokens, then merges) and saves it next to each
fixture's config.json.

Usage: python3 tools/tiny_tokenizer.py tests/fixtures/hf/tiny-kimi [more dirs...]
Made with tokenizers 0.23.3 (Python 3.11).
"""
import pathlib
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB = 384


def build(corpus: str) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([corpus], trainer=trainer)
    return tok


def main() -> None:
    root = pathlib.Path(__file__).resolve().parent.parent
    tok = build((root / "README.md").read_text())
    assert tok.get_vocab_size() <= VOCAB, tok.get_vocab_size()
    assert tok.token_to_id("<|bos|>") == 0 and tok.token_to_id("<|eos|>") == 1
    for d in sys.argv[1:]:
        tok.save(str(pathlib.Path(d) / "tokenizer.json"))
        print(f"wrote {d}/tokenizer.json ({tok.get_vocab_size()} tokens)")


if __name__ == "__main__":
    main()
