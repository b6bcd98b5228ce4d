"""Token ids to text: `detokenizer.py` (incremental detokenization per choice, stop strings)
and `token_texts.py` (each token's text and bytes for logprobs)."""
