"""A word-level tokenizer for the tiny model (run with aiperf's venv, which has `tokenizers`):
word ``w<i>`` is token id ``i`` (3..1023), so a prompt of token ids written as words
tokenizes back to exactly those ids, and aiperf's text reaches the model as kvtier bench's
token ids."""
import json
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

out = sys.argv[1]
vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 1024)}}
tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
tok.save(f"{out}/tokenizer.json")
with open(f"{out}/tokenizer_config.json", "w") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>",
               "bos_token": "<s>", "eos_token": "</s>", "model_max_length": 16384,
               "add_bos_token": False}, f)
