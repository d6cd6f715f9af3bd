"""A tokenizer shipped as code, as Kimi K2's is (tokenization_kimi.py over tiktoken): tiktoken BPE ranks from
the folder's tiktoken.model. Test data for `--trust-remote-code` (tests/test_loading.py)."""

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import PreTrainedTokenizer


class TinyTikToken(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}

    def __init__(self, vocab_file, **kwargs):
        ranks = load_tiktoken_bpe(vocab_file)
        self.model = tiktoken.Encoding(
            "tiny", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={"<eos>": len(ranks)}
        )
        self.decoder = {i: t for t, i in ranks.items()}
        super().__init__(eos_token="<eos>", **kwargs)

    @property
    def vocab_size(self):
        return self.model.n_vocab

    def get_vocab(self):
        return {t.decode("latin-1"): i for t, i in self.model._mergeable_ranks.items()}

    def _tokenize(self, text, **kwargs):
        return [str(i) for i in self.model.encode(text)]

    def _convert_token_to_id(self, token):
        return int(token) if token.isdigit() else self.model.n_vocab - 1

    def _convert_id_to_token(self, index):
        return str(index)

    def convert_tokens_to_string(self, tokens):
        return self.model.decode([int(t) for t in tokens])
